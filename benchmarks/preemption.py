"""What preemption costs here: recompute (what JustAPI does) against the memory copy a swap would need.

Runs one offline workload twice on the real model: with a pool big enough for everything, and with a pool so
small that requests are preempted again and again. Reports throughput, preemptions, the KV tokens preemption
gave up, how many of them the prefix cache gave back on resumption, and what was recomputed. Then it times what
a swap of the same blocks to a second host buffer would copy.

usage: python benchmarks/preemption.py [--requests 24] [--small-pool 64]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path
from justapi.model.runner import kv_bytes_per_block


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(64, 128), ignore_eos=True) for _ in range(n)]
    return prompts, params


def run(pool_blocks: int, n: int, prefix_cache: bool = True) -> dict:
    llm = LLM(default_model_path(), scheduled=True, pool_blocks=pool_blocks, prefix_cache=prefix_cache,
              show_progress=False)
    prompts, params = workload(n, llm.engine.model_config.vocab_size)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    stats = llm.engine.scheduler.stats
    out_tokens = sum(len(r.token_ids) for r in results)
    return {"pool_blocks": pool_blocks, "prefix_cache": prefix_cache, "seconds": elapsed,
            "output_tok_s": out_tokens / elapsed, "preemptions": stats.num_preemptions,
            "preempted_tokens": stats.num_preempted_tokens, "resumed_from_cache": stats.num_resumed_cached_tokens,
            "recomputed_tokens": stats.num_preempted_tokens - stats.num_resumed_cached_tokens,
            "tokens": [r.token_ids for r in results], "bytes_per_block": kv_bytes_per_block(llm.engine.model, 16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--small-pool", type=int, default=64)
    args = ap.parse_args()
    big = run(4096, args.requests)
    rows = [big, run(args.small_pool, args.requests), run(args.small_pool, args.requests, prefix_cache=False)]
    print(f"{'pool':>6} {'cache':>5} {'s':>7} {'out tok/s':>9} {'preempt':>7} {'KV tokens dropped':>17} "
          f"{'back from cache':>15} {'recomputed':>10} {'same text':>9}")
    for r in rows:
        print(f"{r['pool_blocks']:>6} {str(r['prefix_cache']):>5} {r['seconds']:>7.1f} {r['output_tok_s']:>9.1f} "
              f"{r['preemptions']:>7} {r['preempted_tokens']:>17} {r['resumed_from_cache']:>15} "
              f"{r['recomputed_tokens']:>10} {str(r['tokens'] == big['tokens']):>9}")
    # What a swap would move instead: every dropped block copied out and back.
    per_block = big["bytes_per_block"]
    src = torch.empty(per_block * 256 // 4)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    copy_s_per_block = (time.perf_counter() - t0) / 10 / 256
    for r in rows[1:]:
        blocks = r["preempted_tokens"] / 16
        print(f"pool {r['pool_blocks']} cache {r['prefix_cache']}: a swap would copy {blocks:.0f} blocks out and back "
              f"({2 * blocks * per_block / 2**20:.0f} MiB, ~{2 * blocks * copy_s_per_block:.2f} s) and would need "
              f"a second host buffer of that size")


if __name__ == "__main__":
    main()
