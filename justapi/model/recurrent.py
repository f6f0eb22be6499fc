"""The recurrent token mixers of hybrid models, in place of attention in some of their layers: LFM2's gated short
convolution and Qwen3.5's Gated DeltaNet. Each keeps a fixed-size state per sequence (model.state_cache holds it in
slots) instead of a growing KV cache.

A flat batch mixes sequences. Gated DeltaNet's C++ kernel takes every decode row and prompt chunk in one call (the
batch's state runs), in place on their slots. Otherwise decode rows (one new token each) are stepped together,
gathering their slots' states and scattering the new ones back, and a prompt chunk runs its own scan from its slot's
state, or from zeros where the span starts its sequence. A draft verification (a chain or a tree) steps each row
from its parent row's state and keeps every row's (model.state_cache: the runner keeps the last accepted one). A
layer's states are a LayerStates, tensors [slots, ...].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import delta_rule
from .layers import linear

# seq(rows' inputs, states) -> (rows' outputs, new states); the same over a batch of single steps
Scan = Callable[[tuple, list], tuple]


def _over_sequences(fp, inputs: tuple, layer, seq: Scan, step: Scan, width: int, runs=None):
    """Each sequence's rows of ``inputs`` (row-major tensors) through its recurrence, each slot's state updated in
    place. With ``runs(inputs, states, meta.state_runs, out)`` (a kernel that steps every run where its slot is) it
    takes every span but a draft verification's; otherwise the decode rows go at once (``step``) and every other
    span alone (``seq``). A draft verification steps its rows one by one (``step``). Returns the outputs
    [rows, width] in the batch's row order."""
    meta, states = fp.meta, layer.tensors
    out = inputs[0].new_empty(inputs[0].shape[0], width)
    if runs is not None and meta.state_runs is not None:
        runs(inputs, states, meta.state_runs, out)
    elif runs is None and meta.decode_rows is not None:
        rows, slots = meta.decode_rows, meta.decode_state_slots
        o, new = step(tuple(t[rows] for t in inputs), [s.index_select(0, slots) for s in states])
        out[rows] = o.to(out.dtype)
        for s, n in zip(states, new):
            s.index_copy_(0, slots, n.to(s.dtype))
    for span in meta.seqs:
        if span.parents is not None:
            layer.checkpoints[span.state_slot] = _verify_rows(span, inputs, states, step, out)
            continue
        if runs is not None or (span.num_query_tokens == 1 and meta.decode_rows is not None):
            continue  # in the kernel's runs, or stepped with the decode rows
        rows = slice(span.query_start, span.query_start + span.num_query_tokens)
        start = [torch.zeros_like(s[span.state_slot]) if span.starts_sequence else s[span.state_slot] for s in states]
        o, new = seq(tuple(t[rows] for t in inputs), start)
        out[rows] = o.to(out.dtype)
        for s, n in zip(states, new):
            s[span.state_slot] = n.to(s.dtype)
    return out


def _l2_normalized(t: torch.Tensor) -> torch.Tensor:
    """t / sqrt(|t|^2 + 1e-6) over the last dimension (the epsilon where transformers and FLA put it)."""
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def _verify_rows(span, inputs: tuple, states: list[torch.Tensor], step: Scan, out: torch.Tensor) -> list:
    """A draft verification's rows stepped one by one, each from its parent row's state (the first from the
    slot's): the state after each row, the slot left as it was."""
    after: list[list[torch.Tensor]] = []
    for j, parent in enumerate(span.parents):
        start = [s[span.state_slot].unsqueeze(0) for s in states] if parent < 0 else after[parent]
        row = span.query_start + j
        o, new = step(tuple(t[row : row + 1] for t in inputs), start)
        out[row] = o[0].to(out.dtype)
        after.append(new)
    return [[s[0] for s in states_after] for states_after in after]


@dataclass
class ShortConv:
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = C * conv(B * x); out_proj(y). Its state is the
    convolution's last K-1 inputs."""

    in_proj: object  # [3 * hidden, hidden]: B, C, x
    conv: torch.Tensor  # [hidden, K] fp32
    out_proj: object

    @staticmethod
    def shard(kind: str, tp, config) -> tuple[int, torch.Tensor] | None:
        """A tensor-parallel rank's channels: its rows of B, C and x and of the convolution, its columns of
        out_proj (None: not this layer's tensor)."""
        a, b = tp.recurrent
        rows, hidden = torch.arange(a, b), config.hidden_size
        if kind == "shortconv.in_proj":
            return 0, torch.cat([rows, hidden + rows, 2 * hidden + rows])
        if kind == "shortconv.conv":
            return 0, rows
        if kind == "shortconv.out_proj":
            return 1, rows
        return None

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.conv.shape[0], self.conv.shape[1] - 1)]

    def linears(self) -> list:
        return [self.in_proj, self.out_proj]

    def __call__(self, h: torch.Tensor, fp, states) -> torch.Tensor:
        b, c, x = linear(h, self.in_proj, None, fp.batch_invariant).chunk(3, dim=-1)
        weight = self.conv

        def seq(inputs, start):
            y, tail = delta_rule.conv_continue(inputs[0].float(), start[0], weight)
            return y, [tail]

        def step(inputs, start):
            y, tails = delta_rule.conv_step(inputs[0].float(), start[0], weight)
            return y, [tails]

        y = _over_sequences(fp, ((b * x),), states, seq, step, x.shape[1])
        return fp.all_reduce(linear(c * y, self.out_proj, None, fp.batch_invariant))


