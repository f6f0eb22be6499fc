"""The static-batching baseline (``--static-batching``): gather up to ``max_seqs`` requests, run them all to the end,
repeat. A ``Batching`` of the one Scheduler: it shares everything with continuous batching but when requests join,
and records each batch's utilisation U."""

from __future__ import annotations

from ..request import Request, pools_from_the_start
from .scheduler import Batching, Scheduler


class StaticBatching(Batching):
    admits_each_step = False  # only whole batches, once the last one has ended

    def __init__(self) -> None:
        self._batch: list[Request] = []

    def admit_batch(self, sched: Scheduler) -> None:
        if sched.running:
            return
        while sched.waiting and len(sched.running) < sched.config.max_seqs:
            req = sched.waiting.popleft()
            if not pools_from_the_start(req):
                sched.kv.match_prefix(req)
            sched.admit(req)
            self._batch.append(req)

    def preempted(self, req: Request) -> None:
        self._batch.remove(req)  # it rejoins in a later batch

    def finished(self, sched: Scheduler, req: Request) -> None:
        if not sched.running and self._batch:
            lengths = [r.num_output_tokens for r in self._batch]
            if max(lengths) > 0:
                sched.stats.batch_utilizations.append(sum(lengths) / (len(lengths) * max(lengths)))
            self._batch = []
