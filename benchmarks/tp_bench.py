"""Tensor parallelism on this machine: SmolLM2 prefill and decode speed with --tp 1 and --tp 2, in process.

usage: python benchmarks/tp_bench.py [--dtype bfloat16] [--tp 1,2]

Per N: prefill of one 1024-token prompt (1 output token), single-stream decode (128 tokens after a 16-token
prompt) and 8-stream decode (8 × 64 tokens). For each it prints the time per engine step, the time rank 0 spent in
the collectives per step (all-reduce after attention and after the MLP of each layer, the embedding's all-reduce,
the logits' all-gather) and their bytes, and the seeds' model t(p) ≈ T/p + 2·(p−1)/p · M/BW, with T the N=1 step
time, M the collective bytes per step and BW the bandwidth the prefill case's collectives reached (messages of
1024 rows × 576 × 4 bytes = 2.4 MB: bandwidth-bound, unlike decode's 2-32 KB ones, which are latency-bound).
"""

from __future__ import annotations

import argparse
import random
import time

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path


def measure(llm: LLM, prompts, params) -> tuple[float, int, float, int]:
    """(seconds, engine steps, seconds in collectives, collective bytes) for one generate call."""
    st = llm.engine.scheduler.stats
    comm = llm.engine.model.comm
    s0 = st.num_steps
    c0, b0 = (comm.seconds, comm.bytes) if comm else (0.0, 0)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    c1, b1 = (comm.seconds, comm.bytes) if comm else (0.0, 0)
    return dt, st.num_steps - s0, c1 - c0, b1 - b0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", default="1,2")
    args = ap.parse_args()
    path = default_model_path()
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 40000) for _ in range(1024)]
    short = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(8)]
    cases = [
        ("prefill 1024", [long_prompt], SamplingParams(temperature=0, max_tokens=1), 1024),
        ("decode x1", short[:1], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), 128),
        ("decode x8", short, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), 8 * 64),
    ]
    base: dict[str, float] = {}
    print(f"SmolLM2-135M, --dtype {args.dtype}, chunk 512, in process")
    print("case          tp  tok/s   ms/step  collective ms/step  collective KiB/step  MB/s  model ms/step")
    for tp in (int(x) for x in args.tp.split(",")):
        llm = LLM(path, tp=tp, dtype=args.dtype, pool_blocks=1024, show_progress=False)
        bw = 0.0
        try:
            llm.generate(short[:1], SamplingParams(max_tokens=4))  # warm-up
            for name, prompts, params, tokens in cases:
                dt, steps, coll, nbytes = measure(llm, [list(p) for p in prompts], params)
                step_ms = 1000 * dt / steps
                if tp == 1:
                    base[name] = step_ms
                rate = nbytes / coll if coll else 0.0
                if name.startswith("prefill"):
                    bw = rate
                model = ""
                if tp > 1 and bw:
                    model = f"{base[name] / tp + 1000 * 2 * (tp - 1) / tp * (nbytes / steps) / bw:.1f}"
                print(f"{name:12}  {tp:>2}  {tokens / dt:>5.1f}  {step_ms:>8.1f}  {1000 * coll / steps:>18.1f}  "
                      f"{nbytes / steps / 1024:>19.1f}  {rate / 1e6:>4.0f}  {model:>13}", flush=True)
        finally:
            llm.engine.close()


if __name__ == "__main__":
    main()
