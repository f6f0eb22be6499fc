"""GGUF quantization blocks → exact integers and per-group terms (``Q4Unpacked``, ``Q8Unpacked``), the forms the
weights of model.quant are built from.

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

from .kernel_policy import GROUP_SIZE


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
