"""Write tiny random-weight GGUF models (llama, qwen2, qwen3, gemma3) with a real byte-level BPE or SentencePiece
tokenizer."""

from __future__ import annotations

import numpy as np

import gguf

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # Qwen3's: added tokens, not special (they stay in the decoded text)
# a thinking model's template, as Qwen3's behaves: the model opens its thinking itself; enable_thinking false
# renders an empty thinking block into the prompt. "opens": DeepSeek-R1's, whose prompt opens the thinking.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
OPENING_TEMPLATE = THINKING_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "e n", "o r"]


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]  # Qwen2.5-Coder's


def vocab(think: bool = False, fim: bool = False) -> tuple[list[str], list[str], list[int]]:
    tokens = SPECIALS + _byte_tokens() + ["".join(m.split()) for m in MERGES]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    if think:
        tokens, types = tokens + THINK_TOKENS, types + [gguf.TokenType.USER_DEFINED] * len(THINK_TOKENS)
    if fim:
        tokens, types = tokens + FIM_TOKENS, types + [gguf.TokenType.CONTROL] * len(FIM_TOKENS)
    return tokens, MERGES, [int(t) for t in types]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece (llama) vocabulary: control tokens, 256 byte fallbacks, and scored pieces."""
    pieces = ["▁", "▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁hello", "▁world", "the", "at", "e", "h", "l", "o", "w",
              "r", "d", "c", "s", "t", "m", "n", "▁a"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = ([int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)]
             + [int(gguf.TokenType.BYTE)] * 256 + [int(gguf.TokenType.NORMAL)] * len(pieces))
    return tokens, scores, types


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block in ggml's 12 bytes (get_scale_min_k4's layout)."""
    scales = np.zeros((len(sc), 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return scales


def _k_groups(arr: np.ndarray, levels: int):
    """Groups of 32 spanning their own min..max in ``levels`` steps, the steps and mins quantized to 6 bits against
    their super-block's largest: (d, dmin, sc, m, q) as Q4_K and Q5_K store them."""
    g = arr.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, groups, 32]
    lo = np.minimum(g.min(-1), 0)
    step = np.maximum((g.max(-1) - lo) / levels, 1e-8)
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.maximum(dmin, 1e-8)), 0, 63).astype(np.uint8)
    q = np.clip(np.round((g + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def quantize_q4_k(arr: np.ndarray) -> np.ndarray:
    """``arr`` [out, in] as Q4_K blocks, quantized as llama.cpp's reference does in outline (gguf cannot): each group
    of 32 spans its own min..max in 15 steps (``w ≈ d·sc·q − dmin·m``), the groups' steps and mins quantized to 6
    bits against their super-block's largest (``d``, ``dmin``), packed in ggml's layout (get_scale_min_k4)."""
    d, dmin, sc, m, q = _k_groups(arr, 15)
    pairs = q.reshape(len(q), 4, 2, 32)  # groups 2i and 2i + 1 share 32 bytes: low and high nibbles
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(len(q), 128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                             _pack_k_scales(sc, m), qs], axis=1)
    return blocks.reshape(arr.shape[0], -1)


def quantize_q5_k(arr: np.ndarray) -> np.ndarray:
    """``arr`` [out, in] as Q5_K blocks (as quantize_q4_k, 31 steps a group): d, dmin, the 12 scale bytes, qh (bit i
    of byte l: the fifth bit of group i's weight l), qs (groups 2i and 2i + 1 in the low and high nibbles of run i)."""
    d, dmin, sc, m, q = _k_groups(arr, 31)
    n = len(q)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):
        qh |= ((q[:, i] >> 4) & 1) << i
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                             _pack_k_scales(sc, m), qh, qs], axis=1)
    return blocks.reshape(arr.shape[0], -1)


