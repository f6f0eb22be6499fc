"""Does torch.compile cut the per-layer cost of the small ops on this CPU? One layer's elementwise tail (residual
add, RMSNorm, SiLU × up) at SmolLM2's sizes in bf16, eager against torch.compile (inductor), 1 and 8 rows.

usage: python benchmarks/compile_probe.py [--dynamic]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from justapi.model.layers import rms_norm


def tail(x, res, w, gate_up):
    h = x + res
    gate, up = gate_up.chunk(2, dim=-1)
    return h, rms_norm(h, w, 1e-5), F.silu(gate) * up


def bench(f, n=2000) -> float:
    for _ in range(50):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dynamic", action="store_true", help="one graph for every batch size (else one per shape)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    w = torch.randn(576, dtype=torch.bfloat16)
    compiled = torch.compile(tail, dynamic=args.dynamic)
    for rows in (1, 8):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        gu = torch.randn(rows, 3072, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        compiled(x, x, w, gu)
        build = time.perf_counter() - t0
        print(f"{rows} rows: eager {bench(lambda: tail(x, x, w, gu)):.1f} us, compiled "
              f"{bench(lambda: compiled(x, x, w, gu)):.1f} us (dynamic={args.dynamic}, first call {build:.1f} s)")


if __name__ == "__main__":
    main()
