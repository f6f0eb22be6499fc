"""``justapi plan --model M --hardware H --rate R --slo ttft_p99=..,tpot_p99=..``: the search space for a model on a
machine (this CPU through its fitted cost model, or a described device through its roofline), the cheapest
configuration meeting the SLO, the static-batching baseline beside it, and the goodput curve as a PNG.

The workload is ``bench serve``'s, built in token ids (``IdText``: a prompt's text is its ids, so lengths are exact
and shared prefixes share ids) with Poisson arrivals at each rate tried.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from ..bench.workloads import WorkloadSpec, arrival_times, build
from ..config import SchedulerConfig
from .cost_model import CostModel, load_costs
from .hardware import HARDWARE, Hardware, ModelShape, RooflineCosts, model_shape
from .search import Candidate, Outcome, SloTargets, Space, search, simulate
from .simulator import SimRequest, StepCosts, requests_of

CURVE = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)  # the goodput curve's rates, times the asked rate
SATURATED = 0.5  # the curve stops past the rate whose goodput falls below this share of the offered rate


class IdText:
    """A tokenizer whose text is the token ids themselves ("17 4051 9"): workloads of exact lengths without the
    model's vocabulary."""

    special_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.split()]


def workload(spec: WorkloadSpec, vocab_size: int):
    """Requests of ``spec`` at a rate: a function of the rate (Poisson arrivals, seeded)."""
    text = IdText(vocab_size)
    jobs = build(spec, text)

    def at_rate(rate: float) -> list[SimRequest]:
        return requests_of(jobs, text, arrival_times(jobs, rate, "poisson", spec.seed))

    return at_rate


@dataclass
class Target:
    """What the plan runs on: a step cost per TP degree, pool blocks per TP degree, the TP degrees allowed."""

    name: str
    costs: Callable[[int], StepCosts]
    blocks: Callable[[int], int]
    tps: tuple[int, ...]
    price: float
    note: str
    transfer: Callable[[Candidate], Callable[[int], float]] | None = None  # per candidate: a KV transfer by tokens


def target_for(model: str, hardware: str, fitted: CostModel | None, block_size: int, bytes_per_weight: float,
               max_tp: int) -> tuple[Target, ModelShape | None]:
    """``hardware`` "this": the fitted cost model (one device: tensor parallelism on these cores is measured
    slower); a name of HARDWARE: the roofline of the model's shape on 1, 2, 4, ... devices of it."""
    if hardware == "this":
        if fitted is None:
            raise ValueError("planning on this machine needs its cost model: justapi plan profile -- --model M")
        settings = fitted.settings or {}
        if not settings.get("num_blocks"):
            raise ValueError("the cost model does not say how many KV blocks its server had")
        return Target(fitted.machine, lambda tp: fitted, lambda tp: int(settings["num_blocks"]), (1,), 1.0,
                      fitted.describe()), None
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}: 'this' (a fitted cost model) or one of "
                         f"{', '.join(HARDWARE)}")
    hw: Hardware = HARDWARE[hardware]
    shape = model_shape(model, bytes_per_weight)
    tps = tuple(t for t in (1, 2, 4, 8) if t <= min(hw.devices, max_tp) and shape.heads % t == 0 and
                shape.kv_heads % t == 0)
    return Target(hw.name, lambda tp: RooflineCosts(shape, hw, tp),
                  lambda tp: RooflineCosts(shape, hw, tp).kv_pool_blocks(block_size), tps, hw.price_hour,
                  RooflineCosts(shape, hw, 1).describe(),
                  lambda cand: partial(RooflineCosts(shape, hw, cand.tp).transfer_seconds,
                                       across_nodes=cand.devices > hw.devices)), shape


def baseline(space: Space, best: Outcome, rate: float, slo: SloTargets) -> Outcome:
    """The chosen configuration with static batching instead of continuous (the documents' baseline, U); a
    disaggregated one as colocated replicas on as many devices (a static batch is one engine's)."""
    return simulate(space, static_twin(best.candidate), rate, slo, static=True)


def static_twin(cand: Candidate) -> Candidate:
    return replace(cand, replicas=cand.replicas + cand.decoders, decoders=0)


def curve(space: Space, cand: Candidate, rate: float, slo: SloTargets) -> list[tuple[float, dict]]:
    """Goodput against rate for ``cand``, from a quarter of the asked rate until it saturates."""
    points: list[tuple[float, dict]] = []
    for k in CURVE:
        points.append((rate * k, simulate(space, cand, rate * k, slo).figures))
        if points[-1][1].get("goodput", 0.0) < SATURATED * rate * k:
            break
    return points


