"""torch's fused CPU attention on one prefill chunk with its keys as they are or padded to a multiple of
attention.KEY_PAD (zeros, masked out), over W1's prompt lengths (64-512): SmolLM2's heads (9 query / 3 KV, size 64),
bf16, the additive causal mask the engine builds. Each length's two variants are timed interleaved, best of --reps.

usage: python benchmarks/sdpa_key_pad.py [--reps 7]

Prints per length the time of one layer's attention both ways and the largest difference of their outputs, then the
sums over all lengths.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from justapi.model.attention import KEY_PAD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    totals = {"ragged": 0.0, "padded": 0.0}
    print(f"{'tokens':>6} {'ragged ms':>10} {'padded ms':>10} {'ratio':>6} {'max diff':>9}")
    for n in range(64, 513, 29):
        padded = -(-n // KEY_PAD) * KEY_PAD
        q = torch.randn(1, heads, n, dim, generator=g).bfloat16()
        k = torch.randn(1, kv_heads, n, dim, generator=g).bfloat16()
        v = torch.randn(1, kv_heads, n, dim, generator=g).bfloat16()
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        bias = torch.zeros(n, n, dtype=torch.bfloat16).masked_fill_(~causal, float("-inf"))
        bias_p = torch.full((n, padded), float("-inf"), dtype=torch.bfloat16)
        bias_p[:, :n] = bias
        pad = (0, 0, 0, padded - n)
        k_p, v_p = F.pad(k, pad), F.pad(v, pad)
        runs = {
            "ragged": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=dim ** -0.5, enable_gqa=True),
            "padded": lambda: F.scaled_dot_product_attention(q, k_p, v_p, attn_mask=bias_p, scale=dim ** -0.5,
                                                             enable_gqa=True),
        }
        diff = (runs["ragged"]().float() - runs["padded"]().float()).abs().max().item()
        best = dict.fromkeys(runs, float("inf"))
        for rep in range(args.reps):
            for name, fn in list(runs.items())[:: 1 if rep % 2 else -1]:
                t = time.perf_counter()
                for _ in range(5):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - t) / 5)
        for name in totals:
            totals[name] += best[name]
        print(f"{n:6d} {best['ragged'] * 1e3:10.3f} {best['padded'] * 1e3:10.3f} "
              f"{best['padded'] / best['ragged']:6.2f} {diff:9.2g}")
    print(f"{'all':>6} {totals['ragged'] * 1e3:10.3f} {totals['padded'] * 1e3:10.3f} "
          f"{totals['padded'] / totals['ragged']:6.2f}")


if __name__ == "__main__":
    main()
