"""The prefix cache's disk tier (--prefix-cache-dir) against real `justapi serve` processes on loopback.

ttft: a long shared prompt's time to first token cold (no disk tier, and with one: what writing costs), warm (the
      prefix in memory), and after a restart from the disk (a fresh process, the prefix only on disk); each round
      a new prefix, medians over rounds.
w2:   a W2-style shared-prefix workload (`justapi bench serve --workload shared-prefix`) on a pool too small to keep
      the prefixes, with and without the disk tier: throughput, TTFT, the hit ratio by tier.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_helpers import ServerProcess, labelled, metric  # noqa: E402


def started(flags: list[str], log_path: str) -> ServerProcess:
    """A `justapi serve` on loopback once it answers, its memory settled: the KV pool's prefault (model.hugepages)
    takes a core for a few seconds after a start, and what a request meets then says more about the start than about
    the tier. A first request pays the first-call costs."""
    srv = ServerProcess(flags, log_path, timeout_s=300)
    last, still = -1, 0
    while still < 4:
        with open(f"/proc/{srv.proc.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        still = still + 1 if abs(rss - last) < 1024 else 0
        last = rss
        time.sleep(0.25)
    ttft(srv.url, [7] * 64)
    return srv


def metrics_of(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/metrics", timeout=30).text


def ttft(url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of a greedy completion of ``prompt``."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def run_ttft(args, flags: list[str], work: str) -> dict:
    """Each figure from a server started for it and settled: cold without and with the disk tier, warm, and the
    first request of a restarted server whose prefix is only on disk."""
    rng = random.Random(0)
    rows: dict[str, list[float]] = {"cold, no disk tier": [], "cold, disk tier on": [], "warm (memory)": [],
                                    "after a restart (disk)": []}
    disk_hits, read_s = [], []
    log = lambda name: os.path.join(work, f"ttft-{name}.log")  # noqa: E731
    for r in range(args.rounds):
        disk = os.path.join(work, f"kv{r}")
        prefix = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens - 16)]
        tails = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(4)]
        srv = started(flags, log("cold"))
        rows["cold, no disk tier"].append(ttft(srv.url, prefix + tails[3]))
        srv.stop()
        srv = started([*flags, "--prefix-cache-dir", disk], log("warm"))
        rows["cold, disk tier on"].append(ttft(srv.url, prefix + tails[0]))
        rows["warm (memory)"].append(ttft(srv.url, prefix + tails[1]))
        srv.stop()
        srv = started([*flags, "--prefix-cache-dir", disk], log("restart"))
        rows["after a restart (disk)"].append(ttft(srv.url, prefix + tails[2]))
        text = metrics_of(srv)
        disk_hits.append(labelled(text, "justapi_prefix_cache_hits_by_tier", tier="disk"))
        read_s.append(metric(text, "justapi_prefix_cache_disk_read_seconds_total"))
        srv.stop()
        shutil.rmtree(disk)
    out = {name: statistics.median(v) for name, v in rows.items()}
    out["disk blocks loaded after the restart"] = statistics.median(disk_hits)
    out["seconds reading them"] = statistics.median(read_s)
    out["rounds"] = rows
    return out


def run_w2(args, flags: list[str], work: str) -> dict:
    results = {}
    disk = ["--prefix-cache-dir", os.path.join(work, "w2")]
    for name, extra in (("without disk tier", []), ("with disk tier", disk)):
        srv = started([*flags, "--pool-blocks", str(args.w2_pool_blocks), *extra], os.path.join(work, f"w2-{name}.log"))
        out = os.path.join(work, f"w2-{len(extra)}.json")
        subprocess.run([sys.executable, "-m", "justapi.cli", "bench", "serve", "--base-url", srv.url,
                        "--workload", "shared-prefix", "--num-prefixes", str(args.w2_prefixes), "--prefix-len",
                        str(args.w2_prefix_len), "--suffixes-per-prefix", str(args.w2_suffixes), "--input-len", "32",
                        "--output-len", "32", "--max-concurrency", "4", "--json", out], check=True)
        text = metrics_of(srv)
        srv.stop()
        report = json.load(open(out))
        results[name] = {"report": report, "hits_memory": labelled(text, "justapi_prefix_cache_hits_by_tier",
                                                                   tier="memory"),
                         "hits_disk": labelled(text, "justapi_prefix_cache_hits_by_tier", tier="disk"),
                         "misses": metric(text, "prefix_cache_misses")}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [ttft] [w2] [options] [-- SERVE FLAGS]")
    p.add_argument("parts", nargs="*", help="ttft, w2 (default: both)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--w2-prefixes", type=int, default=8)
    p.add_argument("--w2-prefix-len", type=int, default=800)
    p.add_argument("--w2-suffixes", type=int, default=8)
    p.add_argument("--w2-pool-blocks", type=int, default=250, help="16-token blocks: ~4,000 tokens")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, flags = p.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: flags for every server
    # a 1 GiB pool: prefaulted while the model loads (a quarter of memory takes ~10 s more here, every request
    # right after a start slower meanwhile, which would tell more about the start than about the tier)
    flags = flags or ["--kv-memory", "1G"]
    args.parts = args.parts or ["ttft", "w2"]
    if set(args.parts) - {"ttft", "w2"}:
        p.error(f"parts are ttft and w2, not {' '.join(args.parts)}")
    work = tempfile.mkdtemp(prefix="kv-tier-")
    figures = {}
    if "ttft" in args.parts:
        figures["ttft"] = run_ttft(args, flags, work)
        print(json.dumps(figures["ttft"], indent=2))
    if "w2" in args.parts:
        figures["w2"] = run_w2(args, flags, work)
        for name, r in figures["w2"].items():
            print(name, json.dumps({k: v for k, v in r.items() if k != "report"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
