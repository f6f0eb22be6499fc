"""What a model is, as the engine sees it: ``ModelConfig``, the facts a GGUF file's metadata states, and ``ARCHS``,
what sets each supported architecture apart from Llama (what the file does not state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchTraits:
    """What sets an architecture apart from Llama, for the one decoder in model/llama.py. Everything a GGUF file
    states (sizes, biases and norms present, the window) is read from the file; these are what it does not state."""

    rope_style: str = "neox"  # "norm": rotate adjacent pairs (llama.cpp's llama); "neox": rotate halves
    mlp_act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh"
    embed_scale: bool = False  # token embeddings times sqrt(hidden) (Gemma)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual add (Gemma 2/3)
    sliding_window: bool = False  # reads {arch}.attention.sliding_window (other families' files may carry the key
    # for a model that transformers and JustAPI run without a window)
    global_every: int = 0  # with a sliding window: every Nth layer attends globally (Gemma 3: 6); 0: every layer
    local_rope_theta: float | None = None  # the sliding layers' RoPE base where it differs (Gemma 3: 10,000)
    moe_norm_top_k: bool = False  # mixture of experts: the top-k routing weights renormalized to sum to 1
    nope_every: int = 0  # every Nth layer attends without RoPE (SmolLM3: 4); 0: every layer has it
    # an encoder (model.encoder): bidirectional attention over each whole prompt, post-norm LayerNorm layers,
    # pooled states out, no LM head; RoPE where the file has no position embeddings (nomic-bert)
    encoder: bool = False
    final_norm: str = "output_norm"  # the norm after the last layer (LFM2's file calls it token_embd_norm)
    ffn_norm: str = "ffn_norm"  # the norm before each MLP (Qwen3.5's file calls it post_attention_norm)
    gated_attention: bool = False  # attn_q holds each head's query and an output gate, sigmoid(gate) * attention


ARCHS = {
    # a llama file with {arch}.attention.sliding_window (Mistral 7B v0.1's 4096) attends through that window
    "llama": ArchTraits(rope_style="norm", sliding_window=True),
    "qwen2": ArchTraits(),
    "qwen3": ArchTraits(),
    # mixtures of experts (model/moe.py): Qwen2-MoE with a shared expert and raw top-k softmax weights, Qwen3-MoE
    # (QK norm) with renormalized ones (llama.cpp's and transformers' GGUF defaults for each)
    "qwen2moe": ArchTraits(),
    "qwen3moe": ArchTraits(moe_norm_top_k=True),
    # Phi-3: fused attn_qkv and gate/up (ffn_up) tensors, which the model reads as stored; a window where the file
    # gives one (Phi-3 mini's 2047, on every layer)
    "phi3": ArchTraits(sliding_window=True),
    # Gemma 2 and 3: the GGUF stores norm weights as 1 + w (llama.cpp's converter), so their RMSNorm is Llama's;
    # the attention scale is head_dim ** -0.5, as llama.cpp uses for every size but 27B. Gemma 2 also soft-caps
    # attention scores and logits ({arch}.attn_logit_softcapping, final_logit_softcapping: ModelConfig)
    "gemma2": ArchTraits(mlp_act="gelu_tanh", embed_scale=True, post_norms=True, sliding_window=True, global_every=2),
    "gemma3": ArchTraits(mlp_act="gelu_tanh", embed_scale=True, post_norms=True, sliding_window=True, global_every=6,
                         local_rope_theta=10000.0),
    # SmolLM3: Llama with no RoPE on every fourth layer (3, 7, ...: llama.cpp's n_no_rope_layer_step, which the
    # file does not state)
    "smollm3": ArchTraits(rope_style="norm", nope_every=4),
    # Granite 3.x (dense): Llama with the multipliers its file states (ModelConfig: embedding_scale, residual_scale,
    # attention_scale, logit_scale)
    "granite": ArchTraits(rope_style="norm"),
    # BERT-family encoders for embeddings and reranking: bert (learned positions, GELU), nomic-bert (RoPE, SwiGLU)
    "bert": ArchTraits(encoder=True, mlp_act="gelu"),
    "nomic-bert": ArchTraits(encoder=True, mlp_act="silu"),
    # hybrids (model.recurrent): LFM2's short convolutions between GQA layers with QK norm; Qwen3.5's Gated DeltaNet
    # with every {arch}.full_attention_interval-th layer gated attention, partial RoPE (the file's 1 + w norms)
    "lfm2": ArchTraits(final_norm="token_embd_norm"),
    "qwen35": ArchTraits(ffn_norm="post_attention_norm", gated_attention=True),
    # Qwen3.5's mixture of experts: softmax, top-k renormalized, a shared expert behind its sigmoid gate
    "qwen35moe": ArchTraits(ffn_norm="post_attention_norm", gated_attention=True, moe_norm_top_k=True),
}
SUPPORTED_ARCHS = tuple(ARCHS)


# rope.scaling.type values served; per-frequency factors come as tensors (rope_freqs: llama3's; rope_factors_long
# and _short: LongRoPE's)
ROPE_SCALING_KINDS = ("none", "linear", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How the file stretches RoPE past its training context (none where it does not)."""

    kind: str = "none"
    factor: float = 1.0  # linear and YaRN: the context's stretch
    original_context: int | None = None  # YaRN and LongRoPE: the context the model was trained at
    attn_factor: float = 1.0  # YaRN: llama.cpp's extra multiplier of its attention scaling; LongRoPE: the whole one
    beta_fast: float = 32.0  # YaRN: the frequencies kept (rotations within the original context) ...
    beta_slow: float = 1.0  # ... and those interpolated, with a ramp between
    freq_factors: tuple[float, ...] | None = None  # divisors of each frequency (Llama 3.x's rope_freqs)
    # LongRoPE (Phi-3.5, Phi-4-mini): divisors for a served context up to the original one, and past it
    short_factors: tuple[float, ...] | None = None
    long_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported; supported: {', '.join(ROPE_SCALING_KINDS)} "
                             "and per-frequency factors (rope_freqs)")
        if self.kind in ("yarn", "longrope") and not self.original_context:
            raise ValueError(f"{self.kind} RoPE scaling needs rope.scaling.original_context_length")
        if self.kind == "longrope" and not (self.short_factors and self.long_factors):
            raise ValueError("LongRoPE needs both rope_factors_short and rope_factors_long")
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")

    def divisors(self, context: int) -> tuple[float, ...] | None:
        """Each frequency's divisor for a model serving ``context`` tokens: LongRoPE's long factors past the
        original context, its short ones within it (chosen per served context, as llama.cpp and vLLM do: one table
        keeps every cached key valid), else the file's per-frequency factors, if any."""
        if self.kind == "longrope":
            return self.long_factors if context > self.original_context else self.short_factors
        return self.freq_factors


