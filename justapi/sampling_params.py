"""Per-request settings, validated on construction: how to sample (the OpenAI fields plus ``ignore_eos`` and
``speculative``) and how the scheduler ranks the request (``priority``, ``user``, ``deadline``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured.spec import StructuredOutput


POOLING_KINDS = ("last", "mean", "cls", "rank")
# temperatures below this are greedy (vLLM's rule): dividing logits by less overflows them to infinities, whose
# softmax is NaN, and the argmax is what such a temperature samples anyway
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI allows 4); each is searched for in every new text
MAX_STOP_CHARS = 512  # characters per stop string: the text held back from a stream is the longest one
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # OpenAI's cap on logit_bias entries is 300; each is one scatter per sampled token


@dataclass(frozen=True)
class Pooling:
    """An embedding request: nothing is sampled; the prompt's final hidden states (after the last norm) are pooled,
    the last token's, the first's ("cls") or the mean of all, L2-normalized unless told not to, and cut to
    ``dimensions`` first (then normalized) where given. "rank": a reranker's score, the last token's state through the
    model's classifier (model.blocks.Classifier): one number, never normalized."""

    kind: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling {self.kind!r} is not supported; supported: {', '.join(POOLING_KINDS)}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature=0`` is greedy; ``None`` for max_tokens means "to the
    context end"."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # every token of the prompt and output so far: logit / p if positive, else * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100) added to the logits
    min_tokens: int = 0  # EOS, stop token ids and stop strings end nothing before this many output tokens
    # set by the scheduler for a request with min_tokens: the tokens held back until then (EOS and stop token ids)
    min_tokens_stop_ids: tuple[int, ...] = ()
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    n: int = 1
    skip_special_tokens: bool = True
    speculative: bool = True  # False: never draft for this request, even when the engine speculates
    structured: StructuredOutput | None = None  # the output must match this JSON schema / regex / choice / grammar
    # a reasoning model's (open, close) think token ids: ``structured`` applies after the close token; an open id
    # (not -1: the prompt opened the thinking) is the forced first token
    think_tokens: tuple[int, int] | None = None
    thinking_budget: int | None = None  # with think_tokens: the thinking's most tokens, then its close is forced
    pooling: Pooling | None = None  # an embedding request (prefill only): see Pooling
    # scheduling (core.policy): read under --scheduling-policy priority / fair; the deadline always
    priority: int = 0  # lower is more urgent (vLLM's meaning)
    user: str | None = None  # whose fair share the request's tokens count against (None: the anonymous share)
    deadline: float | None = None  # time.monotonic() at which the request ends with what it has ("timeout")

    @classmethod
    def for_embedding(cls, pooling: Pooling) -> SamplingParams:
        """An embedding request's settings: one prefill, nothing sampled, never a draft."""
        return cls(max_tokens=1, temperature=0.0, speculative=False, pooling=pooling)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        self._check_adjustments()
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int) or self.thinking_budget < 0):
            raise ValueError(f"thinking_budget must be a non-negative integer, got {self.thinking_budget!r}")
        if self.structured is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output: the output ends where its "
                             "grammar does")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")

    def _check_adjustments(self) -> None:
        rp = self.repetition_penalty
        # bounded away from 0: dividing logits by a denormal overflows them to infinities (a NaN distribution)
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or not 0.01 <= rp <= 100:
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {rp!r}")
        self.logit_bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes this request's logits before its distribution (model.sampler.adjust_logits)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
