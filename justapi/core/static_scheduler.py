"""The static-batching baseline (``--static-batching``): gather up to ``max_seqs`` requests, run them all to the end,
repeat. It shares everything with the continuous scheduler but admission, and records each batch's utilisation U."""

from __future__ import annotations

from ..config import SchedulerConfig
from ..request import Request
from ..request import pools_from_the_start
from .scheduler import Scheduler


class StaticScheduler(Scheduler):
    """The static-batching baseline: gather up to ``max_seqs`` requests, run them all to the end, repeat."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._batch: list[Request] = []

    def _may_admit(self) -> bool:
        return False

    def _admit_batch(self) -> None:
        if self.running:
            return
        while self.waiting and len(self.running) < self.config.max_seqs:
            req = self.waiting.popleft()
            if not pools_from_the_start(req):
                self.kv.match_prefix(req)
            self._admit(req)
            self._batch.append(req)

    def _preempt(self, req: Request) -> None:
        super()._preempt(req)
        self._batch.remove(req)  # it rejoins in a later batch

    def _on_finished(self, req: Request) -> None:
        if not self.running and self._batch:
            lengths = [r.num_output_tokens for r in self._batch]
            if max(lengths) > 0:
                self.stats.batch_utilizations.append(sum(lengths) / (len(lengths) * max(lengths)))
            self._batch = []
