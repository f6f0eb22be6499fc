"""Attention over the paged KV cache: keys and values live in fixed-size blocks reached through block tables.

Cache layout, per layer, for K and for V: ``[num_kv_heads, num_blocks, block_size, head_dim]`` (an int8 cache's rows:
``head_dim + head_dim / 8`` bytes, the values then their groups' scales, ``quantize_rows``). Token ``i`` of a
sequence lives in block ``block_table[i // block_size]`` at offset ``i % block_size``; its *slot* is
``block_id * block_size + offset``. Heads come first so that gathering a sequence's blocks yields
``[num_kv_heads, tokens, head_dim]`` ready for batched matmuls, with no transposing copy (measured: the copies of
the token-major layout took more time than the attention matmuls in batched decode)::

    block_table = [7, 2]      block_size = 4
    tokens:  t0 t1 t2 t3 | t4 t5
    slots:   28 29 30 31 |  8  9

One call covers a flat batch of sequences, each contributing ``num_query_tokens`` new tokens (a prefill chunk,
one decode token, or several draft tokens) that see every earlier token of their own sequence. A sequence may
bring its own mask over its new tokens (a draft tree); the default is causal. A layer with a sliding window
(Gemma 3's local layers) hides from a query at position p every key at slot p - window or before::

    window 4, query at position 9:   slots 0 .. 5 hidden | 6 7 8 9 visible
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kernel_policy import INT8_GROUP, int8_head_dim


@dataclass
class SeqSpan:
    """One sequence's share of a flat batch."""

    query_start: int  # first row of this sequence in the flat batch
    num_query_tokens: int  # new tokens this step
    context_len: int  # tokens visible to the last new token, the new ones included
    # [ceil(context_len / block_size)] int64; None for a span of the decode batch, which reads
    # AttentionMetadata.decode_block_tables instead
    block_table: torch.Tensor | None
    # [num_query_tokens, M] bool over the last M context positions (M >= num_query_tokens; a draft tree's nodes),
    # everything before them visible; None: causal
    mask: torch.Tensor | None = None
    # the new tokens' positions (a draft tree's nodes sit at their depth, not their slot); None: the slots before
    # context_len, the causal default. Read only by windowed layers.
    positions: list[int] | None = None
    # the additive masks of the fused path, [num_query_tokens, padded context] (0 or -inf), by (window, dtype):
    # built by the first layer that needs one and reused by the others
    biases: dict = field(default_factory=dict, repr=False, compare=False)
    state_slot: int = -1  # the sequence's slot in a hybrid model's state cache (model.state_cache); -1: none
    # a draft verification's rows (the last real token, then the drafts): each row's parent row (-1: the sequence's
    # state), so that a hybrid's recurrent layers step each node from its parent's state (model.recurrent)
    parents: list[int] | None = None

    @property
    def starts_sequence(self) -> bool:
        """Its rows are its sequence's first (a hybrid's recurrent layers start them from zeros)."""
        return self.context_len == self.num_query_tokens


