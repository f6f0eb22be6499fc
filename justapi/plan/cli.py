"""``justapi plan``: ``profile`` fits this machine's cost model of a model on a real server; ``simulate`` runs a
``bench serve`` workload through the engine's scheduler on that cost model and prints the figures bench prints."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import math
import sys

from ..bench.cli import _range, _rate, _spec, _tokenizer, _workload_flags, _write_json
from ..bench import report
from ..bench.workloads import WorkloadError, arrival_times, build
from .cost_model import CostModelError, default_path, load_costs
from .hardware import HARDWARE, MODELS
from .search import SloTargets
from .simulator import SimRequest, Simulation, SimulationError, requests_of


class PlanError(Exception):
    """A planning command that cannot run; the message says why."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _search_flags(plan: argparse.ArgumentParser) -> None:
    """``justapi plan``'s own flags (their dests apart from the subcommands' flags of the same names)."""
    plan.add_argument("--model", dest="plan_model", default=None,
                      help="a GGUF file (its shape; on this machine its cost model), or a named shape: "
                           + ", ".join(MODELS))
    plan.add_argument("--hardware", default="this", help="this (the fitted cost model) or " + ", ".join(HARDWARE))
    plan.add_argument("--rate", type=_rate, default=None, help="requests per second to serve")
    plan.add_argument("--slo", type=SloTargets.parse, default=None, help="ttft_p99=MS,tpot_p99=MS")
    plan.add_argument("--costs", dest="plan_costs", default=None, help="this machine's cost model (default: the "
                                                                       "cache's for --model)")
    plan.add_argument("--tp", dest="plan_tp", type=_ints, default=(1, 2, 4, 8), help="TP degrees to try")
    plan.add_argument("--chunk-sizes", type=_ints, default=(256, 512, 1024, 2048))
    plan.add_argument("--max-seqs", dest="plan_max_seqs", type=_ints, default=(16, 32, 64, 128, 256))
    plan.add_argument("--max-replicas", type=int, default=64, help="engines per candidate at most")
    plan.add_argument("--disaggregate", action="store_true",
                      help="also try prefill/decode disaggregation (every split of prefill and decode workers)")
    plan.add_argument("--weight-bytes", type=float, default=2.0, help="a named shape's bytes per weight (fp8: 1)")
    plan.add_argument("--max-model-len", dest="plan_max_model_len", type=int, default=32768)
    plan.add_argument("--out", dest="plan_out", default="plan.png", help="the goodput curve's PNG")
    g = plan.add_argument_group("workload (bench serve's, in token ids, Poisson arrivals at each rate tried)")
    g.add_argument("--workload", dest="plan_workload", default="random", choices=["random", "shared-prefix"])
    g.add_argument("--num-requests", dest="plan_requests", type=int, default=300)
    g.add_argument("--input-len", dest="plan_input", type=_range, default=(64, 512))
    g.add_argument("--output-len", dest="plan_output", type=_range, default=(16, 256))
    g.add_argument("--num-prefixes", dest="plan_prefixes", type=int, default=4)
    g.add_argument("--prefix-len", dest="plan_prefix_len", type=int, default=256)
    g.add_argument("--seed", dest="plan_seed", type=int, default=0)
    g.add_argument("--max-concurrency", dest="plan_concurrency", type=int, default=None)


