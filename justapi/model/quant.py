"""GGUF 4-bit weights kept quantized in memory and multiplied with torch's CPU int4 kernel or the engine's own.

A Q4_0 or Q4_1 block holds 32 weights of one row as 4-bit integers ``q`` in [0, 15] with an fp16 scale ``d``
(and for Q4_1 an fp16 minimum ``m``)::

    Q4_0:  w = d · (q − 8)          Q4_1:  w = d · q + m
    bytes: d(2) qs(16)              bytes: d(2) m(2) qs(16)     qs[j] = q[j] | q[j + 16] << 4

torch's group-wise int4 matmul (``_weight_int4pack_mm_for_cpu``, group size 32) dequantizes as
``w = (q − 8) · scale + zero``, so a Q4 block maps onto one group: ``scale = d`` and ``zero = 0`` (Q4_0) or
``zero = m + 8·d`` (Q4_1). The integers are copied exactly; scale and zero are held in bfloat16, the kernel's
dtype, and the activations are cast to bfloat16 for the product (the kernel has no fp32-activation fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32  # weights per GGUF Q4 block, and the kernel's group size


@dataclass
class Q4Unpacked:
    """A 4-bit weight as integers and per-group scale/zero, before packing; rows can be concatenated."""

    q: torch.Tensor  # [out, in] uint8 in [0, 15]
    scale: torch.Tensor  # [out, in / 32] fp32
    zero: torch.Tensor  # [out, in / 32] fp32
    # the file's own fp32 dequantization (gguf's, as --dtype float32 loads it), where the loader was asked for it:
    # the dense copy of a model computing in fp32
    exact: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the kernel computes with (scale and zero rounded to bfloat16 as the kernel holds them)."""
        s = self.scale.to(torch.bfloat16).float().repeat_interleave(GROUP_SIZE, dim=1)
        z = self.zero.to(torch.bfloat16).float().repeat_interleave(GROUP_SIZE, dim=1)
        return (self.q.float() - 8) * s + z


def unpack_q4(raw: np.ndarray, is_q4_1: bool, shape: tuple[int, int]) -> Q4Unpacked:
    """Split raw Q4_0/Q4_1 bytes of an [out, in] weight into integers, scales and zeros, exactly."""
    rows, cols = shape
    block_bytes = 20 if is_q4_1 else 18
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // GROUP_SIZE, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE)
    if is_q4_1:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE)
        zero = m + 8 * d
        qs = blocks[:, 4:]
    else:
        zero = np.zeros_like(d)
        qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)
    return Q4Unpacked(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


@dataclass
class Q8Unpacked:
    """A GGUF Q8_0 weight as integers and per-group scales: ``w = q · d``, 32 weights a group, d in fp16."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / 32] fp32 (fp16 values)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight (each product exact), as gguf's dequantize gives it."""
        return self.q.float() * self.scale.repeat_interleave(GROUP_SIZE, dim=1)


def unpack_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Split raw Q8_0 bytes of an [out, in] weight (blocks of d(2) qs(32)) into integers and scales, exactly."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // GROUP_SIZE, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE)
    q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8Unpacked(torch.from_numpy(q), torch.from_numpy(d))


def cat_q4(parts: list[Q4Unpacked]) -> Q4Unpacked:
    """Stack weights along the output dimension (fused QKV and gate/up projections)."""
    exact = torch.cat([p.exact for p in parts]) if all(p.exact is not None for p in parts) else None
    return Q4Unpacked(
        torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]), exact
    )


# torch's int4 CPU kernel dequantizes the weight again for every row of x, so its cost grows linearly with the
# rows (measured on SmolLM2's shapes: 2.5x faster than a bf16 matmul at 1 row, even at 4-8 rows, 3.5x slower at 32,
# 6x slower at 512). Batches of at least this many rows take another path (AMX_MAX_ROWS below) with the same
# dequantized weight values.
INT4_MAX_ROWS = 6

# A plain bf16 ``F.linear`` on CPU goes through oneDNN, which reorders the weight into its blocked (AMX/AVX-512)
# layout on every call; at decode sizes that reorder costs as much as the product. The weight is reordered once at
# load instead, as torch's own inductor does when it freezes a model (``mkldnn._reorder_linear_weight``), and
# multiplied with ``mkldnn._linear_pointwise``. An fp32 ``F.linear`` goes through MKL instead, which on AMD's Zen 3
# takes 1.5-2.8x oneDNN's time with a prepacked weight at 8-28 rows (SmolLM2's head at 28 rows: 30.2 against
# 14.6 ms; 1.0-1.25x at 128-512 rows), so the fp32 copies of a 4-bit model are prepacked too. (--dtype float32's
# weights are not: that exact path keeps F.linear.) Tests turn this off to check that greedy output is unchanged.
ONEDNN_PREPACK = True
PREPACK_ROWS_HINT = 32  # the batch size oneDNN picks the layout for; any number of rows works with it


