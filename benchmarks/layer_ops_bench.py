"""The small C++ layer ops against the torch ops they replace, on SmolLM2's sizes: silu(gate) * up from the fused
gate/up rows (``silu_mul``) and the greedy pick over the vocabulary (``argmax_rows``), at a decode batch (28 rows)
and a mixed step (373 rows: a 345-token prompt and 28 decodes). Outputs are checked equal first; times are the
best of --reps, the two sides alternating.

usage: python benchmarks/layer_ops_bench.py [--reps 50]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from justapi.kernels import decode_kernels


def best_of(reps: int, a, b) -> tuple[float, float]:
    best = [float("inf"), float("inf")]
    for rep in range(reps):
        for i in ((0, 1) if rep % 2 else (1, 0)):
            f = (a, b)[i]
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    k = decode_kernels()
    if k is None or not k.silu_mul_available(False):
        raise SystemExit("the C++ kernels (with AVX-512 or AVX2) are not available here")
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads; op, rows, dtype: torch, C++, ratio")
    for dtype in (torch.bfloat16, torch.float32):
        if not k.silu_mul_available(dtype == torch.bfloat16):
            continue  # bf16 on AVX2
        for rows in (28, 373):
            gate_up = torch.randn(rows, 2 * 1536, generator=g).to(dtype)

            def torch_silu(gate_up=gate_up):
                gate, up = gate_up.chunk(2, dim=-1)
                return F.silu(gate) * up

            assert torch.equal(k.silu_mul(gate_up), torch_silu())
            t, c = best_of(args.reps, torch_silu, lambda gate_up=gate_up: k.silu_mul(gate_up))
            print(f"silu_mul {rows:4d} {str(dtype):>14}: {t * 1e6:7.0f} us {c * 1e6:7.0f} us  {c / t:.2f}")
    for rows in (1, 8, 28):
        logits = torch.randn(rows, 49152, generator=g)
        assert torch.equal(k.argmax_rows(logits), logits.max(dim=-1).indices)
        t, c = best_of(args.reps, lambda x=logits: x.max(dim=-1).indices, lambda x=logits: k.argmax_rows(x))
        print(f"argmax   {rows:4d} {'torch.float32':>14}: {t * 1e6:7.0f} us {c * 1e6:7.0f} us  {c / t:.2f}")


if __name__ == "__main__":
    main()
