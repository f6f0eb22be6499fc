"""A request as the scheduler sees it: token ids, how many of them have KV computed, and its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .core.outputs import Drafts
    from .core.radix_cache import _Node


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"  # its deadline passed; the client gets finish_reason "length" (output_processor)
    FINISHED_ERROR = "error"  # its own sampling, grammar or text raised: it fails alone, its blocks freed


@dataclass(eq=False)
class Request:
    """One sequence being generated. Invariant: ``num_computed_tokens <= len(all_token_ids)``.

    Every kind of work (prefill chunk, decode token, prefix-cache hit, recompute after preemption) moves
    ``num_computed_tokens`` towards ``num_tokens``; when they meet, the runner samples the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission; -1 before it
    num_preemptions: int = 0
    cache_node: _Node | None = None  # the radix node this request holds locked
    drafts: Drafts | None = None  # its drafts for the next step (core.drafts), while it decodes with any
    imported_kv: object = None  # disaggregation: the prompt's KV computed by a prefill worker, until admission
    # a hybrid model's prefix cache (core.state_snapshots): the snapshot slot its state starts from at admission,
    # and the depth of a cached prefix it matched without a snapshot (where it takes one)
    state_load: int | None = None
    snapshot_at: int = 0
    arrival_time: float = 0.0  # the scheduler's clock when it was queued (priority aging)
    arrival_seq: int = 0  # the scheduler's count of requests queued before it (ties in arrival order)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finish status after the latest token, if it ends the request (stop strings are checked later)."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        stoppable = self.num_output_tokens >= params.min_tokens
        if stoppable and (last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids)):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def pools_from_the_start(req: Request) -> bool:
    """An embedding request averaging all its prompt's final hidden states, or taking its first's (cls): those
    rows must be computed, so no prefix of its prompt comes from the cache."""
    pooling = req.sampling_params.pooling
    return pooling is not None and pooling.kind in ("mean", "cls")


def with_min_tokens_stop_ids(params: SamplingParams, eos_token_ids) -> SamplingParams:
    """A request with min_tokens carries the tokens its sampler holds back until then: EOS (unless ignored) and its
    stop token ids; it reaches every runner (worker, rank, decode worker) with its settings."""
    if not params.min_tokens:
        return params
    held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return replace(params, min_tokens_stop_ids=tuple(sorted(held)))
