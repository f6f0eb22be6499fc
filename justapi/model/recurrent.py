"""The recurrent token mixers of hybrid models, in place of attention in some of their layers: LFM2's gated short
convolution and Qwen3.5's Gated DeltaNet. Each keeps a fixed-size state per sequence (model.state_cache holds it in
slots) instead of a growing KV cache.

A flat batch mixes sequences: decode rows (one new token each) are stepped together, gathering their slots' states
and scattering the new ones back; every other span (a prompt chunk) runs its own scan from its slot's state, or from
zeros where the span starts its sequence. A layer's state is a list of tensors, each [slots, ...].
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


def _over_sequences(fp, inputs: tuple, states: list[torch.Tensor], seq: Scan, step: Scan, width: int):
    """Each sequence's rows of ``inputs`` (row-major tensors) through its recurrence: the decode rows at once
    (``step``), every other span alone (``seq``); each slot's state updated in place. Returns the outputs
    [rows, width] in the batch's row order."""
    meta = fp.meta
    out = inputs[0].new_empty(inputs[0].shape[0], width)
    if meta.decode_rows is not None:
        rows, slots = meta.decode_rows, meta.decode_state_slots
        o, new = step(tuple(t[rows] for t in inputs), [s.index_select(0, slots) for s in states])
        out[rows] = o.to(out.dtype)
        for s, n in zip(states, new):
            s.index_copy_(0, slots, n.to(s.dtype))
    for span in meta.seqs:
        if span.num_query_tokens == 1 and span.mask is None and meta.decode_rows is not None:
            continue  # stepped with the decode rows
        if span.mask is not None:
            raise ValueError("draft trees are not verified on recurrent layers")
        rows = slice(span.query_start, span.query_start + span.num_query_tokens)
        fresh = span.context_len == span.num_query_tokens  # the span starts its sequence
        start = [torch.zeros_like(s[span.state_slot]) if fresh else s[span.state_slot] for s in states]
        o, new = seq(tuple(t[rows] for t in inputs), start)
        out[rows] = o.to(out.dtype)
        for s, n in zip(states, new):
            s[span.state_slot] = n.to(s.dtype)
    return out


def _l2_normalized(t: torch.Tensor) -> torch.Tensor:
    """t / sqrt(|t|^2 + 1e-6) over the last dimension (the epsilon where transformers and FLA put it)."""
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)


@dataclass
class ShortConv:
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = C * conv(B * x); out_proj(y). Its state is the
    convolution's last K-1 inputs."""

    in_proj: object  # [3 * hidden, hidden]: B, C, x
    conv: torch.Tensor  # [hidden, K] fp32
    out_proj: object

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.conv.shape[0], self.conv.shape[1] - 1)]

    def linears(self) -> list:
        return [self.in_proj, self.out_proj]

    def __call__(self, h: torch.Tensor, fp, states: list[torch.Tensor]) -> torch.Tensor:
        b, c, x = linear(h, self.in_proj, None, fp.batch_invariant).chunk(3, dim=-1)
        weight = self.conv

        def seq(inputs, start):
            y, tail = delta_rule.conv_continue(inputs[0].float(), start[0], weight)
            return y, [tail]

        def step(inputs, start):
            y, tails = delta_rule.conv_step(inputs[0].float(), start[0], weight)
            return y, [tails]

        y = _over_sequences(fp, ((b * x),), states, seq, step, h.shape[1])
        return fp.all_reduce(linear(c * y, self.out_proj, None, fp.batch_invariant))


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

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.conv.shape[0], self.conv.shape[1] - 1), (self.value_heads, self.key_dim, self.value_dim)]

    def linears(self) -> list:
        return [self.in_proj, self.out_proj]

    def __call__(self, h: torch.Tensor, fp, states: list[torch.Tensor]) -> torch.Tensor:
        n = h.shape[0]
        qk, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        proj = linear(h, self.in_proj, None, fp.batch_invariant).float()
        mixed, z, b, alpha = proj.split([2 * qk + vd, vd, self.value_heads, self.value_heads], dim=-1)
        beta = b.sigmoid()
        g = self.a * F.softplus(alpha + self.dt_bias)
        scan = delta_rule.per_token if fp.batch_invariant else delta_rule.chunked
        o = _over_sequences(fp, (mixed, g, beta), states, lambda i, s: self._seq(i, s, scan), self._step, vd)
        o = F.rms_norm(o.view(n, self.value_heads, self.value_dim), (self.value_dim,), self.norm, self.eps)
        o = (o * F.silu(z.view(n, self.value_heads, self.value_dim))).to(h.dtype)
        return fp.all_reduce(linear(o.reshape(n, vd), self.out_proj, None, fp.batch_invariant))

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
        mixed, g, beta = inputs
        conv_out, tail = delta_rule.conv_continue(mixed, start[0], self.conv)
        q, k, v = self._qkv(conv_out)
        o, state = scan(q, k, v, g, beta, start[1])
        return o.reshape(o.shape[0], -1), [tail, state]

    def _step(self, inputs: tuple, start: list) -> tuple:
        mixed, g, beta = inputs
        conv_out, tails = delta_rule.conv_step(mixed, start[0], self.conv)
        q, k, v = self._qkv(conv_out)
        o, state = delta_rule.delta_step(q, k, v, g, beta, start[1])
        return o.reshape(o.shape[0], -1), [tails, state]
