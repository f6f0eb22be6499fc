"""q_matmul (kernels/q_matmul.cpp) against the dense fp32 copy on oneDNN, on SmolLM2's own weights, in process.

usage: python benchmarks/q_matmul_bench.py [--rows 1 8 28 64 512] [--reps 7]

Loads the model as --dtype auto computes on a CPU without a bf16 matmul (fp32; simulated where there is one),
then times, for each row count, one pass of fp32 rows through all 30 layers' 4-bit projections and through the
Q8_0 head, both ways, interleaved, best of --reps. Prints ms per pass and the ratio (q_matmul / dense).
"""

from __future__ import annotations

import argparse
import time

import torch

from justapi import LLM
from justapi.model import quant
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 28, 64, 512])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    quant.cpu_has_bf16_matmul = lambda: False  # the fp32 route, as on AVX2-only CPUs
    model = LLM(default_model_path(), pool_blocks=16, show_progress=False).engine.model
    if model.lm_head.q_bytes is None:
        raise SystemExit("q_matmul is not built here (needs AVX2 and FMA, and the C++ kernels)")
    layers = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    head = model.lm_head
    kernels = head.kernels

    def q(w, x):
        bits = 8 if w is head else 4
        offset = None if w is head else w.q_offset
        return kernels.q_matmul(x, w.q_bytes, w.q_scale, offset, bits, w.shape[0])

    def dense(w, x):
        return quant.packed_linear(x, w.dense)

    print(f"{'rows':>5} {'layers q_matmul':>16} {'dense':>8} {'ratio':>6} {'head q_matmul':>14} {'dense':>8} {'ratio':>6}")
    for rows in args.rows:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in layers + [head]}
        best = {}
        for _ in range(args.reps):
            for name, fn in (("q", q), ("dense", dense)):
                t = time.perf_counter()
                for w in layers:
                    fn(w, xs[w.shape[1]])
                t1 = time.perf_counter()
                fn(head, xs[head.shape[1]])
                t2 = time.perf_counter()
                best[name, "layers"] = min(best.get((name, "layers"), 1e9), t1 - t)
                best[name, "head"] = min(best.get((name, "head"), 1e9), t2 - t1)
        ms = {k: v * 1e3 for k, v in best.items()}
        print(f"{rows:>5} {ms['q', 'layers']:>16.2f} {ms['dense', 'layers']:>8.2f} "
              f"{ms['q', 'layers'] / ms['dense', 'layers']:>6.2f} {ms['q', 'head']:>14.2f} {ms['dense', 'head']:>8.2f} "
              f"{ms['q', 'head'] / ms['dense', 'head']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
