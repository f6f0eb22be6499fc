"""The engine interface that AsyncLLM and the server use, implemented by EngineCore (one process) and WorkerPoolEngine
(prefill and decode worker processes): requests and steps, tokenizing and chat rendering, limits, health, and a
stats snapshot. Everything here but ``tokenizer``, ``render_chat``, ``limits`` and ``check_request`` (which read
only what never changes, or a count) is called on the engine thread alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import EngineConfig
from ..model_config import ModelConfig
from ..core.stats import PdSnapshot, SchedulerSnapshot
from ..model.tokenizer import Tokenizer
from ..sampling_params import SamplingParams
from .output_processor import RequestOutput
from .step_log import StepWork


class EngineDeadError(Exception):
    """The engine loop failed; no more requests can be served."""


class RequestFailedError(Exception):
    """One request failed alone (its sampling, grammar or text raised); the engine serves the others on."""


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of this engine."""

    max_model_len: int  # prompt + output tokens
    vocab_size: int  # token ids are in 0..vocab_size - 1


class Engine(Protocol):
    """What AsyncLLM and the server may use of an engine."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer

    @property
    def limits(self) -> EngineLimits: ...

    tool_parser: str | None  # the format tool calls are read in (structured.tool_calls), None: no tools

    reasoning_parser: str | None  # how the model's thinking is told from its answer (structured.reasoning)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                    variables: dict | None = None) -> list[int]:
        """Token ids of a conversation in the model's chat template (ChatTemplateError for a bad one)."""

    def fim_prompt(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
                   middle: str = "") -> list[int]:
        """Token ids of a fill-in-the-middle prompt (ValueError for a model without FIM tokens)."""

    def pair_prompt(self, query: str, document: str) -> list[int]:
        """Token ids of a (query, document) pair as the model scores it (a reranker's template or pair layout)."""

    def prepare(self, params: SamplingParams) -> None:
        """Compile what the request needs (its grammar) or raise ValueError; slow: call it off the event loop."""

    def new_seed(self) -> int: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError for a request that can never be served; its max_tokens."""

    def admit(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The request checked once and defaulted (max_tokens, seed), or ValueError: what ``queue`` takes."""

    def queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue an admitted request."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """``queue(admit(...))``: the offline API's way in."""

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    @property
    def has_unfinished(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def step(self) -> list[RequestOutput]:
        """One iteration: what each request produced."""

    last_step: StepWork | None  # what the latest step computed and its parts' times; None where workers run them

    def idle(self) -> None:
        """Called by the engine loop while nothing runs."""

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that failed for a reason outside them (a dead worker)."""

    def health(self) -> tuple[bool, dict]:
        """(serving, details)."""

    def stats(self) -> SchedulerSnapshot | PdSnapshot:
        """A frozen copy of the engine's state (core.stats), for other threads to read."""

    def stats_line(self) -> str: ...

    def shared_prefixes(self, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """The prefix cache's most reused prefixes (token ids, requests that started from them); none where the
        cache lives in worker processes."""

    def close(self) -> None: ...
