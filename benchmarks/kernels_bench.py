"""The engine's C++ kernels in process, one kernel family per mode.

usage: python benchmarks/kernels_bench.py [weights] [--model GGUF] [--rows 1 5 8 28 64 128 512] [--reps 7] [--fp32]
                                         [--disable K ... | --base REV] [--torch-small-rows N ...]
       python benchmarks/kernels_bench.py attention [--base REV | --huge-pages] [--block-order random] [--reps 7]
       python benchmarks/kernels_bench.py prefill [--base REV] [--reps 7]
       python benchmarks/kernels_bench.py peak
       python benchmarks/kernels_bench.py sampling [--reps 7]

``weights`` (the default): the weight kernels on SmolLM2's own weights (or ``--model``'s), route by route: what each
kernel of the policy costs at each batch size, and what the weights of each route table hold. Loads the model with
--dtype auto (``--fp32``: as on a CPU without a bf16 matmul, which computes in fp32; simulated through the policy's
CPU probe where this CPU has one) once with the default policy and once more for each kernel named with
``--disable`` (default: every optional kernel this CPU uses), then times, per row count, one pass of random rows
through all the layers' projections (4- or 8-bit) and through the LM head, each model's passes interleaved, best of
``--reps``. Prints the start-up log's route tables, the weights' MiB, ms per pass and the ratio to the default, and
the default's layers' rate (2 x weights x rows per pass, GFLOP/s: compare with ``peak``). ``--base REV``: instead of
kernels off, the kernels as built at that git revision, swapped into the same weights and timed interleaved with
the working tree's (a change inside a weight kernel, before and after). ``--torch-small-rows N``: also the
default policy with torch's int4 (and int8) kernels taking batches of up to N rows instead of 5, where they take any
(beside AMX tiles): where the tiles should start.

``attention``: the decode-attention kernel alone, on a W1-sized batch: 32 sequences of 64-767 tokens (seeded),
SmolLM2's heads (9 query / 3 KV, head size 64), blocks of 16 scattered through the pool (``--block-order in-order``:
each sequence's one after another; a real run lies between: the probe benchmarks/block_order.py at 440cc2b), and one
cache per layer for 30 layers, so each call reads its K/V from memory as in a real step. Prints the best time per
call (one layer) and the K/V bytes read per second, for fp32 and bf16 caches. ``--base REV`` builds the kernel
source at that git revision too (with the flags that revision used) and times it interleaved with the working
tree's, on the same inputs; ``--huge-pages`` times caches on transparent huge pages against ordinary pages,
interleaved.

``prefill``: a prompt chunk's attention over its bf16 cache, the C++ kernel (kernels/prefill_attention.cpp, AVX-512
BF16 or, in fp32, AVX2) against the path it replaces (torch's fused kernel over the gathered, padded K/V, in bf16 or
over K/V widened to fp32, its mask built once as in a step), interleaved, best of ``--reps``, on SmolLM2's heads
(9 / 3, size 64) and Gemma 3 270M's (4 / 1, size 256):
fresh chunks of 64-512 tokens, chunks after a cached prefix, and a sliding window of 512. Prints ms a layer, the
ratio, and each one's rate over the arithmetic of the keys a query sees (4 x heads x head size per query-key pair).
``--base REV`` times that revision's kernel too, interleaved, and prints the working tree's time against it.

``peak``: the rate this CPU's cores reach on products with nothing to load: 16 independent accumulators per thread
updated in registers with fp32 FMAs and, where there is AVX-512 BF16, with ``vdpbf16ps`` (what the ``dpbf16`` route
multiplies with), and where there is AVX-512 VNNI with ``vpdpbusd`` (8-bit integers, what an integer-activation
route would multiply with; integer operations counted as FLOP), on 1 thread and on all of torch's, best of 5 runs
of ~0.1 s. The ceiling the products of ``weights`` are measured against.

Replaces int4_amx_bench.py, q_matmul_bench.py and decode_attention_bench.py (docs/benchmarks-archive.md).

``sampling``: one sampled row's token drawn by the sampler (model/sampler.py ``sample``) through torch's ops and
through the C++ ``sample_rows``, ms per row (median of 30 calls, best of ``--reps``), on random logits (N(0, 3))
of SmolLM2's and Gemma 3's vocabulary sizes, under temperature 0.8 alone and with top-k 40, top-p 0.95 and both.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import os
import subprocess
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def load(disabled: tuple[str, ...], path: str | None):
    from justapi import LLM
    from justapi.model.gguf_loader import default_model_path

    return LLM(path or default_model_path(), pool_blocks=16, disabled_kernels=disabled,
               show_progress=False).engine.model


def use_kernels(model, kernels) -> None:
    """Every C++ call of ``model`` (layer ops, attention, each packed weight's matmul, the head's) through the module
    ``kernels``: another revision's build (``build_at``) swapped in, or the model's own put back."""
    model.kernels = kernels
    for w in [w for layer in model.layers for w in layer.linears()] + [model.lm_head]:
        if getattr(w, "kernels", None) is not None:
            w.kernels = kernels


def one_pass(model, xs: dict[int, torch.Tensor], kernels) -> tuple[float, float]:
    """Seconds for all the layers' projections, and for the head, at the rows of ``xs`` (by input width), through the
    C++ ``kernels`` module given."""
    use_kernels(model, kernels)
    linears = [w for layer in model.layers for w in layer.linears()]
    t = time.perf_counter()
    for w in linears:
        w.matmul(xs[w.shape[1]])
    t1 = time.perf_counter()
    model.lm_head.matmul(xs[model.lm_head.shape[1]])
    return t1 - t, time.perf_counter() - t1


def weights(args) -> None:
    from justapi.model import kernel_policy

    if args.fp32:
        probe = kernel_policy.probe_cpu
        kernel_policy.probe_cpu = lambda kernels: dataclasses.replace(probe(kernels), bf16_matmul=False)
    models = {"default": load((), args.model)}
    policy = models["default"].policy
    kernels = {"default": policy.kernels}  # the C++ module each side's weights run
    if args.base:
        models[args.base], kernels[args.base] = models["default"], build_at(args.base)
    off = args.disable if args.disable is not None else sorted(policy.enabled - {"fused_silu"})
    for kernel in [] if args.base else off:
        models[f"{kernel} off"] = load((kernel,), args.model)
        kernels[f"{kernel} off"] = models[f"{kernel} off"].policy.kernels
    routes = {}  # the route tables as loaded (describe() reads the limits when called)
    for limit in args.torch_small_rows:  # torch's int4/int8 kernels up to this many rows, the units' route above
        default_limit, kernel_policy.TORCH_SMALL_MAX_ROWS = kernel_policy.TORCH_SMALL_MAX_ROWS, limit
        try:
            models[f"torch<={limit}"] = load((), args.model)
            routes[f"torch<={limit}"] = models[f"torch<={limit}"].policy.describe()
        finally:
            kernel_policy.TORCH_SMALL_MAX_ROWS = default_limit
        kernels[f"torch<={limit}"] = policy.kernels
    for name, model in models.items():
        if name == args.base:
            continue  # the default's weights and routes
        lines = routes.get(name) or model.policy.describe()
        print(f"{name}: weights {model.weight_bytes() / 2**20:.1f} MiB; {lines[0]}")
        print("\n".join(lines[1:]))
    width = max(len(n) for n in models) + 2
    layer_weights = sum(w.shape[0] * w.shape[1] for layer in models["default"].layers
                        for w in layer.linears())
    print(f"\n{'rows':>5}" + "".join(f"{n + ' layers':>{width + 7}}{'head':>8}" for n in models))
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        widths = {w.shape[1] for layer in models["default"].layers
                  for w in layer.linears()}
        xs = {k: torch.randn(rows, k, generator=g).to(policy.dtype) for k in widths}
        best = {n: [1e9, 1e9] for n in models}
        for rep in range(args.reps):
            for name in list(models)[:: 1 if rep % 2 else -1]:
                for i, t in enumerate(one_pass(models[name], xs, kernels[name])):
                    best[name][i] = min(best[name][i], t)
        base = best["default"]
        cells = [f"{b[0] * 1e3:>{width}.2f}ms{b[0] / base[0]:>5.2f}x{b[1] * 1e3:>6.2f}ms" for b in best.values()]
        print(f"{rows:>5}" + "".join(cells) + f"{2 * layer_weights * rows / base[0] / 1e9:>8.0f} GFLOP/s", flush=True)




def build_at(rev: str):
    """The C++ kernels module as built at ``rev`` (its sources and its compiler flags)."""
    show = lambda path: subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,  # noqa: E731
                                       capture_output=True, text=True).stdout
    init = show("justapi/kernels/__init__.py")
    flags = {}
    if "build_spec" in init:  # since the build moved to kernels/build_spec.py: its sources and flags
        spec: dict = {}
        exec(show("justapi/kernels/build_spec.py"), spec)
        init = " ".join(spec["SOURCES"])
        flags = {"extra_cflags": list(spec["CFLAGS"]), "extra_ldflags": list(spec["LDFLAGS"])}
    for node in ast.walk(ast.parse(show("justapi/kernels/__init__.py"))):
        if isinstance(node, ast.keyword) and node.arg in ("extra_cflags", "extra_ldflags") and not flags.get(node.arg):
            flags[node.arg] = ast.literal_eval(node.value)
    march = os.environ.get("JUSTAPI_KERNELS_MARCH")  # the working tree's kernels are built for it too (as_avx2.sh)
    if march:
        flags["extra_cflags"] = [f"-march={march}" if f == "-march=native" else f for f in flags["extra_cflags"]]
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
    from torch.utils import cpp_extension

    return cpp_extension.load(name="justapi_paged_attention_base", sources=sources, build_directory=tmp,
                              verbose=False, **flags)


def attention(args) -> None:
    from justapi.kernels import decode_kernels
    from justapi.model import hugepages

    kernels = [("working tree", decode_kernels())]
    if args.base:
        kernels.insert(0, (args.base, build_at(args.base)))
    if args.huge_pages:
        if not hugepages.available():
            raise SystemExit("transparent huge pages are off on this machine")
        kernels = [("4 KiB pages", kernels[0][1]), ("huge pages", kernels[0][1])]
    g = torch.Generator().manual_seed(0)
    seqs, heads, kv_heads, dim, bs, layers = 32, 9, 3, 64, args.block_size, 30
    ctx = torch.randint(64, 768, (seqs,), generator=g)
    nblocks = (ctx + bs - 1) // bs
    pool = int(nblocks.sum()) + 8
    # the blocks of all sequences in random order (a pool after much churn), or each sequence's in order, one
    # sequence after another (a fresh pool's prompts)
    perm = torch.randperm(pool, generator=g) if args.block_order == "random" else torch.arange(pool)
    tables = torch.zeros(seqs, int(nblocks.max()), dtype=torch.long)
    used = 0
    for i in range(seqs):
        tables[i, : nblocks[i]] = perm[used : used + nblocks[i]]
        used += int(nblocks[i])
    q = torch.randn(seqs, heads, dim, generator=g)
    k = torch.randn(kv_heads, pool, bs, dim, generator=g)
    v = torch.randn(kv_heads, pool, bs, dim, generator=g)
    print(f"{seqs} sequences, {int(ctx.sum())} context tokens in blocks of {bs} ({args.block_order}), "
          f"{layers} layers' caches, {torch.get_num_threads()} threads")
    from justapi.model.attention import quantize_rows

    for dtype in (torch.float32, torch.bfloat16, torch.int8):  # int8: rows with their groups' scales
        as_cache = (lambda x: quantize_rows(x)) if dtype == torch.int8 else (lambda x: x.to(dtype, copy=True))
        caches = [(as_cache(k), as_cache(v)) for _ in range(layers)]  # 30 distinct caches
        placed = {name: caches for name, _ in kernels}
        if args.huge_pages:
            flat = hugepages.zeros([caches[0][0].shape] * (2 * layers), dtype)
            for dst, src in zip(flat, [t for pair in caches for t in pair]):
                dst.copy_(src)
            placed["huge pages"] = list(zip(flat[0::2], flat[1::2]))
        ref = None
        best = {name: float("inf") for name, _ in kernels}
        usable = []
        for name, mod in kernels:
            try:
                out = mod.decode_attention(q, *placed[name][0], tables, ctx, dim ** -0.5)
            except RuntimeError as e:  # an older kernel without bf16 or int8
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
        nbytes = 2 * kv_heads * int(ctx.sum()) * caches[0][0].shape[-1] * dtype.itemsize
        for name, _ in usable:
            print(f"  {name:>14}, {str(dtype):>14}: {best[name] * 1e3:6.3f} ms a layer, "
                  f"{nbytes / best[name] / 1e9:5.1f} GB/s of K/V")




def prefill(args) -> None:
    from justapi.kernels import decode_kernels
    from justapi.model.attention import SeqSpan, _sequence_attention_fused

    kernels = decode_kernels()
    if kernels is None or not kernels.prefill_attention_available():
        raise SystemExit("the C++ kernels here have no prefill attention (it needs AVX-512 BF16 or AVX2)")
    # the path each build replaces: torch's kernel in bf16 (AVX-512 BF16), over the cache widened to fp32 (AVX2)
    compute = torch.float32 if kernels.prefill_attention_fp32() else torch.bfloat16
    builds = {"C++": kernels} if not args.base else {args.base: build_at(args.base), "C++": kernels}
    g = torch.Generator().manual_seed(0)
    bs, blocks = 16, 128
    print(f"{torch.get_num_threads()} threads; ms a layer, best of {args.reps}, interleaved")
    for name, heads, kv_heads, dim in (("SmolLM2", 9, 3, 64), ("Gemma 3 270M", 4, 1, 256)):
        k = torch.randn(kv_heads, blocks, bs, dim, generator=g).to(torch.bfloat16)
        v = torch.randn(kv_heads, blocks, bs, dim, generator=g).to(torch.bfloat16)
        for n, ctx, window in ((64, 64, 0), (200, 200, 0), (336, 336, 0), (512, 512, 0), (32, 432, 0), (200, 600, 0),
                               (300, 900, 512)):
            table = torch.randperm(blocks, generator=g)[: -(-ctx // bs)]
            q = torch.randn(n, heads, dim, generator=g)
            span = SeqSpan(0, n, ctx, table)  # keeps its mask across calls, as a step's layers share it
            runs = {"torch": lambda: _sequence_attention_fused(q, k, v, span, dim ** -0.5, compute, window or None)}
            for key, mod in builds.items():
                runs[key] = functools.partial(mod.prefill_attention, q, k, v, table, ctx, dim ** -0.5, window)
            best = {key: float("inf") for key in runs}
            for rep in range(args.reps):
                for key, fn in list(runs.items())[:: 1 if rep % 2 else -1]:
                    t = time.perf_counter()
                    for _ in range(5):
                        fn()
                    best[key] = min(best[key], (time.perf_counter() - t) / 5)
            pairs = sum(min(p + 1, window or p + 1) for p in range(ctx - n, ctx))  # query-key pairs seen
            rate = lambda sec: 4 * heads * dim * pairs / sec / 1e9  # noqa: E731
            print(f"  {name}, {n:3d} new of {ctx:3d}{f', window {window}' if window else ''}: torch "
                  f"{best['torch'] * 1e3:6.3f} ms ({rate(best['torch']):4.0f} GFLOP/s), "
                  f"C++ {best['C++'] * 1e3:6.3f} ms "
                  f"({rate(best['C++']):4.0f}), {best['C++'] / best['torch']:.2f}x"
                  + (f"; {args.base} {best[args.base] * 1e3:6.3f} ms, now {best['C++'] / best[args.base]:.2f}x"
                     if args.base else ""))


PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <chrono>

// seconds for `iters` updates of each of 16 accumulators per thread (kind 0: fp32 FMA, 1: vdpbf16ps, 2: vpdpbusd,
// the 8-bit integer products of AVX-512 VNNI: what an integer-activation route could reach), on `threads`
double peak(int64_t kind, int64_t iters, int64_t threads) {
  const auto t0 = std::chrono::steady_clock::now();
  float sink = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    __m512 a = _mm512_set1_ps(1e-3f), b = _mm512_set1_ps(1e-3f);
    for (int64_t it = 0; it < iters; ++it) {
#if defined(__AVX512BF16__)
      if (kind == 1) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
      } else
#endif
#if defined(__AVX512VNNI__)
      if (kind == 2) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          acc[i] = (__m512)_mm512_dpbusd_epi32((__m512i)acc[i], (__m512i)a, (__m512i)b);
      } else
#endif
      {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
      }
      __asm__ volatile("" : "+v"(a));  // no hoisting of the loop body
    }
    for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink == 1.2345f ? -s : s;  // keeps the sums live
}
bool has_dpbf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
bool has_vnni() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}
"""


