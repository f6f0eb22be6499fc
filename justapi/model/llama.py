"""The Llama family (llama, qwen2 with QKV biases, qwen3 with QK norm, phi3 with fused tensors) and Gemma 2/3 over a
paged KV cache.

Gemma is Llama with the differences model_config.ARCHS names: embeddings scaled by sqrt(hidden), a norm on each
sublayer's output before its residual add, GELU (tanh) in the MLP, sliding-window layers (Gemma 3: five to each
global one, RoPE base 10,000; Gemma 2: every other one) and, for Gemma 2, soft-capped attention scores and logits.

``forward`` takes one flat batch: the new tokens of many sequences, each with its own positions and blocks.
Q/K/V and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model_config import ModelConfig
from .attention import AttentionMetadata, paged_attention, write_kv
from .gguf_loader import Q8_SUFFIX, ModelLoadError
from . import hugepages
from .layers import RotaryEmbedding, linear, rms_norm
from .kernel_policy import KernelPolicy
from .moe import MoeWeights, moe_mlp
from .quant import DenseWeight, Int4Weight, Int8RowWeight, Int8Weight
from .unpack import Q4Unpacked, Q8Unpacked, cat_q4, cat_q8


Linear = torch.Tensor | Int4Weight | Int8Weight | DenseWeight  # dense, or packed (model.quant)
PACKED = (Int4Weight, Int8Weight, DenseWeight)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear  # [q_size + 2 * kv_size, hidden]; linears stay packed with --dtype auto
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None  # [2 * intermediate, hidden]; None in a mixture of experts (``moe``)
    down: Linear | None
    post_attn_norm: torch.Tensor | None = None  # Gemma: the attention output normed before the residual add
    post_ffn_norm: torch.Tensor | None = None  # ... and the MLP's
    window: int | None = None  # sliding-window attention (attention.py); None: the whole context
    moe: MoeWeights | None = None  # a mixture of experts' MLP, in place of gate_up and down


class LlamaModel:
    """Weights and the forward pass of a decoder-only Llama-family model."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: str, batch_invariant: bool,
                 tp=None, comm=None, kv_dtype: torch.dtype = torch.float32, policy: KernelPolicy | None = None,
                 huge_pages: bool = False):
        """``tp``: a distributed.tp.TpPlan; ``tensors`` are then this rank's slices (loaded with
        ``shard_selection``) and ``comm`` (a TpComm) combines the ranks' partial results. ``config`` stays the
        whole model's. ``kv_dtype``: the element type of the KV cache this model's runner allocates (fp32 or
        bf16); decode attention computes in fp32 either way, prefill attention in the cache's dtype. ``policy``:
        which kernels serve which weights (model.kernel_policy); None: the pure-torch path. ``huge_pages``: on CPU, the
        weights and this model's KV cache on transparent huge pages where available (model.hugepages)."""
        if tp is not None:
            config = dataclasses.replace(config, num_heads=len(tp.q_heads), num_kv_heads=len(tp.kv_heads))
        self.config = config
        self.batch_invariant = batch_invariant
        self.kv_dtype = kv_dtype
        self.tp = tp
        self.comm = comm

        dense_dtype = tensors["token_embd.weight"].dtype if "token_embd.weight" in tensors else torch.float32
        policy = policy or KernelPolicy.make(dense_dtype, None)

        # a file loaded with its integer weights packed (gguf_loader's keep_packed): its other linears are routed too
        packed_file = any(isinstance(t, (Q4Unpacked, Q8Unpacked, list)) for t in tensors.values())

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = tensors.pop(name, None)
            if t is None and required:
                raise ModelLoadError(f"{config.path}: tensor {name} is missing")
            if t is None or isinstance(t, (Q4Unpacked, Q8Unpacked, list)):  # packed: a matrix, or a list of experts
                return t
            return t.to(device)

        def matrix(*names: str) -> Linear:
            """The weights ``names`` stacked along the output dimension (see ``linear_of``)."""
            return linear_of([take(n) for n in names])

        def linear_of(parts: list) -> Linear:
            """Weights stacked along the output dimension: packed if all are 4-bit or all 8-bit of one form, else
            dense (a fusion of 4- and 8-bit parts, or a type no integer kernel reads)."""
            if all(isinstance(p, Q4Unpacked) for p in parts):
                return Int4Weight(cat_q4(parts), policy)
            if all(isinstance(p, Q8Unpacked) for p in parts) and (fused := cat_q8(parts)) is not None:
                return Int8Weight(fused, policy)
            dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), policy.dtype)
            dense = [p if isinstance(p, torch.Tensor) else p.dequantize().to(device, dtype) for p in parts]
            w = dense[0] if len(dense) == 1 else torch.cat(dense).contiguous()
            return DenseWeight(w, policy) if packed_file and policy.uses("prepack") else w

        self.embed = take("token_embd.weight")  # None once a tied head's Q8_0 form serves the lookups (below)
        self.dtype = self.embed.dtype
        traits = config.traits
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            post = traits.post_norms
            # Phi-3 stores Q/K/V as one attn_qkv tensor and gate/up as one ffn_up of twice the rows: taken as stored
            fused_qkv = p + "attn_qkv.weight" in tensors
            qkv_names = ["attn_qkv"] if fused_qkv else ["attn_q", "attn_k", "attn_v"]
            gate_up_names = ["ffn_gate", "ffn_up"] if p + "ffn_gate.weight" in tensors else ["ffn_up"]
            moe = self._moe_weights(take, linear_of, p, config, traits) if config.num_experts else None
            bias = torch.cat([take(p + n + ".bias") for n in qkv_names]) if config.qkv_bias else None
            self.layers.append(
                LayerWeights(
                    attn_norm=take(p + "attn_norm.weight"),
                    qkv=matrix(*(p + n + ".weight" for n in qkv_names)),
                    qkv_bias=bias,
                    q_norm=take(p + "attn_q_norm.weight") if config.qk_norm else None,
                    k_norm=take(p + "attn_k_norm.weight") if config.qk_norm else None,
                    o=matrix(p + "attn_output.weight"),
                    ffn_norm=take(p + "ffn_norm.weight"),
                    gate_up=None if moe else matrix(*(p + n + ".weight" for n in gate_up_names)),
                    down=None if moe else matrix(p + "ffn_down.weight"),
                    moe=moe,
                    post_attn_norm=take(p + "post_attention_norm.weight").float() if post else None,
                    post_ffn_norm=take(p + "post_ffw_norm.weight").float() if post else None,
                    window=config.window(i),
                )
            )
        self.norm = take("output_norm.weight")
        for layer in self.layers:  # norm weights in fp32 (tiny), as the C++ add_rms_norm takes them
            layer.attn_norm, layer.ffn_norm = layer.attn_norm.float(), layer.ffn_norm.float()
            if layer.q_norm is not None:
                layer.q_norm, layer.k_norm = layer.q_norm.float(), layer.k_norm.float()
        self.norm = self.norm.float()
        # Gemma: x * sqrt(hidden), the factor rounded to the embedding's dtype as transformers does
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5).to(device, self.dtype)
                            if traits.embed_scale else None)
        self.gelu = traits.mlp_act == "gelu_tanh"
        self._gate_act = (lambda t: F.gelu(t, approximate="tanh")) if self.gelu else F.silu
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        q8_forms = {n: tensors.pop(n + Q8_SUFFIX, None) for n in ("output.weight", "token_embd.weight")}  # load_tensors
        head_q8 = q8_forms[head]
        self.lm_head = matrix("output.weight") if head == "output.weight" else self.embed
        packed = head_q8 is not None or any(isinstance(w, PACKED) for layer in self.layers
                                            for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if isinstance(self.lm_head, torch.Tensor) and packed:
            # a packed model's dense head: int8 rows for small batches, the Q8_0 weight on AMX for larger ones
            self.lm_head = Int8RowWeight(self.lm_head, head_q8, policy)
            if head == "token_embd.weight" and not hasattr(self.lm_head, "dense"):
                self.embed = None  # tied, and too large to keep twice: looked up in the head's Q8_0 form
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.context_length, config.rope_style,
                                    device, config.rope_scaling)
        self.local_rope = None  # the sliding layers' own base (Gemma 3), else they share self.rope
        if traits.local_rope_theta is not None and any(layer.window for layer in self.layers):
            self.local_rope = RotaryEmbedding(config.head_dim, traits.local_rope_theta, config.context_length,
                                              config.rope_style, device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.policy = policy
        self.kernels = policy.kernels
        self.huge_pages = huge_pages and device == "cpu"
        if self.huge_pages:
            self._weights_to_huge_pages()

    def _moe_weights(self, take, linear_of, p: str, config: ModelConfig, traits) -> MoeWeights:
        """Layer ``p``'s experts, each expert's gate and up fused (``linear_of(parts)``: packed where all parts are,
        else dense), the router in fp32, and the shared expert, which under tensor parallelism rank 0 alone computes
        (the MLP's all-reduce adds it once)."""
        gates, ups, downs = (take(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        experts = range(len(gates))  # a tensor's first dimension, or a list of packed experts
        plain = lambda t: t if isinstance(t, torch.Tensor) else t.dequantize()  # noqa: E731  (router, gate: small)
        w = MoeWeights(plain(take(p + "ffn_gate_inp.weight")).float(), [linear_of([gates[e], ups[e]]) for e in experts],
                       [linear_of([downs[e]]) for e in experts], self.tp.experts[0] if self.tp is not None else 0,
                       config.num_experts_used, traits.moe_norm_top_k)
        up = take(p + "ffn_up_shexp.weight", False)
        if up is not None:
            gate, down = take(p + "ffn_gate_shexp.weight"), take(p + "ffn_down_shexp.weight")
            shared_gate = take(p + "ffn_gate_inp_shexp.weight")
            if self.tp is None or self.tp.rank == 0:
                w.shared_gate_up, w.shared_down = linear_of([gate, up]), linear_of([down])
                w.shared_gate = plain(shared_gate).float().flatten()
        return w

    def _weights_to_huge_pages(self) -> None:
        """Every plain weight tensor (the linears' packed and dense forms, norms, embedding) copied into one
        huge-page arena. oneDNN's prepacked bf16 copies are opaque tensors and stay where oneDNN put them."""
        slots = [(o, name) for o in self._weight_owners() for name, t in vars(o).items()
                 if isinstance(t, torch.Tensor) and not t.is_mkldnn and t.device.type == "cpu"]
        unique = list({id(getattr(o, n)): getattr(o, n) for o, n in slots}.values())  # a tied head is the embedding
        placed = dict(zip(map(id, unique), hugepages.gather(unique)))
        for o, name in slots:
            setattr(o, name, placed[id(getattr(o, name))])

    def _weight_owners(self) -> list:
        """This model, its layers and their quantized weights: every object holding weight tensors."""
        owners = [self] + self.layers
        for owner in list(owners):
            owners += [w for w in vars(owner).values() if isinstance(w, (*PACKED, Int8RowWeight, MoeWeights))]
        for moe in [o for o in owners if isinstance(o, MoeWeights)]:  # packed experts hold their own forms
            owners += [w for w in moe.gate_up + moe.down + [moe.shared_gate_up, moe.shared_down]
                       if isinstance(w, PACKED)]
        return owners

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor this model holds (each form of each weight; a tied head counted once)."""
        tensors = {id(t): t for o in self._weight_owners() for t in vars(o).values() if isinstance(t, torch.Tensor)}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _fused_norm(self, t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dimension through the C++ add_rms_norm, with no residual: torch's composite norm
        takes ~20 us a call on one decode row (Gemma 3: 72 calls a token, the QK norms and the post-norms), the
        kernel ~1 us; it rounds once, as the fused norms of the residual stream do."""
        rows = t.reshape(-1, t.shape[-1]).contiguous()
        return self.kernels.add_rms_norm(rows, None, weight, self.config.rms_norm_eps)[1].view(t.shape)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``ids``, from the embedding or, where it is tied to a head that holds only its
        Q8_0 form, from that form."""
        return F.embedding(ids, self.embed) if self.embed is not None else self.lm_head.lookup(ids)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,
        hidden_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (fp32) for the rows ``logits_rows`` of the flat batch; writes every new token's K/V. With
        ``hidden_rows``, also those rows' final hidden states (after the last norm, fp32: what embeddings pool)."""
        cfg = self.config
        bi = self.batch_invariant
        if self.tp is None:
            x = self.embed_rows(input_ids)
        else:  # this rank's vocabulary rows; other tokens look up zeros, and the sum over ranks completes x
            a, b = self.tp.vocab
            mine = ((input_ids >= a) & (input_ids < b)).unsqueeze(1).to(self.dtype)
            x = self.comm.all_reduce(self.embed_rows((input_ids - a).clamp(0, b - a - 1)) * mine)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        n = x.shape[0]
        tables = self.rope.tables(positions)  # once, not per layer
        local_tables = self.local_rope.tables(positions) if self.local_rope is not None else tables
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        # the C++ layer ops (justapi.kernels.layer_ops): x += residual and the norm in one call, rotary and the
        # K/V store in another, silu(gate) * up in a third; the torch path below computes the same (rotary and
        # silu bit-identical, the norm's sum of squares in another order)
        fused = self.policy.layer_ops and x.device.type == "cpu"
        fused_silu = fused and self.policy.uses("fused_silu") and not self.gelu
        prefill_kernel = self.policy.uses("prefill_attention") and x.device.type == "cpu"
        norm = self._fused_norm if fused else lambda t, w: rms_norm(t, w, eps)  # the norms with no residual add
        residual = None  # the last sublayer's output, not yet added to x
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = local_tables if layer.window else tables
            if fused:
                x, h = self.kernels.add_rms_norm(x, residual, layer.attn_norm, eps)
            else:
                x = x if residual is None else x + residual
                h = rms_norm(x, layer.attn_norm, eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias, bi)
            # the queries are fp32 whatever the weights' dtype; the cache stores K/V in its own dtype (write_kv), and
            # attention reads them in fp32, except prefill chunks over a bf16 cache of a bf16 model (paged_attention)
            if layer.q_norm is None and fused:
                q = self.kernels.rope_write_kv(qkv, cos, sin, self.rope.style == "neox", cfg.num_heads,
                                               cfg.num_kv_heads, cfg.head_dim, k_cache, v_cache, meta.slot_mapping)
            else:
                v = qkv[:, self.q_size + self.kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
                if layer.q_norm is None:  # Q and K heads side by side are rotated as one tensor (elementwise)
                    qk = self.rope.rotate(qkv[:, : self.q_size + self.kv_size].view(n, qk_heads, cfg.head_dim)
                                          .float(), cos, sin)
                    q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
                else:
                    q = qkv[:, : self.q_size].view(n, cfg.num_heads, cfg.head_dim)
                    k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
                    q = self.rope.rotate(norm(q, layer.q_norm).float(), cos, sin)
                    k = self.rope.rotate(norm(k, layer.k_norm).float(), cos, sin)
                write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self.kernels, bi, x.dtype,
                                   layer.window, cfg.attn_softcap, prefill_kernel).to(x.dtype)
            o = linear(attn.reshape(n, self.q_size), layer.o, None, bi)
            o = o if self.tp is None else self.comm.all_reduce(o)
            if layer.post_attn_norm is not None:
                o = norm(o, layer.post_attn_norm)
            if fused:
                x, h = self.kernels.add_rms_norm(x, o, layer.ffn_norm, eps)
            else:
                x = x + o
                h = rms_norm(x, layer.ffn_norm, eps)
            if layer.moe is not None:
                down = moe_mlp(h, layer.moe, self._gate_act).to(x.dtype)
            else:
                gate_up = linear(h, layer.gate_up, None, bi)
                if fused_silu and gate_up.shape[1] % 32 == 0:  # bit-identical to the two torch ops below
                    act = self.kernels.silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = self._gate_act(gate) * up
                down = linear(act, layer.down, None, bi)
            residual = down if self.tp is None else self.comm.all_reduce(down)
            if layer.post_ffn_norm is not None:
                residual = norm(residual, layer.post_ffn_norm)
        rows = logits_rows if hidden_rows is None else torch.cat([logits_rows, hidden_rows])
        x, residual = x[rows], residual[rows]  # only the rows that give logits or states (row-wise from here)
        if fused:
            x = self.kernels.add_rms_norm(x, residual, self.norm, eps)[1]
        else:
            x = rms_norm(x + residual, self.norm, eps)
        n_logits = len(logits_rows)
        logits = linear(x[:n_logits], self.lm_head, None, bi).float() if n_logits else x.new_empty(0, 0).float()
        logits = logits if self.tp is None or not n_logits else self.comm.gather_vocab(logits)
        if cfg.final_softcap:  # Gemma 2: c·tanh(logits / c)
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits if hidden_rows is None else (logits, x[n_logits:].float())


def shard_selection(name: str, tp, config: ModelConfig):
    """The rows (dim 0) or columns (dim 1) of the GGUF tensor ``name`` [out, in] that rank ``tp`` holds, or None
    for the whole tensor (see distributed.tp for the split); gguf_loader.load_tensors reads only those."""
    from ..distributed.tp import head_rows

    head_dim = config.head_dim

    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if kind in ("token_embd", "output"):  # vocabulary rows
        return 0, torch.arange(*tp.vocab)
    if kind == "attn_q":  # weight rows and bias entries of the rank's query heads
        return 0, head_rows(tp.q_heads, head_dim)
    if kind in ("attn_k", "attn_v"):  # ... of its KV heads (repeated where replicated)
        return 0, head_rows(tp.kv_heads, head_dim)
    if kind == "attn_qkv":  # Phi-3: Q, K and V rows in one tensor, each part's rows as above
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        kv = head_rows(tp.kv_heads, head_dim)
        return 0, torch.cat([head_rows(tp.q_heads, head_dim), q_size + kv, q_size + kv_size + kv])
    if kind == "ffn_up" and config.arch == "phi3":  # gate rows, then up rows, in one tensor
        rows = torch.arange(*tp.ffn)
        return 0, torch.cat([rows, config.intermediate_size + rows])
    if kind == "attn_output":
        return 1, head_rows(tp.q_heads, head_dim)
    if kind in ("ffn_gate", "ffn_up"):
        return 0, torch.arange(*tp.ffn)
    if kind == "ffn_down":
        return 1, torch.arange(*tp.ffn)
    if kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):  # the rank's experts, whole
        return 0, torch.arange(*tp.experts)
    return None  # norms, a mixture of experts' router and shared expert: replicated