@dataclass(frozen=True)
class RecurrentShape:
    """The sizes of a hybrid model's recurrent layers (model.recurrent), as its file states them."""

    kind: str  # "short_conv" (LFM2) or "gated_delta" (Qwen3.5)
    conv_kernel: int  # the causal convolution's length (its state keeps the last conv_kernel - 1 inputs)
    key_heads: int = 0  # Gated DeltaNet: query/key heads ({arch}.ssm.group_count) ...
    value_heads: int = 0  # ... value heads ({arch}.ssm.time_step_rank)
    key_dim: int = 0  # ... each key head's size ({arch}.ssm.state_size)
    value_dim: int = 0  # ... each value head's ({arch}.ssm.inner_size / value_heads)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts read from a GGUF file's metadata (see ``model.gguf_loader.read_model_config``)."""

    path: str
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # per layer, the attention window in tokens (each token sees itself and the window - 1 before it), None: all
    layer_windows: tuple[int | None, ...] = ()
    pooling: str = "last"  # what /v1/embeddings pools: the file's {arch}.pooling_type, else the last token
    # a reranker's (pooling "rank") classifier labels ({arch}.classifier.output_labels; Qwen3-Reranker: yes, no)
    classifier_labels: tuple[str, ...] = ()
    attn_softcap: float | None = None  # attention scores s -> c·tanh(s / c) before the softmax (Gemma 2)
    num_experts: int = 0  # a mixture of experts' experts per layer ({arch}.expert_count); 0: a dense MLP
    num_experts_used: int = 0  # experts per token ({arch}.expert_used_count)
    final_softcap: float | None = None  # logits likewise
    rope_scaling: RopeScaling = RopeScaling()  # how the file stretches RoPE (model.rope); the global layers' only
    rope_dim: int | None = None  # dimensions of each head that RoPE rotates ({arch}.rope.dimension_count); None: all
    # Granite's multipliers ({arch}.embedding_scale, residual_scale, attention.scale, logit_scale); None: absent
    embedding_scale: float | None = None  # token embeddings times this
    residual_scale: float | None = None  # each sublayer's output times this before its residual add
    attention_scale: float | None = None  # the attention scores' scale, in place of head_dim ** -0.5
    logit_scale: float | None = None  # logits divided by this
    # a hybrid's layers: per layer True where it keeps a recurrent state (shaped by ``recurrent``) instead of a KV
    # cache; () for a model whose every layer attends
    recurrent_layers: tuple[bool, ...] = ()
    recurrent: RecurrentShape | None = None

    def __post_init__(self) -> None:
        assert self.arch in SUPPORTED_ARCHS, self.arch
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of KV heads"
        assert not self.layer_windows or len(self.layer_windows) == self.num_layers

    @property
    def traits(self) -> ArchTraits:
        return ARCHS[self.arch]

    @property
    def is_encoder(self) -> bool:
        return self.traits.encoder

    @property
    def rope_style(self) -> str:
        return self.traits.rope_style

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def is_hybrid(self) -> bool:
        return any(self.recurrent_layers)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None