def quantize_q6_k(arr: np.ndarray) -> np.ndarray:
    """``arr`` [out, in] as Q6_K blocks: 16 groups of 16, each ``w ≈ d·sc·(q − 32)`` with int8 sc against the
    super-block's d; ql holds the low nibbles, qh the top two bits, in ggml's layout (gguf's dequantize reads it)."""
    g = arr.astype(np.float32).reshape(-1, 16, 16)
    n = len(g)
    step = np.maximum(np.abs(g).max(-1) / 31, 1e-8)  # [n, 16]
    d = (step.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d), 1, 127).astype(np.int8)
    q = (np.clip(np.round(g / (d * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [n, 2, 64]
    top = (q >> 4).reshape(n, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [n, 2, 32]
    blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                             d.astype(np.float16).view(np.uint8)], axis=1)
    return blocks.reshape(arr.shape[0], -1)


def _pack_two_bit(v: np.ndarray) -> np.ndarray:
    """[n, 256] values in [0, 3] as Q2_K/Q3_K's 64 qs bytes: weight half·128 + i·32 + l at bits 2i of byte
    half·32 + l."""
    v = v.reshape(len(v), 2, 4, 32)
    return (v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)).reshape(len(v), 64)


def quantize_q2_k(arr: np.ndarray) -> np.ndarray:
    """``arr`` [out, in] as Q2_K blocks: 16 groups of 16 spanning min..max in 3 steps, 4-bit scales and mins against
    the super-block's d and dmin (bytes: scales(16) qs(64) d dmin)."""
    g = arr.astype(np.float32).reshape(-1, 16, 16)
    lo = np.minimum(g.min(-1), 0)
    step = np.maximum((g.max(-1) - lo) / 3, 1e-8)
    d = (step.max(-1, keepdims=True) / 15).astype(np.float16).astype(np.float32)
    dmin = np.maximum(-lo.min(-1, keepdims=True) / 15, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d), 1, 15).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin), 0, 15).astype(np.uint8)
    q = np.clip(np.round((g + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, 3).astype(np.uint8)
    blocks = np.concatenate([sc | (m << 4), _pack_two_bit(q.reshape(len(g), 256)),
                             d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8)], axis=1)
    return blocks.reshape(arr.shape[0], -1)


def quantize_q3_k(arr: np.ndarray) -> np.ndarray:
    """``arr`` [out, in] as Q3_K blocks: 16 groups of 16, ``w ≈ d·(sc − 32)·q`` with q in [−4, 3] (stored as q + 4:
    two low bits in qs, the third in hmask) and 6-bit sc packed as gguf's dequantize unpacks them."""
    g = arr.astype(np.float32).reshape(-1, 16, 16)
    n = len(g)
    step = np.maximum(np.abs(g).max(-1) / 4, 1e-8)
    d = (step.max(-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d), 1, 31).astype(np.int16)  # stored as sc + 32
    v = (np.clip(np.round(g / (d * sc)[..., None]), -4, 3) + 4).astype(np.uint8).reshape(n, 256)
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):
        hmask |= (v[:, 32 * i : 32 * (i + 1)] >> 2) << i
    stored = (sc + 32).astype(np.uint8)  # [n, 16], 6 bits
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, :8] = (stored[:, :8] & 0x0F) | ((stored[:, 8:] & 0x0F) << 4)
    for i in range(4):
        scales[:, 8:] |= ((stored[:, 4 * i : 4 * i + 4] >> 4) & 3) << (2 * i)
    blocks = np.concatenate([hmask, _pack_two_bit(v & 3), scales, d.astype(np.float16).view(np.uint8)], axis=1)
    return blocks.reshape(arr.shape[0], -1)


K_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
                "Q6_K": quantize_q6_k}  # gguf quantizes none of them


