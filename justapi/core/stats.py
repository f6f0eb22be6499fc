"""Frozen snapshots of the engine's state, taken on the engine thread, for other threads (/metrics, the stats line)
to read: the live scheduler changes under them between steps (vLLM's make_stats habit). Pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .pd_scheduler import PdScheduler, PdStats
from .scheduler import Scheduler, SchedulerStats


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

    @classmethod
    def of(cls, sched: Scheduler) -> SchedulerSnapshot:
        cache = sched.cache
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
        )


@dataclass(frozen=True)
class WorkerSnapshot:
    """A disaggregated worker as its last report left it."""

    rank: int
    role: str
    alive: bool
    running: int
    waiting: int
    busy_fraction: float
    cache_hits: int
    cache_misses: int
    cached_blocks: int
    load: int


@dataclass(frozen=True)
class PdSnapshot:
    """Disaggregated serving: every worker's last report and the KV transfer counters."""

    workers: tuple[WorkerSnapshot, ...]
    counters: PdStats  # a copy

    @classmethod
    def of(cls, pd: PdScheduler) -> PdSnapshot:
        workers = tuple(WorkerSnapshot(w.rank, w.role, w.alive, w.running, w.waiting, w.busy_fraction, w.cache_hits,
                                       w.cache_misses, w.cached_blocks, w.load) for w in pd.workers.values())
        return cls(workers, dataclasses.replace(pd.stats))

    def pool(self, role: str) -> list[WorkerSnapshot]:
        """The live workers of a role."""
        return [w for w in self.workers if w.role == role and w.alive]
