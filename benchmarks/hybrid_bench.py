"""Hybrid models (issue 57) against an attention-only model of the same size, in process on random weights: prefill
and decode throughput, each sequence's state cache against its KV cache, the recurrences' share of decode time, a
shared system prompt's time to first token and hit ratio with and without the prefix cache (state snapshots), and a
pool small enough to preempt (recomputed against resumed tokens); then llama.cpp's server on the same files where it
is installed (../shared/peers builds it) and loads them, driven the same way.

The three files share their sizes: qwen3 (every layer attention), qwen35 (Gated DeltaNet, every fourth layer gated
attention) and lfm2 (short convolutions, every third layer attention), written as llama.cpp's converter lays them
out by the tests' writers (tests/tiny_gguf.py, tests/tiny_hybrid.py; transformers draws the weights, so the repo's
test extra is needed). Random weights decode as fast as trained ones; the vocabulary is the tests' small one, so the
LM head costs little and the layers dominate. Beside them, measured the same way, the real models: SmolLM2-135M
(Q4_1, its 49k vocabulary) and Gemma 3 270M (Q4_K_M, 262k).

    .venv/bin/python benchmarks/hybrid_bench.py [--hidden 768] [--layers 12] [--qtype Q8_0] [--out FILE.json]
        [--disable delta_rule] [--archs qwen35 ...] [--throughput-only]

Two revisions side by side: ``PYTHONPATH=DIR`` names a checkout of the other one (its kernels built in place), and
``--archs qwen35 --throughput-only`` (prefill and decode only, no peer) run alternately for each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
LLAMA_SERVER = os.path.expanduser("~/.cache/justapi-peers/build/llama.cpp/bin/llama-server")


ARCHS = ("qwen3", "qwen35", "lfm2", "smollm2", "gemma3")


def real_models() -> dict[str, str]:
    """The real models' files: {name: path}."""
    from models_bench import gemma3_path

    from justapi.model.gguf_loader import default_model_path

    return {"smollm2": default_model_path(), "gemma3": gemma3_path()}


