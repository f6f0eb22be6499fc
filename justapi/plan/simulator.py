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
import math
from dataclasses import dataclass, field
from typing import Protocol

from ..bench.client import RequestResult
from ..config import SchedulerConfig
from ..core.batching import StaticBatching
from ..core.outputs import RunnerOutput
from ..core.router import PrefixRouter
from ..core.scheduler import Scheduler
from ..sampling_params import SamplingParams
from .cost_model import StepShape

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


class StepCosts(Protocol):
    """What the simulation asks of a cost model (plan.cost_model's fitted one, plan.hardware's roofline)."""

    def seconds(self, shape: StepShape) -> float: ...

    def describe(self) -> str: ...


class Replica:
    """One engine's scheduler and its virtual clock: a step starts when the one before ends (or work arrives),
    and what it produced reaches its clients when it ends."""

    def __init__(self, config: SchedulerConfig, costs: StepCosts, static_batching: bool = False) -> None:
        self.costs = costs
        self.now = 0.0  # the engine's clock: arrivals, aging and deadlines are read on it
        self.scheduler = Scheduler(config, StaticBatching() if static_batching else None)
        self.scheduler.clock = lambda: self.now
        self.busy_until = math.inf  # the running step's end; inf while idle
        self.live: dict[str, int] = {}  # request id -> its index in the run, until its client hears it ended
        self._outputs: list = []

    def add(self, i: int, req: SimRequest, now: float) -> str | None:
        """Queue request ``i`` at ``now``; the scheduler's refusal (it could never fit), else None."""
        self.now = max(self.now, now)
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, priority=req.priority, user=req.user)
        try:
            self.scheduler.add_request(f"sim-{i}", req.prompt, params, (), seed=i)
        except ValueError as e:
            return str(e)
        self.live[f"sim-{i}"] = i
        return None

    def start_step(self, now: float, run: SimRun) -> bool:
        """Schedule and run a step at ``now`` (its tokens are the runner's effect); False if there is nothing to
        schedule. Its outputs wait for ``finish_step`` at ``busy_until``."""
        self.now = max(self.now, now)
        sched = self.scheduler.schedule()
        if sched.empty:
            return False
        sampled = {}
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            if req.num_computed_tokens + n >= req.num_tokens:
                sampled[rid] = [SIM_TOKEN]
        self._outputs = self.scheduler.update(sched, RunnerOutput(sampled_token_ids=sampled))
        cells = tuple(self.scheduler.record.cells)
        seconds = self.costs.seconds(StepShape.of_cells(cells))
        run.steps.append(SimStep(self.now, seconds, cells))
        self.busy_until = self.now + seconds
        return True

    def finish_step(self, run: SimRun) -> int:
        """The running step ends: its tokens reach their clients; the requests that ended (their slots free)."""
        assert self.busy_until < math.inf
        self.now, self.busy_until = self.busy_until, math.inf
        ended = 0
        for out in self._outputs:
            res = run.results[self.live[out.request_id]]
            if out.new_token_ids:
                if res.ttft is None:
                    res.ttft = self.now - res.start
                res.chunk_times.append(self.now)
                res.output_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                res.ok, res.end = out.finish_reason in ("length", "stop"), self.now
                if not res.ok:
                    res.error = f"finished: {out.finish_reason}"
                del self.live[out.request_id]
                ended += 1
        self._outputs = []
        return ended

    def stuck(self) -> str:
        sched = self.scheduler
        return (f"the scheduler schedules nothing with {len(self.live)} requests unfinished ({len(sched.waiting)} "
                f"waiting, {len(sched.running)} running, {sched.pool.num_free} of {sched.pool.num_blocks} blocks "
                "free)")


class Simulation:
    """``replicas`` engines of one configuration behind the router (core.router, as ``--data-parallel`` routes),
    and bench serve's client, on one virtual clock, driven by ``run``."""

    def __init__(self, config: SchedulerConfig, costs: StepCosts, static_batching: bool = False,
                 replicas: int = 1, router: str = "prefix") -> None:
        if config.spec_method is not None:
            raise SimulationError("speculative decoding is not simulated (its acceptance is the text's): plan "
                                  "without --speculation")
        if replicas < 1:
            raise SimulationError(f"replicas must be at least 1, not {replicas}")
        self.costs = costs
        self.replicas = [Replica(config, costs, static_batching) for _ in range(replicas)]
        self.router = PrefixRouter(router, block_size=config.block_size)
        for k in range(replicas):
            self.router.add(k, config.num_blocks)

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one, with one replica)."""
        return self.replicas[0].scheduler

    def run(self, requests: list[SimRequest], max_concurrency: int | None = None,
            time_limit: float = float("inf")) -> SimRun:
        """Every request to its end (or until ``time_limit`` virtual seconds); their results in request order."""
        run = SimRun([RequestResult(ok=False, kind=r.kind, prompt_tokens=len(r.prompt), usage_reported=True)
                      for r in requests])
        client = _Client(requests, max_concurrency)
        now = 0.0
        while client.pending or any(r.live for r in self.replicas):
            first = min(self.replicas, key=lambda r: r.busy_until)  # the step that ends first, if any runs
            step_end = first.busy_until
            arrival = client.next_send(now)
            if arrival <= step_end and arrival < math.inf:
                now = max(now, arrival)
                for i in client.send_due(now):
                    self._send(i, requests[i], run, now, client)
            elif step_end < math.inf:
                now = step_end
                for _ in range(first.finish_step(run)):
                    client.done()
            else:
                raise SimulationError(next(r.stuck() for r in self.replicas if r.live))
            for replica in self.replicas:
                if replica.busy_until == math.inf and replica.live and not replica.start_step(now, run) \
                        and not client.pending:
                    raise SimulationError(replica.stuck())
            if now > time_limit:
                break
        for replica in self.replicas:
            for i in replica.live.values():
                run.results[i].error, run.results[i].end = "time limit", now
        run.elapsed = now
        run.preemptions = sum(r.scheduler.stats.num_preemptions for r in self.replicas)
        return run

    def _send(self, i: int, req: SimRequest, run: SimRun, now: float, client: _Client) -> None:
        res = run.results[i]
        res.start = now
        loads = {k: len(r.live) for k, r in enumerate(self.replicas)}
        k = self.router.choose(req.prompt, loads) if len(self.replicas) > 1 else 0
        refused = self.replicas[k].add(i, req, now)
        if refused is not None:
            res.error, res.end = refused, now
            client.done()


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

    def next_send(self, now: float) -> float:
        """When the next request can be sent: now where one waits for a free slot, else the next arrival (inf:
        none, or every slot taken)."""
        if self.queued and self.free > 0:
            return now
        if self.free > 0 and self.arrivals:
            return self.arrivals[0][0]
        return math.inf

    def done(self) -> None:
        """A request ended: its slot is free."""
        self.free += 1