@dataclass
class AttentionMetadata:
    """Where new K/V go (``slot_mapping``) and which sequence each query row belongs to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    seqs: list[SeqSpan]
    # Sequences with exactly one new token and no mask run as one padded batch:
    decode_rows: torch.Tensor | None = None  # [num_decodes] rows of the flat batch
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    decode_max_context: int = 0
    decode_state_slots: torch.Tensor | None = None  # [num_decodes] int64: their state slots (hybrid models)
    # a hybrid's recurrent layers' runs (model.recurrent): [n, 4] int64 (first row, rows, state slot, 1 where the run
    # starts its sequence) for every span with a state slot but a draft verification's
    state_runs: torch.Tensor | None = None


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., d] → an int8 cache's rows [..., d + d / 8]: each group of 32 values divided by its scale, max |x| / 127
    over the group, rounded half to even; then the groups' scales' bytes (kernels/layer_ops.cpp's quantize_row, bit
    for bit). Groups of 32 as llama.cpp's q8_0: one scale per row of a head took Gemma 3's next-token KL against
    the bf16 cache to 0.037 (SmolLM2's 0.004; docs/benchmarks-archive.md)."""
    groups = x.float().unflatten(-1, (-1, INT8_GROUP))
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, groups / scale.masked_fill(scale == 0, 1.0), 0.0).round()
    return torch.cat([q.to(torch.int8).flatten(-2), scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)


def widen(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as ``dtype``: an int8 cache's values times their group's scale."""
    if cache_rows.dtype != torch.int8:
        return cache_rows.to(dtype)
    dim = int8_head_dim(cache_rows.shape[-1])
    values = cache_rows[..., :dim].float().unflatten(-1, (-1, INT8_GROUP))
    scales = cache_rows[..., dim:].contiguous().view(torch.float32).unsqueeze(-1)
    return (values * scales).flatten(-2).to(dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] at their slots, in the cache's dtype (int8:
    quantized, ``quantize_rows``)."""
    heads, _, _, width = k_cache.shape
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = quantize_rows(x) if cache.dtype == torch.int8 else x.to(cache.dtype)
        cache.view(heads, -1, width).index_copy_(1, slots, rows.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels=None,
    batch_invariant: bool = False,
    compute_dtype: torch.dtype | None = None,
    window: int | None = None,
    softcap: float | None = None,
    prefill_kernel: bool = False,
) -> torch.Tensor:
    """Attention of query rows ``q`` [num_tokens, num_heads, head_dim] over their sequences' cached K/V.

    ``kernels``: the compiled module of justapi.kernels; the decode batch then reads the cache in place.
    Prefill chunks and draft trees run through torch's fused attention (``scaled_dot_product_attention``, a flash
    kernel on CPU), or prompt chunks through the C++ prefill attention (``prefill_kernel`` below); with
    ``batch_invariant``, through plain matmuls over the whole context instead, the path the bit-identity tests
    across chunkings hold (the flash kernel's tiling follows the sequence lengths).
    The cache may be fp32 or bf16; ``q`` and the result are fp32 (on the torch path, gathered K/V are widened).
    ``compute_dtype``: the model's (None: the cache's); the fused path computes in the cache's dtype only where it
    is the model's (see _sequence_attention_fused). ``window``: the layer's sliding window (module docstring).
    ``softcap`` (Gemma 2): scores s become c·tanh(s / c) before the softmax, which neither torch's fused kernel nor
    the C++ kernel computes: such a model takes the plain-matmul paths. ``prefill_kernel``: prompt chunks (causal,
    no mask of their own) over a bf16 cache go to the C++ prefill attention instead of torch's fused kernel
    (kernels/prefill_attention.cpp; the policy's ``prefill_attention`` route, a bf16 model on AVX-512 BF16).
    """
    use_kernel = (kernels is not None and q.device.type == "cpu" and q.dtype == torch.float32
                  and k_cache.dtype in (torch.float32, torch.bfloat16, torch.int8) and softcap is None)
    if use_kernel and meta.decode_rows is not None and meta.decode_rows.numel() == q.shape[0]:
        # decode rows only (they are then rows 0..n-1 in order): no gather of the queries, no scatter of the result
        return kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                        window or 0)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows]
        if use_kernel:
            out[meta.decode_rows] = kernels.decode_attention(
                qd, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window or 0
            )
        else:
            out[meta.decode_rows] = _decode_attention(qd, k_cache, v_cache, meta, scale, window, softcap)
    for span in meta.seqs:
        if span.num_query_tokens == 1 and span.mask is None and meta.decode_rows is not None:
            continue  # done in the decode batch
        rows = slice(span.query_start, span.query_start + span.num_query_tokens)
        if (use_kernel and prefill_kernel and not batch_invariant and span.mask is None
                and k_cache.dtype in (torch.bfloat16, torch.int8) and q.shape[2] in PREFILL_KERNEL_HEAD_SIZES):
            out[rows] = kernels.prefill_attention(q[rows], k_cache, v_cache, span.block_table, span.context_len, scale,
                                                  window or 0)
        elif batch_invariant or softcap is not None:
            out[rows] = _sequence_attention(q[rows], k_cache, v_cache, span, scale, window, softcap)
        else:
            out[rows] = _sequence_attention_fused(q[rows], k_cache, v_cache, span, scale, compute_dtype, window)
    return out