def peak(args) -> None:
    from torch.utils import cpp_extension

    from justapi.kernels import build_spec

    if "avx512f" not in build_spec.cpu_flags():
        raise SystemExit("peak measures AVX-512 products; this CPU has no AVX-512")
    mod = cpp_extension.load_inline("justapi_peak", PEAK_SOURCE, functions=["peak", "has_dpbf16", "has_vnni"],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    kinds = ([("fp32 FMA", 0, 32)] + ([("vdpbf16ps", 1, 64)] if mod.has_dpbf16() else [])
             + ([("vpdpbusd", 2, 128)] if mod.has_vnni() else []))
    # flops: per 16-lane update (an FMA is 2 a lane; vdpbf16ps 2 pairs a lane; vpdpbusd 4 byte pairs, integer ops)
    for name, kind, flops in kinds:
        for threads in sorted({1, torch.get_num_threads()}):
            iters = 10_000_000
            best = min(mod.peak(kind, iters, threads) for _ in range(5))
            print(f"{name:>10}, {threads} thread(s): {16 * iters * flops * threads / best / 1e9:6.1f} GFLOP/s")


def sampling(args) -> None:
    import statistics

    from justapi import SamplingParams
    from justapi.kernels import decode_kernels
    from justapi.model.sampler import SampleRow, sample

    kernels = decode_kernels()
    settings = {"t 0.8": {}, "+ top-k 40": dict(top_k=40), "+ top-p 0.95": dict(top_p=0.95),
                "+ top-k 40, top-p 0.95": dict(top_k=40, top_p=0.95)}
    print(f"{'vocabulary':>10} {'settings':24} {'torch ms':>9} {'C++ ms':>8}")
    for vocab in (49152, 262144):
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
        for name, extra in settings.items():
            rows = [SampleRow(SamplingParams(temperature=0.8, **extra), 1, [1, 2, 3])]

            def ms(k) -> float:
                def once() -> float:
                    t = time.perf_counter()
                    sample(logits, rows, k)
                    return time.perf_counter() - t
                return min(statistics.median(once() for _ in range(30)) for _ in range(args.reps)) * 1e3

            print(f"{vocab:10} {name:24} {ms(None):9.3f} {ms(kernels):8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["weights", "attention", "prefill", "peak", "sampling"],
                    default="weights")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 28, 64, 128, 512], help="weights: row counts")
    ap.add_argument("--model", default=None, help="weights: a GGUF file (default: SmolLM2)")
    ap.add_argument("--fp32", action="store_true", help="weights: the fp32 route of a CPU without a bf16 matmul")
    ap.add_argument("--disable", nargs="*", default=None,
                    help="weights: kernels to time off (default: each one in use)")
    ap.add_argument("--torch-small-rows", type=int, nargs="*", default=[],
                    help="weights: also time the routes with torch's int4/int8 kernels taking up to N rows (where they "
                         "take 1-5, as beside AMX tiles; 0: the units' route from 1 row)")
    ap.add_argument("--base", default=None, help="attention, weights: a git revision whose kernels are timed alongside")
    ap.add_argument("--block-size", type=int, default=16,
                    help="attention: tokens per KV block (the engine's --block-size)")
    ap.add_argument("--block-order", choices=["random", "in-order"], default="random",
                    help="attention: the blocks in random order or each sequence's contiguous")
    ap.add_argument("--huge-pages", action="store_true", help="attention: caches on huge pages against ordinary ones")
    args = ap.parse_args()
    modes = {"weights": weights, "attention": attention, "prefill": prefill, "peak": peak, "sampling": sampling}
    modes[args.mode](args)


if __name__ == "__main__":
    main()
