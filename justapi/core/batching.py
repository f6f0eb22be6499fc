"""When waiting requests join the running batch (the Scheduler asks its ``Batching``): continuous batching, at any
step they fit; or the static-batching baseline (``--static-batching``): gather up to ``max_seqs`` requests, run them
all to the end, repeat, recording each batch's utilisation U. Everything else is the one Scheduler's."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from ..config import SchedulerConfig
from ..request import Request, pools_from_the_start
from .kv_blocks import KvBlocks
from .stats import SchedulerStats


class BatchHost(Protocol):
    """What a batching reads and calls of the scheduler (core.scheduler.Scheduler)."""

    config: SchedulerConfig
    kv: KvBlocks
    stats: SchedulerStats

    @property
    def running(self) -> list[Request]: ...

    @property
    def waiting(self) -> deque[Request]: ...

    def admit(self, req: Request) -> None: ...


class Batching:
    """Continuous batching: waiting requests join at any step they fit (the scheduler's ``_schedule_waiting``)."""

    admits_each_step = True

    def admit_batch(self, sched: BatchHost) -> None:
        """Before a step is scheduled: admit a whole batch, where this batching does."""

    def preempted(self, req: Request) -> None:
        """``req`` left the running batch for the waiting queue."""

    def finished(self, sched: BatchHost, req: Request) -> None:
        """``req`` ended."""


class StaticBatching(Batching):
    admits_each_step = False  # only whole batches, once the last one has ended

    def __init__(self) -> None:
        self._batch: list[Request] = []

    def admit_batch(self, sched: BatchHost) -> None:
        if sched.running:
            return
        while sched.waiting and len(sched.running) < sched.config.max_seqs:
            req = sched.waiting.popleft()
            if not pools_from_the_start(req):
                sched.kv.match_prefix(req, sched.config.chunk_size)
            sched.admit(req)
            self._batch.append(req)

    def preempted(self, req: Request) -> None:
        self._batch.remove(req)  # it rejoins in a later batch

    def finished(self, sched: BatchHost, req: Request) -> None:
        if not sched.running and self._batch:
            lengths = [r.num_output_tokens for r in self._batch]
            if max(lengths) > 0:
                sched.stats.batch_utilizations.append(sum(lengths) / (len(lengths) * max(lengths)))
            self._batch = []
