"""GGUF 4-bit and 8-bit weights kept quantized in memory, in the forms their kernel routes read (kernel_policy).

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

from .kernel_policy import ALL_ROWS, GROUP_SIZE, PREPACK_ROWS_HINT, KernelPolicy, Route

Q_MATMUL_OUTPUTS = 8  # outputs side by side in q_matmul's layout


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


def unpack_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Q4Unpacked:
    """Split raw Q4_K bytes of an [out, in] weight into the same integers, scales and zeros. A Q4_K super-block of
    256 weights (bytes: d(2) dmin(2) scales(12) qs(128)) is 8 groups of 32, group j holding ``w = d·sc_j·q −
    dmin·m_j`` with 6-bit sc_j and m_j: so ``scale = d·sc_j`` and ``zero = 8·scale − dmin·m_j``, and the integers
    are copied exactly (each 32-byte run of qs holds group 2i in its low nibbles and group 2i + 1 in its high ones).
    The kernels compute ``(q − 8)·scale + zero`` with scale and zero rounded to bfloat16: within bf16 rounding of
    the file's values, like Q4_1's ``m + 8·d``."""
    import gguf

    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 256, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each: the format's own unpacking
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * m.astype(np.float32)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, cols)
    groups = (rows, cols // GROUP_SIZE)
    return Q4Unpacked(torch.from_numpy(q), torch.from_numpy(scale.reshape(groups)),
                      torch.from_numpy(zero.reshape(groups)))


@dataclass
class Q8Unpacked:
    """An 8-bit weight as integers and per-group terms: ``w = q · scale (+ zero)`` over groups of ``group`` inputs.
    Q8_0: q and its fp16 d, groups of 32; Q5_0: q − 16 and d; Q5_1: q in [0, 31], d and the min m as zero; Q5_K: q,
    d·sc and −dmin·m; Q6_K: q − 32 and d·sc, Q3_K: q in [−4, 3] and d·sc, Q2_K: q in [0, 3], d·sc and −dmin·m,
    over groups of 16. Every product q · scale is exact in fp32."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / group] fp32
    zero: torch.Tensor | None = None  # [out, in / group] fp32
    group: int = GROUP_SIZE  # 32, or 16 (Q6_K)

    @property
    def plain(self) -> bool:
        """Q8_0's own form (groups of 32, no zero): the one every 8-bit kernel reads."""
        return self.zero is None and self.group == GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, as gguf's dequantize gives it (each product exact, the zero added with one rounding)."""
        w = self.q.float() * self.scale.repeat_interleave(self.group, dim=1)
        return w if self.zero is None else w + self.zero.repeat_interleave(self.group, dim=1)


def unpack_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Split raw Q8_0 bytes of an [out, in] weight (blocks of d(2) qs(32)) into integers and scales, exactly."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // GROUP_SIZE, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE)
    q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8Unpacked(torch.from_numpy(q), torch.from_numpy(d))


