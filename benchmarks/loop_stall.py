"""How long /health takes while heavy requests are in flight: a 4 MB prompt (tokenized, then refused as too long) and
a grammar that compiles past its time limit, each beside a stream of /health probes, and a simple grammar sent
during the slow one. A stalled event loop shows as /health latency; a grammar queue held by the slow schema shows as
the simple one's latency. ``--src DIR`` serves another checkout (PYTHONPATH), for before/after in one run.

    python benchmarks/loop_stall.py [--src /tmp/before] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_helpers import free_port  # noqa: E402

PROBE_EVERY_S = 0.02


def start_server(src: str | None, port: int, log_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=src) if src else dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "justapi.cli", "serve", "--port", str(port), "--threads", "1"],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=src or None)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start; see {log_path}")


def deep_schema(depth: int) -> dict:
    s: dict = {}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s, "b": {"type": "string", "minLength": 3}}, "required": ["a", "b"]}
    return s


async def probe_while(c: httpx.AsyncClient, url: str, work) -> tuple[list[float], object]:
    """/health latencies (seconds) every PROBE_EVERY_S while ``work`` runs, and its result."""
    task = asyncio.create_task(work)
    latencies = []
    while not task.done():
        t0 = time.perf_counter()
        await c.get(url + "/health")
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(PROBE_EVERY_S)
    return latencies, await task


async def timed(coro) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await coro
    return time.perf_counter() - t0, r.status_code


async def phases(url: str) -> dict:
    async with httpx.AsyncClient(timeout=120) as c:
        out = {}
        cold = await timed(c.post(url + "/v1/completions", json={  # starts the compile workers (lazily, once)
            "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}))
        out["idle"], _ = await probe_while(c, url, asyncio.sleep(3))
        prompt = "word " * (4 * 1024 * 1024 // 5 - 64)  # just under the 4 MiB body limit
        out["4 MB prompt"], big = await probe_while(c, url, timed(c.post(url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 1})))

        async def grammars():
            slow = asyncio.create_task(timed(c.post(url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "deep", "schema": deep_schema(400)}}})))
            await asyncio.sleep(0.5)  # the slow one is compiling
            simple = await timed(c.post(url + "/v1/completions", json={  # not compiled before: no cache hit
                "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "small", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}}}))
            return await slow, simple

        out["slow grammar"], (slow, simple) = await probe_while(c, url, grammars())
        return {"health_s": out, "first_grammar": cold, "big_prompt": big, "slow_grammar": slow,
                "simple_grammar_beside_it": simple}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="serve this checkout instead of the installed one")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    port = free_port()
    proc = start_server(args.src, port, f"/tmp/loop_stall_{port}.log")
    try:
        res = asyncio.run(phases(f"http://127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(30)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"{args.src or 'installed'} on {cpu}")
    print(f"{'phase':14} {'probes':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for phase, xs in res["health_s"].items():
        print(f"{phase:14} {len(xs):6d} {pct(xs, .5) * 1e3:8.1f} {pct(xs, .99) * 1e3:8.1f} {max(xs) * 1e3:8.1f}")
    for name in ("first_grammar", "big_prompt", "slow_grammar", "simple_grammar_beside_it"):
        seconds, status = res[name]
        print(f"{name}: HTTP {status} after {seconds:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(res, src=args.src, cpu=cpu), f, indent=1)


if __name__ == "__main__":
    main()
