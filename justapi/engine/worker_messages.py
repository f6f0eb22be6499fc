"""The one message protocol of the worker loop (engine.worker_loop): between WorkerPoolEngine (the server) and its
workers (data-parallel replicas, prefill and decode workers), or a Ray Serve replica and its loop; one dataclass
each: commands go in through a worker's queue, reports come out through its pipe. Both ends match on the type, never
on a string tag."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..core.admission import StepCosts
from ..core.kv_store import KvStoreStats
from ..core.outputs import EngineCoreOutput
from ..sampling_params import SamplingParams


def seconds_left(params: SamplingParams) -> float | None:
    """A deadline as it travels: the seconds left now (time.monotonic is per host, and a worker may be a Ray actor
    on another one)."""
    return None if params.deadline is None else params.deadline - time.monotonic()


def local_params(params: SamplingParams, deadline_in: float | None) -> SamplingParams:
    """The params with their deadline on this host's clock, ``deadline_in`` seconds from now."""
    return params if deadline_in is None else replace(params, deadline=time.monotonic() + deadline_in)


# --- server → worker -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    deadline_in: float | None = None  # seconds left when sent: hosts' monotonic clocks differ (see local_params)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class SendKv:
    """Prefill side: ship the handed-off request's prompt KV to the process ``dst`` (a global rank)."""

    request_id: str
    dst: int
    tag: int


@dataclass(frozen=True)
class PrefilledRequest:
    """What a decode worker needs to admit a request whose prompt was computed elsewhere."""

    prompt_token_ids: list[int]
    first_token: int
    params: SamplingParams
    seed: int
    num_cached_tokens: int  # counted by the prefill worker's prefix cache
    deadline_in: float | None = None


@dataclass(frozen=True)
class RecvKv:
    """Decode side: receive a prompt's KV of ``shape`` from the process ``src``, then admit the request."""

    request_id: str
    src: int
    tag: int
    shape: tuple[int, ...]
    request: PrefilledRequest


@dataclass(frozen=True)
class CheckIntegrity:
    """Check the KV pool's books and answer with ``Checked``."""


@dataclass(frozen=True)
class Stop:
    pass


# --- worker → server -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    rank: int
    num_blocks: int
    block_size: int
    pid: int


@dataclass(frozen=True)
class Failed:
    """The worker could not start, or its loop died."""

    rank: int
    error: str


@dataclass(frozen=True)
class Outputs:
    rank: int
    outputs: list[EngineCoreOutput]


@dataclass(frozen=True)
class Prefilled:
    """A prefill worker holds this request's prompt KV and its first token: time to ship it."""

    rank: int
    request_id: str


@dataclass(frozen=True)
class Sent:
    rank: int
    request_id: str
    nbytes: int
    num_blocks: int
    seconds: float


@dataclass(frozen=True)
class Received:
    """A decode worker has the request's KV and has queued it for decoding."""

    rank: int
    request_id: str


@dataclass(frozen=True)
class RequestFailed:
    rank: int
    request_id: str | None
    error: str


@dataclass(frozen=True)
class Load:
    """A worker's periodic report, read by PdScheduler's routing."""

    rank: int
    free_blocks: int  # free plus evictable (prefix-cached) blocks
    running: int
    waiting: int
    busy_fraction: float  # share of wall time spent in engine steps since the previous report
    cache_hits: int
    cache_misses: int
    cached_blocks: int
    # for --ttft-slo (core.admission): the worker's fitted step costs, prompt tokens still to compute, decode rows
    costs: StepCosts | None = None
    prefill_backlog: int = 0
    num_decoding: int = 0
    disk_hits: int = 0  # of cache_hits, blocks found in the prefix cache's disk tier
    disk: KvStoreStats | None = None  # what the disk tier did (core.kv_store), with --prefix-cache-dir


@dataclass(frozen=True)
class Checked:
    rank: int
    problem: str | None
    held: dict

