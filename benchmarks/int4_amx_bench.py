"""The 4-bit AMX matmul alone (justapi/kernels/int4_matmul.cpp) against the prepacked bf16 copy it replaces, on
SmolLM2's four projection shapes for 30 layers of distinct random Q4 weights (so each call reads its weight from
memory, as in a real step), at batch sizes around batched decode.

usage: python benchmarks/int4_amx_bench.py [--reps 5] [--base REV] [--head]

Prints, per batch size, the best time of the 120 products (30 layers x QKV, O, gate/up, down) each way and their
ratio. With ``--base REV``, the AMX kernel as built at that git revision against the working tree's instead (the
same packed weights; the products are checked equal first), at 1-64 rows or ``--rows`` (the engine sends batches under
quant.INT4_MAX_ROWS rows to torch's int4 kernel instead; they are timed to show where the two cross), the two
kernels' order alternating from one repetition to the next. With ``--head``, SmolLM2's own LM head instead (its
Q8_0 token embedding, 49152 x 576) through the 8-bit AMX kernel (``q8_amx_matmul``) against its bf16 copy through
oneDNN, with 256 MB read between calls so that each reads the weight from memory, as in a real step.
"""

from __future__ import annotations

import argparse
import time

import torch

from justapi.kernels import decode_kernels
from justapi.model import quant
from justapi.model.quant import Int4Weight, Q4Unpacked

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]: fused QKV, O, fused gate/up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--base", default=None, help="a git revision whose AMX kernel is timed against the working tree's")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="batch sizes for --base, comma-separated")
    ap.add_argument("--head", action="store_true", help="SmolLM2's 8-bit LM head, AMX against oneDNN")
    args = ap.parse_args()
    kernels = decode_kernels()
    if kernels is None or not kernels.int4_amx_available():
        raise SystemExit("the C++ kernels have no AMX on this machine")
    if args.head:
        time_head(kernels, args.reps)
        return
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> Int4Weight:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scale = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.bfloat16).float()
        zero = (torch.randn(n, k // 32, generator=g) * 0.01).to(torch.bfloat16).float()
        return Int4Weight(Q4Unpacked(q, scale, zero), kernels)

    layers = [[weight(n, k) for n, k in SHAPES] for _ in range(30)]
    if args.base:
        compare_revisions(args.base, kernels, layers, args.reps, g, [int(r) for r in args.rows.split(",")])
        return
    amx_rows = quant.AMX_MAX_ROWS
    print("rows  bf16 copy (oneDNN)  4-bit AMX  ratio")
    for rows in (8, 16, 32, 48, 64, 96, 128, 256, 345, 512):
        xs = [torch.randn(rows, k, generator=g).to(torch.bfloat16) for _, k in SHAPES]
        best = {"bf16": 1e9, "amx": 1e9}
        for _ in range(args.reps):
            for name, limit in (("bf16", 0), ("amx", 1 << 30)):
                quant.AMX_MAX_ROWS = limit
                t = time.perf_counter()
                for layer in layers:
                    for x, w in zip(xs, layer):
                        w.matmul(x)
                best[name] = min(best[name], time.perf_counter() - t)
        print(f"{rows:4d}  {best['bf16'] * 1e3:15.1f} ms  {best['amx'] * 1e3:6.1f} ms  {best['amx'] / best['bf16']:.2f}")
    quant.AMX_MAX_ROWS = amx_rows


def compare_revisions(rev: str, kernels, layers, reps: int, g: torch.Generator, sizes: list[int]) -> None:
    from decode_attention_bench import build_at  # benchmarks/ is on the path when this runs as a script

    mods = {rev: build_at(rev), "working tree": kernels}
    print(f"rows  {rev:>14}  working tree  ratio")
    for rows in sizes:
        xs = [torch.randn(rows, k, generator=g).to(torch.bfloat16) for _, k in SHAPES]
        for x, w in zip(xs, layers[0]):
            a, b = (m.int4_amx_matmul(x, w.amx, w.out_features) for m in mods.values())
            assert torch.equal(a, b), "the two kernels disagree"
        best = dict.fromkeys(mods, 1e9)
        for rep in range(reps):
            for name, mod in list(mods.items())[:: 1 if rep % 2 else -1]:
                t = time.perf_counter()
                for layer in layers:
                    for x, w in zip(xs, layer):
                        mod.int4_amx_matmul(x, w.amx, w.out_features)
                best[name] = min(best[name], time.perf_counter() - t)
        old, new = best[rev], best["working tree"]
        print(f"{rows:4d}  {old * 1e3:11.2f} ms  {new * 1e3:9.2f} ms  {new / old:.2f}")


def time_head(kernels, reps: int) -> None:
    import gguf

    from justapi.model.gguf_loader import default_model_path
    from justapi.model.quant import prepack_linear, unpack_q8_0

    t = next(t for t in gguf.GGUFReader(default_model_path()).tensors if t.name == "token_embd.weight")
    if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        raise SystemExit(f"the token embedding is {t.tensor_type.name}, not Q8_0")
    q8 = unpack_q8_0(t.data, tuple(int(d) for d in reversed(t.shape)))
    n = q8.q.shape[0]
    dense, packed = prepack_linear(q8.dequantize().to(torch.bfloat16)), kernels.q8_amx_pack(q8.q, q8.scale)
    flush = torch.ones(64 << 20)  # 256 MB
    g = torch.Generator().manual_seed(0)
    print("rows  bf16 copy (oneDNN)  8-bit AMX  ratio")
    for rows in (6, 8, 16, 28, 32, 64, 128, 345):
        x = torch.randn(rows, q8.q.shape[1], generator=g).to(torch.bfloat16)
        assert rows > 32 or torch.equal(kernels.q8_amx_matmul(x, packed, n), quant.packed_linear(x, dense))
        best = {"bf16": 1e9, "amx": 1e9}
        for rep in range(reps):
            for name in ("bf16", "amx")[:: 1 if rep % 2 else -1]:
                flush.sum()
                t0 = time.perf_counter()
                kernels.q8_amx_matmul(x, packed, n) if name == "amx" else quant.packed_linear(x, dense)
                best[name] = min(best[name], time.perf_counter() - t0)
        old, new = best["bf16"], best["amx"]
        print(f"{rows:4d}  {old * 1e3:15.2f} ms  {new * 1e3:6.2f} ms  {new / old:.2f}")


if __name__ == "__main__":
    main()
