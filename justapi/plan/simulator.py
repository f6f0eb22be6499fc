"""A deployment on virtual time: engines (plan.replica: the engine's own ``Scheduler`` each, on a cost model), the
``PdScheduler`` routing among them as ``--data-parallel`` and ``--disaggregate`` do (core.pd_scheduler, with the
prefix router), the HTTP front, and ``bench serve``'s client. The results are the figures ``justapi bench serve``
reports (bench.report), in seconds of compute.

Nothing here decides what runs: the schedulers batch, page, preempt and cache prefixes as the engine's do; the
PdScheduler picks each request's replica (or prefill worker, then decode worker) as the worker pool's does. A
disaggregated request is handed off by its prefill worker after its first token, its KV moves for
``transfer_s(prompt tokens)`` seconds, then a decode worker admits it with its prompt computed. The client sends each
request at its arrival time, or when one of ``max_concurrency`` slots frees, first come first served; its time to
first token counts from the moment it is sent.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Callable

from ..bench.client import RequestResult
from ..config import SchedulerConfig
from ..core.pd_scheduler import PdScheduler, WorkerInfo
from ..core.router import PrefixRouter
from ..core.scheduler import Scheduler
from .replica import SIM_TOKEN, Replica, SimRequest, SimRun, SimStep, StepCosts

__all__ = ["Simulation", "SimulationError", "SimRequest", "SimRun", "SimStep", "StepCosts"]


class SimulationError(RuntimeError):
    """A workload the simulated scheduler can never finish (it says why)."""


def requests_of(jobs, tokenizer, starts: list[float]) -> list[SimRequest]:
    """A bench workload's jobs as the simulation's requests, sent at ``starts``: a completion prompt each,
    tokenized as the server does (or by plan.answer's ``IdText``), with its class's priority and user."""
    out = []
    for job, at in zip(jobs, starts):
        if len(job.turns) != 1 or job.turns[0].prompt is None:
            raise SimulationError("the simulation takes completion prompts, one a request (random, shared-prefix, "
                                  "burst, --class, or jsonl prompts), not chat turns")
        turn, priority = job.turns[0], job.fields.get("priority", 0)
        out.append(SimRequest(tokenizer.encode(turn.prompt), turn.max_tokens, at, job.kind,
                              int(priority) if isinstance(priority, (int, float)) else 0, job.fields.get("user")))
    return out


class Simulation:
    """``replicas`` engines of one configuration behind the router, or with ``decoders`` > 0 that many prefill
    workers and ``decoders`` decode workers; and bench serve's client, on one virtual clock, driven by ``run``."""

    def __init__(self, config: SchedulerConfig, costs: StepCosts, static_batching: bool = False,
                 replicas: int = 1, router: str = "prefix", front_s: float = 0.0, tail_s: float = 0.0,
                 decoders: int = 0, transfer_s: Callable[[int], float] | None = None) -> None:
        """``front_s``: the HTTP front's seconds before a request reaches the engines (one request after another);
        ``tail_s``: from a step's end until its client has the tokens (plan.profile measures both);
        ``transfer_s``: a disaggregated request's KV transfer, by its prompt tokens."""
        if config.spec_method is not None:
            raise SimulationError("speculative decoding is not simulated (its acceptance is the text's): plan "
                                  "without --speculation")
        if replicas < 1 or decoders < 0:
            raise SimulationError(f"engines must be at least 1 (and decode workers 0 or more), not {replicas}")
        self.costs, self.front_s, self.tail_s = costs, front_s, tail_s
        self.transfer_s = transfer_s or (lambda tokens: 0.0)
        entry = replace(config, hand_off_after_prefill=decoders > 0)
        self.replicas = [Replica(entry, costs, static_batching) for _ in range(replicas)]
        self.decoders = [Replica(config, costs) for _ in range(decoders)]
        role = "prefill" if decoders else "replica"
        workers = [WorkerInfo(k, role, config.num_blocks, config.block_size) for k in range(replicas)]
        workers += [WorkerInfo(replicas + k, "decode", config.num_blocks, config.block_size) for k in range(decoders)]
        self.pd = PdScheduler(workers, PrefixRouter(router, block_size=config.block_size))
        self.engines = self.replicas + self.decoders  # by rank

    @property
    def scheduler(self) -> Scheduler:
        """The first engine's scheduler (the only one, with one replica)."""
        return self.replicas[0].scheduler

    def run(self, requests: list[SimRequest], max_concurrency: int | None = None,
            time_limit: float = float("inf")) -> SimRun:
        """Every request to its end (or until ``time_limit`` virtual seconds); their results in request order.
        Events in time order: a client sends, a request reaches the engines past the front, a KV transfer ends, a
        step ends."""
        self.requests = requests
        self.out = SimRun([RequestResult(ok=False, kind=r.kind, prompt_tokens=len(r.prompt), usage_reported=True)
                           for r in requests])
        self.client = _Client(requests, max_concurrency)
        self._inbound: list[tuple[float, int]] = []  # (when it reaches the engines, request index)
        self._moving: list[tuple[float, int, int, int]] = []  # KV transfers: (end, request index, from, to)
        self._front_free = now = 0.0
        while self.client.pending or self._inbound or self._moving or any(e.live for e in self.engines):
            first = min(self.engines, key=lambda e: e.busy_until)  # the step that ends first, if any runs
            t_send = self.client.next_send(now)
            t_in, t_move = (q[0][0] if q else math.inf for q in (self._inbound, self._moving))
            t = min(t_send, t_in, t_move, first.busy_until)
            if t == math.inf:
                raise SimulationError(next((e.stuck() for e in self.engines if e.live), "nothing can run"))
            if t > time_limit:  # the client gives up on what has not ended
                now = time_limit
                break
            now = max(now, t)
            if t == t_send:
                for i in self.client.send_due(now):
                    self._send(i, now)
            elif t == first.busy_until and t < min(t_in, t_move):
                self._step_ended(first, now)
            self._arrivals(now)
            for engine in self.engines:
                if engine.busy_until == math.inf and engine.live:
                    engine.start_step(now, self.out)
        for res in self.out.results:
            if not res.ok and not res.error:  # still queued, past the front, moving or running
                res.error, res.end = "time limit", now
        self.out.elapsed = now
        self.out.preemptions = sum(e.scheduler.stats.num_preemptions for e in self.engines)
        return self.out

    def _send(self, i: int, now: float) -> None:
        """The client sends request ``i``: the front takes ``front_s`` of it, one request after another."""
        self.out.results[i].start = now
        self._front_free = max(now, self._front_free) + self.front_s
        heapq.heappush(self._inbound, (self._front_free, i))

    def _arrivals(self, now: float) -> None:
        """Requests past the front go to the engine the PdScheduler picks; transfers ended join their decoder."""
        while self._inbound and self._inbound[0][0] <= now:
            i = heapq.heappop(self._inbound)[1]
            req = self.requests[i]
            refused = self.engines[self.pd.route(f"sim-{i}", req.prompt)].add(i, req, now)
            if refused is not None:
                self._refused(i, refused, now)
        while self._moving and self._moving[0][0] <= now:
            _, i, src, dst = heapq.heappop(self._moving)
            self.engines[src].scheduler.release_handoff(f"sim-{i}")
            self.pd.transferred(f"sim-{i}", 0, 0, 0.0)
            refused = self.engines[dst].add(i, self.requests[i], now, first_token=SIM_TOKEN)
            if refused is not None:  # as the worker pool fails it
                self._refused(i, refused, now)

    def _refused(self, i: int, why: str, now: float) -> None:
        """An engine refused request ``i`` (it could never fit there): its client hears why at once."""
        self.out.results[i].error, self.out.results[i].end = why, now
        self.pd.finished(f"sim-{i}")
        self.client.done(now)

    def _step_ended(self, engine: Replica, now: float) -> None:
        for i in engine.finish_step(self.out, self.tail_s):
            self.pd.finished(f"sim-{i}")
            self.client.done(now + self.tail_s)
        for rid in list(engine.scheduler.handoffs):
            if rid not in engine.live:
                continue  # already moving
            i = engine.live.pop(rid)
            for w in self.pd.pool("decode"):  # each decode worker's room as its report says, less what is on its way
                sched = self.engines[w.rank].scheduler
                coming = sum(-(-len(self.requests[j].prompt) // sched.block_size) for _, j, _, d in self._moving
                             if d == w.rank)
                w.free_blocks = sched.pool.num_free + sched.num_cached_blocks - coming
            dst = self.pd.route_decode(rid, len(self.requests[i].prompt))  # as the worker pool asks
            heapq.heappush(self._moving, (now + self.transfer_s(len(self.requests[i].prompt)), i,
                                          self.engines.index(engine), dst))


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
