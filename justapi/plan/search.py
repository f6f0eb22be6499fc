"""The configuration search: for a traffic (a workload at a rate) and an SLO (TTFT and TPOT p99), the cheapest
configuration whose simulation meets it, and the curve of goodput against rate for it.

Each candidate is a tensor-parallel degree, a chunk size and a ``--max-seqs``; for each, the fewest data-parallel
replicas (behind the prefix router) that meet the SLO at the rate is found by simulation: doubling until it is met,
then halving the interval; where disaggregation is searched too, the fewest prefill + decode workers the same way (a
quarter, half and three quarters of each total prefilling), no more than the colocated answer needs. The cheapest
candidate is the one with the fewest devices (engines x TP, times the device's price), ties broken by goodput.
Every simulation runs the engine's Scheduler (plan.simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..bench import report
from ..config import SchedulerConfig
from .simulator import SimRequest, Simulation, SimulationError, StepCosts


@dataclass(frozen=True)
class SloTargets:
    """``ttft_p99=500,tpot_p99=50``: milliseconds at the 99th percentile."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SloTargets:
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("ttft_p99", "tpot_p99"):
                raise ValueError(f"--slo takes ttft_p99=MS,tpot_p99=MS, not {item!r}")
            try:
                values[key + "_ms"] = float(value)
            except ValueError:
                raise ValueError(f"--slo {item!r}: {value!r} is not a number of milliseconds") from None
            if not values[key + "_ms"] > 0:
                raise ValueError(f"--slo {item!r}: the target must be positive")
        if not values:
            raise ValueError("--slo needs at least one of ttft_p99=MS, tpot_p99=MS")
        return cls(**values)

    def met(self, figures: dict) -> bool:
        if figures["failed"]:
            return False
        checks = ((self.ttft_p99_ms, figures["ttft_ms"]["p99"]), (self.tpot_p99_ms, figures["tpot_ms"]["p99"]))
        return all(target is None or (value is not None and value <= target) for target, value in checks)

    def per_request(self) -> report.Slo:
        """The same targets per request, for goodput (requests that met both)."""
        return report.Slo(ttft_ms=self.ttft_p99_ms, tpot_ms=self.tpot_p99_ms)

    def describe(self) -> str:
        parts = [f"TTFT p99 <= {self.ttft_p99_ms:g} ms" if self.ttft_p99_ms else "",
                 f"TPOT p99 <= {self.tpot_p99_ms:g} ms" if self.tpot_p99_ms else ""]
        return " and ".join(p for p in parts if p)


@dataclass(frozen=True)
class Candidate:
    tp: int
    chunk_size: int
    max_seqs: int
    replicas: int = 1  # with decoders: the prefill workers
    decoders: int = 0  # decode workers (--disaggregate); 0: colocated replicas

    @property
    def devices(self) -> int:
        return self.tp * (self.replicas + self.decoders)

    def describe(self) -> str:
        engines = (f"{self.replicas} prefill + {self.decoders} decode workers" if self.decoders else
                   f"{self.replicas} replica{'s' * (self.replicas > 1)}")
        return (f"{engines} x TP {self.tp} ({self.devices} devices), --chunk-size {self.chunk_size} --max-seqs "
                f"{self.max_seqs}")


@dataclass
class Outcome:
    candidate: Candidate
    figures: dict
    meets: bool


@dataclass
class Space:
    """What a search may vary and what each candidate runs on: costs and pool blocks per TP degree, the workload at
    a rate (request rate -> requests with arrival times), the client's concurrency limit."""

    costs: Callable[[int], StepCosts]
    pool_blocks: Callable[[int], int]
    requests: Callable[[float], list[SimRequest]]
    base: SchedulerConfig
    tps: tuple[int, ...] = (1,)
    chunk_sizes: tuple[int, ...] = (512,)
    max_seqs: tuple[int, ...] = (32,)
    max_replicas: int = 64
    max_concurrency: int | None = None
    front_s: float = 0.0  # the HTTP front (plan.profile's, on this machine; none assumed for a described device)
    tail_s: float = 0.0
    # per candidate, a disaggregated request's KV transfer by its prompt tokens; None: no disaggregated candidates
    transfer: Callable[[Candidate], Callable[[int], float]] | None = None