def draw_curve(points: list[tuple[float, dict]], static: list[tuple[float, dict]], title: str, path: str) -> None:
    from ..bench.plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rates = [r for r, _ in points]
    ax.plot(rates, rates, linestyle=":", color="grey", label="offered")
    ax.plot(rates, [f.get("goodput", 0.0) for _, f in points], marker="o", label="continuous batching")
    ax.plot([r for r, _ in static], [f.get("goodput", 0.0) for _, f in static], marker="s",
            label="static batching")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting the SLO)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(figures: dict) -> str:
    def ms(key: str) -> str:
        v = figures[key]["p99"]
        return "-" if v is None else f"{v:.0f}"

    return (f"{figures['output_throughput']:.1f} out tok/s, goodput {figures.get('goodput', 0.0):.2f} req/s, "
            f"TTFT p99 {ms('ttft_ms')} ms, TPOT p99 {ms('tpot_ms')} ms, {figures['failed']} failed")



def answer(args) -> str:
    """The plan for ``justapi plan``'s flags: the cheapest configuration, the baseline beside it, the curve."""
    fitted = load_costs(args.plan_costs, args.plan_model) if args.hardware == "this" else None
    if args.disaggregate and fitted is not None:
        raise ValueError("--disaggregate is planned on described devices: on this machine its workers split the "
                         "cores, which the fitted cost model (all cores) does not describe")
    settings = (fitted.settings or {}) if fitted is not None else {}
    block_size = int(settings.get("block_size", 16))
    target, shape = target_for(args.plan_model, args.hardware, fitted, block_size, args.weight_bytes,
                               max(args.plan_tp))
    vocab = shape.vocab if shape is not None else 32000
    spec = WorkloadSpec(args.plan_workload, args.plan_requests, args.plan_input, args.plan_output,
                        num_prefixes=args.plan_prefixes, prefix_len=args.plan_prefix_len,
                        suffixes_per_prefix=max(1, args.plan_requests // args.plan_prefixes), seed=args.plan_seed)
    max_len = settings.get("max_model_len", args.plan_max_model_len)
    space = Space(target.costs, target.blocks, workload(spec, vocab),
                  SchedulerConfig(num_blocks=1, block_size=block_size, max_model_len=max_len,
                                  prefix_cache=bool(settings.get("prefix_cache", True))),
                  tuple(t for t in args.plan_tp if t in target.tps), args.chunk_sizes, args.plan_max_seqs,
                  args.max_replicas, args.plan_concurrency, fitted.front_s if fitted else 0.0,
                  fitted.tail_s if fitted else 0.0, target.transfer if args.disaggregate else None)
    best, tried = search(space, args.rate, args.slo, target.price)
    lines = [f"plan for {args.rate:g} req/s of {spec.name} ({spec.input_len[0]}-{spec.input_len[1]} in, "
             f"{spec.output_len[0]}-{spec.output_len[1]} out) with {args.slo.describe()}", f"costs: {target.note}"]
    if best is None:
        lines.append(f"no configuration meets it within {args.max_replicas} replicas")
        return "\n".join(lines)
    static = baseline(space, best, args.rate, args.slo)
    u = static.figures.get("static_u")
    lines += [f"cheapest: {best.candidate.describe()}: {fmt(best.figures)}",
              f"  static batching there: {fmt(static.figures)}" + (f", U = {u:.2f}" if u is not None else ""),
              "every candidate at its fewest engines:"]
    lines += [f"  {o.candidate.describe()}: {fmt(o.figures)}" for o in sorted(tried, key=lambda o: o.candidate.devices)]
    if settings.get("seen_rows") and (best.candidate.chunk_size + best.candidate.max_seqs > settings["seen_rows"]
                                      or best.candidate.max_seqs > settings.get("seen_seqs", 0)):
        lines.append(f"note: the cost model saw steps of at most {settings['seen_rows']} rows and "
                     f"{settings.get('seen_seqs')} sequences; this configuration's larger steps are extrapolated "
                     "(profile with its --chunk-size and --max-seqs to measure them)")
    points = curve(space, best.candidate, args.rate, args.slo)
    static_points = [(r, simulate(space, static_twin(best.candidate), r, args.slo, static=True).figures)
                     for r, _ in points]
    draw_curve(points, static_points, f"{target.name}: {best.candidate.describe()}", args.plan_out)
    lines.append(f"goodput curve: {args.plan_out}")
    return "\n".join(lines)