def unpack_q5_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """A Q5_0 weight as 8-bit integers, exactly: a block of 32 (bytes: d(2) qh(4) qs(16)) holds 5-bit q, the low 4
    bits in qs (weight j < 16 in the low nibble of qs[j], weight j + 16 in its high one) and the fifth in bit j of
    qh, and ``w = d·(q − 16)``: so the Q8_0 form's integer is ``q − 16`` (in [−16, 15]) and its scale d."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // GROUP_SIZE, 22)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE)
    q = (_q5_integers(blocks[:, 6:], blocks[:, 2:6]).astype(np.int16) - 16).astype(np.int8).reshape(rows, cols)
    return Q8Unpacked(torch.from_numpy(q), torch.from_numpy(d))


def _q5_integers(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """5-bit integers of Q5_0/Q5_1 blocks: weight j < 16 in the low nibble of qs[j], j + 16 in its high one, the
    fifth bit of weight j in bit j of the little-endian 32-bit qh. [blocks, 32] uint8 in [0, 31]."""
    high = ((qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1) | high


def unpack_q5_1(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Q5_1 (blocks of d(2) m(2) qh(4) qs(16)): ``w = d·q + m``, so q as is, scale d, zero m; exact."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // GROUP_SIZE, 24)
    terms = lambda a, b: torch.from_numpy(  # noqa: E731
        blocks[:, a:b].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE))
    q = _q5_integers(blocks[:, 8:], blocks[:, 4:8]).view(np.int8).reshape(rows, cols)
    return Q8Unpacked(torch.from_numpy(q), terms(0, 2), terms(2, 4))


def unpack_q5_k(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Q5_K (super-blocks of 256: d(2) dmin(2) scales(12) qh(32) qs(128)), 8 groups of 32 with 6-bit sc_j and m_j:
    ``w = d·sc_j·q − dmin·m_j``, so scale d·sc_j, zero −dmin·m_j; group i's low nibbles in the 32-byte run i // 2 of
    qs (low or high half by i % 2), its fifth bits in bit i of qh's 32 bytes."""
    import gguf

    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 256, 176)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    low = ((qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
    high = ((qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    q = (low | high).view(np.int8).reshape(rows, cols)
    groups = (rows, cols // GROUP_SIZE)
    return Q8Unpacked(torch.from_numpy(q), torch.from_numpy((d * sc.astype(np.float32)).reshape(groups)),
                      torch.from_numpy((-dmin * m.astype(np.float32)).reshape(groups)))


def unpack_q6_k(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Q6_K (super-blocks of 256: ql(128) qh(64) scales(16, int8) d(2)), 16 groups of 16: ``w = d·sc_j·(q − 32)``,
    so q − 32 (in [−32, 31]) and scale d·sc_j over groups of 16; bits laid out as gguf's dequantize reads them."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 256, 210)
    ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:210]
    d = d.copy().view(np.float16).astype(np.float32)
    scale = d * sc.copy().view(np.int8).astype(np.float32)  # [blocks, 16]
    low = ((ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
    high = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
    q = (low | (high.reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    return Q8Unpacked(torch.from_numpy(q.astype(np.int8).reshape(rows, cols)),
                      torch.from_numpy(scale.reshape(rows, cols // 16)), None, 16)


def _two_bit_groups(qs: np.ndarray) -> np.ndarray:
    """The 2-bit fields of Q2_K/Q3_K's 64 qs bytes as 16 groups of 16: [blocks, 16, 16] uint8 in [0, 3] (bytes of
    each 32-byte half hold four groups' weights at bit offsets 0, 2, 4, 6)."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def unpack_q2_k(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Q2_K (super-blocks of 256: scales(16) qs(64) d(2) dmin(2)), 16 groups of 16 with a 4-bit scale and min each:
    ``w = d·sc·q − dmin·m``, q in [0, 3]: scale d·sc, zero −dmin·m over groups of 16."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 256, 84)
    sc, qs = blocks[:, :16], blocks[:, 16:80]
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float32)
    groups = (rows, cols // 16)
    return Q8Unpacked(torch.from_numpy(_two_bit_groups(qs).view(np.int8).reshape(rows, cols)),
                      torch.from_numpy((d * (sc & 0x0F).astype(np.float32)).reshape(groups)),
                      torch.from_numpy((-dmin * (sc >> 4).astype(np.float32)).reshape(groups)), 16)


def unpack_q3_k(raw: np.ndarray, shape: tuple[int, int]) -> Q8Unpacked:
    """Q3_K (super-blocks of 256: hmask(32) qs(64) scales(12) d(2)), 16 groups of 16 with 6-bit scales stored
    offset by 32: ``w = d·(sc − 32)·q`` with q = the 2 low bits − 4 where the group's hmask bit is clear, in
    [−4, 3]: scale d·(sc − 32) over groups of 16."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 256, 110)
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:110]
    d = d.copy().view(np.float16).astype(np.float32)
    low = (packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    high = (packed[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int8) - 32
    bit = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).reshape(-1, 16, 16) & 1
    q = _two_bit_groups(qs).astype(np.int8) - ((bit ^ 1) << 2).astype(np.int8)
    return Q8Unpacked(torch.from_numpy(q.reshape(rows, cols)),
                      torch.from_numpy((d * sc.astype(np.float32)).reshape(rows, cols // 16)), None, 16)


def cat_q8(parts: list[Q8Unpacked]) -> Q8Unpacked | None:
    """Stack 8-bit weights along the output dimension (fused QKV and gate/up projections); None where their forms
    differ (groups, zeros): the caller then keeps them dense."""
    first = parts[0]
    if any(p.group != first.group or (p.zero is None) != (first.zero is None) for p in parts):
        return None
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return Q8Unpacked(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero, first.group)


def cat_q4(parts: list[Q4Unpacked]) -> Q4Unpacked:
    """Stack weights along the output dimension (fused QKV and gate/up projections)."""
    exact = torch.cat([p.exact for p in parts]) if all(p.exact is not None for p in parts) else None
    return Q4Unpacked(
        torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]), exact
    )


def prepack_linear(w: torch.Tensor) -> torch.Tensor:
    """A CPU bf16 or fp32 [out, in] weight in oneDNN's blocked layout (an opaque mkldnn tensor): a plain bf16
    ``F.linear`` reorders the weight on every call, which at decode sizes costs as much as the product, and an fp32
    one goes through MKL, 1.5-2.8x oneDNN's prepacked time at 8-28 rows on a Zen 3. Reordered once at load instead,
    as torch's inductor does when it freezes a model. ``packed_linear`` multiplies it."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PREPACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [rows, in] of the weight's dtype and a plain or prepacked weight."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


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


class _RoutedWeight:
    """An [out, in] weight multiplied by the kernel its policy's routes give each batch size (``x @ w.T``)."""

    routes: tuple[Route, ...]
    dtype: torch.dtype  # of the products: the model's compute dtype

    def _bind(self, routes: tuple[Route, ...]) -> None:
        """Build the forms the routes read (``_build_<kernel>``) and the call table."""
        self.routes = routes
        self._table = []
        for route in routes:
            getattr(self, "_build_" + route.kernel)()
            self._table.append((route.max_rows, getattr(self, "_run_" + route.kernel)))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] (any float dtype) → [rows, out] in ``self.dtype``."""
        rows = x.shape[0]
        for max_rows, run in self._table:
            if rows <= max_rows:
                return run(x)
        raise AssertionError("the last route covers every batch size")

    def _run_dense(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x if x.dtype == self.dtype else x.to(self.dtype), self.dense)

    def _run_q_matmul(self, x: torch.Tensor) -> torch.Tensor:
        bits = 4 if self.q_offset is not None else 8
        return self.kernels.q_matmul(x if x.dtype == torch.float32 else x.float(), self.q_bytes, self.q_scale,
                                     self.q_offset, bits, self.shape[0])

    def _dense_form(self, w: torch.Tensor) -> torch.Tensor:
        return prepack_linear(w) if self.policy.uses("prepack") else w

    def forms(self) -> dict[str, torch.Tensor]:
        """The tensors this weight holds, by name (for memory accounting and huge pages)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


class Int4Weight(_RoutedWeight):
    """A 4-bit [out, in] weight (GGUF Q4_0/Q4_1) in the forms its routes read (KernelPolicy.q4_routes).

    torch_int4: torch's group-32 int4 kernel, bf16 rows. amx: the engine's AMX kernel (int4_matmul.cpp), the weight
    expanded to bf16 once for all rows. q_matmul: fp32 rows rounded to 16-bit integers per group, AVX2 integer
    products (q_matmul.cpp). dense: the dequantized weight in the compute dtype (fp32: the file's own values where
    the loader kept them), prepacked for oneDNN. All use the same weight values.
    """

    def __init__(self, w: Q4Unpacked, policy: KernelPolicy) -> None:
        self.shape = w.shape
        self.policy, self.dtype, self.kernels = policy, policy.dtype, policy.kernels
        self._w = w
        self._bind(policy.q4_routes(w.shape))
        del self._w

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def _build_torch_int4(self) -> None:  # [in / 32, out, 2] scales and zeros: the layout the kernel reads
        self.packed = torch._convert_weight_to_int4pack_for_cpu(self._w.q.to(torch.int32).contiguous(), 1)
        self.scales_zeros = torch.stack([self._w.scale.t(), self._w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def _run_torch_int4(self, x: torch.Tensor) -> torch.Tensor:
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # the kernel is fast with bf16 rows only
        y = torch._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_zeros)
        return y if self.dtype == torch.bfloat16 else y.to(self.dtype)

    def _build_q_matmul(self) -> None:
        w = self._w
        self.q_bytes, self.q_scale, self.q_offset = pack_for_q_matmul(w.q, w.scale, w.zero - 8 * w.scale)

    def _build_amx(self) -> None:  # bf16-rounded scale and zero: the values the other routes compute with
        w = self._w
        self.amx = self.kernels.int4_amx_pack(w.q.contiguous(), w.scale.to(torch.bfloat16).float(),
                                              w.zero.to(torch.bfloat16).float())

    def _run_amx(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.int4_amx_matmul(x if x.dtype == self.dtype else x.to(self.dtype), self.amx, self.shape[0])

    def _build_dense(self) -> None:
        w = self._w
        exact = w.exact if self.dtype == torch.float32 and w.exact is not None else w.dequantize()
        self.dense = self._dense_form(exact.to(self.dtype))


class DenseWeight(_RoutedWeight):
    """A packed model's weight of a type no integer kernel reads (Q6_K, Q5_1, the other K-quants, F16), dequantized
    to the compute dtype and prepacked once for oneDNN: a plain bf16 ``F.linear`` reorders the weight on every
    call (0.38 against 0.04 ms a row for Gemma 3's 640 x 2048 Q6_K rows on a Xeon)."""

    def __init__(self, w: torch.Tensor, policy: KernelPolicy) -> None:
        self.shape = tuple(w.shape)
        self.policy, self.dtype, self.kernels = policy, w.dtype, policy.kernels
        self._w = w
        self._bind((Route(ALL_ROWS, "dense"),))
        del self._w

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def _build_dense(self) -> None:
        self.dense = self._dense_form(self._w)


class _Int8Forms(_RoutedWeight):
    """The packed forms of an 8-bit weight (Q8_0's integers and per-32 scales: the file's Q8_0, or Q5_0 widened
    exactly), and rows read back from them, so that an embedding tied to a head needs no copy of its own."""


    def _build_q_matmul(self) -> None:
        self.q_bytes, self.q_scale, self.q_offset = pack_for_q_matmul(self._q8.q, self._q8.scale, None)

    def _build_amx(self) -> None:  # also q8_small's form: built once for both routes
        if not hasattr(self, "amx"):
            w = self._q8
            self.amx = self.kernels.q8_amx_pack(w.q, w.scale, w.zero, w.group)
            self.unit = dict(group=w.group, has_zero=w.zero is not None)  # the unit format, for the kernels

    def _run_amx(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_amx_matmul(x if x.dtype == self.dtype else x.to(self.dtype), self.amx, self.shape[0],
                                          **self.unit)

    def _build_q8_small(self) -> None:  # reads the AMX units
        self._build_amx()

    def _run_q8_small(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_small_matmul(x.float(), self.amx, self.shape[0], **self.unit).to(self.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of the weight in the compute dtype (exact values, rounded once), gathered from the AMX or the
        q_matmul layout (both hold, per block of outputs and group of 32 inputs, 16 steps of 2 inputs side by side
        for each output); None where neither is held."""
        groups, n = self.shape[1] // GROUP_SIZE, len(ids)
        sets, zeros = 1, None
        if hasattr(self, "amx"):  # units of 16 outputs: 512 bytes of integers, then S sets of 16 fp32 scales (and zeros)
            blocks, per_block = self.shape[0] // 16, 16
            sets = GROUP_SIZE // self.unit["group"]
            terms = self.amx.view(torch.float32).view(blocks, groups, -1)[ids // per_block, :, 128:]  # [n, groups, *]
            terms = terms.view(n, groups, -1, 16)[torch.arange(n), :, :, ids % per_block]  # [n, groups, sets(, ×2)]
            scales = terms[..., :sets]
            zeros = terms[..., sets : 2 * sets] if self.unit["has_zero"] else None
            q = self.amx.view(torch.int8).view(blocks, groups, -1)[ids // per_block, :, :512]
            q = q.reshape(n, groups, 16, per_block, 2)
        elif hasattr(self, "q_bytes"):
            per_block = Q_MATMUL_OUTPUTS
            q = self.q_bytes.view(torch.int8).view(-1, groups, 16, per_block, 2)[ids // per_block]
            scales = self.q_scale[ids // per_block, :, ids % per_block].unsqueeze(-1)
        else:
            return None
        q = q[torch.arange(n), :, :, ids % per_block]  # [rows, groups, 16, 2]: 32 inputs a group, `sets` sets
        rows = q.float().reshape(n, groups, sets, GROUP_SIZE // sets) * scales.unsqueeze(-1)
        if zeros is not None:
            rows = rows + zeros.unsqueeze(-1)
        return rows.reshape(n, -1).to(self.dtype)


class Int8Weight(_Int8Forms):
    """An 8-bit [out, in] linear (Q8Unpacked: GGUF Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) in the forms its routes read
    (KernelPolicy.q8_routes): amx and q8_small, the integers in AMX units (on tiles, or AVX-512 FMAs for 1-2 rows);
    q_matmul, on AVX2 (Q8_0's plain form only); dense, the dequantized weight."""

    def __init__(self, w: Q8Unpacked, policy: KernelPolicy) -> None:
        self.shape = tuple(w.q.shape)
        self.policy, self.dtype, self.kernels = policy, policy.dtype, policy.kernels
        self._q8 = w
        self._bind(policy.q8_routes(self.shape, w.plain))
        del self._q8

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def _build_dense(self) -> None:
        self.dense = self._dense_form(self._q8.dequantize().to(self.dtype))


class Int8RowWeight(_Int8Forms):
    """A 4-bit model's dense LM head in the forms its routes read (KernelPolicy.head_routes).

    SmolLM2's head is its Q8_0 token embedding, tied, whose bf16 product reads 56 MB a token. torch_int8: torch's
    int8 kernel (``_weight_int8pack_mm``), which has one scale per row, not Q8_0's one per 32 weights, so rows are
    requantized: the scale is ``max|w| / 127`` rounded up to a bfloat16 value, each weight off by at most half a
    step (1.7 against 4.8 ms for bf16 at one row). amx: the Q8_0 integers on AMX tiles (int4_matmul.cpp's Q8Unit,
    32 MB read a step), q_matmul: the Q8_0 integers on AVX2; both exact products of the file's values. dense: the
    weight in the compute dtype, prepacked for oneDNN. A head too large for a dense copy (KernelPolicy.head_routes:
    Gemma 3's 262k rows) holds only its Q8_0 form, and a tied embedding looks its rows up there (``lookup``).
    """

    def __init__(self, dense: torch.Tensor, q8: Q8Unpacked | None, policy: KernelPolicy) -> None:
        self.shape = tuple(dense.shape)
        self.policy, self.dtype, self.kernels = policy, dense.dtype, policy.kernels
        self._w, self._q8 = dense, q8
        self._bind(policy.head_routes(self.shape, q8 is not None, q8 is None or q8.plain))
        del self._w, self._q8

    def _build_torch_int8(self) -> None:
        w = self._w.float()
        scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny)
        up = scale.to(torch.bfloat16)
        up = torch.where(up.float() < scale, torch.nextafter(up, torch.tensor(float("inf"), dtype=up.dtype)), up)
        self.scale = up.contiguous()
        self.q = torch.round(w / up.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()

    def _run_torch_int8(self, x: torch.Tensor) -> torch.Tensor:
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # fp32 rows take 8-25x as long
        y = torch._weight_int8pack_mm(xb, self.q, self.scale)
        return y if self.dtype == torch.bfloat16 else y.to(self.dtype)

    def _build_dense(self) -> None:
        self.dense = self._dense_form(self._w)