def simulate(space: Space, cand: Candidate, rate: float, slo: SloTargets, static: bool = False) -> Outcome:
    config = replace(space.base, num_blocks=space.pool_blocks(cand.tp), chunk_size=cand.chunk_size,
                     max_seqs=cand.max_seqs, max_decode=max(space.base.max_decode, cand.max_seqs))
    transfer = space.transfer(cand) if space.transfer is not None and cand.decoders else None
    sim = Simulation(config, space.costs(cand.tp), static, cand.replicas, front_s=space.front_s,
                     tail_s=space.tail_s, decoders=cand.decoders, transfer_s=transfer)
    run = sim.run(space.requests(rate), space.max_concurrency)
    figures = report.summarize(run.results, run.elapsed, slo.per_request())
    figures["preemptions"] = run.preemptions
    utilizations = [u for r in sim.replicas for u in r.scheduler.stats.batch_utilizations]
    if utilizations:
        figures["static_u"] = sum(utilizations) / len(utilizations)
    return Outcome(cand, figures, slo.met(figures))


def fewest_replicas(space: Space, cand: Candidate, rate: float, slo: SloTargets) -> Outcome | None:
    """The candidate with the fewest replicas meeting ``slo`` at ``rate`` (None past ``max_replicas``)."""
    low, high, best = 0, 1, None
    while high <= space.max_replicas:
        out = simulate(space, replace(cand, replicas=high), rate, slo)
        if out.meets:
            best = out
            break
        low, high = high, high * 2
    if best is None:
        return None
    while high - low > 1:  # met at high, not at low
        mid = (low + high) // 2
        out = simulate(space, replace(cand, replicas=mid), rate, slo)
        if out.meets:
            high, best = mid, out
        else:
            low = mid
    return best


SPLITS = (0.25, 0.5, 0.75)  # shares of a disaggregated deployment's workers that prefill


def best_split(space: Space, cand: Candidate, total: int, rate: float, slo: SloTargets) -> Outcome | None:
    """The best of a few prefill/decode splits of ``total`` workers (each side at least one) that meets ``slo``."""
    prefills = sorted({min(total - 1, max(1, round(total * share))) for share in SPLITS})
    met = [o for o in (simulate(space, replace(cand, replicas=p, decoders=total - p), rate, slo) for p in prefills)
           if o.meets]
    return max(met, key=lambda o: o.figures.get("goodput", 0.0)) if met else None


def fewest_split(space: Space, cand: Candidate, rate: float, slo: SloTargets, at_most: int) -> Outcome | None:
    """Disaggregated: the fewest workers (prefill + decode) meeting ``slo``, at most ``at_most`` (more could not be
    cheaper than the colocated answer): doubling, then halving the interval."""
    low, high, best = 1, 2, None
    while high <= at_most:
        best = best_split(space, cand, high, rate, slo)
        if best is not None:
            break
        low, high = high, high * 2
    if best is None:
        return None
    while high - low > 1:
        mid = (low + high) // 2
        out = best_split(space, cand, mid, rate, slo)
        if out is not None:
            high, best = mid, out
        else:
            low = mid
    return best


def search(space: Space, rate: float, slo: SloTargets, price: float = 1.0) -> tuple[Outcome | None, list[Outcome]]:
    """The cheapest outcome meeting ``slo`` at ``rate``, and every candidate's best."""
    tried = []
    for tp in space.tps:
        for chunk in space.chunk_sizes:
            for seqs in space.max_seqs:
                cand = Candidate(tp, chunk, seqs)
                try:
                    colocated = fewest_replicas(space, cand, rate, slo)
                    at_most = colocated.candidate.replicas if colocated is not None else space.max_replicas
                    split = fewest_split(space, cand, rate, slo, at_most) if space.transfer is not None else None
                except (SimulationError, ValueError):
                    continue  # this TP degree cannot hold the model, or a request can never fit
                tried += [o for o in (colocated, split) if o is not None]
    if not tried:
        return None, tried
    best = min(tried, key=lambda o: (o.candidate.devices * price, -o.figures.get("goodput", 0.0)))
    return best, tried