def write_models(folder: str, args) -> dict[str, str]:
    """The three GGUFs of one size: {arch: path}."""
    from tiny_gguf import write_tiny_model
    from tiny_hybrid import write_tiny_lfm2, write_tiny_qwen35

    heads, head_dim = args.hidden // 64, 64
    sizes = dict(hidden=args.hidden, intermediate=args.intermediate, heads=heads, kv_heads=max(1, heads // 3),
                 head_dim=head_dim, linear_dim=head_dim, linear_key_heads=heads // 2, linear_value_heads=heads,
                 context=4096)
    paths = {arch: os.path.join(folder, f"{arch}.gguf") for arch in ("qwen3", "qwen35", "lfm2")}
    write_tiny_model(paths["qwen3"], "qwen3", num_layers=args.layers, hidden=args.hidden, num_heads=heads,
                     num_kv_heads=sizes["kv_heads"], intermediate=args.intermediate, head_dim=head_dim,
                     context_length=4096, qtype=args.qtype)
    write_tiny_qwen35(paths["qwen35"], num_layers=args.layers, qtype=args.qtype, **sizes)
    lfm2_layers = tuple("full_attention" if i % 3 == 2 else "conv" for i in range(args.layers))
    write_tiny_lfm2(paths["lfm2"], layers=lfm2_layers, qtype=args.qtype, **sizes)
    return paths


def best_of_3(rate) -> float:
    """The highest of three calls of ``rate()``: this VM's speed drifts within a minute."""
    return max(rate() for _ in range(3))


def measure(path: str, args) -> dict:
    """Prefill tok/s (8 prompts of --prompt tokens, one token out) and decode tok/s at 1 and 8 sequences (--output
    tokens each), each the best of 3, and the bytes one sequence keeps: its states and its KV per token."""
    from justapi import LLM, SamplingParams
    from justapi.model.state_cache import state_bytes_per_seq

    llm = LLM(path, show_progress=False, max_seqs=8, pool_blocks=4096 // 16 * 9, disabled_kernels=args.disable)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    run = lambda prompts, n: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
    run([prompt(args.prompt)], 8)  # warm-up: first-call costs (a full chunk's too) out of the figures
    def rate(batch: int, prompt_len: int, out: int, tokens: int) -> float:  # tokens counted a second
        prompts = [prompt(prompt_len) for _ in range(batch)]
        t = time.perf_counter()
        run(prompts, out)
        return tokens / (time.perf_counter() - t)

    # (the first prefills also fault in the KV pool's untouched pages: the best of 3 leaves that out too)
    figures = {"prefill_tok_s": best_of_3(lambda: rate(8, args.prompt, 1, 8 * args.prompt))}
    for batch in (1, 8):
        figures[f"decode_tok_s_{batch}"] = best_of_3(lambda: rate(batch, 16, args.output, batch * args.output))  # noqa: B023
    rank = llm.engine.executor.rank
    figures["state_bytes_per_seq"] = state_bytes_per_seq(llm.engine.model)
    figures["kv_bytes_per_token"] = rank.kv_bytes_per_block() // rank.config.block_size
    return figures


def recurrence_share(path: str, args) -> float:
    """The share of a batch-8 decode run's wall time spent in the recurrences themselves (the C++ Gated DeltaNet
    runs, or model.delta_rule's convolution and delta-rule functions on the torch path; the projections aside)."""
    from justapi import LLM, SamplingParams
    from justapi.model import delta_rule

    spent = [0.0]

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return run

    llm = LLM(path, show_progress=False, max_seqs=8, pool_blocks=1024)
    targets = [(delta_rule, n) for n in ("conv_continue", "conv_step", "delta_step", "chunked", "per_token")]
    if llm.engine.model.kernels is not None:
        targets.append((llm.engine.model.kernels, "gated_delta_runs"))
    saved = {(m, n): getattr(m, n) for m, n in targets}
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    llm.generate([[5] * 16] * 8, params)  # warm-up
    for (m, n), fn in saved.items():
        setattr(m, n, timed(fn))
    try:
        t = time.perf_counter()
        llm.generate([[7 + i] * 16 for i in range(8)], params)
        return spent[0] / (time.perf_counter() - t)
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)


def shared_prompt(path: str, args) -> dict:
    """A shared system prompt (--prompt tokens) and 16 questions of 32 tokens, one after another: the mean time to
    the first token and the prefix cache's hit ratio, with and without the prefix cache; then a small pool that
    preempts 8 requests decoding together: preemptions, tokens recomputed and resumed from cached blocks."""
    from justapi import LLM, SamplingParams

    rng = random.Random(1)
    system = [rng.randrange(3, 250) for _ in range(args.prompt)]
    asks = [system + [rng.randrange(3, 250) for _ in range(32)] for _ in range(16)]
    out = {}
    for cache in (True, False):
        llm = LLM(path, show_progress=False, max_seqs=8, pool_blocks=1024, prefix_cache=cache)
        llm.generate([asks[0][:64]], SamplingParams(max_tokens=1))  # warm-up
        times = []
        for a in asks:
            t = time.perf_counter()
            llm.generate([a], SamplingParams(temperature=0, max_tokens=1))
            times.append(time.perf_counter() - t)
        stats = llm.engine.scheduler.cache
        out["ttft_ms_cached" if cache else "ttft_ms_uncached"] = 1000 * sum(times[1:]) / (len(times) - 1)
        if cache:
            out["hit_ratio"] = stats.hit_ratio
        # 8 distinct prompts decoding 4 * --output tokens each in a pool that admits them all but cannot hold their
        # growth: preempted requests recompute, or resume from their own prompt's snapshot where the cache has it
        own = [[rng.randrange(3, 250) for _ in range(args.prompt)] for _ in range(8)]
        small = LLM(path, show_progress=False, max_seqs=8, prefix_cache=cache,
                    pool_blocks=8 * (-(-args.prompt // 16) + 2))
        t = time.perf_counter()
        small.generate(own, SamplingParams(temperature=0, max_tokens=4 * args.output, ignore_eos=True))
        st = small.engine.scheduler.stats
        out["preemption" + ("" if cache else "_uncached")] = {
            "seconds": time.perf_counter() - t, "preemptions": st.num_preemptions,
            "preempted_tokens": st.num_preempted_tokens, "resumed_cached_tokens": st.num_resumed_cached_tokens}
    return out


def llama_server(path: str, args) -> dict | None:
    """llama.cpp's server on the same file (2 threads, 8 slots, loopback), driven as ``measure`` drives JustAPI:
    prefill tok/s of 8 prompts sent together (one token out), decode tok/s of 1 and 8 sequences. None where it is
    not installed; an error where it does not load the file."""
    import concurrent.futures

    import httpx

    binary = shutil.which("llama-server") or (LLAMA_SERVER if os.path.exists(LLAMA_SERVER) else None)
    if binary is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [binary, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2", "-np", "8",
           "-c", str(8 * (args.prompt + args.output + 64)), "-cb", "-b", "2048", "-ub", "512"]
    with open("/proc/cpuinfo") as f:
        if "amx_tile" in f.read():
            cmd.append("--no-repack")  # ggml's AMX repacking crashes on these machines (as peers_bench.sh notes)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                return {"error": "llama-server did not load this file"}
            time.sleep(0.2)
        vocab = 250  # ids every test vocabulary has
        rng = random.Random(0)
        prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731

        def complete(ids: list[int], n: int) -> dict:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            return httpx.post(f"{url}/completion", json=body, timeout=600).json()

        def together(prompts: list[list[int]], n: int) -> float:
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda ids: complete(ids, n), prompts))
            return time.perf_counter() - t

        complete(prompt(64), 8)  # warm-up
        figures = {"prefill_tok_s": best_of_3(
            lambda: 8 * args.prompt / together([prompt(args.prompt) for _ in range(8)], 1))}
        for batch in (1, 8):
            figures[f"decode_tok_s_{batch}"] = best_of_3(
                lambda: batch * args.output / together([prompt(16) for _ in range(batch)], args.output))  # noqa: B023
        return figures
    finally:
        server.terminate()
        server.wait(timeout=30)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--qtype", default="Q8_0", help="the linear weights' GGUF type (F32, Q8_0, Q4_0)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--out", help="also write the figures to this JSON file")
    ap.add_argument("--disable", nargs="*", default=(), help="kernels off in the throughput runs (--disable-kernels), "
                    "e.g. delta_rule for the torch path of the recurrence")
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--throughput-only", action="store_true", help="prefill and decode only: no peer, no cache runs")
    args = ap.parse_args()
    import justapi

    print("justapi from", justapi.__file__, flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_models(folder, args) if set(args.archs) & {"qwen3", "qwen35", "lfm2"} else {}
        paths |= real_models() if set(args.archs) & {"smollm2", "gemma3"} else {}
        for arch, path in paths.items():
            if arch not in args.archs:
                continue
            results[arch] = {"justapi": measure(path, args)}
            if not args.throughput_only:
                results[arch]["llama.cpp"] = llama_server(path, args)
                if arch in ("qwen35", "lfm2"):
                    results[arch]["recurrence_share"] = recurrence_share(path, args)
                results[arch]["shared_prompt"] = shared_prompt(path, args)
            print(arch, json.dumps(results[arch]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if args.throughput_only or "qwen3" not in results:
        return
    base = results["qwen3"]["justapi"]
    print(f"{'model':<8}{'prefill':>10}{'decode 1':>10}{'decode 8':>10}{'state/seq':>12}{'KV/token':>10}"
          f"{'llama.cpp prefill / decode 1 / 8':>34}")
    for arch, r in results.items():
        j, peer = r["justapi"], r["llama.cpp"] or {}
        ratio = lambda k: f"{j[k]:.0f} ({j[k] / base[k]:.2f}x)"  # noqa: E731
        print(f"{arch:<8}{ratio('prefill_tok_s'):>10} {ratio('decode_tok_s_1'):>10} {ratio('decode_tok_s_8'):>10}"
              f"{j['state_bytes_per_seq'] / 2**20:>10.2f}Mi{j['kv_bytes_per_token'] / 2**10:>8.1f}Ki"
              f"{peer.get('prefill_tok_s', 0):>16.0f} / {peer.get('decode_tok_s_1', 0):.0f} / "
              f"{peer.get('decode_tok_s_8', 0):.0f}")
    for arch, r in results.items():
        print(arch, "recurrences' share of decode:", f"{r.get('recurrence_share', 0):.1%};", "shared prompt:",
              json.dumps(r["shared_prompt"]))


if __name__ == "__main__":
    main()