def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN has a bf16 matmul kernel for this CPU (AVX-512 or AMX). Without one (AVX2 only: AMD Zen 2/3,
    older Intel) a bf16 product is emulated and takes 5-8x the fp32 time (measured on a Zen 3 EPYC: 96.6 against
    14.0 ms for a 512-row chunk through SmolLM2's gate/up), so --dtype auto computes in fp32 there."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def prepack_linear(w: torch.Tensor) -> torch.Tensor:
    """A CPU bf16 or fp32 [out, in] weight in oneDNN's blocked layout (an opaque mkldnn tensor), or ``w`` itself
    where prepacking is off or unavailable (bf16 without a bf16 matmul); ``packed_linear`` multiplies either."""
    if not ONEDNN_PREPACK or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return w
    if w.dtype != torch.float32 and (w.dtype != torch.bfloat16 or not cpu_has_bf16_matmul()):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PREPACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [rows, in] of the weight's dtype and a weight from ``prepack_linear``."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


# Batches of INT4_MAX_ROWS to AMX_MAX_ROWS rows multiply the 4-bit weight on AMX tiles where the engine's C++
# kernels run (justapi/kernels/int4_matmul.cpp: the weight is read as 4 bits and expanded to bf16 once for all rows,
# where the bf16 copy reads 4x the bytes). Products are summed in fp32 and rounded once, as in oneDNN's bf16 product:
# bit-identical to it up to 32 rows on SmolLM2's shapes, while from 48 rows oneDNN splits its sums differently and
# a few elements per product differ in the last bit (tests/test_kernels.py checks 8 and 345 rows). Faster at every size measured: 0.4x
# oneDNN's time at decode batches of 8-32 rows, 0.67-0.83x for prefill chunks of 96-512 rows (before the passes over
# pairs of blocks, which took 0.76-0.80x of that again at 373-512 rows)
# (benchmarks/int4_amx_bench.py). Tests set it to 0 to compare with the bf16 copy.
AMX_MAX_ROWS = 1 << 62

# On a CPU without a bf16 matmul, where --dtype auto computes in fp32, the engine's AVX2 kernel (kernels/q_matmul.cpp)
# multiplies batches of up to Q_MATMUL_MAX_ROWS rows by the 4-bit weights and the Q8_0 head as stored, with the
# rows rounded to 16-bit integers per group of 32 and integer multiply-adds. (Since 2026-12-01 the 4-bit products
# split each rounded value into two bytes: 0.8x the time at one row, 0.9x at 8, the same from 28 rows,
# benchmarks/q_matmul_ab.py; the figures below are from before.) Measured on SmolLM2's weights on a
# Zen 3 EPYC (2 threads, all 30 layers, benchmarks/q_matmul_bench.py), against the dense fp32 copy on oneDNN
# (prepacked): 0.16x the time at one row, 0.43x at 8, 0.64x at 28, 0.87x at 64, 0.94x at 128, 1.16x at 512 (the
# head: 0.25x to 0.98x up to 64 rows). Single-stream decode in process went from 62.5 and 64.6 to 88.9 and 99.0
# tok/s against the fp32 kernel it replaced. Larger batches (prefill chunks) multiply the dense copy. Tests turn it
# off to compare.
Q_MATMUL = True
Q_MATMUL_MAX_ROWS = 64
Q_MATMUL_OUTPUTS = 8  # outputs side by side in q_matmul's layout


def pack_for_q_matmul(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None):
    """q_matmul's layout (see kernels/q_matmul.cpp) of a weight ``q`` [out, in] (uint8 in [0, 15] with ``offset``:
    ``w = q · scale + offset``; int8 without: ``w = q · scale``) and its [out, in / 32] fp32 terms: for each block of
    8 outputs (the last padded with zeros) and each group of 32 inputs, the inputs of the 8 outputs side by side,
    8-bit: 16 steps of 2 inputs; 4-bit: 4 chunks of 32 bytes, chunk c inputs 8c..8c+3 in the low nibbles and
    8c+4..8c+7 in the high ones. Returns (bytes [blocks, …], scale, offset), the terms [blocks, in / 32, 8]."""
    out, cols = q.shape
    blocks, groups = -(-out // Q_MATMUL_OUTPUTS), cols // GROUP_SIZE
    pad = lambda t: torch.cat([t, t.new_zeros(blocks * Q_MATMUL_OUTPUTS - out, t.shape[1])])  # noqa: E731
    q = pad(q)
    if offset is not None:  # [block, output, group, chunk, half, input]  ->  [block, group, chunk, half, output, input]
        v = q.view(blocks, Q_MATMUL_OUTPUTS, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        packed = v[:, :, :, 0] | (v[:, :, :, 1] << 4)
    else:  # [block, output, group, step, input]  ->  [block, group, step, output, input]
        packed = q.view(torch.uint8).view(blocks, Q_MATMUL_OUTPUTS, groups, 16, 2).permute(0, 2, 3, 1, 4)
    terms = lambda t: pad(t.float()).view(blocks, Q_MATMUL_OUTPUTS, groups).transpose(1, 2).contiguous()  # noqa: E731
    return (packed.reshape(blocks, -1).contiguous(), terms(scale), None if offset is None else terms(offset))


def q_matmul_fits(kernels, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Whether q_matmul serves a weight of ``shape`` [out, in] in a model computing in ``dtype``."""
    return (Q_MATMUL and dtype == torch.float32 and kernels is not None and kernels.q_matmul_available()
            and shape[1] % GROUP_SIZE == 0)


class Int4Weight:
    """A packed [out, in] 4-bit weight and its dequantization in ``dtype``; ``matmul(x)`` is ``x @ w.T``.

    Where the model computes in fp32 (the CPU has no bf16 matmul, see cpu_has_bf16_matmul) and the engine's AVX2
    kernel is built, batches of up to Q_MATMUL_MAX_ROWS rows run through it (q_matmul, see Q_MATMUL). Otherwise
    up to INT4_MAX_ROWS rows (single-stream and small-batch decode, where reading the weight is the cost) run
    through torch's int4 kernel (bf16 rows). Larger batches (batched decode, prefill chunks) run through the
    engine's AMX kernel where ``kernels`` has it, and otherwise through a matmul of the dense copy (bf16 through
    oneDNN, prepacked; fp32 without a bf16 kernel). All use the same weight values.
    """

    def __init__(self, w: Q4Unpacked, kernels=None, dtype: torch.dtype = torch.bfloat16) -> None:
        self.out_features, self.in_features = w.shape
        self.dtype = dtype  # of the products; the model's compute dtype
        self.kernels = self.amx = self.q_bytes = self.packed = None
        if q_matmul_fits(kernels, dtype, w.shape):  # fp32 rows on AVX2 (kernels/q_matmul.cpp), see Q_MATMUL
            self.kernels = kernels
            self.q_bytes, self.q_scale, self.q_offset = pack_for_q_matmul(w.q, w.scale, w.zero - 8 * w.scale)
        else:  # torch's int4 kernel, [in / 32, out, 2] scales and zeros: the layout it reads
            self.packed = torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32).contiguous(), 1)
            self.scales_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        # INT4_MAX_ROWS rows or more, without AMX: in fp32 the file's exact values where the loader kept them (the
        # weights of --dtype float32), else the kernel's values (bf16 scales and zeros)
        dense = w.exact if dtype == torch.float32 and w.exact is not None else w.dequantize()
        self.dense = prepack_linear(dense.to(dtype))
        if (dtype == torch.bfloat16 and kernels is not None and kernels.int4_amx_available() and self.out_features % 16 == 0
                and self.in_features % GROUP_SIZE == 0):
            self.kernels = kernels
            self.amx = kernels.int4_amx_pack(w.q.contiguous(), w.scale.to(torch.bfloat16).float(),
                                             w.zero.to(torch.bfloat16).float())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] (any float dtype) → [rows, out] in ``self.dtype``."""
        rows = x.shape[0]
        if self.q_bytes is not None and rows <= Q_MATMUL_MAX_ROWS:
            return self.kernels.q_matmul(x if x.dtype == torch.float32 else x.float(), self.q_bytes, self.q_scale,
                                         self.q_offset, 4, self.out_features)
        if rows < INT4_MAX_ROWS and self.packed is not None:
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # the kernel is fast with bf16 rows only
            y = torch._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_zeros)
            return y if self.dtype == torch.bfloat16 else y.to(self.dtype)
        x = x if x.dtype == self.dtype else x.to(self.dtype)  # no call per projection when it is
        if self.amx is not None and rows <= AMX_MAX_ROWS:
            return self.kernels.int4_amx_matmul(x, self.amx, self.out_features)
        return packed_linear(x, self.dense)


# The 8-bit head on AMX only up to this many rows (one pass over each block of outputs): measured on SmolLM2's head
# (49152 x 576, read from memory), 0.49-0.80x oneDNN's time at 6-64 rows, 1.5-1.9x at 128-345
# (benchmarks/int4_amx_bench.py --head). A decode step's head has a row per sequence; more come from drafts.
Q8_AMX_MAX_ROWS = 64


class Int8RowWeight:
    """A dense [out, in] weight also held as int8 with one bf16 scale per output row; ``matmul(x)`` is ``x @ w.T``.

    For the LM head of a 4-bit model (SmolLM2's is its Q8_0 token embedding, tied), whose bf16 product reads 56 MB
    a token and took a quarter of a single-stream step. torch's int8 kernel (``_weight_int8pack_mm``) has one scale
    per row, not Q8_0's one per 32 weights, so rows are requantized: the scale is ``max|w| / 127`` rounded up to a
    bfloat16 value (the kernel's dtype, so no further rounding), each weight off by at most half a step. Like
    Int4Weight, only batches under INT4_MAX_ROWS rows use it (measured 1.7 ms against 4.8 ms for bf16 at one row,
    slower from 8 rows); larger batches multiply the exact dense weight: given the GGUF's Q8_0 integers and scales
    (``q8``) and AMX in ``kernels``, on AMX tiles from the 8-bit weight (int4_matmul.cpp's Q8Unit: the dense bf16
    values, expanded in L1, 32 MB read a step instead of 56 MB; bit-identical to oneDNN's product up to 32 rows
    on SmolLM2's width, like the 4-bit kernel), else through oneDNN. In fp32 on AVX2 (a CPU without a bf16 matmul),
    batches of up to Q_MATMUL_MAX_ROWS rows multiply the Q8_0 weight itself through q_matmul (see Q_MATMUL), and
    no int8 rows are made.
    """

    def __init__(self, dense: torch.Tensor, q8: Q8Unpacked | None = None, kernels=None) -> None:
        self.kernels = self.amx = self.q_bytes = None
        self.dtype = dense.dtype  # of the products: the model's compute dtype, bf16 or (no bf16 kernel) fp32
        self.shape = tuple(dense.shape)
        self.dense = prepack_linear(dense)
        if q8 is not None and q_matmul_fits(kernels, self.dtype, self.shape):  # see Q_MATMUL: no int8 rows then
            self.kernels = kernels
            self.q_bytes, self.q_scale, _ = pack_for_q_matmul(q8.q, q8.scale, None)
            return
        if (self.dtype == torch.bfloat16 and q8 is not None and kernels is not None and kernels.int4_amx_available()
                and dense.shape[0] % 16 == 0 and dense.shape[1] % GROUP_SIZE == 0):
            self.kernels = kernels
            self.amx = kernels.q8_amx_pack(q8.q, q8.scale)
        w = dense.float()
        scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny)
        up = scale.to(torch.bfloat16)
        up = torch.where(up.float() < scale, torch.nextafter(up, torch.tensor(float("inf"), dtype=up.dtype)), up)
        self.scale = up.contiguous()
        self.q = torch.round(w / up.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] (any float dtype) → [rows, out] in ``self.dtype``."""
        rows = x.shape[0]
        if self.q_bytes is not None and rows <= Q_MATMUL_MAX_ROWS:
            return self.kernels.q_matmul(x if x.dtype == torch.float32 else x.float(), self.q_bytes, self.q_scale,
                                         None, 8, self.shape[0])
        if rows < INT4_MAX_ROWS and self.q_bytes is None:  # int8 rows (not made where q_matmul serves)
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # fp32 rows take 8-25x as long
            y = torch._weight_int8pack_mm(xb, self.q, self.scale)
            return y if self.dtype == torch.bfloat16 else y.to(self.dtype)
        x = x if x.dtype == self.dtype else x.to(self.dtype)
        if self.amx is not None and rows <= min(AMX_MAX_ROWS, Q8_AMX_MAX_ROWS):
            return self.kernels.q8_amx_matmul(x, self.amx, self.shape[0])
        return packed_linear(x, self.dense)
