"""What every engine (EngineCore, WorkerPoolEngine, ServeEngine) knows of the model without running it: its config,
tokenizer and chat template, the limits a request must respect, and the seeds of requests that give none; and the
one place a request is checked and defaulted (``admit``). One place, so that the server sees the same answers
whichever engine serves."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from ..config import EngineConfig
from ..core.limits import RequestLimits
from ..model.chat_template import ChatTemplate
from ..model.gguf_loader import ModelLoadError, open_gguf, read_model_config
from ..model.fim import FimTokens
from ..model.pairs import PairFormat
from ..model.tokenizer import Tokenizer
from ..sampling_params import SamplingParams
from ..structured.grammars import for_model as grammars_for
from ..structured.reasoning import parser_for_template as reasoning_parser_for
from ..structured.tool_calls import parser_for_template
from .protocol import EngineLimits


class ModelFront:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        reader = open_gguf(config.model)
        self.model_config = read_model_config(reader, config.model)
        self.tokenizer = Tokenizer(config.model, reader)
        self._pairs = PairFormat(reader, self.tokenizer)
        self.fim = FimTokens(reader, self.tokenizer)
        self.chat_template = ChatTemplate(_template_source(config.chat_template) or self.tokenizer.chat_template)
        # a template that renders no tools gets them in its system message, calls asked in the hermes format
        self.tool_parser = config.tool_call_parser or parser_for_template(self.chat_template.source) or (
            "hermes" if self.chat_template.available and not self.chat_template.renders_tools else None)
        self.reasoning_parser = (None if config.reasoning_parser == "none" else
                                 config.reasoning_parser or reasoning_parser_for(self.chat_template.source))
        ctx = self.model_config.context_length
        if config.max_model_len is not None and config.max_model_len > ctx:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's context length {ctx}")
        self.max_model_len = config.max_model_len or ctx
        if self.model_config.is_encoder:
            _check_encoder_flags(config, self.model_config.arch)
        if self.model_config.is_hybrid:
            _check_hybrid_flags(config, self.model_config.arch)
        self._seeds = random.Random(config.seed)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_model_len, self.model_config.vocab_size)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                    variables: dict | None = None) -> list[int]:
        """Token ids of a conversation in the chat template, with ``tools`` offered and ``variables`` (a request's
        chat_template_kwargs) set (ChatTemplateError for a bad template or one that renders no tools)."""
        return self.chat_template.encode(self.tokenizer, messages, add_generation_prompt, tools, variables)

    def fim_prompt(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
                   middle: str = "") -> list[int]:
        """Token ids of a fill-in-the-middle prompt (model.fim; ValueError for a model without FIM tokens)."""
        return self.fim.prompt(prefix, suffix, extra, middle)

    def pair_prompt(self, query: str, document: str) -> list[int]:
        """Token ids of a (query, document) pair as the reranker reads it (model.pairs)."""
        return self._pairs.ids(query, document)

    def prepare(self, params: SamplingParams) -> None:
        """Do the slow part of admitting a request before it reaches the engine loop: compile its grammar (or
        raise GrammarError, a ValueError, naming the problem). Call it off the event loop; it may take seconds."""
        if params.structured is not None:
            grammars_for(self.config.model).check(params.structured)

    def new_seed(self) -> int:
        return self._seeds.getrandbits(62)

    # --- requests: checked and defaulted once, here ---------------------------------------------------------
    @property
    def request_limits(self) -> RequestLimits:
        """What a request may ask of this engine's KV pool (or of its smallest worker's): each engine's own."""
        raise NotImplementedError

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError (AdmissionError) for a request this engine can never serve: its task, its token ids,
        its length; its max_tokens (by default as many as fit). Reads state only."""
        self.check_task(params)
        self.check_token_ids(prompt_token_ids)
        return self.request_limits.check(len(prompt_token_ids), params.max_tokens, params.pooling is not None)

    def admit(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The request checked (check_request), its max_tokens and seed set where it gave none: what ``queue``
        takes. Reads state only: the server's front calls it on its event loop before a stream starts (a 4xx then),
        its grammar already compiled off the loop; the offline API through add_request; nothing after it checks the
        request again."""
        max_tokens = self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self.new_seed()
        return dataclasses.replace(params, max_tokens=max_tokens, seed=seed)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Admit and queue a request, its grammar compiled first; ValueError for one that can never be served."""
        params = self.admit(prompt_token_ids, params)
        self.prepare(params)
        self.queue(request_id, prompt_token_ids, params)

    def queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue an admitted request (``admit``'s params) on the engine thread; each engine's own."""
        raise NotImplementedError

    def check_task(self, params: SamplingParams) -> None:
        """An encoder serves embeddings and scores only, a reranker scores, other models embed (ValueError for a
        request the model cannot serve)."""
        if self.model_config.is_encoder and params.pooling is None:
            raise ValueError(f"this model is an encoder ({self.model_config.arch}): it serves embeddings and "
                             "scores (/v1/embeddings, /v1/rerank, /v1/score), not generated text")
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < self.model_config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary "
                             f"(0..{self.model_config.vocab_size - 1})")
        if params.pooling is not None and (params.pooling.kind == "rank") != (self.model_config.pooling == "rank"):
            raise ValueError(f"pooling {params.pooling.kind!r} does not fit this model, whose file pools "
                             f"{self.model_config.pooling!r} (a reranker scores, other models embed)")

    def check_token_ids(self, token_ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")


def _check_encoder_flags(config: EngineConfig, arch: str) -> None:
    """The flags an encoder cannot take, refused at start-up, each by name."""
    refused = {"--tp": config.tp > 1, "--disaggregate": config.disaggregate,
               "--static-batching": config.static_batching,
               "--draft-model / --spec-method": config.speculation is not None}
    named = [flag for flag, given in refused.items() if given]
    if named:
        raise ValueError(f"{', '.join(named)} cannot serve an encoder ({arch}): it computes each prompt once, "
                         "in one step, and generates nothing")


def _check_hybrid_flags(config: EngineConfig, arch: str) -> None:
    """The flags a hybrid model's recurrent states do not serve yet, refused at start-up, each by name."""
    worker_tp = config.disaggregate and max(config.prefill_tp or config.tp, config.decode_tp or config.tp) > 1
    if worker_tp:
        raise ValueError(f"--disaggregate with tensor-parallel workers cannot serve a hybrid model ({arch}) yet: "
                         "its recurrent states would have to be gathered from every rank")


def _template_source(path: str | None) -> str | None:
    """A --chat-template file's text (ModelLoadError if it cannot be read)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"--chat-template {path}: {e}") from None
