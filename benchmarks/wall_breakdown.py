"""Where a loaded run's wall time goes: a real `justapi serve` process, a workload sent by `justapi bench serve`, and
the wall time split three ways.

1. The engine's own step log (GET /engine/steps, engine/step_log.py), from a run with no profiler attached: the
   engine thread's wall time as idle (no work), taking in commands, scheduling, executing, updating, detokenizing
   and delivering, with each step's shape (prefill tokens, decode rows).
   Each request's time to first token is split by the same log (the bench's JSON has its response id and times).
2. The CPU seconds each thread of the server used (/proc/PID/task/TID/stat), the same run: the engine thread, the
   event loop (HTTP, SSE, tokenizing prompts) and the kernels' OpenMP threads, against wall time x cores.
3. py-spy sampling the same workload run again (Python frames; with --native also native ones): each engine-thread
   sample is put in one category (the kernel route of a product, the part of attention, other layer work,
   sampling, batch building, ...); with --native, waits inside it (the GIL, an OpenMP barrier) are counted apart.
   The busy time of run 1 is split in the sampled shares; the throughput of the profiled run says what the profiler
   cost.

    .venv/bin/python benchmarks/wall_breakdown.py [--workload W1 W2 W3] [--rate 50] [--native] [--model GGUF]
        [--keep DIR] [--json FILE] [-- SERVE FLAGS]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from justapi.bench.client import read_step_log
from justapi.config import usable_cores

BIN = Path(sys.executable).parent
NAME = "smollm2-135m"

# the workloads of benchmarks/peers_bench.sh (justapi bench serve arguments), from the file both read
WORKLOADS = dict(line.split(" ", 1) for line in (Path(__file__).parent / "workloads.txt").read_text().splitlines())


# --- the server -----------------------------------------------------------------------------------------------------
def start_server(args, log_path: Path) -> subprocess.Popen:
    cmd = [str(BIN / "justapi"), "serve", "--port", str(args.port), "--served-model-name", NAME, *args.serve_args]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited; see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models", timeout=2)
            break
        except OSError:
            time.sleep(1)
    wait_quiet(proc.pid)
    return proc


def wait_quiet(pid: int, limit_s: float = 120) -> None:
    """Wait until the server uses under 5% of a core over a second: the KV pool's pages are faulted in by a thread
    for several seconds after start-up (model/hugepages.py), which would take a core from the first run."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = sum(thread_cpu(pid).values())
        time.sleep(1)
        if sum(thread_cpu(pid).values()) - before < 0.05:
            return


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def get_json(args, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{args.port}{path}", timeout=30) as r:
        return json.load(r)


def run_workload(args, workload: str, out_json: Path) -> tuple[float, float]:
    """Run ``justapi bench serve`` once; its (start, end) on this machine's monotonic clock."""
    cmd = [str(BIN / "justapi"), "bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}", "--name", "justapi",
           *WORKLOADS[workload].split(), "--json", str(out_json)]
    if args.model:  # prompts of the workload's lengths in the served model's own tokens
        cmd += ["--tokenizer", args.model]
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return start, time.monotonic()


# --- 1. the step log ------------------------------------------------------------------------------------------------
def step_totals(steps: list[dict], start: float, end: float) -> dict:
    """Seconds of the engine thread by phase from the run's first step to its last step's end (the client's start-up
    and report are not the server's time), and the steps' shapes."""
    steps = [s for s in steps if start <= s["start"] <= end]
    if steps:
        start = steps[0]["start"]
        end = steps[-1]["start"] + steps[-1]["commands"] + steps[-1]["step"] + steps[-1]["deliver"]
    t = collections.Counter()
    shapes = collections.Counter()
    for s in steps:
        idle = min(s["idle"], s["start"] - start)  # the first step's wait began before the run
        t["idle (no work)"] += idle
        if idle > 0.005:
            shapes["idle gaps over 5 ms"] += 1
        t["commands (adds, aborts)"] += s["commands"]
        t["deliver + stats"] += s["deliver"]
        w = s["work"]
        if w is None:
            t["step (workers)"] += s["step"]
            continue
        t["schedule"] += w["schedule"]
        t["execute"] += w["execute"]
        t["update"] += w["update"]
        t["detokenize"] += w["detokenize"]
        t["step, other"] += s["step"] - w["schedule"] - w["execute"] - w["update"] - w["detokenize"]
        kind = ("mixed" if w["num_decodes"] else "prefill") if w["num_prefill_tokens"] else "decode"
        shapes[kind + " steps"] += 1
        shapes[kind + " s"] += w["execute"]
        shapes[kind + " decode rows"] += w["num_decodes"]
        shapes[kind + " prefill tokens"] += w["num_prefill_tokens"]
    return {"phases": t, "shapes": shapes, "num_steps": len(steps), "wall": end - start}


def first_token_parts(steps: list[dict], requests: list[dict]) -> list[dict]:
    """Each request's time to first token in four parts: until the first step to start after it was sent (the step
    in flight then, HTTP, tokenizing), the steps that ran without it while it waited (queued), its prompt's steps
    (its first step's start to its last prompt chunk's end; "own share": its tokens of those steps' prompt tokens),
    and the first token's way back to the client. The engine runs a response's choice i as ``ID-i``; every request
    here has one choice."""
    first, last_chunk, own_tokens = {}, {}, collections.Counter()
    for i, s in enumerate(steps):
        for rid, kind, _, tokens, _ in (s["work"] or {}).get("cells", ()):
            first.setdefault(rid, i)
            if kind == "prefill":
                last_chunk[rid] = i
                own_tokens[rid] += tokens
    starts = [s["start"] for s in steps]
    ends = [s["start"] + s["commands"] + s["step"] + s["deliver"] for s in steps]
    parts = []
    for r in requests:
        rid = r["id"] + "-0"
        if not r["ok"] or r["ttft"] is None or rid not in first:
            continue
        k0, k1 = first[rid], last_chunk.get(rid, first[rid])
        nxt = bisect.bisect_left(starts, r["start"], hi=k0)
        step_tokens = sum(steps[k]["work"]["num_prefill_tokens"] for k in range(k0, k1 + 1))
        parts.append({"ttft": r["ttft"], "until a step starts": starts[nxt] - r["start"],
                      "queued": starts[k0] - starts[nxt], "queued steps": k0 - nxt,
                      "prompt steps": k1 - k0 + 1, "prompt": ends[k1] - starts[k0],
                      "own share": own_tokens[rid] / step_tokens if step_tokens else 1.0,
                      "to the client": r["start"] + r["ttft"] - ends[k1]})
    return parts


# --- 3. the sampled stacks ------------------------------------------------------------------------------------------
MODULE_CATEGORIES = [  # the leaf-most justapi frame's file → the category
    ("justapi/model/quant.py", "products"), ("justapi/model/attention.py", "attention"),
    ("justapi/model/sampler.py", "sampling"),
    ("justapi/spec/", "speculation"), ("justapi/structured/", "grammar masks"),
    ("justapi/model/llama.py", "other layer work"), ("justapi/model/layers.py", "other layer work"),
    ("justapi/model/moe.py", "other layer work"), ("justapi/model/runner.py", "batch building"),
    ("justapi/core/stats.py", "deliver + stats"), ("justapi/core/", "scheduling"),
    ("justapi/engine/output_processor.py", "detokenize"), ("justapi/model/tokenizer.py", "detokenize"),
    ("justapi/engine/async_llm.py", "engine loop"), ("justapi/engine/", "engine loop"),
]
# with --native, a sample inside the one-call decode step (kernels/decode_step.cpp, no Python frame inside) by the
# first of these its native frames name
# (source files where the kernels carry debug information, function names where they do not: a JUSTAPI_KERNELS_MARCH
# build)
NATIVE_STEP_PARTS = [("small_rows", "products: q4_small / q8_small"), ("small_matmul", "products: q4_small / q8_small"),
                     ("int4pack_mm", "products: torch_int4"), ("dpbf16", "products: dpbf16"),
                     ("int4_matmul.cpp", "products: amx"), ("_amx_", "products: amx"),
                     ("q_matmul", "products: q_matmul"), ("paged_attention.cpp", "attention: decode"),
                     ("decode_attention", "attention: decode"), ("attend_", "attention: decode"),
                     ("layer_ops.cpp", "layer ops"), ("rope_write", "layer ops"), ("add_rms_norm", "layer ops"),
                     ("gelu", "layer ops"), ("silu", "layer ops")]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")
# attention.py's lines by number, to tell which kernel a sample in paged_attention was calling
ATTENTION_LINES = (Path(__file__).parent.parent / "justapi/model/attention.py").read_text().splitlines()


def attention_part(func: str, line: str | None) -> str:
    """The part of attention a sample's leaf-most attention.py frame is in: the decode kernel, a prompt chunk's
    attention (the C++ prefill kernel or torch's fused one), the gathers of K/V for torch's, or the rest."""
    text = ATTENTION_LINES[int(line) - 1] if line and 0 < int(line) <= len(ATTENTION_LINES) else ""
    if "decode_attention" in text or func.endswith("_decode_attention"):
        return "attention: decode"
    if "prefill_attention" in text or func.startswith("_sequence_attention"):
        return "attention: prompt chunks"
    if func.startswith("_gather"):
        return "attention: K/V gathers"
    return "attention: other"


def parse_raw(path: Path) -> dict[int, list[tuple[list[str], int]]]:
    """py-spy's raw output → per thread id, (frames root first, sample count)."""
    stacks = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        head, _, count = line.rpartition(" ")
        m = re.match(r"thread \((\d+)\): [^;]*;?(.*)", head)
        if m and count.isdigit():
            stacks[int(m.group(1))].append((m.group(2).split(";"), int(count)))
    return stacks


def engine_category(frames: list[str]) -> tuple[str, str | None]:
    """(category, wait) of one engine-thread sample; wait: "GIL" or "OpenMP barrier" when the leaf waits."""
    names = " ".join(frames)
    if "(threading.py" in names and "step (justapi/engine" not in names:
        return "idle (no work)", None
    category = "engine loop"
    step = next((i for i, f in enumerate(frames) if "DecodeLayers" in f), None)
    if step is not None:  # the native decode step (--native): its kernel's frames, not Python's, say what it runs
        inside = " ".join(frames[step:])
        part = next((c for key, c in NATIVE_STEP_PARTS if key in inside), "other")
        return "native decode step: " + part, _wait(frames)
    for frame in reversed(frames):
        m = FRAME.match(frame)
        if m is None or "justapi/" not in m.group("file") or not m.group("file").endswith(".py"):
            continue  # the category is the Python code's; a C++ frame only names a kernel
        category = next((c for prefix, c in MODULE_CATEGORIES if m.group("file").startswith(prefix)), category)
        if category == "products":  # quant.py's _run_<route> runs one kernel route (model/kernel_policy.py)
            category = f"products: {_route(frames) or 'python (forms, views)'}"
        elif category == "attention":
            category = attention_part(m.group("func").rpartition(".")[2], m.group("line"))
        break
    return category, _wait(frames)


def _route(frames: list[str]) -> str | None:
    """The kernel route of the innermost quant.py ``_run_<route>`` frame (a helper it calls, such as _small_rows,
    may be the leaf-most one); None outside one."""
    for frame in reversed(frames):
        m = FRAME.match(frame)
        if m and m.group("file").startswith("justapi/model/quant.py"):
            func = m.group("func").rpartition(".")[2]  # py-spy may name the class: _RoutedWeight._run_q_matmul
            if func.startswith("_run_"):
                return func[5:]
    return None


def _wait(frames: list[str]) -> str | None:
    """What the sample's thread waits on, from its native frames (--native): the GIL, an OpenMP barrier, or None."""
    leaf = " ".join(frames[-3:])
    if "pthread_cond_timedwait" in leaf or "gil_scoped_acquire" in leaf or "take_gil" in leaf:
        return "GIL"
    if "libgomp" in leaf and "justapi/kernels" not in leaf and "libtorch_cpu" not in leaf:
        return "OpenMP barrier"
    return None


def loop_category(frames: list[str]) -> str:
    """The category of one event-loop (main thread) sample."""
    names = " ".join(frames)
    leaf = " ".join(frames[-3:])
    if frames[-1].startswith("select (selectors.py") or "select_epoll_poll" in leaf:
        return "idle (waiting for sockets)"
    if "pthread_cond_timedwait" in leaf or "take_gil" in leaf:
        return "GIL"
    if "justapi/model/tokenizer.py" in names or "justapi/model/chat_template.py" in names:
        return "tokenizing prompts"
    if "justapi/server" in names or "justapi/engine/async_llm.py" in names:
        return "justapi handlers (routes, SSE chunks)"
    return "HTTP/SSE framework and asyncio (uvicorn, starlette, h11, pydantic)"


def sampled_shares(raw: Path, engine_tid: int, loop_tid: int) -> dict:
    stacks = parse_raw(raw)
    engine, waits, loop = collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in stacks.get(engine_tid, []):
        category, wait = engine_category(frames)
        engine[category] += n
        if wait:
            waits[f"{category}: {wait}"] += n
    for frames, n in stacks.get(loop_tid, []):
        loop[loop_category(frames)] += n
    return {"engine": engine, "waits": waits, "loop": loop}


# --- the report -----------------------------------------------------------------------------------------------------
def measure(args, workload: str, tmp: Path, profile: bool) -> dict:
    log_path = tmp / f"server_{workload}_{'spy' if profile else 'plain'}.log"
    proc = start_server(args, log_path)
    try:
        tids = thread_cpu(proc.pid)
        first = get_json(args, "/engine/steps?since=1000000000")["next"]
        spy = None
        if profile:
            raw = tmp / f"spy_{workload}.txt"
            spy = subprocess.Popen([str(BIN / "py-spy"), "record", "--pid", str(proc.pid), "--rate", str(args.rate),
                                    "--format", "raw", "--threads", "--idle", "--output", str(raw),
                                    *(["--native"] if args.native else [])],
                                   stdout=subprocess.DEVNULL, stderr=open(tmp / "spy.log", "a"))
            time.sleep(2)  # py-spy attaches
        cpu0 = thread_cpu(proc.pid)
        start, end = run_workload(args, workload, tmp / f"bench_{workload}.json")
        cpu1 = thread_cpu(proc.pid)
        steps = read_step_log(f"http://127.0.0.1:{args.port}", first)
        totals = step_totals(steps, start, end)
        bench = json.loads((tmp / f"bench_{workload}.json").read_text())["servers"][0]["figures"]
        result = {"wall": totals["wall"], "bench": bench, "steps": totals,
                  "first tokens": first_token_parts(steps, bench.pop("requests"))}
        used = {tid: cpu1.get(tid, 0) - cpu0.get(tid, 0) for tid in cpu1}
        engine_tid = busiest_python_thread(used, tids, proc.pid)
        result["cpu"] = {"engine thread": used.get(engine_tid, 0), "event loop (main thread)": used.get(proc.pid, 0),
                         "other threads (OpenMP, ...)": sum(v for t, v in used.items()
                                                            if t not in (engine_tid, proc.pid))}
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=120)
            result["sampled"] = sampled_shares(raw, engine_tid, proc.pid)
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def busiest_python_thread(used: dict[int, float], before_run: dict[int, float], pid: int) -> int:
    """The engine thread: of the threads that existed before the run (the engine's, not a per-request worker's),
    the busiest other than the main thread. torch's OpenMP workers compute only inside a step, ~1/cores as much."""
    return max((t for t in before_run if t != pid), key=lambda t: used.get(t, 0))