def add_parser(sub, engine_flags) -> None:
    plan = sub.add_parser("plan", help="the capacity planner: the cheapest configuration meeting an SLO; fit a cost "
                                       "model; simulate the scheduler on it",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _search_flags(plan)
    psub = plan.add_subparsers(dest="plan_command")
    prof = psub.add_parser("profile", help="fit this machine's step cost model of a model on a real justapi serve",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    prof.add_argument("--out", default=None, help="the cost model's JSON (default: in the cache, by model and CPU)")
    prof.add_argument("--scale", type=float, default=1.0, help="more (>1) or fewer profiling requests")
    prof.add_argument("--records", default=None, help="also write the server's step records to this JSON file")
    prof.add_argument("serve_flags", nargs=argparse.REMAINDER, metavar="-- SERVE FLAGS",
                      help="justapi serve's flags for the profiled server (its --model, --max-seqs, ...)")
    sim = psub.add_parser("simulate", help="a bench serve workload through the scheduler on a fitted cost model",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine_flags(sim)
    _workload_flags(sim, seed=False)
    sim.add_argument("--costs", default=None, help="the cost model (default: justapi plan profile's for --model "
                                                   "on this CPU)")
    sim.add_argument("--request-rate", type=_rate, default=math.inf, help="requests per second (default: all at "
                                                                          "once)")
    sim.add_argument("--arrival", default="poisson", choices=["poisson", "fixed"])
    sim.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    sim.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLO targets, e.g. ttft:2000")
    sim.add_argument("--trace", default=None, help="replay the requests of a recorded run instead of a workload: "
                                                   "`justapi bench serve --json`'s file (their send times, prompt and "
                                                   "output lengths; the first server's)")
    sim.add_argument("--json", default=None, help="write the figures to this JSON file")


def cmd_profile(args, engine_config, build_parser) -> int:
    from .profile import profile

    flags = [f for f in args.serve_flags if f != "--"]
    config = engine_config(build_parser().parse_args(["serve", *flags]))
    if config.worker_processes or config.tp > 1:
        raise PlanError("profile one engine (no --tp, --data-parallel or --disaggregate): the simulation scales it")
    model, records = asyncio.run(profile(flags, config, _tokenizer(config.model), args.scale))
    out = args.out or default_path(config.model, model.machine)
    model.save(out)
    if args.records:
        _write_json(args.records, records)
    print(model.describe())
    print(f"wrote {out}")
    return 0


def trace_requests(path: str, vocab_size: int, seed: int = 0) -> list[SimRequest]:
    """The requests of a recorded ``bench serve --json`` run: each sent when it was (from the first), with its
    prompt's length (random ids: a trace keeps no text) and the tokens it generated."""
    try:
        with open(path) as f:
            timings = json.load(f)["servers"][0]["figures"]["requests"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise PlanError(f"--trace {path}: not a bench serve --json file with request timings ({e})") from None
    done = [t for t in timings if t.get("ok") and t.get("prompt_tokens") and t.get("output_tokens")]
    if not done:
        raise PlanError(f"--trace {path}: no completed request with its token counts")
    rng, first = random.Random(seed), min(t["start"] for t in done)
    return [SimRequest([rng.randrange(vocab_size) for _ in range(t["prompt_tokens"])], t["output_tokens"],
                       t["start"] - first) for t in sorted(done, key=lambda t: t["start"])]


def cmd_simulate(args, engine_config) -> int:
    from ..engine.engine_core import scheduler_config

    config = engine_config(args)
    if config.worker_processes or config.tp > 1:  # each worker would take a share of the cores profiled whole
        raise PlanError("plan simulate runs one engine on this machine's cost model: no --data-parallel, "
                        "--disaggregate or --tp (justapi plan searches those on described devices)")
    costs = load_costs(args.costs, config.model)
    settings = costs.settings or {}
    num_blocks = config.pool_blocks or settings.get("num_blocks")
    if not num_blocks:
        raise PlanError("give --pool-blocks: the cost model does not say how many blocks its server's pool had")
    sched = scheduler_config(config, num_blocks, settings.get("max_model_len") or 8192)
    tokenizer = _tokenizer(config.model)
    if args.trace:  # sent as they were: no client limit of its own
        requests, limit = trace_requests(args.trace, tokenizer.vocab_size, args.seed), None
    else:
        jobs = build(_spec(args), tokenizer)
        requests = requests_of(jobs, tokenizer, arrival_times(jobs, args.request_rate, args.arrival, args.seed))
        limit = args.max_concurrency
    run = Simulation(sched, costs, config.static_batching, front_s=costs.front_s, tail_s=costs.tail_s).run(
        requests, limit, args.time_limit)
    figures = report.summarize(run.results, run.elapsed, report.Slo.parse(args.goodput))
    figures.update(steps=len(run.steps), preemptions=run.preemptions, cost_model=costs.describe())
    print(report.table(["simulated"], [figures]))
    print(f"{len(run.steps)} steps, {run.preemptions} preemptions, {run.elapsed:.2f} s of engine time; "
          f"cost model: {costs.describe()}")
    if args.json:
        _write_json(args.json, figures)
    return 0


def cmd_search(args) -> int:
    from .answer import answer

    if args.plan_model is None or args.rate is None or args.slo is None:
        raise PlanError("justapi plan needs --model, --rate and --slo (or a subcommand: profile, simulate)")
    print(answer(args))
    return 0


def main(args, engine_config, build_parser) -> int:
    """``engine_config`` and ``build_parser``: justapi.startup's (the serve flags a profiled server takes)."""
    try:
        if args.plan_command == "profile":
            return cmd_profile(args, engine_config, build_parser)
        if args.plan_command == "simulate":
            return cmd_simulate(args, engine_config)
        return cmd_search(args)
    except (PlanError, CostModelError, SimulationError, WorkloadError, ValueError, RuntimeError) as e:
        print(f"justapi plan: error: {e}", file=sys.stderr)
        return 2

