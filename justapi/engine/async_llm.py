"""AsyncLLM: the engine's asyncio front. The step loop runs in its own thread; requests stream back via queues.

The event loop never waits for a step: adds and aborts go through a command queue that the engine thread
drains between steps, and outputs come back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ..core.admission import StepCostModel
from ..core.limits import AdmissionError
from ..core.stats import PdSnapshot, SchedulerSnapshot
from ..sampling_params import SamplingParams
from .output_processor import RequestOutput
from .protocol import Engine, EngineDeadError, RequestFailedError
from .step_log import StepLog

log = logging.getLogger("justapi.engine")

STATS_EVERY_S = 0.1  # how stale the stats snapshot may get while requests run (a copy costs ~0.1 ms)
SHARED_PREFIXES_EVERY_S = 1.0  # how often a watched engine walks its prefix tree for the dashboard
SHARED_PREFIXES = 5  # the prefixes the dashboard lists


class QueueFullError(Exception):
    """Too many requests are waiting; the server answers 429."""

    retry_after: int | None = None  # seconds a client should wait before retrying, where known


class SloRefusal(QueueFullError):
    """The request's predicted time to first token exceeds ``--ttft-slo``; the server answers 429 at once."""

    def __init__(self, predicted: float, slo: float) -> None:
        super().__init__(f"the server is overloaded: the predicted time to first token is {predicted:.1f} s, over "
                         f"the server's limit of {slo:g} s")
        self.retry_after = max(1, math.ceil(predicted - slo))  # by then the queue ahead has drained that much


@dataclass
class RequestTiming:
    """When a request arrived, produced its first token, and finished (``time.monotonic`` seconds)."""

    arrival: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0
    priority: int = 0
    user: str | None = None
    predicted_ttft: float | None = None  # what admission predicted (core.admission), where it could
    group: str = ""  # the client request it is a choice of (the queue counts client requests)
    waiting: bool = True  # counted in AsyncLLM's waiting client requests (no first token yet, not ended)


