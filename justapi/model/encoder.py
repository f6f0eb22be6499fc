"""BERT-family encoders (bert, nomic-bert) in llama.cpp's GGUF layout, for embeddings and reranking.

Each sequence's whole prompt is computed in one step (the scheduler's ``whole_prompts``): attention is
bidirectional, so no token's state is final before the last token is in, and nothing is cached (no KV pool, no
prefix cache). The layers are post-norm: ``x = LN(x + attn(x))``, ``x = LN(x + mlp(x))``; the embedding is the
token's row plus token type 0 (llama.cpp's one segment) plus a learned position (bert), normed; nomic-bert rotates
Q and K instead (neox RoPE) and gates its MLP (SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model_config import ModelConfig
from .attention import AttentionMetadata
from .gguf_loader import ModelLoadError
from .blocks import Classifier
from .layers import RotaryEmbedding, linear
from .kernel_policy import KernelPolicy
from .unpack import Q4Unpacked, Q8Unpacked


@dataclass
class EncoderLayer:
    qkv: torch.Tensor  # [3 * hidden, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias after attention
    up: torch.Tensor
    up_bias: torch.Tensor | None
    gate: torch.Tensor | None  # nomic-bert's SwiGLU gate; None: GELU(up)
    down: torch.Tensor
    down_bias: torch.Tensor | None
    out_norm: tuple[torch.Tensor, torch.Tensor]


class EncoderModel:
    """The weights and forward pass of an encoder; the runner drives it as it drives a decoder (``forward``'s
    signature), with no KV cache and only pooling requests."""

    kv_layers = 0  # the runner allocates no KV cache

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor | Q4Unpacked | Q8Unpacked], device: str,
                 batch_invariant: bool, tp=None, comm=None, kv_dtype: torch.dtype = torch.float32,
                 policy: KernelPolicy | None = None, huge_pages: bool = False):
        """``tensors``: as gguf_loader.load_tensors returns them, all dense (an encoder is loaded unpacked)."""
        if tp is not None:
            raise ModelLoadError(f"{config.path}: an encoder ({config.arch}) is not split by --tp; serve it whole")
        self.config = config
        self.kv_dtype = kv_dtype
        self.huge_pages = False
        self.batch_invariant = batch_invariant
        self.policy = policy or KernelPolicy.make(torch.float32, None)

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = tensors.pop(name, None)
            if t is None and required:
                raise ModelLoadError(f"{config.path}: tensor {name} is missing")
            return None if t is None else t.to(device)

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return take(prefix + ".weight").float(), take(prefix + ".bias").float()

        self.embed = take("token_embd.weight")
        self.dtype = self.embed.dtype
        types = take("token_types.weight", False)
        self.type_row = None if types is None else types[0]  # every token is segment 0, as llama.cpp has it
        self.positions = take("position_embd.weight", False)
        self.embed_norm = norm("token_embd_norm")
        self.rope = None
        if self.positions is None:  # nomic-bert: rotary positions
            self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.context_length, "neox", device)
        self.layers = [self._layer(take, norm, f"blk.{i}.") for i in range(config.num_layers)]
        self.classifier = Classifier.load(take) if config.pooling == "rank" else None

    @staticmethod
    def _layer(take, norm, p: str) -> EncoderLayer:
        qkv = take(p + "attn_qkv.weight", False)
        if qkv is not None:  # nomic-bert's fused Wqkv
            bias = take(p + "attn_qkv.bias", False)
        else:
            parts = [take(p + f"attn_{n}.weight") for n in "qkv"]
            qkv = torch.cat(parts)
            biases = [take(p + f"attn_{n}.bias", False) for n in "qkv"]  # each optional, as llama.cpp has them
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, parts)])
        return EncoderLayer(
            qkv=qkv, qkv_bias=bias, o=take(p + "attn_output.weight"), o_bias=take(p + "attn_output.bias", False),
            attn_norm=norm(p + "attn_output_norm"), up=take(p + "ffn_up.weight"),
            up_bias=take(p + "ffn_up.bias", False),
            gate=take(p + "ffn_gate.weight", False), down=take(p + "ffn_down.weight"),
            down_bias=take(p + "ffn_down.bias", False), out_norm=norm(p + "layer_output_norm"))

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.type_row, self.positions, *self.embed_norm]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
            tensors += [*layer.attn_norm, *layer.out_norm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches,
                logits_rows: torch.Tensor, hidden_rows: torch.Tensor | None = None):
        """(no logits, the ``hidden_rows``' final states in fp32): every span is a whole prompt."""
        cfg = self.config
        x = F.embedding(input_ids, self.embed)
        if self.type_row is not None:
            x = x + self.type_row
        if self.positions is not None:
            x = x + self.positions[positions]
        x = self._norm(x, self.embed_norm)
        tables = self.rope.tables(positions) if self.rope is not None else None
        for layer in self.layers:
            x = self._norm(x + self._attention(x, layer, meta, tables), layer.attn_norm)
            x = self._norm(x + self._mlp(x, layer), layer.out_norm)
        logits = x.new_empty(len(logits_rows), cfg.vocab_size).float()  # none: an encoder samples nothing
        return logits if hidden_rows is None else (logits, x[hidden_rows].float())

    def _norm(self, x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weights[0].to(x.dtype), weights[1].to(x.dtype), self.config.rms_norm_eps)

    def _attention(self, x: torch.Tensor, layer: EncoderLayer, meta: AttentionMetadata, tables) -> torch.Tensor:
        n, heads, d = x.shape[0], self.config.num_heads, self.config.head_dim
        q, k, v = (t.reshape(n, heads, d) for t in linear(x, layer.qkv, layer.qkv_bias, self.batch_invariant)
                   .split(heads * d, dim=-1))
        if tables is not None:
            q, k = self.rope.rotate(q, *tables), self.rope.rotate(k, *tables)
        out = torch.empty_like(q)
        for span in meta.seqs:  # each prompt attends to all of itself, and to nothing else
            if span.context_len != span.num_query_tokens:
                raise RuntimeError("an encoder's prompt must be computed in one step (the scheduler's whole_prompts)")
            rows = slice(span.query_start, span.query_start + span.num_query_tokens)
            # [1, heads, tokens, d]: the 4-D form torch's CPU flash kernel takes (3-D inputs take its math path)
            heads_first = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(*heads_first)[0].transpose(0, 1)
        return linear(out.reshape(n, heads * d), layer.o, layer.o_bias, self.batch_invariant)

    def _mlp(self, x: torch.Tensor, layer: EncoderLayer) -> torch.Tensor:
        up = linear(x, layer.up, layer.up_bias, self.batch_invariant)
        if layer.gate is not None:  # SwiGLU
            act = F.silu(linear(x, layer.gate, None, self.batch_invariant)) * up
        else:
            act = F.gelu(up)  # erf GELU, as BERT was trained (llama.cpp computes the tanh approximation)
        return linear(act, layer.down, layer.down_bias, self.batch_invariant)
