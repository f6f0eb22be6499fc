"""What the scheduler tells of each step for the step log (engine.step_log) and the dashboard: one cell per scheduled
request, the requests preempted while scheduling it, those aborted since the step before. The scheduler only
reports; this observer keeps the latest step."""

from __future__ import annotations


class StepRecord:
    def __init__(self) -> None:
        self.cells: list[tuple] = []  # (request id, kind, first position computed, tokens computed, drafts accepted)
        self.preempted: list[str] = []
        self.aborted: list[str] = []  # between the step before and this one
        self._aborted_since: list[str] = []

    def begin(self) -> None:
        """A step is being scheduled: what it records starts afresh; the aborts since the last one are its."""
        self.cells, self.preempted = [], []
        self.aborted, self._aborted_since = self._aborted_since, []

    def begin_update(self) -> None:
        self.cells = []

    def cell(self, request_id: str, kind: str, start: int, num_tokens: int, accepted: int) -> None:
        self.cells.append((request_id, kind, start, num_tokens, accepted))

    def preempt(self, request_id: str) -> None:
        self.preempted.append(request_id)

    def abort(self, request_id: str) -> None:
        self._aborted_since.append(request_id)
