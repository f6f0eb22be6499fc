"""The C++ decode-attention kernel alone, on a W1-sized batch: 32 sequences of 64-767 tokens (seeded), SmolLM2's
heads (9 query / 3 KV, head size 64), blocks of 16 scattered through the pool, and one cache per layer for 30
layers, so each call reads its K/V from memory as in a real step (not from a cache warmed by the previous call).

usage: python benchmarks/decode_attention_bench.py [--base REV | --huge-pages] [--reps 7]

Prints the best time per call (one layer) and the K/V bytes read per second, for fp32 and bf16 caches. With
``--base REV``, the kernel source at that git revision is built too (with the flags that revision used, read from
its justapi/kernels/__init__.py) and timed interleaved with the working tree's, on the same inputs. With
``--huge-pages``, the working tree's kernel over caches on transparent huge pages (model.hugepages, as the engine
allocates them) against the same caches on ordinary pages, interleaved.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import tempfile
import time

import torch
from torch.utils import cpp_extension

from justapi.kernels import decode_kernels
from justapi.model import hugepages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_at(rev: str):
    """The decode_attention module as built at ``rev`` (its sources and its compiler flags)."""
    show = lambda path: subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,  # noqa: E731
                                       capture_output=True, text=True).stdout
    init = show("justapi/kernels/__init__.py")
    flags = {}
    for node in ast.walk(ast.parse(init)):
        if isinstance(node, ast.keyword) and node.arg in ("extra_cflags", "extra_ldflags"):
            flags[node.arg] = ast.literal_eval(node.value)
    tmp = tempfile.mkdtemp(prefix="justapi-kernel-base-")
    files = subprocess.run(["git", "ls-tree", "--name-only", rev, "justapi/kernels/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    sources = []
    for path in files:  # every source the revision's build names, and every header they may include
        name = os.path.basename(path)
        if name.endswith(".h") or (name.endswith(".cpp") and name in init):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(show(path))
            if name.endswith(".cpp"):
                sources.append(os.path.join(tmp, name))
    return cpp_extension.load(name="justapi_paged_attention_base", sources=sources, build_directory=tmp,
                              verbose=False, **flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="a git revision whose kernel is timed alongside")
    ap.add_argument("--huge-pages", action="store_true", help="caches on huge pages against ordinary ones")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    kernels = [("working tree", decode_kernels())]
    if args.base:
        kernels.insert(0, (args.base, build_at(args.base)))
    if args.huge_pages:
        if not hugepages.available():
            raise SystemExit("transparent huge pages are off on this machine")
        kernels = [("4 KiB pages", kernels[0][1]), ("huge pages", kernels[0][1])]
    g = torch.Generator().manual_seed(0)
    seqs, heads, kv_heads, dim, bs, layers = 32, 9, 3, 64, 16, 30
    ctx = torch.randint(64, 768, (seqs,), generator=g)
    nblocks = (ctx + bs - 1) // bs
    pool = int(nblocks.sum()) + 8
    perm = torch.randperm(pool, generator=g)
    tables = torch.zeros(seqs, int(nblocks.max()), dtype=torch.long)
    used = 0
    for i in range(seqs):
        tables[i, : nblocks[i]] = perm[used : used + nblocks[i]]
        used += int(nblocks[i])
    q = torch.randn(seqs, heads, dim, generator=g)
    k = torch.randn(kv_heads, pool, bs, dim, generator=g)
    v = torch.randn(kv_heads, pool, bs, dim, generator=g)
    print(f"{seqs} sequences, {int(ctx.sum())} context tokens, {layers} layers' caches, {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        caches = [(k.to(dtype, copy=True), v.to(dtype, copy=True)) for _ in range(layers)]  # 30 distinct caches
        placed = {name: caches for name, _ in kernels}
        if args.huge_pages:
            flat = hugepages.zeros([k.shape] * (2 * layers), dtype)
            for dst, src in zip(flat, [t for pair in caches for t in pair]):
                dst.copy_(src)
            placed["huge pages"] = list(zip(flat[0::2], flat[1::2]))
        ref = None
        best = {name: float("inf") for name, _ in kernels}
        usable = []
        for name, mod in kernels:
            try:
                out = mod.decode_attention(q, *placed[name][0], tables, ctx, dim ** -0.5)
            except RuntimeError as e:  # an older kernel without bf16
                print(f"  {name}, {dtype}: {str(e).splitlines()[0]}")
                continue
            ref = out if ref is None else ref
            assert (out - ref).abs().max().item() < 1e-4, "the kernels disagree"
            usable.append((name, mod))
        for rep in range(args.reps):
            for name, mod in usable[:: 1 if rep % 2 else -1]:  # the order alternates
                t = time.perf_counter()
                for i in range(2 * layers):
                    mod.decode_attention(q, *placed[name][i % layers], tables, ctx, dim ** -0.5)
                best[name] = min(best[name], (time.perf_counter() - t) / (2 * layers))
        nbytes = 2 * kv_heads * int(ctx.sum()) * dim * dtype.itemsize
        for name, _ in usable:
            print(f"  {name:>14}, {str(dtype):>14}: {best[name] * 1e3:6.3f} ms a layer, {nbytes / best[name] / 1e9:5.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
