"""Which kernel multiplies each kind of weight at each batch size: decided once at load, logged, never at call time.

In the spirit of ggml's per-type traits: a frozen ``KernelPolicy`` built from the CPU's capabilities (probed once)
and the flags (``--dtype``, ``--no-cpu-kernels``, ``--disable-kernels``) holds, per weight type, a short table of
routes, ``(max_rows, kernel)`` with the first route whose ``max_rows`` covers a batch serving it::

    4-bit linear, bf16 model on AMX:              rows 1-5 torch_int4 | 6+ amx
    4-bit linear, bf16 model, AVX-512 BF16 (Zen 4): rows 1-2 q4_small   | 3+ dpbf16
    4-bit linear, fp32 model on AVX2:             rows 1+ q_matmul (also Q8_0's 8-bit linears and heads)
    8-bit linear, bf16 model on AMX:              rows 1-2 q8_small   | 3+ amx
    8-bit linear, bf16 model, AVX-512 BF16:       rows 1-4 q8_small   | 5+ dpbf16
    8-bit head,   bf16 model on AMX:              rows 1-2 q8_small   | 3-64 amx | 65+ dense (bf16, prepacked;
                                                  none over 128 MiB)
    8-bit head,   bf16 model, AVX-512 BF16:       rows 1-4 q8_small   | 5+ dpbf16

A weight (model.quant) builds only the forms its routes read. docs/quantization.md has the whole table and what
each form costs in memory; the row limits below were measured there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import OPTIONAL_KERNELS

GROUP_SIZE = 32  # weights per GGUF Q4/Q8 block, and every kernel's group size
ALL_ROWS = 1 << 62

# torch's int4 (and int8) kernel dequantizes the weight again for every row of x, so its cost grows with the rows:
# 2.5x faster than a bf16 matmul at 1 row and still at 4-8, 3.5x slower at 32 (SmolLM2's shapes)
TORCH_SMALL_MAX_ROWS = 5
# q_matmul (fp32 rows on AVX2) against the fp32 copy on oneDNN, all 30 layers of SmolLM2 on a Zen 3: 0.16x the
# time at 1 row, 0.43x at 8, 0.64x at 28, 0.87x at 64, 0.94x at 128, 1.16x at 512. It takes every batch: the copy
# would win only on prefill chunks of several hundred rows, and it holds 8x a 4-bit weight's bytes (a 7B model's
# fp32 copies: 28 GiB, more than such a machine has; Gemma 3 270M: 2.76x its file instead of 1.13x)
# the 8-bit head on AMX (one pass over each block of outputs): 0.49-0.80x oneDNN's time at 6-64 rows, 1.5-1.9x at
# 128-345 (SmolLM2's 49152 x 576 head)
Q8_AMX_MAX_ROWS = 64
# an LM head's dense copy and torch's int8 rows serve batches its Q8_0 form serves too, a little faster (the head's
# rows are a step's sampled positions, rarely over 64); above this size (Gemma 3's 262,144 x 640: 320 MiB in bf16,
# against 168 MiB of Q8_0) the copies would be most of the model's memory, so the head keeps its Q8_0 form only
HEAD_DENSE_MAX_BYTES = 128 << 20
# q8_small (1-2 rows on AVX-512 FMAs, the AMX units' integers widened once for all rows) against the AMX tiles, on
# a Xeon: 0.85x the time at 1 row for Gemma 3's 262k-row head, 0.56-0.64x for its layers and SmolLM2's head (which
# it also serves faster than torch's int8 kernel: 0.83 against 1.33 ms); 0.97-1.0x at 2 rows, 1.0-1.2x at 3-4
Q8_SMALL_MAX_ROWS = 2
# ... and against dpbf16 (the units on AVX-512 BF16 vectors, no AMX) on a Zen 4: 0.4-0.6x the time of dpbf16 and of
# the dense bf16 copy on oneDNN at 1-4 rows for SmolLM2's head
Q8_SMALL_MAX_ROWS_NO_AMX = 4
# q4_small (the same FMAs on the 4-bit units) beside dpbf16, where it replaces torch's int4 kernel and its copy of
# the weight: SmolLM2's 4-bit layers on a Zen 4, 1 / 2 / 3 rows: 2.9-3.0 / 3.9-4.0 / 5.7 ms a pass, torch's int4
# kernel 3.5 / 4.3 / 5.0 (11 at 5 rows), dpbf16 4.8 / 4.9 / 5.0 (docs/benchmarks.md)
Q4_SMALL_MAX_ROWS = 2
PREPACK_ROWS_HINT = 32  # the batch size oneDNN picks a prepacked layout for; any number of rows works with it


@dataclass(frozen=True)
class Route:
    """Batches of up to ``max_rows`` rows (not served by an earlier route) go to ``kernel``."""

    max_rows: int
    kernel: str  # "torch_int4", "torch_int8", "q_matmul", "amx", "dpbf16", "q8_small", "q4_small" or "dense"


def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN has a bf16 matmul kernel for this CPU (AVX-512 or AMX). Without one (AVX2 only: AMD Zen 2/3)
    a bf16 product is emulated and takes 5-8x the fp32 time (96.6 against 14.0 ms for a 512-row chunk through
    SmolLM2's gate/up on a Zen 3), so --dtype auto computes in fp32 there."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU and the compiled kernels can run; probed once per process (``probe_cpu``)."""

    bf16_matmul: bool  # oneDNN's bf16 matmul (AVX-512 BF16 or AMX)
    amx: bool  # the C++ kernels' AMX tiles (built with AMX, permitted by the OS)
    avx512_units: bool  # the C++ kernels' AVX-512 BF16 products of the packed units (dpbf16, q8_small, q4_small)
    q_matmul: bool  # the C++ kernels' AVX2 integer matmul
    silu_bf16: bool  # the C++ silu_mul on bf16 rows (AVX-512)
    silu_fp32: bool  # ... on fp32 rows (AVX2 or AVX-512)
    prefill_attention: bool  # the C++ prefill attention over a bf16 cache with bf16 products (AVX-512 BF16)
    prefill_attention_fp32: bool  # ... in fp32 (the AVX2 build)
    onednn: bool  # torch's oneDNN (prepacked weights)

    def names(self) -> str:
        flags = {"bf16-matmul": self.bf16_matmul, "amx": self.amx, "avx512-bf16 units": self.avx512_units,
                 "avx2-q_matmul": self.q_matmul}
        return " ".join(k for k, v in flags.items() if v) or "none of bf16-matmul, amx, avx2"


