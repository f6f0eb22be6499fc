"""q_matmul's 4-bit products, this tree's kernel against another checkout's, in one process, interleaved.

usage: python benchmarks/q_matmul_ab.py --base /path/to/other/checkout [--rows 1 8 28 64] [--reps 12]

Builds both trees' C++ kernels (each its own module name) and packs one set of random 4-bit weights of SmolLM2's
layer shapes (fused QKV 960 x 576, O 576 x 576, fused gate/up 3072 x 576, down 576 x 1536) with each tree's own
``quant.pack_for_q_matmul``; the speed does not depend on the values. For each row count, times one pass of fp32
rows through 30 layers' products with each kernel, the two alternating, best of --reps; prints ms and the ratio
(this tree / base). Both results are compared first (within 1e-3 of the largest output: the trees may round the
rows differently). For picking a kernel variant on a host whose speed drifts by tens of percent between runs.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import time

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # one layer's products, [out, in]


def load_tree(root: str, name: str):
    """(kernels module, quant module) of the checkout at ``root``."""
    sources = sorted(glob.glob(os.path.join(root, "justapi", "kernels", "*.cpp")))
    kernels = cpp_extension.load(name=name, sources=sources, extra_ldflags=["-fopenmp"], verbose=False,
                                 extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])
    spec = importlib.util.spec_from_file_location(f"{name}_quant", os.path.join(root, "justapi", "model", "quant.py"))
    quant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quant)
    return kernels, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout's root (e.g. a git worktree)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 28, 64])
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    trees = {"this": load_tree(HERE, "q_matmul_ab_this"), "base": load_tree(os.path.abspath(args.base), "q_matmul_ab_base")}
    g = torch.Generator().manual_seed(0)
    weights = []  # per shape: {tree: (bytes, scale, offset)}, out
    for out, cols in SHAPES:
        q = torch.randint(0, 16, (out, cols), dtype=torch.uint8, generator=g)
        scale = torch.rand(out, cols // 32, generator=g) * 0.01 + 1e-3
        offset = torch.randn(out, cols // 32, generator=g) * 0.01
        weights.append(({t: quant.pack_for_q_matmul(q, scale, offset) for t, (_, quant) in trees.items()}, out))

    def run(tree: str, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        kernels = trees[tree][0]
        return [kernels.q_matmul(xs[packed[tree][1].shape[1] * 32], *packed[tree], 4, out) for packed, out in weights]

    print(f"{'rows':>5} {'this ms':>9} {'base ms':>9} {'this/base':>10}")
    for rows in args.rows:
        xs = {cols: torch.randn(rows, cols, generator=g) for cols in (576, 1536)}
        for a, b in zip(run("this", xs), run("base", xs)):
            assert (a - b).abs().max() <= 1e-3 * b.abs().max(), "the trees' products differ"
        best = {"this": float("inf"), "base": float("inf")}
        for _ in range(args.reps):
            for tree in best:
                t = time.perf_counter()
                for _ in range(30):
                    run(tree, xs)
                best[tree] = min(best[tree], time.perf_counter() - t)
        print(f"{rows:>5} {best['this'] * 1e3:>9.1f} {best['base'] * 1e3:>9.1f} {best['this'] / best['base']:>10.2f}",
              flush=True)


if __name__ == "__main__":
    main()
