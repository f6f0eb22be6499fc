"""The engine's own ``Scheduler`` on virtual time: requests arrive from a workload, each step costs what a cost model
says, and the results are the figures ``justapi bench serve`` reports (bench.report), in seconds of compute.

Nothing here decides what runs: ``Scheduler.schedule`` and ``Scheduler.update`` are the engine's (core.scheduler),
with their policy, prefix cache, preemption and batching; the scheduler's clock is the simulation's. The runner is
replaced by its effect: every request whose computed tokens catch up with its tokens gets one new token (a fixed
id that is no stop token, as a benchmark's ``ignore_eos`` requests run), and the clock moves by the step's cost.
The client is ``bench serve``'s: each request is sent at its arrival time, or when one of ``max_concurrency`` slots
frees, first come first served; its time to first token counts from the moment it is sent.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..bench.client import RequestResult
from ..config import SchedulerConfig
from ..core.batching import Batching
from ..core.outputs import RunnerOutput, SchedulerOutput
from ..core.scheduler import Scheduler
from ..sampling_params import SamplingParams
from .cost_model import CostModel, StepShape

SIM_TOKEN = 1  # the token every simulated step samples (never a stop token: requests ignore EOS)


class SimulationError(RuntimeError):
    """A workload the simulated scheduler can never finish (it says why)."""


@dataclass
class SimRequest:
    """A request of the workload: its prompt's token ids, output length, arrival (seconds) and class."""

    prompt: list[int]
    max_tokens: int
    at: float = 0.0
    kind: str = ""
    priority: int = 0
    user: str | None = None


@dataclass
class SimStep:
    """One simulated step: when it started, what it cost, its cells (as the step log records them)."""

    start: float
    seconds: float
    cells: tuple[tuple, ...]


@dataclass
class SimRun:
    """What a simulation produced: per-request results (bench.client's), the steps, the virtual time it spanned."""

    results: list[RequestResult]
    steps: list[SimStep] = field(default_factory=list)
    elapsed: float = 0.0
    preemptions: int = 0


class Simulation:
    """One scheduler on virtual time, driven by ``run``."""

    def __init__(self, config: SchedulerConfig, costs: CostModel, batching: Batching | None = None) -> None:
        if config.spec_method is not None:
            raise SimulationError("speculative decoding is not simulated (its acceptance is the text's): plan "
                                  "without --speculation")
        self.costs = costs
        self.now = 0.0
        self.scheduler = Scheduler(config, batching)
        self.scheduler.clock = lambda: self.now  # arrivals, aging and deadlines in virtual time

    def run(self, requests: list[SimRequest], max_concurrency: int | None = None,
            time_limit: float = float("inf")) -> SimRun:
        """Every request to its end (or until ``time_limit`` virtual seconds); their results in request order."""
        results = [RequestResult(ok=False, kind=r.kind, prompt_tokens=len(r.prompt), usage_reported=True)
                   for r in requests]
        client = _Client(requests, max_concurrency)
        run = SimRun(results)
        live: dict[str, int] = {}
        while len(live) or client.pending:
            for i in client.send_due(self.now):
                if not self._add(i, requests[i], results[i], live):
                    client.done(self.now)
            sched = self.scheduler.schedule()
            if sched.empty:
                if not client.pending_at(self.now):
                    raise SimulationError(self._stuck(live))
                self.now = max(self.now, client.next_arrival())
                continue
            self._step(sched, run, live, client)
            if self.now > time_limit:
                break
        for i in live.values():
            results[i].error, results[i].end = "time limit", self.now
        run.elapsed = self.now
        run.preemptions = self.scheduler.stats.num_preemptions
        return run

    def _add(self, i: int, req: SimRequest, res: RequestResult, live: dict[str, int]) -> bool:
        """Queue request ``i``; False where the scheduler refuses it (it could never fit), as the server would."""
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, priority=req.priority, user=req.user)
        rid = f"sim-{i}"
        res.start = self.now
        try:
            self.scheduler.add_request(rid, req.prompt, params, (), seed=i)
        except ValueError as e:
            res.error, res.end = str(e), self.now
            return False
        live[rid] = i
        return True

    def _step(self, sched: SchedulerOutput, run: SimRun, live: dict[str, int], client: _Client) -> None:
        sampled = {}
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            if req.num_computed_tokens + n >= req.num_tokens:
                sampled[rid] = [SIM_TOKEN]
        outs = self.scheduler.update(sched, RunnerOutput(sampled_token_ids=sampled))
        cells = tuple(self.scheduler.record.cells)
        seconds = self.costs.seconds(StepShape.of_cells(cells))
        run.steps.append(SimStep(self.now, seconds, cells))
        self.now += seconds
        for out in outs:
            i = live[out.request_id]
            res = run.results[i]
            if out.new_token_ids:
                if res.ttft is None:
                    res.ttft = self.now - res.start
                res.chunk_times.append(self.now)
                res.output_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                res.ok, res.end = out.finish_reason in ("length", "stop"), self.now
                if not res.ok:
                    res.error = f"finished: {out.finish_reason}"
                del live[out.request_id]
                client.done(self.now)

    def _stuck(self, live: dict[str, int]) -> str:
        sched = self.scheduler
        return (f"the scheduler schedules nothing with {len(live)} requests unfinished ({len(sched.waiting)} "
                f"waiting, {len(sched.running)} running, {sched.pool.num_free} of {sched.pool.num_blocks} blocks "
                "free)")


class _Client:
    """bench serve's sender: each request at its arrival time, holding one of ``max_concurrency`` slots until it
    ends; requests waiting for a slot take them in arrival order."""

    def __init__(self, requests: list[SimRequest], max_concurrency: int | None) -> None:
        self.arrivals = [(r.at, i) for i, r in enumerate(requests)]
        heapq.heapify(self.arrivals)
        self.free = max_concurrency if max_concurrency else len(requests)
        self.queued: list[tuple[float, int]] = []  # arrived, waiting for a slot

    @property
    def pending(self) -> int:
        return len(self.arrivals) + len(self.queued)

    def send_due(self, now: float) -> list[int]:
        """Requests sent at ``now``: those arrived that have a slot."""
        while self.arrivals and self.arrivals[0][0] <= now:
            heapq.heappush(self.queued, heapq.heappop(self.arrivals))
        sent = []
        while self.queued and self.free > 0:
            sent.append(heapq.heappop(self.queued)[1])
            self.free -= 1
        return sent

    def pending_at(self, now: float) -> bool:
        """Whether a request is still to be sent (it may wait for a slot that a running request frees)."""
        return bool(self.arrivals) or (bool(self.queued) and self.free > 0)

    def next_arrival(self) -> float:
        return self.arrivals[0][0] if self.arrivals else self.queued[0][0]

    def done(self, now: float) -> None:
        self.free += 1
