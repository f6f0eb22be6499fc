"""In-process throughput on a W1-like mix, no HTTP: requests with prompts 64-512 and outputs 16-256 tokens.

usage: python benchmarks/offline_mix.py [--requests 32] [--dtype float32|bfloat16] [--batch-invariant]
                                        [--max-tokens N] [--profile]
Prints output tokens/s and engine steps; with --profile, the functions that took the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-invariant", action="store_true", help="fixed 16-row matmul tiles (see README)")
    ap.add_argument("--max-tokens", type=int, default=None, help="every request's output length (default: 16-256)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    llm = LLM(default_model_path(), scheduled=True, pool_blocks=4096, dtype=args.dtype, show_progress=False,
              batch_invariant=args.batch_invariant)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))] for _ in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens or rng.randint(16, 256), ignore_eos=True)
              for _ in prompts]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    if prof:
        prof.disable()
    out = sum(len(r.token_ids) for r in results)
    mode = ", batch-invariant" if args.batch_invariant else ""
    print(f"dtype {args.dtype}{mode}: {args.requests} requests, {out} output tokens in {elapsed:.1f} s = "
          f"{out / elapsed:.1f} out tok/s, {llm.engine.scheduler.stats.num_steps} steps")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
