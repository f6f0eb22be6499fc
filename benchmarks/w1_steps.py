"""Where W1's time goes, in process: engine steps by kind (decode only, prefill chunk + decodes, prefill only), and
the time of schedule / execute / update.

usage: python benchmarks/w1_steps.py [--requests 128] [--max-seqs 32] [--kv-cache-dtype auto] [--profile]

The W1 mix of docs/benchmarks.md (prompts 64-512 tokens, outputs 16-256, EOS ignored, greedy), all requests sent
at once to an engine with the server's defaults (--scheduled, --dtype auto, at most 32 running). With --profile,
the functions that took the most time (cProfile).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import random
import time

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    llm = LLM(default_model_path(), scheduled=True, max_seqs=args.max_seqs, kv_cache_dtype=args.kv_cache_dtype,
              show_progress=False)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))] for _ in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 256), ignore_eos=True) for _ in prompts]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up (kernel build, first allocations)

    parts: collections.Counter = collections.Counter()
    kinds = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # kind -> steps, seconds, decode rows, prefill tokens

    def timed(name, f):
        def call(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            parts[name] += time.perf_counter() - t
            return out
        return call

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timed("update", engine.scheduler.update)
    execute = engine.runner.execute

    def execute_by_kind(sched):
        t = time.perf_counter()
        out = execute(sched)
        dt = time.perf_counter() - t
        parts["execute"] += dt
        n = sched.num_scheduled_tokens.values()
        decodes, prefill = sum(1 for v in n if v == 1), sum(v for v in n if v > 1)
        kind = ("prefill + decodes" if decodes else "prefill only") if prefill else "decode only"
        k = kinds[kind]
        k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + dt, k[2] + decodes, k[3] + prefill
        return out

    engine.runner.execute = execute_by_kind
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    if prof:
        prof.disable()
    out = sum(len(r.token_ids) for r in results)
    print(f"{args.requests} requests, <= {args.max_seqs} running: {out} output tokens in {elapsed:.1f} s = "
          f"{out / elapsed:.1f} out tok/s; " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    print(f"{'step kind':18s} {'steps':>6s} {'seconds':>8s} {'ms/step':>8s} {'decode rows/step':>17s} "
          f"{'prefill tokens/step':>20s}")
    for kind, (steps, sec, decodes, prefill) in sorted(kinds.items()):
        print(f"{kind:18s} {steps:6d} {sec:8.1f} {sec / steps * 1e3:8.1f} {decodes / steps:17.1f} {prefill / steps:20.1f}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
