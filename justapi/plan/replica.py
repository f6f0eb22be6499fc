"""One simulated engine (``Replica``): the engine's own ``Scheduler`` on a virtual clock, its runner replaced by its
effect (every request whose computed tokens catch up with its tokens gets a token, a fixed id that is no stop token,
as a benchmark's ``ignore_eos`` requests run), each step costing what a cost model says; and the records a
simulation keeps (plan.simulator drives the replicas)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from ..bench.client import RequestResult
from ..config import SchedulerConfig
from ..core.batching import StaticBatching
from ..core.outputs import RunnerOutput
from ..core.scheduler import Scheduler
from ..sampling_params import SamplingParams
from .cost_model import StepShape

SIM_TOKEN = 1  # the token every simulated step samples (never a stop token: requests ignore EOS)


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

    def add(self, i: int, req: SimRequest, now: float, first_token: int | None = None) -> str | None:
        """Queue request ``i`` at ``now`` (with ``first_token``: its prompt computed by a prefill worker, its KV
        arrived); the scheduler's refusal (it could never fit), else None."""
        self.now = max(self.now, now)
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, priority=req.priority, user=req.user)
        try:
            if first_token is None:
                self.scheduler.add_request(f"sim-{i}", req.prompt, params, (), seed=i)
            else:  # the KV itself is not simulated: any marker makes the scheduler count the prompt computed
                self.scheduler.add_prefilled_request(f"sim-{i}", req.prompt, first_token, params, (), i, True, 0)
        except ValueError as e:
            return str(e)
        self.live[f"sim-{i}"] = i
        return None

    def start_step(self, now: float, run: SimRun) -> None:
        """Schedule and run a step at ``now`` (its tokens are the runner's effect), where there is one to schedule;
        its outputs wait for ``finish_step`` at ``busy_until``."""
        self.now = max(self.now, now)
        sched = self.scheduler.schedule()
        if sched.empty:
            return
        sampled, blocks = {}, {}
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            blocks[rid] = list(req.block_ids)  # a block two rows hold is one block: shared reads counted as such
            if req.num_computed_tokens + n >= req.num_tokens:
                sampled[rid] = [SIM_TOKEN]
        self._outputs = self.scheduler.update(sched, RunnerOutput(sampled_token_ids=sampled))
        cells = tuple(self.scheduler.record.cells)
        seconds = self.costs.seconds(StepShape.of_cells(cells, blocks, self.scheduler.block_size))
        run.steps.append(SimStep(self.now, seconds, cells))
        self.busy_until = self.now + seconds

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