def report(workload: str, plain: dict, spied: dict, cores: int, rate: int) -> str:
    wall, b = plain["wall"], plain["bench"]
    lines = [f"## {workload}: wall {wall:.1f} s, {b['output_throughput']:.1f} output tok/s, TTFT p50 "
             f"{b['ttft_ms']['p50']:.0f} ms, TPOT p99 {b['tpot_ms']['p99']:.1f} ms, {b['failed']} failed "
             "(profiled run: "
             f"{spied['bench']['output_throughput']:.1f} tok/s, {spied['wall']:.1f} s)",
             "", "engine thread (step log, unprofiled run) | s | % of wall", "---|---|---"]
    phases = plain["steps"]["phases"]
    for name, s in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name} | {s:.2f} | {100 * s / wall:.1f}")
    lines.append(f"sum | {sum(phases.values()):.2f} | {100 * sum(phases.values()) / wall:.1f}")
    sampled = spied.get("sampled")
    if sampled:
        eng = sampled["engine"]
        busy = {k: v for k, v in eng.items() if k != "idle (no work)"}
        total = sum(busy.values())
        lines += ["", f"engine thread outside idle, by py-spy samples ({total} samples at {rate} Hz); seconds: "
                  "the share times the unprofiled run's busy time | share % | s", "---|---|---"]
        busy_s = wall - phases.get("idle (no work)", 0)
        for name, n in sorted(busy.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name} | {100 * n / total:.1f} | {busy_s * n / total:.2f}")
        for name, n in sorted(sampled["waits"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  of which waiting: {name} | {100 * n / total:.1f} | {busy_s * n / total:.2f}")
        loop = sampled["loop"]
        ltotal = sum(loop.values()) or 1
        lines += ["", "event loop (main thread), by py-spy samples | share % |", "---|---|"]
        for name, n in sorted(loop.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name} | {100 * n / ltotal:.1f} |")
    cpu = plain["cpu"]
    lines += ["", f"CPU seconds by thread (unprofiled run; the machine has {cores} cores x {wall:.1f} s = "
              f"{cores * wall:.1f} s) | s | % of wall x cores", "---|---|---"]
    for name, s in cpu.items():
        lines.append(f"{name} | {s:.2f} | {100 * s / (cores * wall):.1f}")
    shapes = plain["steps"]["shapes"]
    lines += ["", "steps (unprofiled run) | count | execute s | mean ms | mean decode rows | mean prefill tokens",
              "---|---|---|---|---|---"]
    for kind in ("decode", "mixed", "prefill"):
        n = shapes.get(kind + " steps", 0)
        if n:
            lines.append(f"{kind} | {n} | {shapes[kind + ' s']:.2f} | {1000 * shapes[kind + ' s'] / n:.1f} | "
                         f"{shapes[kind + ' decode rows'] / n:.1f} | {shapes[kind + ' prefill tokens'] / n:.0f}")
    lines.append(f"idle gaps over 5 ms: {shapes.get('idle gaps over 5 ms', 0)}")
    return "\n".join(lines + first_token_lines(plain["first tokens"]))


def first_token_lines(parts: list[dict]) -> list[str]:
    """Mean parts of the time to first token over all requests, and over the middle half by TTFT (what p50 says)."""
    if not parts:
        return []
    by_ttft = sorted(parts, key=lambda p: p["ttft"])
    groups = {"all": by_ttft, "middle half": by_ttft[len(by_ttft) // 4: max(1, 3 * len(by_ttft) // 4)]}
    lines = ["", "time to first token (unprofiled run), mean | " + " | ".join(f"{k} ({len(g)})" for k, g in
             groups.items()), "---|" + "---|" * len(groups)]
    for key in ("ttft", "until a step starts", "queued", "prompt", "to the client"):
        lines.append(f"{key}, ms | " + " | ".join(f"{1000 * sum(p[key] for p in g) / len(g):.0f}"
                                                   for g in groups.values()))
    lines.append("its share of its prompt steps' prompt tokens, % | " + " | ".join(
        f"{100 * sum(p['own share'] for p in g) / len(g):.0f}" for g in groups.values()))
    for key in ("queued steps", "prompt steps"):
        lines.append(f"{key} | " + " | ".join(f"{sum(p[key] for p in g) / len(g):.2f}" for g in groups.values()))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", nargs="+", default=["W1", "W2", "W3"], choices=sorted(WORKLOADS))
    p.add_argument("--model", help="GGUF to serve (default: the server's default, SmolLM2)")
    p.add_argument("--port", type=int, default=8030)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second (its own cost grows with it)")
    p.add_argument("--native", action="store_true",
                   help="native frames too: waits for the GIL and at OpenMP barriers (the profiler then takes ~20%% "
                        "of the throughput on 2 cores: Python frames alone cost nothing measurable)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--keep", type=Path, help="keep the server logs, py-spy's raw stacks and the bench JSON here")
    p.add_argument("serve_args", nargs="*", help="after --: extra `justapi serve` flags")
    args = p.parse_args()
    cpu = re.search(r"model name\s*: (.*)", Path("/proc/cpuinfo").read_text()).group(1)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {usable_cores()} cores, {cpu}, "
          f"serve flags: {' '.join(args.serve_args) or '(defaults)'}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for workload in args.workload:
            plain = measure(args, workload, folder, profile=False)
            spied = measure(args, workload, folder, profile=True)
            results[workload] = {"plain": plain, "profiled": spied}
            print(report(workload, plain, spied, usable_cores(), args.rate), flush=True)
            print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=dict))


if __name__ == "__main__":
    main()