def _write_rope_scaling(w, rope: dict, head_dim: int, theta: float, context_length: int) -> None:
    """``rope`` (transformers' rope_parameters) as llama.cpp's converter writes it."""
    kind = rope["rope_type"]
    if kind == "longrope":  # Phi-3's: the two factor sets as tensors, the attention factor precomputed, no type key
        old = rope["original_max_position_embeddings"]
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_rope_scaling_orig_ctx_len(old)
        scale = context_length / old
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(old))) if scale > 1 else 1.0)
        return
    if kind == "llama3":  # the converter's rope_freqs: each frequency's divisor under Llama 3's scaling
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        divisors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * np.pi * theta ** (i / head_dim)
            if wavelen < old / high:
                divisors.append(1.0)
            elif wavelen > old / low:
                divisors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
        return
    w.add_rope_scaling_type(gguf.RopeScalingType(kind))
    w.add_rope_scaling_factor(rope["factor"])
    if "original_max_position_embeddings" in rope:
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


RERANK_TEMPLATE = "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
GRANITE_SCALES = {"embedding": 12.0, "residual": 0.22, "attention": 0.0078125 * 8, "logits": 8.0}


def write_tiny_model(
    path: str,
    arch: str = "llama",
    *,
    tokenizer: str = "gpt2",
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate: int = 128,
    context_length: int = 512,
    tied: bool = True,
    qtype: str = "F32",
    seed: int = 0,
    weight_scale: float = 0.2,
    vocab_from: str | None = None,
    embd_qtype: str = "F32",
    sliding_window: int = 8,
    head_dim: int | None = None,
    pooling: str | None = None,
    llama_window: int | None = None,
    num_experts: int = 4,
    experts_used: int = 2,
    rope: dict | None = None,
    rope_dim: int | None = None,
    granite: dict | None = None,
    rerank: tuple[int, int] | None = None,
    chat_template: str = CHAT_TEMPLATE,
    fim: bool = False,
) -> str:
    """A random model whose linear weights are stored as ``qtype`` and its token embedding as ``embd_qtype`` (F32
    or a type gguf quantizes, e.g. Q8_0 as SmolLM2's); returns ``path``. ``gemma3``: its extra norms, QK norm,
    ``sliding_window`` on all but every sixth layer, RoPE base 1e6 for the global layers (the file's; 1e4 local).

    ``phi3``: Q/K/V fused in attn_qkv, gate and up in one ffn_up of twice the rows. ``gemma2``: Gemma 3 without QK
    norm, a window on every other layer, attention scores and logits soft-capped at 50 and 30 (transformers'
    defaults, which its GGUF loader does not read). ``llama_window``: a Mistral-style window on every llama layer.
    ``pooling``: the file's pooling type (an embedding model's). ``qwen2moe`` / ``qwen3moe``: ``num_experts``
    experts of width ``intermediate`` in 3-D tensors, ``experts_used`` a token; qwen2moe adds a shared expert of
    the same width with its sigmoid gate, and QKV biases; qwen3moe has QK norm.

    ``vocab_from``: another GGUF file whose tokenizer (every ``tokenizer.*`` key) the model takes, e.g. a tiny
    random draft model for SmolLM2.

    ``rope``: transformers' ``rope_parameters`` of a scaled RoPE (``rope_type`` llama3, linear or yarn), written as
    llama.cpp's converter does: llama3 as a ``rope_freqs`` tensor of per-frequency divisors, longrope as
    ``rope_factors_short`` and ``_long`` tensors, the others as ``rope.scaling.*`` keys. ``rope_dim``: the
    dimensions of each head rotated, where fewer than all (Phi-4-mini's partial rotary).

    ``smollm3`` and ``granite`` hold llama's tensors, drawn in the same order (the same seed gives the same weights
    as a llama file); ``granite``'s multipliers (``embedding``, ``residual``, ``attention``, ``logits``) go in its
    metadata.

    ``fim``: Qwen2.5-Coder's fill-in-the-middle tokens and their keys.

    ``chat_template``: the file's; a thinking one (``THINKING_TEMPLATE``) adds Qwen3's <think> and </think> tokens.

    ``rerank``: a Qwen3-Reranker as llama.cpp's converter writes one, for the (yes, no) token ids given: pooling
    rank, ``cls.output.weight`` the head's rows of those tokens, its labels and ``RERANK_TEMPLATE``.
    """
    granite = granite or GRANITE_SCALES
    rng = np.random.default_rng(seed)
    source = gguf.GGUFReader(vocab_from) if vocab_from else None
    if source is not None:
        tokens = source.fields["tokenizer.ggml.tokens"].contents()
    elif tokenizer == "gpt2":
        tokens, merges, types = vocab(think="<think>" in chat_template, fim=fim)
    else:
        tokens, scores, types = spm_vocab()
    vocab_size = len(tokens)
    head_dim = head_dim or hidden // num_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(num_layers)
    w.add_context_length(context_length)
    if rerank is not None:
        pooling = "rank"
        w.add_classifier_output_labels(["yes", "no"])
        w.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)
    if pooling is not None:  # an embedding model's {arch}.pooling_type: "mean" or "last"; a reranker's "rank"
        w.add_pooling_type(gguf.PoolingType[pooling.upper()])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(num_heads)
    w.add_head_count_kv(num_kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if rope is not None:
        _write_rope_scaling(w, rope, rope_dim or head_dim, 1e6 if arch == "gemma3" else 10000.0, context_length)
    if rope_dim is not None:
        w.add_rope_dimension_count(rope_dim)
    if arch == "granite":  # its multipliers (Granite 3's are of these magnitudes)
        w.add_embedding_scale(granite["embedding"])
        w.add_residual_scale(granite["residual"])
        w.add_attention_scale(granite["attention"])
        w.add_logit_scale(granite["logits"])
    w.add_vocab_size(vocab_size)
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if llama_window is not None:
        w.add_sliding_window(llama_window)
    moe = arch in ("qwen2moe", "qwen3moe")
    if moe:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(experts_used)
        w.add_expert_feed_forward_length(intermediate)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(intermediate)
    if source is not None:
        for key, f in source.fields.items():
            if key.startswith("tokenizer.") and f.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(key, f.contents())
            elif key.startswith("tokenizer."):
                w.add_key_value(key, f.contents(), f.types[0])
    else:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(tokens)
        w.add_token_types(types)
        if tokenizer == "gpt2":
            w.add_tokenizer_pre("default")
            w.add_token_merges(merges)
            w.add_add_bos_token(False)
        else:
            w.add_token_scores(scores)
            w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(chat_template)
        if fim:  # as llama.cpp's converter writes a code model's
            for name, token in zip(("fim_pre", "fim_suf", "fim_mid", "fim_sep"), FIM_TOKENS):
                w.add_uint32(f"tokenizer.ggml.{name}_token_id", tokens.index(token))

    def rand(*shape, scale=weight_scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def add_linear(name, arr):
        if arr.ndim == 3:  # stacked experts: each [out, in] quantized as a matrix, the stack kept
            flat = arr.reshape(-1, arr.shape[-1])
            packed = _quantized(flat)
            if packed is None:
                w.add_tensor(name, arr)
            else:
                w.add_tensor(name, packed[0].reshape(arr.shape[0], arr.shape[1], -1), raw_dtype=packed[1])
            return
        if qtype == "F32":
            w.add_tensor(name, arr)
        elif qtype in K_QUANTIZERS:
            w.add_tensor(name, K_QUANTIZERS[qtype](arr), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    def _quantized(arr):
        """(raw bytes, type) of ``arr`` [rows, in] as ``qtype`` where it is quantized, else None."""
        if qtype == "F32":
            return None
        qt = gguf.GGMLQuantizationType[qtype]
        if qtype in K_QUANTIZERS:
            return K_QUANTIZERS[qtype](arr), qt
        return gguf.quants.quantize(arr, qt), qt

    embd = rand(vocab_size, hidden, scale=1.0)
    if embd_qtype == "F32":
        w.add_tensor("token_embd.weight", embd)
    else:
        qt = gguf.GGMLQuantizationType[embd_qtype]
        quantize = K_QUANTIZERS.get(embd_qtype, lambda a: gguf.quants.quantize(a, qt))
        w.add_tensor("token_embd.weight", quantize(embd), raw_dtype=qt)
    for i in range(num_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + rand(hidden, scale=0.1)))
        qkv = [rand(num_heads * head_dim, hidden), rand(num_kv_heads * head_dim, hidden),
               rand(num_kv_heads * head_dim, hidden)]
        if arch == "phi3":
            add_linear(p + "attn_qkv.weight", np.concatenate(qkv))
        else:
            for name, arr in zip(("attn_q", "attn_k", "attn_v"), qkv):
                add_linear(p + name + ".weight", arr)
        if arch in ("qwen2", "qwen2moe"):
            w.add_tensor(p + "attn_q.bias", rand(num_heads * head_dim))
            w.add_tensor(p + "attn_k.bias", rand(num_kv_heads * head_dim))
            w.add_tensor(p + "attn_v.bias", rand(num_kv_heads * head_dim))
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            w.add_tensor(p + "attn_q_norm.weight", (1 + rand(head_dim, scale=0.1)))
            w.add_tensor(p + "attn_k_norm.weight", (1 + rand(head_dim, scale=0.1)))
        add_linear(p + "attn_output.weight", rand(hidden, num_heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", (1 + rand(hidden, scale=0.1)))
        if moe:
            w.add_tensor(p + "ffn_gate_inp.weight", rand(num_experts, hidden, scale=1.0))
            add_linear(p + "ffn_gate_exps.weight", rand(num_experts, intermediate, hidden))
            add_linear(p + "ffn_up_exps.weight", rand(num_experts, intermediate, hidden))
            add_linear(p + "ffn_down_exps.weight", rand(num_experts, hidden, intermediate))
            if arch == "qwen2moe":
                add_linear(p + "ffn_gate_shexp.weight", rand(intermediate, hidden))
                add_linear(p + "ffn_up_shexp.weight", rand(intermediate, hidden))
                add_linear(p + "ffn_down_shexp.weight", rand(hidden, intermediate))
                w.add_tensor(p + "ffn_gate_inp_shexp.weight", rand(hidden))
        else:
            gate, up = rand(intermediate, hidden), rand(intermediate, hidden)
            if arch == "phi3":
                add_linear(p + "ffn_up.weight", np.concatenate([gate, up]))
            else:
                add_linear(p + "ffn_gate.weight", gate)
                add_linear(p + "ffn_up.weight", up)
            add_linear(p + "ffn_down.weight", rand(hidden, intermediate))
        if arch in ("gemma2", "gemma3"):
            w.add_tensor(p + "post_attention_norm.weight", (1 + rand(hidden, scale=0.1)))
            w.add_tensor(p + "post_ffw_norm.weight", (1 + rand(hidden, scale=0.1)))
    w.add_tensor("output_norm.weight", (1 + rand(hidden, scale=0.1)))
    head = embd if tied else rand(vocab_size, hidden)
    if not tied:
        w.add_tensor("output.weight", head)
    if rerank is not None:
        w.add_tensor("cls.output.weight", head[list(rerank)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


WORDPIECE = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "hello", "world", "a",
             "##s", "##at", "##e", "##r", "c", "s", "m", "t", "h", "e", "##t", "##h", ".", ",", "!", "what", "is",
             "paris", "capital", "of", "france", "dog", "##og", "d", "o", "g", "##o", "##g", "##d"]


def write_tiny_encoder(path: str, arch: str = "bert", *, num_layers: int = 2, hidden: int = 32, num_heads: int = 4,
                       intermediate: int = 64, context_length: int = 64, pooling: str | None = "mean",
                       seed: int = 0, rerank: bool = False, legacy_specials: bool = False) -> str:
    """A random BERT-family encoder in llama.cpp's converter layout: ``bert`` (separate Q/K/V with biases, learned
    positions, GELU MLP with biases) or ``nomic-bert`` (fused Q/K/V, RoPE, SwiGLU, no biases); post-norm layers;
    the WordPiece vocabulary ``WORDPIECE`` rewritten as the converter does (U+2581 before a word-initial piece,
    ``##`` dropped). ``rerank``: a cross-encoder's head (cls, cls.output of one label) and pooling rank.
    ``legacy_specials``: [CLS] and [SEP] only as cls_token_id and seperator_token_id, no BOS, EOS or add_* keys (the
    converter's older files, bge-small-en-v1.5's among them)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(num_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(num_heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    if arch == "nomic-bert":
        w.add_rope_freq_base(1000.0)
    if rerank:
        pooling = "rank"
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType[pooling.upper()])
    control = {t for t in WORDPIECE if t.startswith("[")}
    tokens = [t if t in control else t[2:] if t.startswith("##") else "\u2581" + t for t in WORDPIECE]
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL) for t in WORDPIECE])
    w.add_token_type_count(2)
    if legacy_specials:
        w.add_uint32("tokenizer.ggml.cls_token_id", WORDPIECE.index("[CLS]"))
    else:
        w.add_bos_token_id(WORDPIECE.index("[CLS]"))
        w.add_eos_token_id(WORDPIECE.index("[SEP]"))
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
    w.add_sep_token_id(WORDPIECE.index("[SEP]"))
    w.add_unk_token_id(WORDPIECE.index("[UNK]"))
    w.add_pad_token_id(WORDPIECE.index("[PAD]"))

    def rand(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    nomic = arch == "nomic-bert"
    w.add_tensor("token_embd.weight", rand(len(WORDPIECE), hidden, scale=1.0))
    w.add_tensor("token_types.weight", rand(2, hidden, scale=0.5))
    if not nomic:
        w.add_tensor("position_embd.weight", rand(context_length, hidden, scale=0.5))
    w.add_tensor("token_embd_norm.weight", 1 + rand(hidden, scale=0.1))
    w.add_tensor("token_embd_norm.bias", rand(hidden, scale=0.1))
    for i in range(num_layers):
        p = f"blk.{i}."
        if nomic:
            w.add_tensor(p + "attn_qkv.weight", rand(3 * hidden, hidden))
        else:
            for name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(p + name + ".weight", rand(hidden, hidden))
                w.add_tensor(p + name + ".bias", rand(hidden, scale=0.1))
        w.add_tensor(p + "attn_output.weight", rand(hidden, hidden))
        if not nomic:
            w.add_tensor(p + "attn_output.bias", rand(hidden, scale=0.1))
        w.add_tensor(p + "attn_output_norm.weight", 1 + rand(hidden, scale=0.1))
        w.add_tensor(p + "attn_output_norm.bias", rand(hidden, scale=0.1))
        w.add_tensor(p + "ffn_up.weight", rand(intermediate, hidden))
        if nomic:
            w.add_tensor(p + "ffn_gate.weight", rand(intermediate, hidden))
        else:
            w.add_tensor(p + "ffn_up.bias", rand(intermediate, scale=0.1))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, intermediate))
        if not nomic:
            w.add_tensor(p + "ffn_down.bias", rand(hidden, scale=0.1))
        w.add_tensor(p + "layer_output_norm.weight", 1 + rand(hidden, scale=0.1))
        w.add_tensor(p + "layer_output_norm.bias", rand(hidden, scale=0.1))
    if rerank:
        w.add_tensor("cls.weight", rand(hidden, hidden))
        w.add_tensor("cls.bias", rand(hidden, scale=0.1))
        w.add_tensor("cls.output.weight", rand(1, hidden, scale=1.0))
        w.add_tensor("cls.output.bias", rand(1, scale=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