@functools.cache
def _probe(kernels) -> CpuFeatures:
    has = lambda name, *args: kernels is not None and getattr(kernels, name)(*args)  # noqa: E731
    return CpuFeatures(cpu_has_bf16_matmul(), has("int4_amx_available"), has("units_avx512_available"),
                       has("q_matmul_available"),
                       has("silu_mul_available", True), has("silu_mul_available", False),
                       has("prefill_attention_available") and not has("prefill_attention_fp32"),
                       has("prefill_attention_fp32"),
                       torch.backends.mkldnn.is_available())


def probe_cpu(kernels) -> CpuFeatures:
    """This CPU's features as the engine uses them (``kernels``: the compiled module or None)."""
    return _probe(kernels)


def compute_dtype(dtype_flag: str, all_f32: bool, gpu: bool, cpu: CpuFeatures) -> tuple[torch.dtype, bool]:
    """The model's compute dtype for ``--dtype`` and whether Q4 weights stay 4-bit (see config.DTYPES)."""
    if dtype_flag != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_flag], False
    if all_f32:
        return torch.float32, False
    if gpu:
        return torch.bfloat16, False
    return (torch.bfloat16 if cpu.bf16_matmul else torch.float32), True


def resolve_dtype(dtype_flag: str, reader, gpu: bool, kernels) -> tuple[torch.dtype, bool]:
    """``compute_dtype`` for a GGUF file (its ``reader``): a file whose matrices are all F32 runs in float32."""
    import gguf

    matrices = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    all_f32 = all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in matrices)
    return compute_dtype(dtype_flag, all_f32, gpu, probe_cpu(kernels))


def kv_cache_dtype(kv_flag: str, dtype: torch.dtype, keep_packed: bool) -> torch.dtype:
    """The KV cache's dtype for ``--kv-cache-dtype`` (see config.KV_CACHE_DTYPES)."""
    if kv_flag == "auto":
        return torch.bfloat16 if dtype == torch.bfloat16 or keep_packed else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[kv_flag]


INT8_GROUP = 32  # an int8 cache row: head_dim values, each 32 with a scale of their own; then the scales (fp32)


