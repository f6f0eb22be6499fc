"""The weight kernels on SmolLM2's own weights, route by route, in process: what each kernel of the policy costs at
each batch size, and what the weights of each route table hold.

usage: python benchmarks/kernels_bench.py [--rows 1 5 8 28 64 128 512] [--reps 7] [--fp32] [--disable K ...]

Loads the model with --dtype auto (``--fp32``: as on a CPU without a bf16 matmul, which computes in fp32; simulated
through the policy's CPU probe where this CPU has one) once with the default policy and once more for each kernel
named with ``--disable`` (default: every optional kernel this CPU uses), then times, per row count, one pass of
random rows through all 30 layers' 4-bit projections and through the LM head, each model's passes interleaved, best
of ``--reps``. Prints the start-up log's route tables, the weights' MiB, ms per pass and the ratio to the default.
Replaces int4_amx_bench.py and q_matmul_bench.py (docs/benchmarks-archive.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from justapi import LLM
from justapi.model import kernel_policy
from justapi.model.gguf_loader import default_model_path


def load(disabled: tuple[str, ...]):
    return LLM(default_model_path(), pool_blocks=16, disabled_kernels=disabled, show_progress=False).engine.model


def one_pass(model, xs: dict[int, torch.Tensor]) -> tuple[float, float]:
    """Seconds for all 4-bit projections, and for the head, at the rows of ``xs`` (by input width)."""
    t = time.perf_counter()
    for layer in model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            w.matmul(xs[w.shape[1]])
    t1 = time.perf_counter()
    model.lm_head.matmul(xs[model.lm_head.shape[1]])
    return t1 - t, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 28, 64, 128, 512])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--fp32", action="store_true", help="the fp32 route of a CPU without a bf16 matmul")
    ap.add_argument("--disable", nargs="*", default=None, help="kernels to time off (default: each one in use)")
    args = ap.parse_args()
    if args.fp32:
        probe = kernel_policy.probe_cpu
        kernel_policy.probe_cpu = lambda kernels: dataclasses.replace(probe(kernels), bf16_matmul=False)
    models = {"default": load(())}
    policy = models["default"].policy
    for kernel in args.disable if args.disable is not None else sorted(policy.enabled - {"fused_silu"}):
        models[f"{kernel} off"] = load((kernel,))
    for name, model in models.items():
        lines = model.policy.describe()
        print(f"{name}: weights {model.weight_bytes() / 2**20:.1f} MiB; {lines[0]}")
        print("\n".join(lines[1:]))
    width = max(len(n) for n in models) + 2
    print(f"\n{'rows':>5}" + "".join(f"{n + ' layers':>{width + 7}}{'head':>8}" for n in models))
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        widths = {w.shape[1] for layer in models["default"].layers for w in (layer.o, layer.down)}
        xs = {k: torch.randn(rows, k, generator=g).to(policy.dtype) for k in widths}
        best = {n: [1e9, 1e9] for n in models}
        for rep in range(args.reps):
            for name in list(models)[:: 1 if rep % 2 else -1]:
                for i, t in enumerate(one_pass(models[name], xs)):
                    best[name][i] = min(best[name][i], t)
        base = best["default"]
        cells = [f"{b[0] * 1e3:>{width}.2f}ms{b[0] / base[0]:>5.2f}x{b[1] * 1e3:>6.2f}ms" for b in best.values()]
        print(f"{rows:>5}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
