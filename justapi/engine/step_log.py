"""StepLog: one small record per engine step in a bounded ring buffer, for what reads the schedule after the fact or
live: the dashboard (server/dashboard.py) draws each step's cells, pool and prefix cache; benchmarks/wall_breakdown.py
splits a loaded run's wall time. The engine thread appends; readers copy."""

from __future__ import annotations

import collections
import dataclasses
import threading
from dataclasses import dataclass

STEP_LOG_SIZE = 16384  # records kept: a loaded run of several minutes at ~50 steps a second


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one EngineCore step computed and how long its parts took (seconds, engine thread)."""

    schedule: float
    execute: float  # every rank's batch building, forward pass and sampling
    update: float  # the scheduler taking the sampled tokens in
    detokenize: float  # incremental text and stop strings
    num_tokens: int  # scheduled tokens
    num_prefill_tokens: int  # of those, prompt tokens (chunks, and recomputation after preemption)
    num_decodes: int  # requests decoding (one token each, plus any draft slots)
    # what the dashboard draws: per scheduled request (id, "prefill" | "decode" | "spec", first position computed,
    # tokens computed, drafts accepted); the requests preempted in the step, those that finished in it or were
    # aborted since the step before; the pool's blocks (held by requests, cached and evictable, free); the prefix
    # cache's block hits and misses so far
    cells: tuple[tuple[str, str, int, int, int], ...] = ()
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    kv_blocks: tuple[int, int, int] = (0, 0, 0)
    prefix_hits: int = 0
    prefix_misses: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One pass of the engine loop that ran a step: the idle wait before it, the commands taken in, the step, and
    the delivery of its outputs to the clients' queues. ``start`` is ``time.monotonic()`` after the idle wait."""

    seq: int
    start: float
    idle: float  # seconds the loop waited for work since the previous step
    commands: float  # adds and aborts taken in
    step: float  # engine.step(), all of it
    deliver: float  # outputs handed to the event loop, stats snapshot
    work: StepWork | None  # None for an engine whose steps run elsewhere (disaggregated workers)
    num_open: int  # requests being streamed back (running or waiting) after the step
    num_waiting: int  # of those, not yet admitted

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class StepLog:
    """The latest STEP_LOG_SIZE records; ``since(seq)`` returns the newer ones (the engine thread appends)."""

    def __init__(self, size: int = STEP_LOG_SIZE) -> None:
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=size)
        self.next_seq = 0  # the seq the next record gets: records so far
        self._lock = threading.Lock()  # a reader copies while the engine thread appends

    def append(self, *fields) -> None:
        """Add a record of StepRecord's fields after ``seq``, which the log numbers."""
        with self._lock:
            self._records.append(StepRecord(self.next_seq, *fields))
            self.next_seq += 1

    def since(self, seq: int, limit: int | None = None) -> tuple[list[StepRecord], int]:
        """Records with ``seq`` >= the given one, oldest first (older ones may have left the buffer), at most
        ``limit`` of them, and the seq to ask from next time."""
        with self._lock:
            records, next_seq = list(self._records), self.next_seq
        records = [r for r in records if r.seq >= seq]
        if limit is not None and len(records) > limit:
            records = records[:limit]
            next_seq = records[-1].seq + 1
        return records, next_seq