# the head sizes kernels/prefill_attention.cpp is compiled for (others take torch's fused kernel)
PREFILL_KERNEL_HEAD_SIZES = (64, 128, 256)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks ``block_ids`` (1-D) of every head, [num_kv_heads, len(block_ids), block_size, head_dim].

    One ``index_select`` per head on the leading dimension: measured 4x faster than advanced indexing.
    """
    heads, _, block_size, dim = cache.shape
    out = cache.new_empty(heads, block_ids.numel(), block_size, dim)
    for h in range(heads):
        torch.index_select(cache[h], 0, block_ids, out=out[h])
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first ``length`` cached vectors, [num_kv_heads, length, head_dim]."""
    return _gather_blocks(cache, block_table).flatten(1, 2)[:, :length]


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _sequence_attention(q, k_cache, v_cache, span: SeqSpan, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    ctx = span.context_len
    k = widen(_gather(k_cache, span.block_table, ctx), q.dtype).transpose(1, 2)  # [kvh, d, ctx]
    v = widen(_gather(v_cache, span.block_table, ctx), q.dtype)  # [kvh, ctx, d]
    qh = q.view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_q, head_dim)
    scores = _capped(torch.bmm(qh, k).view(num_kv_heads, group, num_q, ctx) * scale, softcap)
    visible = _visibility(span, q.device, window)  # [num_q, ctx]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(num_kv_heads, group * num_q, ctx)
    o = torch.bmm(probs, v).view(num_kv_heads, group, num_q, head_dim)
    return o.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)


# The fused kernel's keys are padded to a multiple of this many (zeros, masked out): torch's CPU flash kernel takes
# a slow path for a ragged key count (a 325-token chunk: 3.51 ms a layer, padded to 352: 0.96 ms; summed over W1's
# prompt lengths 0.55x the time; a probe in docs/benchmarks-archive.md).
KEY_PAD = 32


def _sequence_attention_fused(q, k_cache, v_cache, span: SeqSpan, scale: float,
                              compute_dtype: torch.dtype | None = None, window: int | None = None) -> torch.Tensor:
    """``_sequence_attention`` through torch's fused kernel (grouped query heads, additive mask): measured 3.3x
    faster on a 512-token chunk, within 1e-6 of it, with an fp32 cache. With a bf16 cache and a model that
    computes in bf16 it runs in bf16 (the kernel accumulates in fp32; K/V are stored bf16 already, and the result
    is rounded to bf16 for the output projection anyway): 2.5x faster again on an AMX CPU, the queries and the
    softmax weights rounded to bf16. A model that computes in fp32 over a bf16 cache (--dtype auto's route on a CPU
    without a bf16 matmul, where torch's bf16 kernel is emulated) widens the gathered K/V to fp32 instead: that
    took about the bf16 kernel's time (0.9-1.2x, on a Zen 3, docs/benchmarks-archive.md) and keeps SmolLM2's logits
    closer to the exact path (prefill KL 0.0005 instead of 0.002; docs/benchmarks-archive.md).

    ::

        keys:  k0 .. k344 | 0 .. 0        (KEY_PAD: 352 keys; the zeros' scores get -inf, their weights 0)
    """
    ctx, dt = span.context_len, k_cache.dtype
    if dt == torch.int8:  # its K/V widened to the model's dtype (the copy the prefill kernel does not make)
        dt = compute_dtype or q.dtype
    elif compute_dtype is not None and compute_dtype != dt:
        dt = q.dtype
    padded = -(-ctx // KEY_PAD) * KEY_PAD
    window = window if window is not None and ctx > window else None  # a window wider than the context hides nothing
    bias = span.biases.get((window, dt))
    if bias is None:  # once per step, not once per layer
        bias = torch.full((span.num_query_tokens, padded), float("-inf"), dtype=dt, device=q.device)
        bias[:, :ctx].masked_fill_(_visibility(span, q.device, window), 0.0)
        span.biases[window, dt] = bias
    pad = (0, 0, 0, padded - ctx)  # zeros rather than the cache's slots past the context
    k = F.pad(widen(_gather(k_cache, span.block_table, ctx), dt), pad).unsqueeze(0)  # [1, kvh, padded, d]
    v = F.pad(widen(_gather(v_cache, span.block_table, ctx), dt), pad).unsqueeze(0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0).to(dt), k, v, attn_mask=bias,
                                       scale=scale, enable_gqa=True)  # [1, heads, num_q, d]
    return o[0].transpose(0, 1).to(q.dtype)


