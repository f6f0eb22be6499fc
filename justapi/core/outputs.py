"""Messages between the scheduler, the model runner and the engine: what to compute, and what came out.

``SchedulerOutput`` carries a request's full state once (``NewRequestData``) and small diffs afterwards
(``CachedRequestData``), so the same message can drive an in-process runner or workers in other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped, after preemption): everything it needs to run it."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int
    kv_import: object = None  # disaggregation: KV of the first num_computed_tokens tokens, to copy into the blocks


@dataclass
class CachedRequestData:
    """A request the runner already holds: only the blocks added since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class Drafts:
    """A request's drafts for one step: prompt-lookup ``tokens`` known when scheduling (a chain), or none and
    ``depth`` tree levels the runner's draft-model proposer fills; ``depth`` is the drafts' length either way."""

    depth: int
    tokens: tuple[int, ...] = ()

    @classmethod
    def chain(cls, tokens: list[int]) -> Drafts:
        return cls(len(tokens), tuple(tokens))


@dataclass
class SchedulerOutput:
    """One step's work: for each scheduled request, how many of its next tokens to compute."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_request_ids: set[str] = field(default_factory=set)  # the runner drops their state
    # speculative decoding: each drafting request's drafts, computed after its last token (their slots counted in
    # num_scheduled_tokens)
    drafts: dict[str, Drafts] = field(default_factory=dict)
    # a hybrid's prefix cache (core.state_snapshots): snapshot slots copied into a request's state before the step,
    # and from it after
    state_loads: dict[str, int] = field(default_factory=dict)
    state_saves: dict[str, int] = field(default_factory=dict)
    # the prefix cache's disk tier (core.kv_store): runs of blocks to fill before the step, (block ids, their K/V
    # as read from disk: per block [layers, 2, kv_heads, block_size, row], every head, in the KV dtype; row: head_dim
    # or an int8 row's width)
    kv_loads: list[tuple[list[int], memoryview | bytearray]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class Logprob:
    """The log-probability of a sampled token and its top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RunnerOutput:
    """Tokens sampled this step: one list per scheduled request (empty for a prefill chunk that did not finish)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # embedding requests whose prefill ended
    failed: dict[str, str] = field(default_factory=dict)  # requests whose own sampling or grammar raised: why


@dataclass
class EngineCoreOutput:
    """What one step produced for one request, as the engine front-ends consume it."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    embedding: list[float] | None = None  # an embedding request's result, with its finish
    error: str | None = None  # why a request failed alone (finish_reason "error")
