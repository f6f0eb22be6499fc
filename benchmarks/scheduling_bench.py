"""Scheduling under overload (issue 29): FCFS against `fair`, FCFS against `priority`, and `--ttft-slo` against
none, each pair on the same seeded traffic through a real `justapi serve`; prints the figures, writes JSON and a
chart (docs/benchmarks.md shows them).

    python benchmarks/scheduling_bench.py [--seconds 60] [--slo 2.0] [--out docs/img/scheduling]
        [--json FILE] [-- EXTRA SERVE FLAGS]

First the server's capacity C (requests per second) is measured on the workload's request shape with every
request sent at once; then, with arrivals over ``--seconds``:
  fair      a heavy tenant at 1.5 C and a light one at 0.1 C (``user``), under fcfs and fair; and the light
            tenant alone, the reference for how far the heavy one pushes its TTFT up;
  priority  an interactive class (priority 0) at 0.5 C and a batch class (priority 5) at 1.0 C, fcfs and priority;
  slo       one class at 1.5 C, without and with --ttft-slo; goodput = requests with TTFT <= the SLO per second.
The TTFT predictions' error comes from the server's log (one line per request with predicted and measured TTFT).

    python benchmarks/scheduling_bench.py --overhead

prints instead what the policies cost the engine thread a step, in process without a model: the scheduler's
schedule + update + expire with 32 running and 200 waiting requests per policy, a stats snapshot of that state (taken
after every step that added requests), and one update of the step-cost fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from wall_breakdown import BIN, start_server  # noqa: E402  (one way to start and settle a server)

SHAPE = ["--input-len", "64:256", "--output-len", "32:128", "--seed", "0"]
POOL = ["--pool-blocks", "4096"]  # 64k tokens: plenty for these runs, and a quick start
LOG_LINE = re.compile(r"TTFT ([\d.]+|nan) s \(predicted ([\d.]+|nan) s\)")


def bench(port: int, out: Path, *args: str) -> dict:
    cmd = [str(BIN / "justapi"), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--name", "justapi",
           *SHAPE, "--json", str(out), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())["servers"][0]["figures"]


class Server:
    """``justapi serve`` with the given flags for the runs inside a ``with`` block."""

    def __init__(self, args, flags: list[str], tmp: Path, label: str) -> None:
        self.args, self.flags, self.log = args, flags, tmp / f"{label}.log"

    def __enter__(self):
        ns = argparse.Namespace(port=self.args.port, model=self.args.model,
                                serve_args=[*POOL, *self.flags, *self.args.serve_args])
        self.proc = start_server(ns, self.log)
        return self

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)

    def prediction_errors(self) -> list[float]:
        """Measured minus predicted TTFT of every request the log has both for."""
        errs = []
        for m in LOG_LINE.finditer(self.log.read_text()):
            if "nan" not in m.groups():
                errs.append(float(m.group(1)) - float(m.group(2)))
        return errs


def classes(*specs: tuple[str, float, float, str]) -> list[str]:
    """--class flags: (name, rate, seconds, extra fields)."""
    out = []
    for name, rate, seconds, extra in specs:
        out += ["--class", f"name={name},rate={rate:.3f},requests={max(1, round(rate * seconds))}" + extra]
    return out


def run(args, tmp: Path) -> dict:
    """Each run on a fresh server: runs share seeded prompts, which an earlier run would leave in the prefix cache."""
    T, res = args.seconds, {}

    def on(flags: list[str], label: str, *bench_args: str) -> tuple[dict, Server]:
        with Server(args, flags, tmp, label) as srv:
            return bench(args.port, tmp / f"{label}.json", *bench_args), srv

    cap, _ = on([], "capacity", "--num-requests", "48")
    C = cap["request_throughput"]
    res["capacity"] = {"req_per_s": C, "output_tok_per_s": cap["output_throughput"]}
    print(f"capacity: {C:.2f} req/s ({cap['output_throughput']:.1f} output tok/s)", file=sys.stderr)
    light = ("light", 0.1 * C, T, ",user=light")
    fair_traffic = classes(("heavy", 1.5 * C, T, ",user=heavy"), light)
    prio_traffic = classes(("interactive", 0.5 * C, T, ",priority=0"), ("batch", 1.0 * C, T, ",priority=5"))
    slo_traffic = classes(("all", 1.5 * C, T, "")) + ["--goodput", f"ttft:{args.slo * 1000:.0f}"]
    res["fair"] = {"fcfs": on([], "fair-fcfs", *fair_traffic)[0],
                   "fair": on(["--scheduling-policy", "fair"], "fair-fair", *fair_traffic)[0],
                   "light alone": on([], "fair-alone", *classes(light))[0]}
    res["priority"] = {"fcfs": on([], "prio-fcfs", *prio_traffic)[0],
                       "priority": on(["--scheduling-policy", "priority"], "prio-priority", *prio_traffic)[0]}
    res["slo"] = {"none": on([], "slo-none", *slo_traffic)[0]}
    res["slo"]["ttft-slo"], srv = on(["--ttft-slo", str(args.slo)], "slo-slo", *slo_traffic)
    errs = srv.prediction_errors()
    absolute = sorted(abs(e) for e in errs)
    res["prediction_error_s"] = {
        "requests": len(errs), "mean": sum(errs) / len(errs) if errs else None,
        "abs_p50": absolute[len(absolute) // 2] if errs else None,
        "abs_p90": absolute[int(len(absolute) * 0.9)] if errs else None,
    }
    return res


def ttft(fig: dict, kind: str, p: str = "p50") -> float | None:
    v = fig["by_kind"][kind]["ttft_ms"][p]
    return None if v is None else v / 1000


def report(res: dict, slo: float) -> str:
    lines = [f"capacity C = {res['capacity']['req_per_s']:.2f} req/s"]
    f = res["fair"]
    lines.append("fair shares (heavy 1.5 C, light 0.1 C): light TTFT p50 / p90 s, heavy TTFT p50 s, out tok/s")
    for run in ("fcfs", "fair"):
        fig = f[run]
        lines.append(f"  {run:6} light {ttft(fig, 'light'):.2f} / {ttft(fig, 'light', 'p90'):.2f}   heavy "
                     f"{ttft(fig, 'heavy'):.2f}   {fig['output_throughput']:.1f}")
    alone = ttft(f["light alone"], "light")
    lines.append(f"  light alone {alone:.2f} / {ttft(f['light alone'], 'light', 'p90'):.2f}; factor under fair "
                 f"{ttft(f['fair'], 'light') / alone:.2f}x (p50), under fcfs {ttft(f['fcfs'], 'light') / alone:.1f}x")
    lines.append("priority (interactive 0.5 C prio 0, batch 1.0 C prio 5): TTFT p50 / p90 s, out tok/s")
    for run in ("fcfs", "priority"):
        fig = res["priority"][run]
        lines.append(f"  {run:8} interactive {ttft(fig, 'interactive'):.2f} / {ttft(fig, 'interactive', 'p90'):.2f}"
                     f"   batch {ttft(fig, 'batch'):.2f} / {ttft(fig, 'batch', 'p90'):.2f}   "
                     f"{fig['output_throughput']:.1f}")
    lines.append(f"SLO admission (1.5 C, TTFT SLO {slo:g} s): completed, refused, goodput req/s, TTFT p50 / p99 s")
    for run in ("none", "ttft-slo"):
        fig = res["slo"][run]
        refused = sum(n for e, n in fig["errors"].items() if "429" in e)
        lines.append(f"  {run:8} {fig['completed']:4} {refused:4}   {fig.get('goodput', 0):.2f}   "
                     f"{fig['ttft_ms']['p50'] / 1000:.2f} / {fig['ttft_ms']['p99'] / 1000:.2f}")
    e = res["prediction_error_s"]
    if e["requests"]:
        lines.append(f"  TTFT prediction error (measured - predicted) over {e['requests']} requests: mean "
                     f"{e['mean']:+.2f} s, |error| p50 {e['abs_p50']:.2f} s, p90 {e['abs_p90']:.2f} s")
    return "\n".join(lines)


def chart(res: dict, slo: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    runs = [("fcfs", res["fair"]["fcfs"]), ("fair", res["fair"]["fair"]), ("light alone", res["fair"]["light alone"])]
    for i, (name, fig_) in enumerate(runs):
        ax.bar(i - 0.2, ttft(fig_, "light"), 0.4, color="tab:green", label="light p50" if i == 0 else None)
        ax.bar(i + 0.2, ttft(fig_, "light", "p90"), 0.4, color="tab:olive", label="light p90" if i == 0 else None)
    ax.set_xticks(range(3), [n for n, _ in runs])
    ax.set_ylabel("light tenant's TTFT (s)")
    ax.set_title("heavy tenant at 1.5x capacity")
    ax.legend(fontsize=8)
    ax = axes[1]
    for j, run in enumerate(("fcfs", "priority")):
        fig_ = res["priority"][run]
        for k, (cls, color) in enumerate((("interactive", "tab:blue"), ("batch", "tab:gray"))):
            ax.bar(j + (k - 0.5) * 0.4, ttft(fig_, cls), 0.4, color=color, label=f"{cls} p50" if j == 0 else None)
    ax.set_xticks(range(2), ["fcfs", "priority"])
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("two priority classes at 1.5x capacity")
    ax.legend(fontsize=8)
    ax = axes[2]
    names = ["none", "ttft-slo"]
    ax.bar(range(2), [res["slo"][n].get("goodput", 0) for n in names], 0.5, color="tab:purple")
    ax.set_xticks(range(2), ["no admission control", f"--ttft-slo {slo:g}"])
    ax.set_ylabel(f"goodput (req/s with TTFT <= {slo:g} s)")
    ax.set_title("one class at 1.5x capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overhead() -> None:
    import time

    from justapi.config import SchedulerConfig
    from justapi.core.admission import StepCostModel
    from justapi.core.outputs import RunnerOutput
    from justapi.core.scheduler import Scheduler
    from justapi.core.stats import SchedulerSnapshot
    from justapi.sampling_params import SamplingParams

    def per_call_us(fn, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    model = StepCostModel()
    print(f"step-cost fit update: {per_call_us(lambda: model.observe(0.05, 300, 20, 1), 20000):.1f} us")
    for policy in ("fcfs", "priority", "fair"):
        s = Scheduler(SchedulerConfig(num_blocks=100_000, block_size=16, policy=policy))
        for i in range(232):
            params = SamplingParams(max_tokens=4000, ignore_eos=True, priority=i % 3, user=f"u{i % 4}")
            s.add_request(f"r{i}", list(range(100 + i)), params, {2}, 0)

        def step():
            out, res = s.schedule(), RunnerOutput()
            for rid, n in out.num_scheduled_tokens.items():
                req = s.requests[rid]
                if req.num_computed_tokens + n == req.num_tokens:
                    res.sampled_token_ids[rid] = [7]
            s.update(out, res)
            s.expire()

        per_call_us(step, 50)  # past the prompts: 32 decoding
        print(f"{policy:8} schedule + update + expire: {per_call_us(step, 300):6.1f} us a step; stats snapshot "
              f"{per_call_us(lambda: SchedulerSnapshot.of(s), 200):6.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--model", default=None, help="GGUF (default: the server's default model)")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals per overloaded run")
    p.add_argument("--slo", type=float, default=2.0, help="the TTFT SLO in seconds")
    p.add_argument("--out", default=None, help="write OUT.png (the chart) and OUT.json")
    p.add_argument("--json", default=None, help="write the figures here (default: OUT.json)")
    p.add_argument("--overhead", action="store_true", help="only the policies' cost a step, in process")
    p.add_argument("serve_args", nargs="*", help="extra flags for justapi serve, after --")
    args = p.parse_args()
    if args.overhead:
        overhead()
        return
    with tempfile.TemporaryDirectory() as tmp:
        res = run(args, Path(tmp))
    print(report(res, args.slo))
    if args.out:
        chart(res, args.slo, args.out + ".png")
    path = args.json or (args.out + ".json" if args.out else None)
    if path:
        Path(path).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
