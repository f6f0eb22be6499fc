"""torch's fused attention (the prefill chunks' and draft trees' path) in fp32 and in bf16, and fp32 over K/V
widened from a bf16 cache, on SmolLM2's heads (9 query heads, 3 KV heads, head size 64), with an additive mask.

usage: python benchmarks/sdpa_dtype.py   (prints ms a call, best of 20 rounds of 10, per queries x keys)

Picks how attention.py runs a bf16 cache's chunks: in bf16 where the CPU has a bf16 matmul, else widened to fp32.
"""

import time

import torch
import torch.nn.functional as F


def best_ms(fn, rounds: int = 20, calls: int = 10) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    print(f"{'queries':>7} {'keys':>5} {'fp32 ms':>8} {'bf16 ms':>8} {'widened ms':>10}")
    for n, length in ((32, 448), (128, 1024), (345, 704), (512, 512)):
        q, k, v = torch.randn(1, 9, n, 64), torch.randn(1, 3, length, 64), torch.randn(1, 3, length, 64)
        mask = torch.zeros(n, length)
        qb, kb, vb, maskb = q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16()

        def sdpa(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)

        fp32 = best_ms(lambda: sdpa(q, k, v, mask))
        bf16 = best_ms(lambda: sdpa(qb, kb, vb, maskb))
        widened = best_ms(lambda: sdpa(q, kb.float(), vb.float(), mask))
        print(f"{n:>7} {length:>5} {fp32:>8.3f} {bf16:>8.3f} {widened:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
