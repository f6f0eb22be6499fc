"""Frozen snapshots of the engine's state, taken on the engine thread, for other threads (/metrics, the stats line)
to read: the live scheduler changes under them between steps (vLLM's make_stats habit). Pure Python."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..request import Request
from .admission import StepCosts
from .block_pool import BlockPool
from .kv_blocks import KvBlocks
from .kv_store import KvStoreStats
from .pd_scheduler import PdScheduler, PdStats
from .radix_cache import RadixPrefixCache


class Snapshotted(Protocol):
    """What a snapshot reads of a scheduler (core.scheduler.Scheduler), and nothing else."""

    @property
    def waiting(self) -> Sequence[Request]: ...

    @property
    def running(self) -> Sequence[Request]: ...

    @property
    def pool(self) -> BlockPool: ...

    @property
    def cache(self) -> RadixPrefixCache | None: ...

    @property
    def stats(self) -> SchedulerStats: ...

    @property
    def num_cached_blocks(self) -> int: ...

    @property
    def kv(self) -> KvBlocks: ...


@dataclass
class SchedulerStats:
    """A scheduler's running counters (live, engine thread only; snapshots copy them)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # computed tokens whose KV preemption gave up
    num_resumed_cached_tokens: int = 0  # of those, found again in the prefix cache on resumption
    num_scheduled_tokens_total: int = 0
    num_timeouts: int = 0  # requests ended by their deadline
    last_step_tokens: int = 0
    last_step_prefill_tokens: int = 0  # of those, prompt tokens (chunks, recomputation after preemption)
    last_step_decodes: int = 0  # requests decoding in the last step
    batch_utilizations: list[float] = field(default_factory=list)  # static batching: U per finished batch
    # speculative decoding
    spec_steps: int = 0  # request-steps that verified at least one draft token
    spec_draft_tokens: int = 0  # draft tokens (tree nodes) verified
    spec_accepted_tokens: int = 0  # of those, accepted (at most one per tree level)
    spec_accepted_at: list[int] = field(default_factory=list)  # steps that accepted a draft at position k (0: first)
    spec_proposed_at: list[int] = field(default_factory=list)  # steps that proposed drafts at position k

    def count_spec(self, num_nodes: int, depth: int, accepted: int) -> None:
        """One request-step that verified ``num_nodes`` draft tokens ``depth`` levels deep and accepted ``accepted``."""
        self.spec_steps += 1
        self.spec_draft_tokens += num_nodes
        self.spec_accepted_tokens += accepted
        while len(self.spec_proposed_at) < depth:
            self.spec_proposed_at.append(0)
            self.spec_accepted_at.append(0)
        for k in range(depth):
            self.spec_proposed_at[k] += 1
            self.spec_accepted_at[k] += k < accepted

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per speculative request-step: accepted drafts plus the target's own token."""
        return (self.spec_accepted_tokens + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0


@dataclass(frozen=True)
class SchedulerSnapshot:
    """One engine's scheduler: requests, KV pool, prefix cache and the counters of SchedulerStats."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_used_by_requests: int
    prefix_cache_hits: int
    prefix_cache_misses: int
    prefix_cache_blocks: int
    counters: SchedulerStats  # a copy, lists included
    # by class (core.policy): waiting requests per priority and per user (None: anonymous); prompt tokens still to
    # compute per priority, of waiting and prefilling requests (what a new request's first token waits behind)
    waiting_by_priority: tuple[tuple[int, int], ...] = ()
    waiting_by_user: tuple[tuple[str | None, int], ...] = ()
    prefill_backlog: tuple[tuple[int, int], ...] = ()
    num_decoding: int = 0
    # a hybrid model's state cache (model.state_cache): slots, slots held by running requests, bytes; 0 otherwise
    state_slots_total: int = 0
    state_slots_used: int = 0
    state_cache_bytes: int = 0
    # the prefix cache's disk tier (core.kv_store): of prefix_cache_hits, blocks found on disk; what it did
    prefix_cache_disk_hits: int = 0
    disk_tier: KvStoreStats | None = None

    def tokens_ahead(self, priority: int | None) -> int:
        """Prompt tokens to compute before a new request's (of ``priority``; None: all queued count)."""
        return sum(n for p, n in self.prefill_backlog if priority is None or p <= priority)

    def requests_ahead(self, priority: int | None) -> int:
        """Waiting requests that start before a new one (of ``priority``; None: all of them)."""
        return sum(n for p, n in self.waiting_by_priority if priority is None or p <= priority)

    @classmethod
    def of(cls, sched: Snapshotted) -> SchedulerSnapshot:
        cache = sched.cache
        by_priority: dict[int, int] = {}
        by_user: dict[str | None, int] = {}
        backlog: dict[int, int] = {}
        for req in sched.waiting:
            params = req.sampling_params
            by_priority[params.priority] = by_priority.get(params.priority, 0) + 1
            by_user[params.user] = by_user.get(params.user, 0) + 1
        num_decoding = 0
        for queue in (sched.waiting, sched.running):
            for req in queue:
                left = len(req.prompt_token_ids) - req.num_computed_tokens
                if left > 0:
                    priority = req.sampling_params.priority
                    backlog[priority] = backlog.get(priority, 0) + left
                else:
                    num_decoding += 1
        return cls(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_blocks_used=sched.pool.num_used,
            kv_blocks_total=sched.pool.num_blocks,
            kv_blocks_used_by_requests=len({b for r in sched.running for b in r.block_ids}),
            prefix_cache_hits=cache.hits if cache else 0,
            prefix_cache_misses=cache.misses if cache else 0,
            prefix_cache_blocks=sched.num_cached_blocks,
            counters=dataclasses.replace(sched.stats, batch_utilizations=list(sched.stats.batch_utilizations[-1:]),
                                         spec_accepted_at=list(sched.stats.spec_accepted_at),
                                         spec_proposed_at=list(sched.stats.spec_proposed_at)),
            waiting_by_priority=tuple(sorted(by_priority.items())),
            waiting_by_user=tuple(by_user.items()),
            prefill_backlog=tuple(sorted(backlog.items())),
            num_decoding=num_decoding,
            prefix_cache_disk_hits=sched.kv.disk_hits,
            disk_tier=sched.kv.store.snapshot() if sched.kv.store is not None else None,
        )


@dataclass(frozen=True)
class WorkerSnapshot:
    """A worker (disaggregated pool member or data-parallel replica) as its last report left it."""

    rank: int | str  # a worker process's rank, or a Ray Serve replica's id (engine.serve_engine)
    role: str
    alive: bool
    running: int
    waiting: int
    busy_fraction: float
    cache_hits: int
    cache_misses: int
    cached_blocks: int
    load: int
    costs: StepCosts | None = None  # as last reported
    prefill_backlog: int = 0
    num_decoding: int = 0
    routed: int = 0
    free_blocks: int = 0  # free or evictable (prefix-cached), as last reported
    num_blocks: int = 0
    disk_hits: int = 0  # of cache_hits, found in the prefix cache's disk tier
    disk: KvStoreStats | None = None


@dataclass(frozen=True)
class PdSnapshot:
    """Engines in worker processes (disaggregated pools or replicas): every worker's last report and the KV
    transfer counters."""

    workers: tuple[WorkerSnapshot, ...]
    counters: PdStats  # a copy
    entry_role: str = "prefill"  # the pool new requests start in: "prefill", or "replica" when data-parallel

    @classmethod
    def of(cls, pd: PdScheduler) -> PdSnapshot:
        workers = tuple(WorkerSnapshot(w.rank, w.role, w.alive, w.running, w.waiting, w.busy_fraction, w.cache_hits,
                                       w.cache_misses, w.cached_blocks, w.load, w.costs, w.prefill_backlog,
                                       w.num_decoding, w.routed, w.free_blocks, w.num_blocks, w.disk_hits, w.disk)
                        for w in pd.workers.values())
        return cls(workers, dataclasses.replace(pd.stats), pd.entry_role)

    def pool(self, role: str) -> list[WorkerSnapshot]:
        """The live workers of a role."""
        return [w for w in self.workers if w.role == role and w.alive]
