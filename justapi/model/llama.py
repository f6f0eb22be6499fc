"""Decoder-only models over a paged KV cache, assembled at load from model.blocks' parts: the Llama family (llama,
qwen2 with QKV biases, qwen3 with QK norm, phi3 with fused tensors, the MoE variants), Gemma 2/3 and the others
model_config.ARCHS lists. What sets a family apart is chosen once per layer here (which RoPE table, or none;
which norms; a dense MLP or experts; the multipliers), so ``forward`` is the loop over layers it reads as.

``forward`` takes one flat batch: the new tokens of many sequences, each with its own positions and blocks.
Q/K/V and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..model_config import ModelConfig
from .attention import AttentionMetadata
from .blocks import Attention, Classifier, DecoderLayer, DenseMlp, ForwardPass, MoeMlp
from .decode_plan import decode_layers
from .recurrent import GatedDeltaNet, ShortConv
from .gguf_loader import Q8_SUFFIX, ModelLoadError
from . import hugepages
from .layers import RotaryEmbedding, linear
from .kernel_policy import KernelPolicy
from .moe import MoeWeights
from .quant import DenseWeight, Int4Weight, Int8RowWeight, Int8Weight
from .unpack import Q4Unpacked, Q8Unpacked, cat_q4, cat_q8


Linear = torch.Tensor | Int4Weight | Int8Weight | DenseWeight  # dense, or packed (model.quant)
PACKED = (Int4Weight, Int8Weight, DenseWeight)
_PACKED_PARTS = (Q4Unpacked, Q8Unpacked, list)  # as load_tensors keeps them: a matrix, or a list of experts


class _FileWeights:
    """The loaded tensors, taken by name as the parts are built; linears fused and packed per the kernel policy."""

    def __init__(self, tensors: dict, config: ModelConfig, device: str, policy: KernelPolicy) -> None:
        self.tensors, self.config, self.device, self.policy = tensors, config, device, policy
        # a file loaded with its integer weights packed (gguf_loader's keep_packed): its other linears are routed too
        self.packed_file = any(isinstance(t, _PACKED_PARTS) for t in tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, required: bool = True):
        t = self.tensors.pop(name, None)
        if t is None and required:
            raise ModelLoadError(f"{self.config.path}: tensor {name} is missing")
        return t if t is None or isinstance(t, _PACKED_PARTS) else t.to(self.device)

    def norm(self, name: str, required: bool = True) -> torch.Tensor | None:
        """A norm weight in fp32 (tiny), as the C++ add_rms_norm takes them."""
        t = self.take(name, required)
        return None if t is None else t.float()

    def matrix(self, *names: str) -> Linear:
        """The weights ``names`` stacked along the output dimension (see ``linear_of``)."""
        return self.linear_of([self.take(n) for n in names])

    def linear_of(self, parts: list) -> Linear:
        """Weights stacked along the output dimension: packed if all are 4-bit or all 8-bit of one form, else
        dense (a fusion of 4- and 8-bit parts, or a type no integer kernel reads)."""
        policy = self.policy
        if all(isinstance(p, Q4Unpacked) for p in parts):
            return Int4Weight(cat_q4(parts), policy)
        if all(isinstance(p, Q8Unpacked) for p in parts) and (fused := cat_q8(parts)) is not None:
            return Int8Weight(fused, policy)
        dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), policy.dtype)
        dense = [p if isinstance(p, torch.Tensor) else p.dequantize().to(self.device, dtype) for p in parts]
        w = dense[0] if len(dense) == 1 else torch.cat(dense).contiguous()
        return DenseWeight(w, policy) if self.packed_file and policy.uses("prepack") else w


class LlamaModel:
    """Weights and the forward pass of a decoder-only model (module docstring)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor | Q4Unpacked | Q8Unpacked], device: str,
                 batch_invariant: bool, tp=None, comm=None, kv_dtype: torch.dtype = torch.float32,
                 policy: KernelPolicy | None = None, huge_pages: bool = False):
        """``tp``: a distributed.tp.TpPlan; ``tensors`` are then this rank's slices (loaded with
        ``shard_selection``) and ``comm`` (a TpComm) combines the ranks' partial results. ``config`` stays the
        whole model's. ``kv_dtype``: the element type of the KV cache this model's runner allocates (fp32 or
        bf16); decode attention computes in fp32 either way, prefill attention in the cache's dtype. ``policy``:
        which kernels serve which weights (model.kernel_policy); None: the pure-torch path. ``huge_pages``: on CPU, the
        weights and this model's KV cache on transparent huge pages where available (model.hugepages)."""
        if tp is not None:
            config = dataclasses.replace(config, num_heads=len(tp.q_heads), num_kv_heads=len(tp.kv_heads),
                                         recurrent=_rank_recurrent(config, tp))
        self.config = config
        self.batch_invariant = batch_invariant
        self.kv_dtype = kv_dtype
        self.tp = tp
        self.comm = comm
        dense_dtype = tensors["token_embd.weight"].dtype if "token_embd.weight" in tensors else torch.float32
        self.policy = policy = policy or KernelPolicy.make(dense_dtype, None)
        self.kernels = policy.kernels
        weights = _FileWeights(tensors, config, device, policy)
        self.embed = weights.take("token_embd.weight")  # None once a tied head's Q8_0 form serves lookups (_head)
        self.dtype = self.embed.dtype
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.context_length, config.rope_style,
                                    device, config.rope_scaling, config.rope_dim)
        self.local_rope = self._local_rope(device)
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        self.norm = weights.norm(config.traits.final_norm + ".weight")
        self.embed_scale = self._embed_scale(device)
        self.lm_head = self._head(weights)
        # layers with a KV cache (model.runner sizes the pool by them); a hybrid's others keep states
        self.kv_layers = sum(not config.is_recurrent(i) for i in range(config.num_layers))
        self.classifier = Classifier.load(weights.take) if config.pooling == "rank" else None
        self.huge_pages = huge_pages and device == "cpu"
        if self.huge_pages:
            self._weights_to_huge_pages()
        # decode steps' layers in one native call where every part has one (model.decode_plan): built last, over
        # the tensors as they stay (huge pages moved them)
        self.decode_layers = decode_layers(self) if device == "cpu" else None

    # --- assembly: each layer's parts, chosen once ---------------------------------------------------------------
    def _local_rope(self, device: str) -> RotaryEmbedding | None:
        """The sliding layers' own RoPE table where their base differs (Gemma 3's 10,000, unscaled); else None."""
        cfg, theta = self.config, self.config.traits.local_rope_theta
        if theta is None or not any(cfg.window(i) for i in range(cfg.num_layers)):
            return None
        return RotaryEmbedding(cfg.head_dim, theta, cfg.context_length, cfg.rope_style, device, rot_dim=cfg.rope_dim)

    def _layer_rope(self, i: int) -> RotaryEmbedding | None:
        cfg = self.config
        if cfg.traits.nope_every and (i + 1) % cfg.traits.nope_every == 0:
            return None  # SmolLM3: every Nth layer has no positional encoding
        return self.local_rope if cfg.window(i) and self.local_rope is not None else self.rope

    def _layer(self, w: _FileWeights, i: int) -> DecoderLayer:
        cfg, p = self.config, f"blk.{i}."
        post = cfg.traits.post_norms
        mixer = self._recurrent(w, p) if cfg.is_recurrent(i) else self._attention(w, i)
        return DecoderLayer(
            attn_norm=w.norm(p + "attn_norm.weight"), attn=mixer,
            ffn_norm=w.norm(p + cfg.traits.ffn_norm + ".weight"),
            mlp=self._mlp(w, p), post_attn_norm=w.norm(p + "post_attention_norm.weight") if post else None,
            post_ffn_norm=w.norm(p + "post_ffw_norm.weight") if post else None, residual_scale=cfg.residual_scale)

    def _attention(self, w: _FileWeights, i: int) -> Attention:
        cfg, p = self.config, f"blk.{i}."
        # Phi-3 stores Q/K/V as one attn_qkv tensor: taken as stored
        names = ["attn_qkv"] if w.has(p + "attn_qkv.weight") else ["attn_q", "attn_k", "attn_v"]
        return Attention(
            qkv=w.matrix(*(p + n + ".weight" for n in names)),
            qkv_bias=torch.cat([w.take(p + n + ".bias") for n in names]) if cfg.qkv_bias else None,
            q_norm=w.norm(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=w.norm(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            o=w.matrix(p + "attn_output.weight"), heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, scale=cfg.attention_scale or cfg.head_dim ** -0.5, rope=self._layer_rope(i),
            window=cfg.window(i), softcap=cfg.attn_softcap, gated=cfg.traits.gated_attention)

    def _recurrent(self, w: _FileWeights, p: str) -> ShortConv | GatedDeltaNet:
        """A hybrid's recurrent layer, from the tensors llama.cpp's converter writes (model.hybrid_meta)."""
        shape = self.config.recurrent
        assert shape is not None  # a recurrent layer's file states its shape (hybrid_meta)
        if shape.kind == "short_conv":
            return ShortConv(w.matrix(p + "shortconv.in_proj.weight"), w.take(p + "shortconv.conv.weight").float(),
                             w.matrix(p + "shortconv.out_proj.weight"))
        return GatedDeltaNet(
            w.matrix(*(p + n + ".weight" for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"))),
            w.take(p + "ssm_conv1d.weight").float(), w.take(p + "ssm_a").float().flatten(),
            w.take(p + "ssm_dt.bias").float().flatten(), w.norm(p + "ssm_norm.weight"), w.matrix(p + "ssm_out.weight"),
            shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim, self.config.rms_norm_eps)

    def _mlp(self, w: _FileWeights, p: str) -> DenseMlp | MoeMlp:
        act = self.config.traits.mlp_act
        if self.config.num_experts:
            return MoeMlp(self._moe_weights(w, p), act)
        # Phi-3 stores gate and up as one ffn_up of twice the rows: taken as stored
        names = ["ffn_gate", "ffn_up"] if w.has(p + "ffn_gate.weight") else ["ffn_up"]
        return DenseMlp(w.matrix(*(p + n + ".weight" for n in names)), w.matrix(p + "ffn_down.weight"), act)

    def _moe_weights(self, w: _FileWeights, p: str) -> MoeWeights:
        """Layer ``p``'s experts, each expert's gate and up fused (packed where all parts are, else dense), the
        router in fp32, and the shared expert, which under tensor parallelism rank 0 alone computes (the MLP's
        all-reduce adds it once)."""
        cfg = self.config
        downs = w.take(p + "ffn_down_exps.weight")
        experts = range(len(downs))  # a tensor's first dimension, or a list of packed experts
        if w.has(p + "ffn_gate_up_exps.weight"):  # llama.cpp's fused form: each expert's gate rows, then its up rows
            fused = w.take(p + "ffn_gate_up_exps.weight")
            gate_ups = [w.linear_of([fused[e]]) for e in experts]
        else:
            gates, ups = (w.take(p + f"ffn_{n}_exps.weight") for n in ("gate", "up"))
            gate_ups = [w.linear_of([gates[e], ups[e]]) for e in experts]
        plain = lambda t: t if isinstance(t, torch.Tensor) else t.dequantize()  # noqa: E731  (router, gate: small)
        moe = MoeWeights(plain(w.take(p + "ffn_gate_inp.weight")).float(), gate_ups,
                         [w.linear_of([downs[e]]) for e in experts],
                         self.tp.experts[0] if self.tp is not None else 0, cfg.num_experts_used,
                         cfg.traits.moe_norm_top_k)
        up = w.take(p + "ffn_up_shexp.weight", False)
        if up is not None:
            gate, down = w.take(p + "ffn_gate_shexp.weight"), w.take(p + "ffn_down_shexp.weight")
            shared_gate = w.take(p + "ffn_gate_inp_shexp.weight")
            if self.tp is None or self.tp.rank == 0:
                moe.shared_gate_up, moe.shared_down = w.linear_of([gate, up]), w.linear_of([down])
                moe.shared_gate = plain(shared_gate).float().flatten()
        return moe

    def _embed_scale(self, device: str) -> torch.Tensor | None:
        """What token embeddings are multiplied by: Gemma's sqrt(hidden), Granite's embedding multiplier; rounded
        to the embedding's dtype, as transformers does."""
        cfg = self.config
        scale = cfg.hidden_size ** 0.5 if cfg.traits.embed_scale else cfg.embedding_scale
        return None if scale is None else torch.tensor(scale).to(device, self.dtype)

    def _head(self, w: _FileWeights) -> Linear | Int8RowWeight:
        """The LM head: ``output.weight``, or the token embedding where the file ties them. A packed model's dense
        head keeps int8 rows for small batches and its Q8_0 form for larger ones on AMX."""
        head = "output.weight" if w.has("output.weight") else "token_embd.weight"
        q8_forms = {n: w.take(n + Q8_SUFFIX, False) for n in ("output.weight", "token_embd.weight")}  # load_tensors
        lm_head = w.matrix("output.weight") if head == "output.weight" else self.embed
        packed = q8_forms[head] is not None or any(
            isinstance(x, PACKED) for layer in self.layers for x in layer.linears())
        if isinstance(lm_head, torch.Tensor) and packed:
            lm_head = Int8RowWeight(lm_head, q8_forms[head], w.policy)
            if head == "token_embd.weight" and not hasattr(lm_head, "dense"):
                self.embed = None  # tied, and too large to keep twice: looked up in the head's Q8_0 form
        return lm_head

    # --- memory ----------------------------------------------------------------------------------------------------
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
        """This model, its layers, their parts and quantized weights: every object holding weight tensors."""
        owners = [self] + self.layers + [part for layer in self.layers for part in (layer.attn, layer.mlp)]
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

    # --- the forward pass --------------------------------------------------------------------------------------------
    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``ids``, from the embedding or, where it is tied to a head that holds only its
        Q8_0 form, from that form."""
        return F.embedding(ids, self.embed) if self.embed is not None else self.lm_head.lookup(ids)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            x = self.embed_rows(input_ids)
        else:  # this rank's vocabulary rows; other tokens look up zeros, and the sum over ranks completes x
            a, b = self.tp.vocab
            mine = ((input_ids >= a) & (input_ids < b)).unsqueeze(1).to(self.dtype)
            x = self.comm.all_reduce(self.embed_rows((input_ids - a).clamp(0, b - a - 1)) * mine)
        return x if self.embed_scale is None else x * self.embed_scale

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list,
        logits_rows: torch.Tensor,
        hidden_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (fp32) for the rows ``logits_rows`` of the flat batch; writes every new token's K/V (and a
        hybrid's states). ``caches``: each layer's (K, V), or its states (model.state_cache ``layer_caches``). With
        ``hidden_rows``, also those rows' final hidden states (after the last norm, fp32: what embeddings pool)."""
        x = self._embed(input_ids)
        fp = ForwardPass(self, positions, meta, x.device.type == "cpu")
        residual = None  # the last sublayer's output, not yet added to x
        if self.decode_layers is not None and meta.decode_rows is not None and len(meta.decode_rows) == len(x):
            native, ropes = self.decode_layers  # every row one sequence's next token
            x, residual = native.run(x, [fp.tables(rope) for rope in ropes], caches, meta.slot_mapping,
                                     meta.decode_block_tables, meta.decode_context_lens)
        else:
            for layer, cache in zip(self.layers, caches):
                x, residual = layer(x, residual, fp, cache)
        rows = logits_rows if hidden_rows is None else torch.cat([logits_rows, hidden_rows])
        # only the rows that give logits or states (row-wise from here)
        x = fp.add_norm(x[rows], residual[rows], self.norm)[1]
        n_logits = len(logits_rows)
        return self._logits(x[:n_logits]) if hidden_rows is None else (self._logits(x[:n_logits]), x[n_logits:].float())

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if not len(x):
            return x.new_empty(0, 0).float()
        logits = linear(x, self.lm_head, None, self.batch_invariant).float()
        logits = logits if self.tp is None else self.comm.gather_vocab(logits)
        if cfg.logit_scale:  # Granite: logits divided by its logits scaling
            logits = logits / cfg.logit_scale
        if cfg.final_softcap:  # Gemma 2: c·tanh(logits / c)
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits


def _rank_recurrent(config: ModelConfig, tp):
    """The recurrent layers' shape on rank ``tp``: its share of Gated DeltaNet's key heads and their value heads."""
    shape = config.recurrent
    if shape is None or shape.kind != "gated_delta":
        return shape  # a short convolution's channels are its tensors' rows
    keys = tp.recurrent[1] - tp.recurrent[0]
    return dataclasses.replace(shape, key_heads=keys, value_heads=keys * (shape.value_heads // shape.key_heads))


def shard_selection(name: str, tp, config: ModelConfig):
    """The rows (dim 0) or columns (dim 1) of the GGUF tensor ``name`` [out, in] that rank ``tp`` holds, or None
    for the whole tensor (see distributed.tp for the split); gguf_loader.load_tensors reads only those. The
    embedding and the head split by vocabulary rows; each layer part says how its own tensors split."""
    # a layer's tensor by its name between "blk.N." and ".weight" / ".bias" (attn_q, shortconv.in_proj, ssm_a)
    kind = name.split(".", 2)[2].removesuffix(".weight").removesuffix(".bias") if name.startswith("blk.") \
        else name.split(".")[0]
    if kind in ("token_embd", "output"):  # vocabulary rows
        return 0, torch.arange(*tp.vocab)
    # a layer's token mixer: attention, or a hybrid's recurrent layer (Qwen3.5's attn_qkv is its DeltaNet's)
    recurrent = name.startswith("blk.") and config.is_recurrent(int(name.split(".")[1]))
    mixers = (ShortConv, GatedDeltaNet) if recurrent else (Attention,)
    for part in (*mixers, DenseMlp, MoeMlp):
        selection = part.shard(kind, tp, config)
        if selection is not None:
            return selection
    return None  # norms, a mixture of experts' router and shared expert, a reranker's head: replicated