def _visibility(span: SeqSpan, device, window: int | None = None) -> torch.Tensor:
    """[num_query_tokens, context_len] bool: the cached prefix is visible to all, the rest per the mask; with a
    ``window``, only slots after each query's position - window. (Slots are compared with positions: a draft
    node's slot is at or after its position, but every node a query sees is its ancestor, well inside any window.)

    ::

        context:  p p p p | n0 n1 n2        (p: cached before this step, n: new this step)
        n0:       1 1 1 1 | 1  0  0         causal by default, or rows of span.mask
        n1:       1 1 1 1 | 1  1  0         (a mask may also cover tree nodes cached by earlier
        n2:       1 1 1 1 | 1  1  1          draft passes: then it is wider than the new tokens)
    """
    n, ctx = span.num_query_tokens, span.context_len
    own = span.mask if span.mask is not None else torch.ones(n, n, dtype=torch.bool, device=device).tril()
    prefix = ctx - own.shape[1]
    visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device), own], dim=1)
    if window is None or ctx <= window:
        return visible
    positions = span.positions if span.positions is not None else range(ctx - n, ctx)
    first = torch.tensor(positions, device=device).unsqueeze(1) - window  # the last hidden slot of each query
    return visible & (torch.arange(ctx, device=device).unsqueeze(0) > first)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One new token per sequence, all sequences at once, contexts padded to the longest and masked.

    ::

        k_cache[:, tables]  →  [kvh, B, max_blocks, block_size, d]  =  [kvh·B, L, d]   (one gather, no transpose)
        q [B, H, d]         →  [kvh·B, group, d];  scores = q @ kᵀ  →  [kvh·B, group, L]
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    length = meta.decode_max_context
    tables = meta.decode_block_tables
    width = k_cache.shape[-1]  # head_dim, or an int8 cache's rows with their scales
    k = widen(_gather_blocks(k_cache, tables.flatten()).view(num_kv_heads, num_seqs, -1, width)[:, :, :length], q.dtype)
    v = widen(_gather_blocks(v_cache, tables.flatten()).view(num_kv_heads, num_seqs, -1, width)[:, :, :length], q.dtype)
    qh = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)  # [kvh, B, group, d]
    scores = _capped(torch.matmul(qh, k.transpose(2, 3)) * scale, softcap)  # [kvh, B, group, L]
    slots = torch.arange(length, device=q.device).unsqueeze(0)
    hidden = slots >= meta.decode_context_lens.unsqueeze(1)  # [B, L]: padding past each context
    if window is not None:  # the query sits at context_len - 1
        hidden |= slots <= (meta.decode_context_lens - 1 - window).unsqueeze(1)
    scores = scores.masked_fill(hidden[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.matmul(probs, v)  # [kvh, B, group, d]
    return o.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
