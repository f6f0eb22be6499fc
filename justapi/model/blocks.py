"""The parts a decoder layer is assembled from, each chosen once at load (model.llama ``LlamaModel``): self-attention
over the paged cache (with its RoPE table, or none, its QK norm, window and soft-cap), a dense MLP or a mixture of
experts, and the layer around them (pre-norms, optional post-norms, a residual multiplier). A family differs by
which parts it takes (model_config.ARCHS and what the file states), never by a branch inside the layer loop.

Under tensor parallelism each part holds its rank's heads or MLP rows (``shard_selection`` below cuts them out of
the file) and sums the ranks' partial outputs itself (``ForwardPass.all_reduce``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, paged_attention, write_kv
from .layers import RotaryEmbedding, linear, rms_norm
from .moe import MoeWeights, moe_mlp
from .recurrent import GatedDeltaNet, ShortConv


class ForwardPass:
    """What every layer of one forward call shares: the batch's attention metadata, each RoPE table's rows looked
    up once, the kernel routes (the C++ layer ops where the policy has them: x += residual and the norm in one call,
    rotary and the K/V store in another, silu(gate) * up in a third; the torch path computes the same, rotary and
    silu bit-identical, the norm's sum of squares in another order) and the tensor-parallel reduction."""

    def __init__(self, model, positions: torch.Tensor, meta: AttentionMetadata, on_cpu: bool) -> None:
        self.positions = positions
        self.meta = meta
        self.kernels = model.kernels
        self.batch_invariant = model.batch_invariant
        self.eps = model.config.rms_norm_eps
        self.fused = model.policy.layer_ops and on_cpu
        self.fused_silu = self.fused and model.policy.uses("fused_silu")
        self.prefill_kernel = model.policy.uses("prefill_attention") and on_cpu
        # the C++ Gated DeltaNet runs for a hybrid's decode rows and prompt chunks (its sums in another order than
        # the torch steps that verify drafts, so --batch-invariant keeps the torch path)
        self.delta_kernel = model.policy.uses("delta_rule") and on_cpu and not model.batch_invariant
        self.comm = model.comm
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of this batch's positions in ``rope``'s table: once per table, not once per layer."""
        if id(rope) not in self._tables:
            self._tables[id(rope)] = rope.tables(self.positions)
        return self._tables[id(rope)]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
        """(x + residual, its RMSNorm): the residual stream advanced and the next sublayer's input."""
        if self.fused:
            return self.kernels.add_rms_norm(x, residual, weight, self.eps)
        x = x if residual is None else x + residual
        return x, rms_norm(x, weight, self.eps)

    def norm(self, t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm with no residual add. Fused, through the C++ add_rms_norm: torch's composite norm takes ~20 us a
        call on one decode row (Gemma 3: 72 calls a token, the QK norms and the post-norms), the kernel ~1 us; it
        rounds once, as the fused norms of the residual stream do."""
        if not self.fused:
            return rms_norm(t, weight, self.eps)
        rows = t.reshape(-1, t.shape[-1]).contiguous()
        return self.kernels.add_rms_norm(rows, None, weight, self.eps)[1].view(t.shape)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial ``t`` (itself without tensor parallelism)."""
        return t if self.comm is None else self.comm.all_reduce(t)


@dataclass
class Attention:
    """Self-attention over the paged KV cache: fused Q/K/V, optional biases and per-head QK norm, RoPE (None: the
    layer sees no positions, SmolLM3's NoPE layers), an optional sliding window and score soft-cap."""

    qkv: object  # [q_size + 2 * kv_size, hidden], dense or packed (model.quant)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: object
    heads: int  # this rank's
    kv_heads: int
    head_dim: int
    scale: float
    rope: RotaryEmbedding | None
    window: int | None = None  # sliding-window attention (attention.py); None: the whole context
    softcap: float | None = None  # scores s -> c·tanh(s / c) (Gemma 2)
    gated: bool = False  # each head's query rows followed by its gate's: the output times sigmoid(gate) (Qwen3.5)

    @staticmethod
    def shard(kind: str, tp, config) -> tuple[int, torch.Tensor] | None:
        """A tensor-parallel rank's rows or columns of the attention tensor ``kind`` (None: not attention's):
        its query heads' and KV heads' rows (Phi-3's fused attn_qkv: each part's), its heads' output columns."""
        from ..distributed.tp import head_rows

        d = config.head_dim
        if kind == "attn_q":  # weight rows and bias entries of the rank's query heads (and their gates' rows)
            return 0, head_rows(tp.q_heads, 2 * d if config.traits.gated_attention else d)
        if kind in ("attn_k", "attn_v"):  # ... of its KV heads (repeated where replicated)
            return 0, head_rows(tp.kv_heads, d)
        if kind == "attn_qkv":
            q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
            kv = head_rows(tp.kv_heads, d)
            return 0, torch.cat([head_rows(tp.q_heads, d), q_size + kv, q_size + kv_size + kv])
        if kind == "attn_output":
            return 1, head_rows(tp.q_heads, d)
        return None

    def linears(self) -> list:
        return [self.qkv, self.o]

    def __call__(self, h: torch.Tensor, fp: ForwardPass, kv: tuple[torch.Tensor, torch.Tensor]):
        n, d = h.shape[0], self.head_dim
        k_cache, v_cache = kv
        qkv = linear(h, self.qkv, self.qkv_bias, fp.batch_invariant)
        gate = None
        if self.gated:  # each head's [query | gate] rows: the gate set aside, the rest laid out as usual
            both = qkv[:, : 2 * self.heads * d].view(n, self.heads, 2 * d)
            gate = both[..., d:].reshape(n, self.heads * d)
            qkv = torch.cat([both[..., :d].reshape(n, self.heads * d), qkv[:, 2 * self.heads * d :]], dim=1)
        q_size, kv_size = self.heads * d, self.kv_heads * d
        # the queries are fp32 whatever the weights' dtype; the cache stores K/V in its own dtype (write_kv), and
        # attention reads them in fp32, except prefill chunks over a bf16 cache of a bf16 model (paged_attention)
        rope = self.rope
        if fp.fused and rope is not None and rope.whole:  # one call: QK norms (where there are), rotary, K/V store
            cos, sin = fp.tables(rope)
            q = fp.kernels.rope_write_kv(qkv, cos, sin, rope.style == "neox", self.heads, self.kv_heads, d,
                                         k_cache, v_cache, fp.meta.slot_mapping, self.q_norm, self.k_norm, fp.eps)
        else:
            q = qkv[:, :q_size].view(n, self.heads, d)
            k = qkv[:, q_size : q_size + kv_size].view(n, self.kv_heads, d)
            v = qkv[:, q_size + kv_size :].view(n, self.kv_heads, d)
            if self.q_norm is not None:
                q, k = fp.norm(q, self.q_norm), fp.norm(k, self.k_norm)
            q, k = q.float(), k.float()
            if rope is not None:
                cos, sin = fp.tables(rope)
                q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
            write_kv(k_cache, v_cache, k, v, fp.meta.slot_mapping)
        attn = paged_attention(q, k_cache, v_cache, fp.meta, self.scale, fp.kernels, fp.batch_invariant, h.dtype,
                               self.window, self.softcap, fp.prefill_kernel).to(h.dtype).reshape(n, q_size)
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        o = linear(attn, self.o, None, fp.batch_invariant)
        return o if fp.comm is None else fp.comm.all_reduce(o)


@dataclass
class DenseMlp:
    """act(gate) * up, then down: gate and up fused into one matmul."""

    gate_up: object  # [2 * intermediate, hidden], dense or packed
    down: object
    act: str  # "silu" or "gelu_tanh"

    @staticmethod
    def shard(kind: str, tp, config) -> tuple[int, torch.Tensor] | None:
        """A rank's MLP rows (gate and up; Phi-3's fused ffn_up: its gate rows, then its up rows) and the matching
        columns of down (None: not the MLP's tensor)."""
        rows = torch.arange(*tp.ffn)
        if kind == "ffn_up" and config.arch == "phi3":
            return 0, torch.cat([rows, config.intermediate_size + rows])
        if kind in ("ffn_gate", "ffn_up"):
            return 0, rows
        if kind == "ffn_down":
            return 1, rows
        return None

    def __call__(self, h: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        gate_up = linear(h, self.gate_up, None, fp.batch_invariant)
        if self.act == "silu" and fp.fused_silu and gate_up.shape[1] % 32 == 0:  # bit-identical to the torch ops
            act = fp.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = activation(self.act)(gate) * up
        down = linear(act, self.down, None, fp.batch_invariant)
        return down if fp.comm is None else fp.comm.all_reduce(down)


@dataclass
class MoeMlp:
    """A mixture of experts (model.moe) in place of the dense MLP."""

    weights: MoeWeights
    act: str

    @staticmethod
    def shard(kind: str, tp, config) -> tuple[int, torch.Tensor] | None:
        """A rank's experts, whole (the router and the shared expert are every rank's)."""
        if kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps"):
            return 0, torch.arange(*tp.experts)
        return None

    def __call__(self, h: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        return fp.all_reduce(moe_mlp(h, self.weights, activation(self.act)).to(h.dtype))


@dataclass
class Classifier:
    """A reranker's head on its pooled state (llama.cpp's cls tensors): tanh(dense) where the file has one (BERT
    cross-encoders), then the output rows. Two or more labels give the first label's softmax probability
    (Qwen3-Reranker: P(yes) against no); one gives its logit's sigmoid (as vLLM and sentence-transformers score a
    one-label cross-encoder: the order of llama.cpp's raw logit, in 0..1)."""

    out: torch.Tensor  # [labels, hidden] fp32
    out_bias: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # [hidden, hidden]
    dense_bias: torch.Tensor | None = None

    @classmethod
    def load(cls, take) -> Classifier:
        """From the file's cls.output (and cls before it where present), fp32, replicated on every rank;
        ``take(name, required)`` gives a loaded tensor."""
        def f32(name: str) -> torch.Tensor | None:
            t = take(name, False)
            return None if t is None else (t if isinstance(t, torch.Tensor) else t.dequantize()).float()

        return cls(f32("cls.output.weight"), f32("cls.output.bias"), f32("cls.weight"), f32("cls.bias"))

    def score(self, h: torch.Tensor) -> float:
        x = h if self.dense is None else torch.tanh(F.linear(h, self.dense, self.dense_bias))
        logits = F.linear(x, self.out, self.out_bias)
        return float(torch.softmax(logits, -1)[0] if len(logits) > 1 else torch.sigmoid(logits[0]))


def activation(name: str):
    return (lambda t: F.gelu(t, approximate="tanh")) if name == "gelu_tanh" else F.silu


@dataclass
class DecoderLayer:
    """Pre-norm attention and MLP on the residual stream; Gemma's norms on each sublayer's output before its add
    (``post_*_norm``), Granite's multiplier of each sublayer's output (``residual_scale``)."""

    attn_norm: torch.Tensor  # fp32, as the C++ add_rms_norm takes them
    attn: Attention | ShortConv | GatedDeltaNet  # the token mixer: attention, or a hybrid's recurrent layer
    ffn_norm: torch.Tensor
    mlp: DenseMlp | MoeMlp
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    residual_scale: float | None = None

    def __post_init__(self) -> None:
        self._plain = self.post_attn_norm is None and self.post_ffn_norm is None and self.residual_scale is None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, fp: ForwardPass, cache) -> tuple:
        """(x, residual): the stream and this layer's MLP output, not yet added to it (the next norm adds it).
        ``cache``: the layer's (K, V) cache, or a recurrent layer's states (model.state_cache)."""
        x, h = fp.add_norm(x, residual, self.attn_norm)
        o = self.attn(h, fp, cache)
        if self._plain:  # most families: the sublayers' outputs go to the stream as they are
            x, h = fp.add_norm(x, o, self.ffn_norm)
            return x, self.mlp(h, fp)
        x, h = fp.add_norm(x, self._output(o, self.post_attn_norm, fp), self.ffn_norm)
        return x, self._output(self.mlp(h, fp), self.post_ffn_norm, fp)

    def linears(self) -> list:
        """The layer's projection weights (a mixture of experts' aside)."""
        mlp = [self.mlp.gate_up, self.mlp.down] if isinstance(self.mlp, DenseMlp) else []
        return self.attn.linears() + mlp

    def _output(self, out: torch.Tensor, post_norm: torch.Tensor | None, fp: ForwardPass) -> torch.Tensor:
        out = out if post_norm is None else fp.norm(out, post_norm)
        return out if self.residual_scale is None else out * self.residual_scale
