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

    def finish_step(self, run: SimRun, tail_s: float = 0.0) -> list[int]:
        """The running step ends: its tokens reach their clients ``tail_s`` later; the requests that ended."""
        assert self.busy_until < math.inf
        self.now, self.busy_until = self.busy_until, math.inf
        seen, ended = self.now + tail_s, []
        for out in self._outputs:
            i = self.live[out.request_id]
            res = run.results[i]
            if out.new_token_ids:
                if res.ttft is None:
                    res.ttft = seen - res.start
                res.chunk_times.append(seen)
                res.output_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                res.ok, res.end = out.finish_reason in ("length", "stop"), seen
                if not res.ok:
                    res.error = f"finished: {out.finish_reason}"
                del self.live[out.request_id]
                ended.append(i)
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
                 replicas: int = 1, router: str = "prefix", front_s: float = 0.0, tail_s: float = 0.0) -> None:
        """``front_s``: the HTTP front's seconds before a request reaches the engines (one request after another);
        ``tail_s``: from a step's end until its client has the tokens (plan.profile measures both)."""
        if config.spec_method is not None:
            raise SimulationError("speculative decoding is not simulated (its acceptance is the text's): plan "
                                  "without --speculation")
        if replicas < 1:
            raise SimulationError(f"replicas must be at least 1, not {replicas}")
        self.costs, self.front_s, self.tail_s = costs, front_s, tail_s
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
        """Every request to its end (or until ``time_limit`` virtual seconds); their results in request order.
        Events in time order: a client sends, a request reaches the engines past the front, a step ends."""
        run = SimRun([RequestResult(ok=False, kind=r.kind, prompt_tokens=len(r.prompt), usage_reported=True)
                      for r in requests])
        client = _Client(requests, max_concurrency)
        self._inbound: list[tuple[float, int]] = []  # (when it reaches the engines, request index)
        self._front_free = 0.0
        now = 0.0
        while client.pending or self._inbound or any(r.live for r in self.replicas):
            first = min(self.replicas, key=lambda r: r.busy_until)  # the step that ends first, if any runs
            t_send, t_in = client.next_send(now), self._inbound[0][0] if self._inbound else math.inf
            t = min(t_send, t_in, first.busy_until)
            if t == math.inf:
                raise SimulationError(next((r.stuck() for r in self.replicas if r.live), "nothing can run"))
            now = max(now, t)
            if t == t_send:
                for i in client.send_due(now):
                    self._send(i, run, now)
            elif t == first.busy_until and t < t_in:
                for i in first.finish_step(run, self.tail_s):
                    client.done(now + self.tail_s)
            while self._inbound and self._inbound[0][0] <= now:  # reached the engines
                self._route(heapq.heappop(self._inbound)[1], requests, run, now, client)
            for replica in self.replicas:
                if replica.busy_until == math.inf and replica.live:
                    replica.start_step(now, run)
            if now > time_limit:
                break
        for replica in self.replicas:
            for i in replica.live.values():
                run.results[i].error, run.results[i].end = "time limit", now
        run.elapsed = now
        run.preemptions = sum(r.scheduler.stats.num_preemptions for r in self.replicas)
        return run

    def _send(self, i: int, run: SimRun, now: float) -> None:
        """The client sends request ``i``: the front takes ``front_s`` of it, one request after another."""
        run.results[i].start = now
        self._front_free = max(now, self._front_free) + self.front_s
        heapq.heappush(self._inbound, (self._front_free, i))

    def _route(self, i: int, requests: list[SimRequest], run: SimRun, now: float, client: _Client) -> None:
        req, res = requests[i], run.results[i]
        loads = {k: len(r.live) for k, r in enumerate(self.replicas)}
        k = self.router.choose(req.prompt, loads) if len(self.replicas) > 1 else 0
        refused = self.replicas[k].add(i, req, now)
        if refused is not None:
            res.error, res.end = refused, now
            client.done(now)


class _Client:
    """bench serve's sender: each request at its arrival time, holding one of ``max_concurrency`` slots until it
    hears the request ended; requests waiting for a slot take them in arrival order."""

    def __init__(self, requests: list[SimRequest], max_concurrency: int | None) -> None:
        self.arrivals = [(r.at, i) for i, r in enumerate(requests)]
        heapq.heapify(self.arrivals)
        self.free = max_concurrency if max_concurrency else len(requests)
        self.freeing: list[float] = []  # when taken slots come back
        self.queued: list[tuple[float, int]] = []  # arrived, waiting for a slot

    @property
    def pending(self) -> int:
        return len(self.arrivals) + len(self.queued)

    def send_due(self, now: float) -> list[int]:
        """Requests sent at ``now``: those arrived that have a slot."""
        while self.freeing and self.freeing[0] <= now:
            heapq.heappop(self.freeing)
            self.free += 1
        while self.arrivals and self.arrivals[0][0] <= now:
            heapq.heappush(self.queued, heapq.heappop(self.arrivals))
        sent = []
        while self.queued and self.free > 0:
            sent.append(heapq.heappop(self.queued)[1])
            self.free -= 1
        return sent

    def next_send(self, now: float) -> float:
        """When the next request can be sent: once one has arrived and a slot is free (inf: not before a request
        ends)."""
        if not self.queued and not self.arrivals:
            return math.inf
        slot = now if self.free > 0 else (self.freeing[0] if self.freeing else math.inf)
        request = now if self.queued else self.arrivals[0][0]
        return max(slot, request)

    def done(self, at: float) -> None:
        """A request's end reaches the client at ``at``: its slot is free from then."""
        heapq.heappush(self.freeing, at)
