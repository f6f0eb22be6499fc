"""Hybrid models (issue 57) against an attention-only model of the same size, in process on random weights: prefill
and decode throughput, each sequence's state cache against its KV cache, the recurrences' share of decode time, a
shared system prompt's time to first token and hit ratio with and without the prefix cache (state snapshots), and a
pool small enough to preempt (recomputed against resumed tokens); then llama.cpp's llama-bench on the same files
where it is installed (../shared/peers builds it) and loads them.

The three files share their sizes: qwen3 (every layer attention), qwen35 (Gated DeltaNet, every fourth layer gated
attention) and lfm2 (short convolutions, every third layer attention), written as llama.cpp's converter lays them
out by the tests' writers (tests/tiny_gguf.py, tests/tiny_hybrid.py; transformers draws the weights, so the repo's
test extra is needed). Random weights decode as fast as trained ones; the vocabulary is the tests' small one, so the
LM head costs little and the layers dominate.

    .venv/bin/python benchmarks/hybrid_bench.py [--hidden 768] [--layers 12] [--qtype Q8_0] [--out FILE.json]
        [--disable delta_rule]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
LLAMA_BENCH = os.path.expanduser("~/.cache/justapi-peers/build/llama.cpp/bin/llama-bench")


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


def measure(path: str, args) -> dict:
    """Prefill tok/s (8 prompts of --prompt tokens, one token out), decode tok/s at 1 and 8 sequences (--output
    tokens each), and the bytes one sequence keeps: its states and its KV per token."""
    from justapi import LLM, SamplingParams
    from justapi.model.state_cache import state_bytes_per_seq

    llm = LLM(path, show_progress=False, max_seqs=8, pool_blocks=4096 // 16 * 9, disabled_kernels=args.disable)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    run = lambda prompts, n: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
    run([prompt(64)], 8)  # warm-up: first-call costs out of the figures
    figures = {}
    t = time.perf_counter()
    run([prompt(args.prompt) for _ in range(8)], 1)
    figures["prefill_tok_s"] = 8 * args.prompt / (time.perf_counter() - t)
    for batch in (1, 8):
        prompts = [prompt(16) for _ in range(batch)]
        t = time.perf_counter()
        run(prompts, args.output)
        figures[f"decode_tok_s_{batch}"] = batch * args.output / (time.perf_counter() - t)
    rank = llm.engine.executor.rank
    figures["state_bytes_per_seq"] = state_bytes_per_seq(llm.engine.model)
    figures["kv_bytes_per_token"] = rank.kv_bytes_per_block() // rank.config.block_size
    return figures


def recurrence_share(path: str, args) -> float:
    """The share of a batch-8 decode run's wall time spent in the recurrences themselves (model.delta_rule's
    convolution and delta-rule functions, their projections aside): what a C++ kernel for them could save."""
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

    names = ("conv_continue", "conv_step", "delta_step", "chunked", "per_token")
    saved = {n: getattr(delta_rule, n) for n in names}
    llm = LLM(path, show_progress=False, max_seqs=8, pool_blocks=1024)
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    llm.generate([[5] * 16] * 8, params)  # warm-up
    for n in names:
        setattr(delta_rule, n, timed(saved[n]))
    try:
        t = time.perf_counter()
        llm.generate([[7 + i] * 16 for i in range(8)], params)
        return spent[0] / (time.perf_counter() - t)
    finally:
        for n in names:
            setattr(delta_rule, n, saved[n])


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


def llama_bench(path: str, args) -> dict | None:
    """llama.cpp's pp and tg tok/s on the same file (2 threads), or None where it is absent or refuses the file."""
    binary = shutil.which("llama-bench") or (LLAMA_BENCH if os.path.exists(LLAMA_BENCH) else None)
    if binary is None:
        return None
    cmd = [binary, "-m", path, "-p", str(args.prompt), "-n", str(args.output), "-t", "2", "-r", "2", "-o", "json"]
    with open("/proc/cpuinfo") as f:
        if "amx_tile" in f.read():
            cmd += ["--repack", "0"]  # ggml's AMX repacking crashes on these machines (as peers_bench.sh notes)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        rows = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, json.JSONDecodeError):
        return {"error": "llama-bench did not run on this file"}
    return {("prefill_tok_s" if r["n_prompt"] else "decode_tok_s_1"): r["avg_ts"] for r in rows}


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
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for arch, path in write_models(folder, args).items():
            results[arch] = {"justapi": measure(path, args), "llama.cpp": llama_bench(path, args)}
            if arch != "qwen3":
                results[arch]["recurrence_share"] = recurrence_share(path, args)
            results[arch]["shared_prompt"] = shared_prompt(path, args)
            print(arch, json.dumps(results[arch]), flush=True)
    base = results["qwen3"]["justapi"]
    print(f"{'model':<8}{'prefill':>10}{'decode 1':>10}{'decode 8':>10}{'state/seq':>12}{'KV/token':>10}"
          f"{'llama.cpp pp / tg':>22}")
    for arch, r in results.items():
        j, peer = r["justapi"], r["llama.cpp"] or {}
        ratio = lambda k: f"{j[k]:.0f} ({j[k] / base[k]:.2f}x)"  # noqa: E731
        print(f"{arch:<8}{ratio('prefill_tok_s'):>10} {ratio('decode_tok_s_1'):>10} {ratio('decode_tok_s_8'):>10}"
              f"{j['state_bytes_per_seq'] / 2**20:>10.2f}Mi{j['kv_bytes_per_token'] / 2**10:>8.1f}Ki"
              f"{peer.get('prefill_tok_s', 0):>12.0f} / {peer.get('decode_tok_s_1', 0):.0f}")
    for arch, r in results.items():
        print(arch, "recurrences' share of decode:", f"{r.get('recurrence_share', 0):.1%};", "shared prompt:",
              json.dumps(r["shared_prompt"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
