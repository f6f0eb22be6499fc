"""The planner's simulation against the real server, on this machine, in one run (issue 61's validation table).

One ``justapi serve`` (a child on loopback, SERVE FLAGS as given) is profiled (``justapi plan profile``'s phases, its
cost model fitted on them), then runs each workload as ``justapi bench serve`` sends it; the same jobs at the same
arrival times go through the simulation (the engine's Scheduler on the fitted cost model). Printed per workload:
throughput, TTFT and TPOT p50/p99, measured and simulated, with the error of each; and, to tell the cost model's
error from the schedule's, the engine time and steps the server's step log shows against the simulation's.

    python benchmarks/plan_validate.py [--workloads W1 W2 W3 P1] [--scale 1] [--out F.json] [-- SERVE FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from justapi.bench import report  # noqa: E402
from justapi.bench.cli import _spec, _step_log_position, _tokenizer  # noqa: E402
from justapi.bench.client import read_step_log, run_workload  # noqa: E402
from justapi.bench.workloads import arrival_times, build  # noqa: E402
from justapi.engine.engine_core import scheduler_config  # noqa: E402
from justapi.engine.model_process import ModelProcess  # noqa: E402
from justapi.plan.profile import fit_records, measure, prompt_blocks, settled, step_samples  # noqa: E402
from justapi.plan.simulator import Simulation, requests_of  # noqa: E402
from justapi.startup import build_parser, engine_config  # noqa: E402

# beside workloads.txt's W1-W3 (W3: Poisson arrivals): a prefix-heavy Poisson workload, four long system prompts
EXTRA = {"P1": "--workload shared-prefix --num-prefixes 4 --suffixes-per-prefix 12 --prefix-len 1000 "
               "--input-len 32:96 --output-len 32:128 --request-rate 2 --max-concurrency 32"}
FIGURES = (("output tok/s", ("output_throughput",)), ("TTFT p50 ms", ("ttft_ms", "p50")),
           ("TTFT p99 ms", ("ttft_ms", "p99")), ("TPOT p50 ms", ("tpot_ms", "p50")),
           ("TPOT p99 ms", ("tpot_ms", "p99")), ("sent to first step p50 ms", ("first_step_wait_ms", "p50")))


def workload_lines() -> dict[str, str]:
    lines = {}
    with open(os.path.join(ROOT, "benchmarks", "workloads.txt")) as f:
        for line in f:
            name, _, rest = line.strip().partition(" ")
            if name:
                lines[name] = rest
    return {**lines, **EXTRA}


def _get(figures: dict, path: tuple[str, ...]):
    for key in path:
        figures = figures.get(key) if isinstance(figures, dict) else None
    return figures


async def run_one(url: str, name: str, line: str, config, settings: dict, costs, tokenizer) -> dict:
    args = build_parser().parse_args(["bench", "serve", "--base-url", url, *shlex.split(line)])
    jobs = build(_spec(args), tokenizer)
    starts = arrival_times(jobs, args.request_rate, args.arrival, args.seed)
    since = await asyncio.to_thread(_step_log_position, url)
    results, elapsed, _ = await run_workload(url, jobs, starts, max_concurrency=args.max_concurrency,
                                             request_timeout=600.0, time_limit=1800.0)
    records = await asyncio.to_thread(read_step_log, url, since)
    measured = report.summarize(results, elapsed)
    sched = scheduler_config(config, settings["num_blocks"], settings["max_model_len"])
    run = Simulation(sched, costs, front_s=costs.front_s, tail_s=costs.tail_s).run(
        requests_of(jobs, tokenizer, starts), args.max_concurrency)
    simulated = report.summarize(run.results, run.elapsed)
    shapes, seconds = step_samples(records, prompt_blocks(results, tokenizer, config.block_size), config.block_size)
    waits = dict(measured=first_step_waits({f"{r.response_id}-0": r.start for r in results if r.ok},
                                           [(rec["start"], tuple((rec.get("work") or {}).get("cells") or ()))
                                            for rec in records]),
                 simulated=first_step_waits({f"sim-{i}": r.start for i, r in enumerate(run.results)},
                                            [(st.start, st.cells) for st in run.steps]))
    engine = dict(measured_steps=len(shapes), simulated_steps=len(run.steps), measured_engine_s=sum(seconds),
                  predicted_engine_s=sum(costs.seconds(s) for s in shapes),
                  simulated_engine_s=sum(s.seconds for s in run.steps))
    measured["first_step_wait_ms"], simulated["first_step_wait_ms"] = waits["measured"], waits["simulated"]
    return dict(name=name, line=line, measured=measured, simulated=simulated, engine=engine, records=records)


def first_step_waits(starts: dict[str, float], steps: list[tuple[float, tuple]]) -> dict:
    """Each request's seconds from being sent to the start of the first step that computes it (the front and the
    queue before the engine), p50 and p99 in ms: ``starts`` by request id as the cells name it; ``steps``: (start,
    cells)."""
    first: dict[str, float] = {}
    for start, cells in steps:
        for cell in cells:
            first.setdefault(cell[0], start)
    return report.percentiles_ms([first[rid] - sent for rid, sent in starts.items() if rid in first])


def table(rows: list[dict]) -> str:
    out = ["| workload | figure | measured | simulated | error |", "|---|---|---|---|---|"]
    for row in rows:
        for label, path in FIGURES:
            m, s = _get(row["measured"], path), _get(row["simulated"], path)
            err = f"{s / m - 1:+.1%}" if m and s is not None else "-"
            out.append(f"| {row['name']} | {label} | {m:.1f} | {s:.1f} | {err} |" if m is not None and s is not None
                       else f"| {row['name']} | {label} | {m} | {s} | - |")
        e = row["engine"]
        out.append(f"| {row['name']} | engine s (steps) | {e['measured_engine_s']:.2f} ({e['measured_steps']}) | "
                   f"{e['simulated_engine_s']:.2f} ({e['simulated_steps']}) | "
                   f"{e['simulated_engine_s'] / e['measured_engine_s'] - 1:+.1%}; the cost model on the measured "
                   f"steps {e['predicted_engine_s'] / e['measured_engine_s'] - 1:+.1%} |")
    return "\n".join(out)


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["W1", "W2", "W3", "P1"])
    p.add_argument("--scale", type=float, default=1.0, help="the profile's size (justapi plan profile --scale)")
    p.add_argument("--out", default=None, help="write every figure to this JSON file")
    p.add_argument("serve_flags", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    flags = [f for f in args.serve_flags if f != "--"]
    config = engine_config(build_parser().parse_args(["serve", *flags]))
    tokenizer = _tokenizer(config.model)
    lines = workload_lines()
    server = ModelProcess("plan-validate", [*flags, "--served-model-name", "plan-validate"])
    await server.start(600)
    try:
        await settled(server.proc.pid)
        records, settings, blocks = await measure(server.url, config, tokenizer, args.scale)
        costs = fit_records(records, config, settings, blocks)
        print(costs.describe(), f"; front {costs.front_s * 1e3:.1f} ms, tail {costs.tail_s * 1e3:.1f} ms", flush=True)
        rows = []
        for name in args.workloads:
            rows.append(await run_one(server.url, name, lines[name], config, settings, costs, tokenizer))
            print(f"{name} done", file=sys.stderr, flush=True)
    finally:
        await server.stop()
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(costs=costs.describe(), settings=settings, rows=rows, profile_records=records), f,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