_DELTA_NET_TENSORS = ("attn_qkv", "ssm_conv1d", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt", "ssm_out")


@dataclass
class GatedDeltaNet:
    """Qwen3.5's linear attention: q, k, v through a short causal convolution and SiLU, q and k L2-normalized, each
    key head serving value_heads / key_heads value heads; the gated delta rule (model.delta_rule) with
    g = -exp(A) * softplus(alpha + dt_bias) and beta = sigmoid(b); the output RMS-normalized per head and gated by
    SiLU(z). The four input projections (qkv, z, b, alpha) are one matmul. Its state: the convolution's last K-1
    inputs and the rule's [value_heads, key_dim, value_dim] matrix, fp32."""

    in_proj: object  # [2 * key_heads * key_dim + 2 * value_heads * value_dim + 2 * value_heads, hidden]
    conv: torch.Tensor  # [conv channels (q, k, v), K] fp32
    a: torch.Tensor  # [value_heads]: -exp(A_log), fp32
    dt_bias: torch.Tensor  # [value_heads] fp32
    norm: torch.Tensor  # [value_dim] fp32: the gated RMSNorm's weight
    out_proj: object
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    eps: float

    @staticmethod
    def shard(kind: str, tp, config) -> tuple[int, torch.Tensor] | None:
        """A tensor-parallel rank's key heads and the value heads they serve (llama.cpp's tiled order: value head
        j * key_heads + k uses key head k), listed so that the rank's own heads keep that order: their rows of the
        input projections and the convolution, their entries of A and dt_bias, their columns of ssm_out."""
        from ..distributed.tp import head_rows

        if kind not in _DELTA_NET_TENSORS:
            return None
        s = config.recurrent
        keys = tuple(range(*tp.recurrent))
        values = tuple(j * s.key_heads + k for j in range(s.value_heads // s.key_heads) for k in keys)
        qkv = torch.cat([head_rows(keys, s.key_dim), s.key_heads * s.key_dim + head_rows(keys, s.key_dim),
                         2 * s.key_heads * s.key_dim + head_rows(values, s.value_dim)])
        selections = {"attn_qkv": (0, qkv), "ssm_conv1d": (0, qkv), "attn_gate": (0, head_rows(values, s.value_dim)),
                      "ssm_beta": (0, torch.tensor(values)), "ssm_alpha": (0, torch.tensor(values)),
                      "ssm_a": (0, torch.tensor(values)), "ssm_dt": (0, torch.tensor(values)),
                      "ssm_out": (1, head_rows(values, s.value_dim))}
        return selections.get(kind)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.conv.shape[0], self.conv.shape[1] - 1), (self.value_heads, self.key_dim, self.value_dim)]

    def linears(self) -> list:
        return [self.in_proj, self.out_proj]

    def __call__(self, h: torch.Tensor, fp, states) -> torch.Tensor:
        qk, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        proj = linear(h, self.in_proj, None, fp.batch_invariant).float()
        mixed, z, b, alpha = proj.split([2 * qk + vd, vd, self.value_heads, self.value_heads], dim=-1)
        inputs = (mixed, b, alpha, z)  # the kernel's order
        scan = delta_rule.per_token if fp.batch_invariant else delta_rule.chunked
        runs = None
        if fp.delta_kernel:
            runs = lambda i, s, r, o: fp.kernels.gated_delta_runs(  # noqa: E731
                *i, self.conv, self.a, self.dt_bias, self.norm, self.eps, *s, r, self.key_heads, o)
        o = _over_sequences(fp, inputs, states, lambda i, s: self._seq(i, s, scan), self._step, vd, runs)
        return fp.all_reduce(linear(o.to(h.dtype), self.out_proj, None, fp.batch_invariant))

    def _gates(self, b: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule's log-decay g = -exp(A) softplus(alpha + dt_bias) and its write strength beta = sigmoid(b)."""
        return self.a * F.softplus(alpha + self.dt_bias), b.sigmoid()

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The rule's output [rows, value_heads, value_dim] RMS-normalized per head and gated by SiLU(z), flat."""
        rows = o.shape[0]
        o = F.rms_norm(o, (self.value_dim,), self.norm, self.eps)
        return (o * F.silu(z.reshape(rows, self.value_heads, self.value_dim))).reshape(rows, -1)

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [rows, value_heads, key_dim] (normalized, q scaled, repeated to the value heads) and v
        [rows, value_heads, value_dim] from the convolution's SiLU output [rows, channels]."""
        rows, qk = conv_out.shape[0], self.key_heads * self.key_dim
        q, k, v = F.silu(conv_out).split([qk, qk, self.value_heads * self.value_dim], dim=-1)
        repeat = self.value_heads // self.key_heads
        q, k = (_l2_normalized(t.view(rows, self.key_heads, self.key_dim)).repeat(1, repeat, 1)
                for t in (q, k))
        return q * self.key_dim ** -0.5, k, v.view(rows, self.value_heads, self.value_dim)

    def _seq(self, inputs: tuple, start: list, scan) -> tuple:
        mixed, b, alpha, z = inputs
        conv_out, tail = delta_rule.conv_continue(mixed, start[0], self.conv)
        q, k, v = self._qkv(conv_out)
        o, state = scan(q, k, v, *self._gates(b, alpha), start[1])
        return self._gated_norm(o, z), [tail, state]

    def _step(self, inputs: tuple, start: list) -> tuple:
        mixed, b, alpha, z = inputs
        conv_out, tails = delta_rule.conv_step(mixed, start[0], self.conv)
        q, k, v = self._qkv(conv_out)
        o, state = delta_rule.delta_step(q, k, v, *self._gates(b, alpha), start[1])
        return self._gated_norm(o, z), [tails, state]