class AsyncLLM:
    """Add a request, receive its outputs as they are produced, abort it."""

    def __init__(self, engine: Engine, max_queue: int = 1024, stats_interval_s: float = 10.0,
                 on_finish: Callable[[str, RequestOutput, RequestTiming], None] | None = None,
                 ttft_slo: float | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.ttft_slo = ttft_slo
        self.step_costs = StepCostModel()  # fitted on the engine thread from each step's time and shape
        self.stats_interval_s = stats_interval_s
        self.on_finish = on_finish
        self._commands: collections.deque = collections.deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestTiming]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="justapi-engine", daemon=True)
        self._pending_adds = 0  # adds queued for the engine thread, guarded by _count_lock
        self._pending_tokens = 0  # their prompt tokens (not in the stats snapshot yet), guarded by _count_lock
        self._count_lock = threading.Lock()
        self._waiting_groups: dict[str, int] = {}  # client request -> its sequences still waiting, under _count_lock
        self._stats = engine.stats()  # replaced whole by the engine thread, never changed in place
        self._stats_taken = time.monotonic()
        self.step_log = StepLog()
        self.num_output_tokens = 0  # delivered so far (the dashboard's throughput), engine thread only writes
        self.watchers = 0  # dashboards open (server.dashboard): the engine thread then lists shared prefixes
        self.shared_prefixes: list[tuple[tuple[int, ...], int]] = []  # (token ids, requests that started from them)
        self._prefixes_taken = 0.0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine loop, or None while it runs."""
        return self._dead

    @property
    def stats(self) -> SchedulerSnapshot | PdSnapshot:
        """The engine's state as the engine thread last copied it: after a step at most STATS_EVERY_S old, after
        every step in which a request finished (so a client that got its last token sees that step counted), and
        whenever the engine goes idle."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending_adds

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       group: str | None = None, check_queue: bool = True,
                       admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; abandoning the iterator (client gone) aborts the request. ``group``: the
        client request this sequence is one choice of (its choices count once against the queue: only the first is
        checked, ``check_queue``); None: a request of its own. ``admitted``: ``params`` are ``validate``'s (the
        server's front admitted it before its stream started), not checked again."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not admitted:
            params = self.validate(prompt_token_ids, params)
        if check_queue:
            self.check_queue()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        timing = RequestTiming(time.monotonic(), len(prompt_token_ids), priority=params.priority, user=params.user,
                               predicted_ttft=self.predict_ttft(len(prompt_token_ids), params),
                               group=group or request_id)
        with self._count_lock:  # counted before the engine thread can see the stream (and end it)
            self._waiting_groups[timing.group] = self._waiting_groups.get(timing.group, 0) + 1
        self._streams[request_id] = (loop, queue, timing)
        with self._count_lock:
            self._pending_adds += 1
            self._pending_tokens += len(prompt_token_ids)
        self._commands.append(("add", request_id, prompt_token_ids, params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    @property
    def num_waiting_requests(self) -> int:
        """Client requests with a sequence that has not produced its first token (nor ended): a request of n
        choices (or of many prompts or embedding inputs) counts once."""
        return len(self._waiting_groups)

    def _left_queue(self, timing: RequestTiming) -> None:
        """A sequence got its first token or ended: its client request waits no more once all its sequences have."""
        if not timing.waiting:
            return
        timing.waiting = False
        with self._count_lock:
            left = self._waiting_groups.pop(timing.group, 1) - 1
            if left > 0:
                self._waiting_groups[timing.group] = left

    def check_queue(self) -> None:
        """Raise QueueFullError when ``max_queue`` client requests are already waiting for their first token."""
        waiting = self.num_waiting_requests
        if waiting >= self.max_queue:
            raise QueueFullError(f"the server is busy: {waiting} requests are already waiting")

    def predict_ttft(self, num_prompt_tokens: int, params: SamplingParams) -> float | None:
        """Seconds to this request's first token if queued now (core.admission); None before the engine (or, with
        disaggregation, a prefill worker) has run a step."""
        snap, config = self._stats, self.engine.config
        if isinstance(snap, PdSnapshot):
            return self._predict_on_prefill_workers(snap, num_prompt_tokens)
        costs = self.step_costs.costs
        if costs is None:
            return None
        rank = params.priority if config.scheduling_policy == "priority" else None
        tokens = snap.tokens_ahead(rank) + self._pending_tokens
        queued = snap.requests_ahead(rank) + self._pending_adds
        slots_awaited = queued + 1 - (config.max_seqs - snap.num_running)
        predicted = costs.ttft(tokens, num_prompt_tokens, snap.num_decoding, config.chunk_size, slots_awaited)
        return predicted if math.isfinite(predicted) else None  # no request finished yet: no basis for a slot wait

    def _predict_on_prefill_workers(self, snap: PdSnapshot, num_prompt_tokens: int) -> float | None:
        """Disaggregated: the first token comes from a prefill worker; the best of theirs, from what each last
        reported (every queued request counts as ahead: the workers report no priorities), requests not yet
        handed to the engine thread counted on each."""
        config = self.engine.config
        best = None
        for w in snap.pool(snap.entry_role):
            if w.costs is None:
                continue
            slots_awaited = w.waiting + self._pending_adds + 1 - (config.max_seqs - w.running)
            t = w.costs.ttft(w.prefill_backlog + self._pending_tokens, num_prompt_tokens, w.num_decoding,
                             config.chunk_size, slots_awaited)
            best = t if best is None else min(best, t)
        return best if best is not None and math.isfinite(best) else None

    def check_slo(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise SloRefusal when ``--ttft-slo`` is set and this request's predicted time to first token exceeds it."""
        if self.ttft_slo is None:
            return
        predicted = self.predict_ttft(len(prompt_token_ids), params)
        if predicted is not None and predicted > self.ttft_slo:
            raise SloRefusal(predicted, self.ttft_slo)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raise AdmissionError/ValueError now for a request that could never run (reads engine state only); its
        params admitted (the engine's ``admit``: max_tokens by default as many as fit, a seed where none)."""
        return self.engine.admit(prompt_token_ids, params)

    def timing(self, request_id: str) -> RequestTiming | None:
        """A streaming request's timing (read by the dashboard; the engine thread updates it in place)."""
        stream = self._streams.get(request_id)
        return stream[2] if stream is not None else None

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are freed before the next step."""
        if request_id in self._streams:
            self._commands.append(("abort", request_id))
            self._wake.set()

    # --- the engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        last_stats = time.monotonic()
        idle_since = time.monotonic()
        try:
            while not self._stop:
                t0 = time.monotonic()
                self._apply_commands()
                if not self.engine.has_unfinished:
                    self.engine.idle()
                    self._take_stats(time.monotonic(), force=True)
                    self._take_shared_prefixes(time.monotonic())
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                t1 = time.monotonic()
                outputs = self.engine.step()
                now = time.monotonic()
                work = self.engine.last_step
                if work is not None:  # what the step cost, as a request queued behind it waits for it
                    self.step_costs.observe(now - t0, work.num_prefill_tokens, work.num_decodes,
                                            sum(out.finished for out in outputs))
                self._take_stats(now, force=any(out.finished for out in outputs))  # before any client sees it end
                self._take_shared_prefixes(now)
                for out in outputs:
                    self._deliver(out, now)
                for rid, error in self.engine.take_failures():
                    self._fail(rid, error)
                t3 = time.monotonic()
                self._record_step(idle_since, t0, t1, now, t3)
                idle_since = t3
                if now - last_stats >= self.stats_interval_s:
                    self._log_stats()
                    last_stats = now
        except BaseException as e:  # a bug in the engine: fail every open request instead of hanging
            log.exception("engine loop failed")
            self._dead = e
            for rid in list(self._streams):
                self._fail(rid, EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}"))

    def _record_step(self, idle_since: float, t0: float, t1: float, t2: float, t3: float) -> None:
        """Log one step: idle from the previous step's end to this pass's start, commands t0-t1, step t1-t2,
        delivery t2-t3. A pass that found no work counts as idle (its command time too: it is under a ms)."""
        self.step_log.append(t0, t0 - idle_since, t1 - t0, t2 - t1, t3 - t2, self.engine.last_step,
                             len(self._streams), self.engine.num_waiting)

    def _take_stats(self, now: float, force: bool = False) -> None:
        if force or now - self._stats_taken >= STATS_EVERY_S:
            self._stats, self._stats_taken = self.engine.stats(), now

    def _take_shared_prefixes(self, now: float) -> None:
        """While a dashboard watches: the prefixes most reused, walked on the engine thread that changes the tree."""
        if self.watchers and now - self._prefixes_taken >= SHARED_PREFIXES_EVERY_S:
            self.shared_prefixes, self._prefixes_taken = self.engine.shared_prefixes(SHARED_PREFIXES), now

    def _apply_commands(self) -> None:
        added, added_tokens = 0, 0
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                _, rid, ids, params = cmd
                added += 1
                added_tokens += len(ids)
                if rid not in self._streams:
                    continue  # aborted before it was added
                try:
                    self.engine.queue(rid, ids, params)
                except (AdmissionError, ValueError, EngineDeadError) as e:
                    self._fail(rid, e)
            else:
                rid = cmd[1]
                out = self.engine.abort_request(rid)
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._left_queue(stream[2])
                if out is not None and stream is not None and self.on_finish is not None:
                    stream[2].finished = time.monotonic()
                    self.on_finish(rid, out, stream[2])
        if added:  # counted as pending until the snapshot holds them: admission's count ahead stays whole
            self._take_stats(time.monotonic(), force=True)
            with self._count_lock:
                self._pending_adds -= added
                self._pending_tokens -= added_tokens

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        loop, queue, timing = stream
        if out.new_token_ids or out.finished:
            self._left_queue(timing)
        if out.new_token_ids:
            if timing.first_token is None:
                timing.first_token = now
            timing.num_output_tokens += len(out.new_token_ids)
            self.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            timing.finished = now
            del self._streams[out.request_id]
            if self.on_finish is not None:
                self.on_finish(out.request_id, out, timing)
            if out.error is not None:
                loop.call_soon_threadsafe(queue.put_nowait, RequestFailedError(out.error))
                return
        # wakes the event loop; the engine thread then waits for the GIL while the loop runs: 1.8-2.8% of a loaded
        # run's wall time, and no less with one wake-up a step (docs/benchmarks.md, benchmarks/wall_breakdown.py)
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._left_queue(stream[2])
            stream[0].call_soon_threadsafe(stream[1].put_nowait, error)

    def _log_stats(self) -> None:
        log.info("engine: %s", self.engine.stats_line())
