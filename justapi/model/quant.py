"""GGUF 4-bit and 8-bit weights kept quantized in memory, in the forms their kernel routes read (kernel_policy),
built from the exact integers and terms of model.unpack; and the dense forms (prepacked for oneDNN) beside them.
"""

from __future__ import annotations

import torch

from .kernel_policy import ALL_ROWS, GROUP_SIZE, PREPACK_ROWS_HINT, KernelPolicy, Route
from .unpack import Q4Unpacked, Q8Unpacked

Q_MATMUL_OUTPUTS = 8  # outputs side by side in q_matmul's layout
UNIT_OUTPUTS = 16  # outputs a unit holds (kernels/q_units.h): a weight's rows are padded with zeros to a multiple


def _padded_rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` [out, ...] with zero rows appended up to ``rows``."""
    if t is None or t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


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
    pad = lambda t: _padded_rows(t, blocks * Q_MATMUL_OUTPUTS).contiguous()  # noqa: E731
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

    # the forms each route reads, in the order its _run_<kernel> passes them: what a native decode step (kernels/
    # decode_step.cpp) is handed to call the same kernel
    ROUTE_FORMS = {"torch_int4": ("packed", "scales_zeros"), "amx": ("units",), "dpbf16": ("units",),
                   "q4_small": ("units",), "q8_small": ("units",), "q_matmul": ("q_bytes", "q_scale", "q_offset"),
                   "dense": ("dense",)}

    def native_routes(self) -> list[tuple] | None:
        """Each route as DecodeLayers takes it, (max_rows, kernel, forms, outputs the kernel computes, group, bits,
        8-bit, has_zero); None where a route has no native call (model.decode_plan). A unit kernel computes the
        padded rows too (``units_out``); DecodeLayers keeps the weight's ``out_features`` of them."""
        if any(route.kernel not in self.ROUTE_FORMS for route in self.routes):
            return None
        unit = getattr(self, "unit", {})
        bits = 4 if getattr(self, "q_offset", None) is not None else 8  # q_matmul's, as _run_q_matmul gives it
        forms = {kernel: [getattr(self, name) for name in names if getattr(self, name, None) is not None]
                 for kernel, names in self.ROUTE_FORMS.items()}
        return [(route.max_rows, route.kernel, forms[route.kernel],
                 self.units_out if self.ROUTE_FORMS[route.kernel] == ("units",) else self.shape[0],
                 unit.get("group", GROUP_SIZE), bits, isinstance(self, _Int8Forms), bool(unit.get("has_zero", False)))
                for route in self.routes]

    @property
    def units_out(self) -> int:
        """The rows the units hold: the weight's outputs padded to whole units."""
        return -(-self.shape[0] // UNIT_OUTPUTS) * UNIT_OUTPUTS

    def _outputs(self, y: torch.Tensor) -> torch.Tensor:
        """A unit kernel's product [rows, units_out] cut to the weight's outputs."""
        return y if y.shape[1] == self.shape[0] else y[:, : self.shape[0]].contiguous()

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

    def _small_rows(self, kernel, x: torch.Tensor, **unit) -> torch.Tensor:
        """q4_small / q8_small: the kernel takes fp32 or bf16 rows and returns the product in their dtype."""
        x = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(self.dtype)
        y = self._outputs(kernel(x, self.units, self.units_out, **unit))
        return y if y.dtype == self.dtype else y.to(self.dtype)

    def _dense_form(self, w: torch.Tensor) -> torch.Tensor:
        return prepack_linear(w) if self.policy.uses("prepack") else w

    def forms(self) -> dict[str, torch.Tensor]:
        """The tensors this weight holds, by name (for memory accounting and huge pages)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


class Int4Weight(_RoutedWeight):
    """A 4-bit [out, in] weight (GGUF Q4_0/Q4_1) in the forms its routes read (KernelPolicy.q4_routes).

    torch_int4: torch's group-32 int4 kernel, bf16 rows. amx: the engine's AMX kernel (int4_matmul.cpp), the weight
    expanded to bf16 once for all rows; dpbf16, the same units on AVX-512 BF16 vectors, and q4_small, 1-4 fp32 rows
    times them with fp32 FMAs, the weights exact (units_avx512.cpp).
    q_matmul: fp32 rows rounded to 16-bit integers per group, AVX2 integer products (q_matmul.cpp). dense: the
    dequantized weight in the compute dtype (fp32: the file's own values where the loader kept them), prepacked for
    oneDNN. All use the same weight values.
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
        if not hasattr(self, "units"):  # one form for the amx, dpbf16 and q4_small routes
            w, rows = self._w, self.units_out
            self.units = self.kernels.int4_amx_pack(_padded_rows(w.q, rows).contiguous(),
                                                    _padded_rows(w.scale.to(torch.bfloat16).float(), rows),
                                                    _padded_rows(w.zero.to(torch.bfloat16).float(), rows))

    def _run_amx(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == self.dtype else x.to(self.dtype)
        return self._outputs(self.kernels.int4_amx_matmul(x, self.units, self.units_out))

    _build_dpbf16 = _build_q4_small = _build_amx  # the same units

    def _run_q4_small(self, x: torch.Tensor) -> torch.Tensor:
        return self._small_rows(self.kernels.int4_small_matmul, x)

    def _run_dpbf16(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == self.dtype else x.to(self.dtype)
        return self._outputs(self.kernels.int4_dpbf16_matmul(x, self.units, self.units_out))

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

    def _build_units(self) -> None:  # the form of the amx, dpbf16 and q8_small routes: built once for all
        if not hasattr(self, "units"):
            w, rows = self._q8, self.units_out
            self.units = self.kernels.q8_amx_pack(_padded_rows(w.q, rows), _padded_rows(w.scale, rows),
                                                  _padded_rows(w.zero, rows), w.group)
            self.unit = dict(group=w.group, has_zero=w.zero is not None)  # the unit format, for the kernels

    _build_amx = _build_dpbf16 = _build_q8_small = _build_units

    def _run_amx(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == self.dtype else x.to(self.dtype)
        return self._outputs(self.kernels.q8_amx_matmul(x, self.units, self.units_out, **self.unit))

    def _run_dpbf16(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == self.dtype else x.to(self.dtype)
        return self._outputs(self.kernels.q8_dpbf16_matmul(x, self.units, self.units_out, **self.unit))

    def _run_q8_small(self, x: torch.Tensor) -> torch.Tensor:
        return self._small_rows(self.kernels.q8_small_matmul, x, **self.unit)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of the weight in the compute dtype (exact values, rounded once), gathered from the units or
        the q_matmul layout (both hold, per block of outputs and group of 32 inputs, 16 steps of 2 inputs side by side
        for each output); None where neither is held."""
        groups, n = self.shape[1] // GROUP_SIZE, len(ids)
        sets, zeros = 1, None
        # each index below takes only the rows' own bytes: block and output within it in one gather from a view
        # (gathering whole blocks first, then the outputs, copied 16x the bytes: ~3 ms of a 373-token step)
        if hasattr(self, "units"):  # blocks of 16 outputs: 512 bytes of integers, S sets of 16 fp32 scales (zeros)
            blocks, per_block = self.units_out // UNIT_OUTPUTS, UNIT_OUTPUTS
            block, out = ids // per_block, ids % per_block
            sets = GROUP_SIZE // self.unit["group"]
            words = self.units.view(torch.float32).view(blocks, groups, -1)
            terms = words[:, :, 128:].unflatten(-1, (-1, 16))[block, :, :, out]  # [n, groups, sets(, ×2)]
            scales = terms[..., :sets]
            zeros = terms[..., sets : 2 * sets] if self.unit["has_zero"] else None
            q = words.view(torch.int8)[:, :, :512].unflatten(-1, (16, per_block, 2))[block, :, :, out]
        elif hasattr(self, "q_bytes"):
            per_block = Q_MATMUL_OUTPUTS
            block, out = ids // per_block, ids % per_block
            q = self.q_bytes.view(torch.int8).view(-1, groups, 16, per_block, 2)[block, :, :, out]
            scales = self.q_scale[block, :, out].unsqueeze(-1)
        else:
            return None
        # q: [rows, groups, 16, 2]: 32 inputs a group, `sets` sets
        rows = q.float().reshape(n, groups, sets, GROUP_SIZE // sets) * scales.unsqueeze(-1)
        if zeros is not None:
            rows = rows + zeros.unsqueeze(-1)
        return rows.reshape(n, -1).to(self.dtype)


class Int8Weight(_Int8Forms):
    """An 8-bit [out, in] linear (Q8Unpacked: GGUF Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) in the forms its routes read
    (KernelPolicy.q8_routes): amx, dpbf16 and q8_small, the integers in units (on AMX tiles, AVX-512 BF16 vectors,
    or fp32 FMAs for 1-2 rows);
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