def kv_row_width(head_dim: int, int8: bool) -> int:
    """Elements of one token's row of one head in the KV cache: an int8 row carries its groups' scales
    (model.attention.quantize_rows)."""
    return head_dim + head_dim // INT8_GROUP * 4 if int8 else head_dim


def int8_head_dim(row_width: int) -> int:
    """The values in an int8 cache row of ``row_width`` bytes (``kv_row_width``'s inverse)."""
    return row_width * INT8_GROUP // (INT8_GROUP + 4)


@dataclass(frozen=True)
class KernelPolicy:
    """The kernel routes of one model, decided at load (see the module docstring)."""

    dtype: torch.dtype  # the model's compute dtype
    kernels: object | None  # the compiled C++ module (justapi.kernels), or None: the pure-torch path
    cpu: CpuFeatures
    enabled: frozenset[str]  # the optional kernels in use (config.OPTIONAL_KERNELS that this CPU runs)

    @classmethod
    def make(cls, dtype: torch.dtype, kernels, disabled: tuple[str, ...] = ()) -> KernelPolicy:
        """The policy for a model computing in ``dtype``, less the ``disabled`` kernels (--disable-kernels)."""
        cpu = probe_cpu(kernels)
        bf16 = dtype == torch.bfloat16
        # the units on AVX-512 BF16 vectors: where there are no AMX tiles (or they are disabled)
        vectors = cpu.avx512_units and bf16 and not (cpu.amx and "amx" not in disabled)
        runs = {"q_matmul": cpu.q_matmul and dtype == torch.float32, "amx": cpu.amx and bf16,
                "dpbf16": vectors,
                "q8_small": cpu.avx512_units and bf16,
                # beside dpbf16 on a CPU without AMX tiles only: on a Xeon with AMX, with the tiles disabled, it took
                # 1.35x torch's int4 kernel's time at 1 row (7.44 against 5.51 ms a pass, docs/benchmarks.md)
                "q4_small": vectors and not cpu.amx,
                "prepack": cpu.onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu.bf16_matmul)),
                "fused_silu": cpu.silu_bf16 if dtype == torch.bfloat16 else cpu.silu_fp32 and dtype == torch.float32,
                # prompt chunks' attention over a bf16 cache: with bf16 products where the model computes in bf16,
                # in fp32 (the AVX2 build) where it computes in fp32; else torch's flash kernel, which widens the
                # cache for an fp32 model (model.attention). Not where there are AMX tiles, which torch's flash
                # kernel uses for bf16 (brgemm) and which this kernel was not measured against (docs/benchmarks.md)
                "prefill_attention": (cpu.prefill_attention and bf16 and not cpu.amx
                                      or cpu.prefill_attention_fp32 and dtype == torch.float32),
                # Gated DeltaNet's convolution and delta rule over a batch's decode rows and prompt chunks, in place
                # on their state slots (fp32 states whatever the model's dtype); --batch-invariant keeps the torch
                # path, whose draft verification steps round as its decode does (model.recurrent)
                "delta_rule": kernels is not None and hasattr(kernels, "gated_delta_runs"),
                # a decode step's layers in one native call where the model's parts allow it (model.decode_plan)
                "decode_step": kernels is not None and hasattr(kernels, "DecodeLayers")}
        assert set(runs) == set(OPTIONAL_KERNELS)
        return cls(dtype, kernels, cpu, frozenset(k for k, ok in runs.items() if ok and k not in disabled))

    def uses(self, kernel: str) -> bool:
        return kernel in self.enabled

    @property
    def layer_ops(self) -> bool:
        """The fused C++ layer ops (add_rms_norm, rope_write_kv) on this model's rows."""
        return self.kernels is not None and self.dtype in (torch.float32, torch.bfloat16)

    def q4_routes(self, shape: tuple[int, int]) -> tuple[Route, ...]:
        """Routes of a 4-bit [out, in] linear."""
        if self.uses("q_matmul") and shape[1] % GROUP_SIZE == 0:
            return (Route(ALL_ROWS, "q_matmul"),)
        units = self._units_kernel(shape)
        if units == "dpbf16" and self.uses("q4_small"):  # one form, the units, for every batch
            return (Route(Q4_SMALL_MAX_ROWS, "q4_small"), Route(ALL_ROWS, units))
        if shape[0] % 16:  # torch's int4 packing takes whole tiles of 16 output rows (a hybrid's fused inputs may not)
            return (Route(ALL_ROWS, units or "dense"),)
        return (Route(TORCH_SMALL_MAX_ROWS, "torch_int4"), Route(ALL_ROWS, units or "dense"))

    def q8_routes(self, shape: tuple[int, int], plain: bool = True) -> tuple[Route, ...]:
        """Routes of an 8-bit [out, in] linear (``plain``: Q8_0's form, groups of 32 and no zero, the only one
        q_matmul reads; the units of amx and dpbf16 also take zeros and groups of 16)."""
        if plain and self.uses("q_matmul") and shape[1] % GROUP_SIZE == 0:
            return (Route(ALL_ROWS, "q_matmul"),)
        if self._units_kernel(shape):
            return (*self._q8_small(), Route(ALL_ROWS, self._units_kernel(shape)))
        return (Route(ALL_ROWS, "dense"),)

    def _units_kernel(self, shape: tuple[int, int]) -> str | None:
        """The kernel that multiplies bf16 rows by packed units (int4_matmul.cpp, units_avx512.cpp), if any here."""
        if shape[1] % GROUP_SIZE:  # the units take groups of 32 inputs (their outputs are padded to units of 16)
            return None
        return "amx" if self.uses("amx") else "dpbf16" if self.uses("dpbf16") else None

    def _q8_small(self) -> tuple[Route, ...]:
        """The route of a few rows times 8-bit units (1-2 beside AMX, 1-4 beside dpbf16), where it runs."""
        rows = Q8_SMALL_MAX_ROWS if self.uses("amx") else Q8_SMALL_MAX_ROWS_NO_AMX
        return (Route(rows, "q8_small"),) if self.uses("q8_small") else ()

    def head_routes(self, shape: tuple[int, int], has_q8: bool, plain: bool = True) -> tuple[Route, ...]:
        """Routes of a packed model's LM head (``has_q8``: the file stores it in an 8-bit type; ``plain``: as Q8_0,
        the one form q_matmul reads, see q8_routes)."""
        q_matmul = has_q8 and plain and self.uses("q_matmul") and shape[1] % GROUP_SIZE == 0
        units = self._units_kernel(shape) if has_q8 else None
        too_large = shape[0] * shape[1] * self.dtype.itemsize > HEAD_DENSE_MAX_BYTES
        if q_matmul:
            return (Route(ALL_ROWS, "q_matmul"),)
        if units:  # torch's int8 kernel is slower than the units' routes here, at any number of rows
            dense_pays = units == "amx" and not too_large  # dpbf16: within 10% of the dense copy at any size
            return (*self._q8_small(), Route(Q8_AMX_MAX_ROWS if dense_pays else ALL_ROWS, units)) + (
                (Route(ALL_ROWS, "dense"),) if dense_pays else ())
        return (Route(TORCH_SMALL_MAX_ROWS, "torch_int8"), Route(ALL_ROWS, "dense"))

    def describe(self) -> list[str]:
        """A few lines for the start-up log: the CPU, the dtype and each weight type's routes."""
        shape = (16 * GROUP_SIZE, 16 * GROUP_SIZE)  # a shape every kernel takes
        dense = f"dense {str(self.dtype).removeprefix('torch.')}" + (" (oneDNN prepacked)" if self.uses("prepack")
                                                                     else "")
        return [
            f"kernels: CPU {self.cpu.names()}; compute {str(self.dtype).removeprefix('torch.')}; C++ kernels "
            + ("off" if self.kernels is None else "on" + (", fused silu" if self.uses("fused_silu") else "")
               + (", prefill attention" if self.uses("prefill_attention") else "")),
            "  4-bit linears: " + describe_routes(self.q4_routes(shape)).replace("dense", dense),
            "  8-bit linears: " + describe_routes(self.q8_routes(shape)).replace("dense", dense),
            "  8-bit LM head: " + describe_routes(self.head_routes(shape, True)).replace("dense", dense),
        ]


def describe_routes(routes: tuple[Route, ...]) -> str:
    """``rows 1-5 torch_int4, 6+ amx``."""
    parts, low = [], 1
    for r in routes:
        if r.max_rows < low:
            continue  # takes no batch (a limit of 0 rows: benchmarks/kernels_bench.py --torch-small-rows 0)
        parts.append(f"{low}+ {r.kernel}" if r.max_rows >= ALL_ROWS else f"{low}-{r.max_rows} {r.kernel}")
        low = r.max_rows + 1
    return "rows " + ", ".join(parts)
