"""The model core against references: transformers on the same GGUF, and dense attention."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from justapi import SamplingParams
from justapi.kernels import decode_kernels
from justapi.model.attention import AttentionMetadata, SeqSpan, paged_attention
from justapi.model.gguf_loader import load_tensors, open_gguf, read_model_config
from justapi.model.llama import LlamaModel
from justapi.model.quant import Int4Weight, Int8RowWeight
from hf_reference import hf_greedy, hf_model
from paged_helpers import paged_prefill_logits
from tiny_gguf import write_tiny_model


def load_model(path: str, batch_invariant: bool = True, policy=None) -> LlamaModel:
    """An fp32 model of the file; ``policy``: its kernels (model.kernel_policy; None: the pure-torch path)."""
    reader = open_gguf(path)
    cfg = read_model_config(reader, path)
    return LlamaModel(cfg, load_tensors(reader, path, torch.float32, False), "cpu", batch_invariant, policy=policy)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_architectures_match_transformers(tmp_path, arch, tied):
    path = write_tiny_model(str(tmp_path / f"{arch}.gguf"), arch, tied=tied, seed=3)
    model = load_model(path)
    assert model.config.qkv_bias == (arch == "qwen2")
    assert model.config.qk_norm == (arch == "qwen3")
    assert model.config.tie_word_embeddings == tied
    # transformers ignores qwen3's key_length and assumes head_dim 128
    ref_model = hf_model(path, **({"head_dim": model.config.head_dim} if arch == "qwen3" else {}))
    ids = [(7 * i + 3) % 260 + 3 for i in range(45)]  # 45 tokens: crosses many 4-token blocks
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    got = paged_prefill_logits(model, ids, block_size=4, chunk=6)
    assert (got - ref).abs().max().item() < 1e-4


def test_tiny_gemma3_matches_transformers(tmp_path):
    """Gemma 3's differences from Llama (embeddings times sqrt(hidden), a norm on each sublayer's output, QK norm,
    GELU, five layers with a sliding window of 8 to each global one, RoPE bases 1e4 and 1e6) against transformers:
    the logits of a 45-token prompt prefilled 6 tokens at a time through 4-token blocks, and 24 greedy tokens
    decoded past the window, one engine step at a time."""
    from justapi import LLM

    path = write_tiny_model(str(tmp_path / "gemma3.gguf"), "gemma3", tokenizer="llama", num_layers=6, seed=3)
    model = load_model(path)
    assert [layer.attn.window for layer in model.layers] == [8] * 5 + [None]
    # transformers takes the attention scale from query_pre_attn_scalar (default 256), which a GGUF does not
    # carry; llama.cpp, and JustAPI, use head_dim
    ref_model = hf_model(path, query_pre_attn_scalar=model.config.head_dim)
    ids = [(7 * i + 3) % 260 + 3 for i in range(45)]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    got = paged_prefill_logits(model, ids, block_size=4, chunk=6)
    assert (got - ref).abs().max().item() < 1e-4
    prompt, want = ids[:5], []
    with torch.no_grad():  # greedy by whole forward passes: transformers' own cache plays no part
        for _ in range(24):
            want.append(int(ref_model(torch.tensor([prompt + want])).logits[0, -1].argmax()))
    llm = LLM(path, pool_blocks=64, block_size=4, show_progress=False)
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids == want


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpp-kernel"])
@pytest.mark.parametrize("dim,bs,cache_dtype", [
    (8, 4, torch.float32),  # the kernel's portable path
    (8, 4, torch.bfloat16),
    (64, 4, torch.float32),  # AVX-512 / AVX2 path (head_dim 64): 16- or 8-row chunks cut short by 4-token blocks
    (64, 32, torch.bfloat16),  # several row chunks per block, bf16 rows widened
    (128, 16, torch.bfloat16),
    (256, 16, torch.bfloat16),  # Gemma 3's head size
], ids=["d8-fp32", "d8-bf16", "d64-bs4-fp32", "d64-bs32-bf16", "d128-bs16-bf16", "d256-bs16-bf16"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fused", "matmuls"])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32], ids=["bf16-model", "fp32-model"])
@pytest.mark.parametrize("window", [None, 7], ids=["global", "window7"])
def test_paged_attention_equals_dense_for_mixed_batch(kernel, dim, bs, cache_dtype, batch_invariant, compute_dtype,
                                                      window):
    """A prefill chunk, two decode tokens and a draft tree in one call, against dense fp32 attention over the
    same cached values.

    With ``kernel``, the decode rows go through the C++ kernel that reads the paged cache in place; the prefill
    chunk and the tree go through torch's fused attention, or with ``batch_invariant`` through plain matmuls. The
    fused attention of a bf16 cache runs in bf16 for a model that computes in bf16, else in fp32.
    """
    kernels = None
    if kernel:
        from justapi.kernels import decode_kernels

        kernels = decode_kernels()
        assert kernels is not None, "the C++ kernel did not build (see the warning logged)"
    torch.manual_seed(0)
    heads, kv_heads, num_blocks = 6, 2, 64
    k_cache = torch.randn(kv_heads, num_blocks, bs, dim).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_blocks, bs, dim).to(cache_dtype)
    perm = torch.randperm(num_blocks)
    tables = [perm[0:10], perm[10:22], perm[22:25], perm[25:35]]
    #          (context, new tokens, mask)
    seqs = [(18, 6, None), (45, 1, None), (9, 1, None), (30, 4, torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))]  # a tree: 0 → {1, 2}, 2 → 3
    spans, row = [], 0
    for (ctx, n, mask), table in zip(seqs, tables):
        spans.append(SeqSpan(row, n, ctx, table[: -(-ctx // bs)], mask))
        row += n
    q = torch.randn(row, heads, dim)
    decode = [s for s in spans if s.num_query_tokens == 1]
    width = max(len(s.block_table) for s in decode)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), seqs=spans,
        decode_rows=torch.tensor([s.query_start for s in decode]),
        decode_block_tables=torch.stack([torch.nn.functional.pad(s.block_table, (0, width - len(s.block_table)))
                                         for s in decode]),
        decode_context_lens=torch.tensor([s.context_len for s in decode]),
        decode_max_context=max(s.context_len for s in decode),
    )
    got = paged_attention(q, k_cache, v_cache, meta, dim ** -0.5, kernels, batch_invariant, compute_dtype, window)
    assert got.dtype == torch.float32
    if not batch_invariant:  # the chunk's and the tree's additive masks are built once, reused by the next layer
        biases = [(s, dict(s.biases)) for s in spans if s.biases]
        assert [s.num_query_tokens for s, _ in biases] == [6, 4]
        assert torch.equal(paged_attention(q, k_cache, v_cache, meta, dim ** -0.5, kernels, batch_invariant,
                                           compute_dtype, window), got)
        assert all(s.biases[key] is b for s, held in biases for key, b in held.items())
    for span in spans:
        n, ctx = span.num_query_tokens, span.context_len
        k = (k_cache[:, span.block_table].flatten(1, 2)[:, :ctx].transpose(0, 1)
             .repeat_interleave(heads // kv_heads, dim=1))
        v = (v_cache[:, span.block_table].flatten(1, 2)[:, :ctx].transpose(0, 1)
             .repeat_interleave(heads // kv_heads, dim=1))
        own = span.mask if span.mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        allowed = torch.cat([torch.ones(n, ctx - n, dtype=torch.bool), own], dim=1)
        if window is not None:  # query i at position ctx - n + i sees the slots after its position - window
            allowed &= torch.arange(ctx)[None, :] > torch.arange(ctx - n, ctx)[:, None] - window
        qs = q[span.query_start : span.query_start + n]
        scores = torch.einsum("qhd,khd->hqk", qs, k.float()) * dim ** -0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", probs, v.float())
        # the fused path computes a bf16 cache's prefill chunks and trees in bf16 for a bf16 model (queries and
        # softmax weights rounded to bf16, fp32 accumulation): measured within 6e-3 here
        bf16_math = (not batch_invariant and n > 1 and cache_dtype == torch.bfloat16
                     and compute_dtype == torch.bfloat16)
        tol = dict(atol=1e-2, rtol=1e-2) if bf16_math else dict(atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got[span.query_start : span.query_start + n], want, **tol)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (6, 2), (9, 3), (8, 2), (16, 2)], ids=["g1", "g3x2", "g3", "g4",
                                                                                        "g8"])
def test_decode_kernel_gives_a_sequence_the_same_bits_alone_in_a_batch_and_on_any_thread(cpp_kernels, dim, heads,
                                                                                          kv_heads):
    """The decode kernel splits its (sequence, KV head) items over the threads by context, and the query heads of a
    KV head share each value row in sets of 1 to 4 (as many as registers hold). A sequence's output is the same
    bits alone or in a batch of skewed lengths, on one thread or two, and within fp32 rounding of float64
    attention over the same bf16 cache, for every set size."""
    if cpp_kernels is None:
        pytest.skip("the C++ kernels did not build here")
    g = torch.Generator().manual_seed(3)
    bs, lens = 16, torch.tensor([700, 20, 33, 1, 400, 64, 17, 250])
    k_cache = torch.randn(kv_heads, 360, bs, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, 360, bs, dim, generator=g).to(torch.bfloat16)
    tables = torch.randperm(360, generator=g).view(8, 45)
    q = torch.randn(8, heads, dim, generator=g)
    threads = torch.get_num_threads()
    try:
        batch = cpp_kernels.decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5)
        torch.set_num_threads(1)
        assert torch.equal(cpp_kernels.decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5), batch)
    finally:
        torch.set_num_threads(threads)
    for i in range(8):
        alone = cpp_kernels.decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1],
                                             dim ** -0.5)
        assert torch.equal(alone[0], batch[i])
        blocks = tables[i, : -(-int(lens[i]) // bs)]
        k = k_cache[:, blocks].flatten(1, 2)[:, : lens[i]].double().repeat_interleave(heads // kv_heads, 0)
        v = v_cache[:, blocks].flatten(1, 2)[:, : lens[i]].double().repeat_interleave(heads // kv_heads, 0)
        p = (torch.einsum("hd,hkd->hk", q[i].double(), k) * dim ** -0.5).softmax(-1)
        torch.testing.assert_close(batch[i].double(), torch.einsum("hk,hkd->hd", p, v), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_tensor_types_load_and_run(tmp_path, qtype):
    import gguf

    path = write_tiny_model(str(tmp_path / "q.gguf"), "llama", hidden=256, intermediate=256, num_heads=4,
                            num_kv_heads=2, qtype=qtype, weight_scale=0.05)
    reader = open_gguf(path)
    tensors = load_tensors(reader, path, torch.float32, False)
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType[qtype]
    want = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).astype("float32")).reshape(256, 256)
    assert torch.equal(tensors["blk.0.ffn_down.weight"], want)
    model = load_model(path)
    logits = paged_prefill_logits(model, list(range(3, 20)))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_weights_stay_4bit_and_match_the_dequantized_weights(tmp_path, qtype):
    """--dtype auto keeps Q4 weights as int4: integers exact, products within bfloat16 rounding of fp32. A Q4_K
    super-block becomes 8 groups of 32, each with its own scale and zero (d·sc·q − dmin·m computed as
    (q − 8)·scale + zero: the same up to fp32 rounding)."""

    from justapi.model.kernel_policy import KernelPolicy
    from justapi.model.quant import Int4Weight, Q4Unpacked

    path, kept, want = _packed_file(tmp_path, qtype)
    w = kept["blk.0.ffn_down.weight"]
    assert isinstance(w, Q4Unpacked) and w.q.dtype == torch.uint8 and int(w.q.max()) <= 15
    groups = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
    torch.testing.assert_close((w.q.float() - 8) * groups(w.scale) + groups(w.zero), want, atol=1e-6, rtol=0)
    assert not isinstance(kept["token_embd.weight"], Q4Unpacked)  # looked up, not multiplied: stays dense

    weight = Int4Weight(w, KernelPolicy.make(torch.bfloat16, None))  # pure torch: int4 kernel, then the bf16 copy
    for rows in (1, 5, 40):  # torch's int4 kernel up to TORCH_SMALL_MAX_ROWS rows, the bf16 copy from there on
        x = torch.randn(rows, 256)
        got = weight.matmul(x).float()
        ref = x.to(torch.bfloat16).float() @ w.dequantize().t()
        torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)  # bf16 output rounding; measured max ~0.01

    q4, kl = _packed_model_and_kl_to_exact(path)
    assert isinstance(q4.layers[0].mlp.gate_up, Int4Weight) and isinstance(q4.layers[0].attn.qkv, Int4Weight)
    assert kl < 0.01


def _packed_file(tmp_path, qtype: str):
    """A tiny model with ``qtype`` linears: its path, its tensors loaded packed (bf16), and gguf's fp32
    dequantization of blk.0.ffn_down."""
    import gguf

    path = write_tiny_model(str(tmp_path / "q.gguf"), "llama", hidden=256, intermediate=256, num_heads=4,
                            num_kv_heads=2, qtype=qtype, weight_scale=0.05)
    reader = open_gguf(path)
    kept = load_tensors(reader, path, torch.bfloat16, False, keep_packed=True)
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).astype("float32")).reshape(256, 256)
    return path, kept, want


def _packed_model_and_kl_to_exact(path: str) -> tuple[LlamaModel, float]:
    """The file's model with its weights packed (bf16 compute, pure torch), and the largest per-position KL of its
    next-token distributions from the exact fp32 path's over a 37-token prompt."""
    reader = open_gguf(path)
    packed = LlamaModel(read_model_config(reader, path), load_tensors(reader, path, torch.bfloat16, False,
                                                                      keep_packed=True), "cpu", False)
    ids = list(range(3, 40))
    a = torch.log_softmax(paged_prefill_logits(load_model(path), ids), -1)
    b = torch.log_softmax(paged_prefill_logits(packed, ids), -1)
    return packed, (a.exp() * (a - b)).sum(-1).max().item()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K"])
def test_8bit_weights_stay_8bit_and_multiply_exactly(tmp_path, qtype):
    """--dtype auto keeps Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K and Q2_K linears as 8-bit integers with their scales
    (and zeros; the last three over groups of 16), which dequantize to exactly the file's values; Int8Weight's
    products on every route this CPU has are within bf16 rounding of the exact product, and the model within a
    small KL of the exact path."""

    from justapi.kernels import decode_kernels
    from justapi.model.kernel_policy import KernelPolicy
    from justapi.model.quant import Int8Weight, Q8Unpacked

    path, kept, want = _packed_file(tmp_path, qtype)
    w = kept["blk.0.ffn_down.weight"]
    assert isinstance(w, Q8Unpacked) and w.q.dtype == torch.int8 and torch.equal(w.dequantize(), want)
    assert (w.group, w.zero is not None) == {"Q6_K": (16, False), "Q5_1": (32, True), "Q5_K": (32, True),
                                             "Q3_K": (16, False), "Q2_K": (16, True)}.get(qtype, (32, False))
    low, high = {"Q5_0": (-16, 15), "Q6_K": (-32, 31), "Q5_1": (0, 31), "Q5_K": (0, 31), "Q3_K": (-4, 3),
                 "Q2_K": (0, 3)}.get(qtype, (-128, 127))
    assert low <= int(w.q.min()) and int(w.q.max()) <= high

    kernels = decode_kernels()
    for dtype in (torch.bfloat16, torch.float32):  # amx / dense; q_matmul / dense
        for policy_kernels in ({None, kernels} if kernels is not None else {None}):
            weight = Int8Weight(w, KernelPolicy.make(dtype, policy_kernels))
            for rows in (1, 6, 100):
                x = torch.randn(rows, 256)
                ref = x.to(dtype).float() @ want.t()
                # bf16: the weight and output rounded to bf16 (relative 2^-8 each); fp32 via q_matmul: rows rounded
                # to 16 bits per group (measured within 2e-5 of the largest product)
                tol = (0.03 if dtype == torch.bfloat16 else 1e-4) * ref.abs().max().item()
                got = weight.matmul(x).float()
                assert (got - ref).abs().max().item() <= tol, (dtype, weight.routes, rows)

    q8, kl = _packed_model_and_kl_to_exact(path)
    assert isinstance(q8.layers[0].mlp.gate_up, Int8Weight) and isinstance(q8.layers[0].attn.qkv, Int8Weight)
    assert kl < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_head_too_large_to_copy_serves_its_tied_embedding_from_its_q8_0_form(tmp_path, monkeypatch, dtype):
    """A Q8_0 head over HEAD_DENSE_MAX_BYTES (Gemma 3's 262k rows; lowered here) keeps only its packed form, with
    no dense copy, and the tied embedding is looked up in that form (the units, or q_matmul's layout on an fp32
    model): the dense embedding's rows exactly, for any rows, and the model's logits those of a model with the
    head's packed routes off."""
    from justapi.kernels import decode_kernels
    from justapi.model import kernel_policy
    from justapi.model.kernel_policy import ALL_ROWS, KernelPolicy, Route
    from justapi.model.quant import Q8Unpacked

    policy = KernelPolicy.make(dtype, decode_kernels())
    kernel = next((k for k in ("amx", "dpbf16", "q_matmul") if policy.uses(k)), None)
    if kernel is None:
        pytest.skip(f"none of the AMX, AVX-512 BF16 and q_matmul kernels run on this CPU with {dtype}")
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(kernel_policy, "HEAD_DENSE_MAX_BYTES", 0)
    ids = torch.tensor([0, 5, 17, 511, 3, 5, 256, 15, 16])
    for group, zero in ((32, False), (16, False), (32, True), (16, True)):  # Q8_0; Q6_K, Q3_K; Q5_K; Q2_K
        q8 = Q8Unpacked(torch.randint(-32, 32, (512, 256), dtype=torch.int8, generator=g),
                        torch.rand(512, 256 // group, generator=g).half().float(),
                        torch.randn(512, 256 // group, generator=g).half().float() if zero else None, group)
        head = Int8RowWeight(q8.dequantize().to(dtype), q8, policy)
        if not q8.plain and kernel == "q_matmul":  # q_matmul reads Q8_0's form only: such a head stays dense
            assert head.lookup(ids) is None and hasattr(head, "dense")
            continue
        assert head.routes[-1] == Route(ALL_ROWS, kernel) and not hasattr(head, "dense")
        assert torch.equal(head.lookup(ids), q8.dequantize()[ids].to(dtype)), (group, zero)
    monkeypatch.undo()

    # a whole model (the tiny tokenizer's 271 rows: the units hold them padded to 272)
    path = write_tiny_model(str(tmp_path / "q.gguf"), "llama", hidden=256, intermediate=256, num_heads=4,
                            num_kv_heads=2, qtype="Q4_0", embd_qtype="Q8_0", weight_scale=0.05)
    reader = open_gguf(path)
    cfg = read_model_config(reader, path)
    load = lambda policy: LlamaModel(cfg, load_tensors(reader, path, dtype, False, keep_packed=True),  # noqa: E731
                                     "cpu", False, policy=policy)
    # the head's packed routes off: a dense head, and the embedding its own copy
    copies = load(KernelPolicy.make(dtype, decode_kernels(), ("amx", "dpbf16", "q_matmul", "q8_small")))
    monkeypatch.setattr(kernel_policy, "HEAD_DENSE_MAX_BYTES", 0)
    packed = load(policy)
    assert copies.embed is not None and packed.embed is None and packed.weight_bytes() < copies.weight_bytes()
    ids = torch.arange(cfg.vocab_size)
    assert torch.equal(packed.embed_rows(ids), copies.embed_rows(ids))
    tokens = list(range(3, 43))
    # in chunks past torch's small-batch kernels (bf16 rows) that the copies' model takes up to 5 rows
    got, want = (paged_prefill_logits(m, tokens, chunk=8) for m in (packed, copies))
    # the products through other kernels: q_matmul's 16-bit rows (fp32), or sums in another order (bf16)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max(), (got - want).abs().max() / want.abs().max()


def test_without_a_bf16_matmul_auto_computes_in_fp32_and_batches_equal_the_float32_path(tmp_path, monkeypatch):
    """On a CPU where oneDNN has no bf16 matmul (AVX2 only, simulated here through the policy's CPU probe), --dtype
    auto computes in fp32 (with a bf16 KV cache by default; fp32 here, to hold the products to the float32 path's).
    Every batch multiplies the 4-bit weights and the Q8_0 head as stored, with rows rounded to 16 bits (q_matmul,
    where the C++ kernels are built), and no weight keeps an fp32 copy (the tied embedding is looked up in the
    head's packed form): logits within 1e-4 of the largest of the float32 path's, for prefill chunks, single rows
    and a chunk of 72 rows. With q_matmul off (--disable-kernels q_matmul), batches of more than
    TORCH_SMALL_MAX_ROWS rows multiply the weights of --dtype float32, prepacked for oneDNN: the float32 path's
    logits up to the order of the sums, and without prepacking (through the same F.linear) bit-identical ones.
    Smaller batches then run through torch's int4 and int8 kernels, within a small KL."""
    from justapi import LLM
    from justapi.kernels import decode_kernels
    from justapi.model import kernel_policy
    from justapi.model.kernel_policy import TORCH_SMALL_MAX_ROWS

    real_probe = kernel_policy.probe_cpu
    monkeypatch.setattr(kernel_policy, "probe_cpu",
                        lambda kernels: dataclasses.replace(real_probe(kernels), bf16_matmul=False))
    path = write_tiny_model(str(tmp_path / "q.gguf"), "llama", hidden=256, intermediate=256, num_heads=4,
                            num_kv_heads=2, qtype="Q4_1", embd_qtype="Q8_0", weight_scale=0.05)  # as SmolLM2's
    auto = LLM(path, kv_cache_dtype="float32", show_progress=False).engine.model
    exact = LLM(path, dtype="float32", show_progress=False).engine.model
    assert auto.dtype == torch.float32 and auto.kv_dtype == torch.float32
    down, head = auto.layers[0].mlp.down, auto.lm_head
    assert isinstance(down, Int4Weight) and not hasattr(down, "units")
    assert isinstance(head, Int8RowWeight) and not hasattr(head, "units")
    small = TORCH_SMALL_MAX_ROWS + 1  # a chunk past torch's small-batch kernels
    ids = [(5 * i + 2) % 200 + 3 for i in range(72)]
    if decode_kernels() is not None and decode_kernels().q_matmul_available():
        assert down.q_bytes is not None and head.q_bytes is not None and auto.embed is None
        assert not hasattr(down, "dense") and not hasattr(head, "dense")
        assert auto.weight_bytes() < exact.weight_bytes() / 4
        for chunk in (small, 1, len(ids)):  # prefill chunks; one row at a time; all at once
            want = paged_prefill_logits(exact, ids, 4, chunk)  # logits up to ~250 here
            got = paged_prefill_logits(auto, ids, 4, chunk)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # measured 2e-5
    few = torch.randn(TORCH_SMALL_MAX_ROWS, 256)
    assert down.matmul(few).dtype == torch.float32 and head.matmul(few).dtype == torch.float32

    dense = LLM(path, kv_cache_dtype="float32", disabled_kernels=("q_matmul",), show_progress=False).engine.model
    down, head = dense.layers[0].mlp.down, dense.lm_head
    assert not hasattr(down, "q_bytes") and not hasattr(head, "q_bytes") and down.dense.dtype == torch.float32
    assert down.dense.is_mkldnn == head.dense.is_mkldnn == torch.backends.mkldnn.is_available()
    want = paged_prefill_logits(exact, ids, 4, small)
    torch.testing.assert_close(paged_prefill_logits(dense, ids, 4, small), want, atol=1e-4, rtol=1e-5)
    plain = LLM(path, kv_cache_dtype="float32", disabled_kernels=("q_matmul", "prepack"),
                show_progress=False).engine.model
    assert not plain.layers[0].mlp.down.dense.is_mkldnn
    assert torch.equal(paged_prefill_logits(plain, ids, 4, small), want)
    one = torch.log_softmax(paged_prefill_logits(plain, ids, 4, 1), -1)  # one row at a time: torch's kernels
    full = torch.log_softmax(paged_prefill_logits(exact, ids, 4, 1), -1)
    assert (full.exp() * (full - one)).sum(-1).max().item() < 0.01


@pytest.mark.parametrize("embd_qtype", ["Q8_0", "Q6_K"])
def test_an_8bit_token_embedding_also_loads_as_integers_and_scales_for_the_head(tmp_path, embd_qtype):
    """With --dtype auto an 8-bit head (here the tied token embedding: Q8_0, or Q6_K as in Q4_K_M files) comes dense
    and, under its name + Q8_SUFFIX, as its integers and scales, which dequantize to exactly the dense weight."""
    import gguf

    from justapi.model.gguf_loader import Q8_SUFFIX
    from justapi.model.quant import Q8Unpacked

    path = write_tiny_model(str(tmp_path / "q.gguf"), "llama", hidden=256, intermediate=256, num_heads=4,
                            num_kv_heads=2, qtype="Q4_0", embd_qtype=embd_qtype)
    reader = open_gguf(path)
    kept = load_tensors(reader, path, torch.float32, False, keep_packed=True)
    q8 = kept["token_embd.weight" + Q8_SUFFIX]
    assert q8.group == (16 if embd_qtype == "Q6_K" else 32)
    assert isinstance(q8, Q8Unpacked) and q8.q.dtype == torch.int8
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).astype("float32")).reshape(q8.q.shape)
    assert torch.equal(q8.dequantize(), want) and torch.equal(kept["token_embd.weight"], want)
    assert "token_embd.weight" + Q8_SUFFIX not in load_tensors(reader, path, torch.float32, False)  # exact path
    LlamaModel(read_model_config(reader, path), kept, "cpu", False)
    assert not any(name.endswith(Q8_SUFFIX) for name in kept)  # taken by the model


@pytest.fixture(scope="module")
def smollm_reference(real_model_path):
    return hf_model(real_model_path)


PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\narr = np.",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "1, 2, 3, 4, 5,",
    "Q: What is the opposite of hot?\nA:",
]


@pytest.mark.real_model
def test_smollm2_logits_match_transformers(real_llm, smollm_reference):
    model = real_llm.engine.model
    ids = real_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    with torch.no_grad():
        ref = smollm_reference(torch.tensor([ids])).logits[0]
    got = paged_prefill_logits(model, ids, block_size=16, chunk=11)
    assert (got - ref).abs().max().item() < 1e-3


@pytest.mark.real_model
def test_smollm2_greedy_matches_transformers_plain_and_chat(real_llm, smollm_reference):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    chats = [real_llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    plain = [real_llm.tokenizer.encode(p) for p in PROMPTS]
    results = real_llm.generate(plain + chats, params)
    for ids, res, want in zip(plain + chats, results, hf_greedy(smollm_reference, plain + chats, 32)):
        assert res.token_ids == want, real_llm.tokenizer.decode(ids)


@pytest.mark.real_model
def test_smollm2_bfloat16_weights_stay_close_to_fp32(real_llm, real_model_path):
    """bf16 weights and KV cache (decode attention computes in fp32, prefill attention in bf16) against the exact
    fp32 path: stated tolerance, not equality (KL measured 0.006 max, argmax agreement 0.94)."""
    from justapi import LLM

    bf16 = LLM(real_model_path, pool_blocks=64, dtype="bfloat16", show_progress=False)
    ids = real_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    exact = torch.log_softmax(paged_prefill_logits(real_llm.engine.model, ids, 16, 11), -1)
    fast = torch.log_softmax(paged_prefill_logits(bf16.engine.model, ids, 16, 11), -1)
    kl = (exact.exp() * (exact - fast)).sum(-1)
    assert kl.max().item() < 0.02  # measured 0.005 with an fp32 cache, 0.009 with bf16, 0.006 with bf16 attention
    assert (exact.argmax(-1) == fast.argmax(-1)).float().mean().item() >= 0.9  # measured 0.97, 0.94 (bf16 attention)


@pytest.mark.real_model
def test_smollm2_int4_weights_stay_close_to_fp32(real_llm, real_model_path):
    """--dtype auto (Q4_1 weights through the int4 kernel, bf16 activations, bf16 KV cache, prefill attention in
    bf16; on a CPU without a bf16 matmul, fp32 activations, a bf16 KV cache, and decode-sized batches through
    q_matmul with rows rounded to 16 bits) against the exact fp32 path.

    Stated tolerance: per-position KL below 0.03 nats (measured max 0.014; 0.007 with the prefill attention in
    fp32) with ≥ 90% argmax agreement (measured 0.97 and 1.0); greedy chat answers of 32 tokens share on average
    ≥ 14 leading tokens with the fp32 answers (measured 25.6 in a batch of 8, 23.0 one at a time, where the LM head
    runs int8) and at least 5 of 8 agree on their first 8 tokens (measured 7 and 7; greedy text flips at
    near-ties, and then the two continuations are different texts). Measured on a Zen 3 (the fp32 route, bf16
    cache): KL at most 0.0005, argmax agreement 1.0, all 8 answers the fp32 ones token for token.
    """
    from justapi import LLM
    from justapi.model.quant import Int4Weight, Int8RowWeight

    q4 = LLM(real_model_path, pool_blocks=64, dtype="auto", show_progress=False)
    assert all(isinstance(layer.mlp.down, Int4Weight) for layer in q4.engine.model.layers)
    assert isinstance(q4.engine.model.lm_head, Int8RowWeight)
    assert q4.engine.model.kv_dtype == torch.bfloat16 and q4.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    for text in ["The quick brown fox jumps over the lazy dog. " * 3, "def fibonacci(n):\n    if n < 2:\n"]:
        ids = real_llm.tokenizer.encode(text)
        exact = torch.log_softmax(paged_prefill_logits(real_llm.engine.model, ids, 16, 11), -1)
        fast = torch.log_softmax(paged_prefill_logits(q4.engine.model, ids, 16, 11), -1)
        assert (exact.exp() * (exact - fast)).sum(-1).max().item() < 0.03
        assert (exact.argmax(-1) == fast.argmax(-1)).float().mean().item() >= 0.9
    questions = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers.",
                 "Explain gravity in one sentence.", "What is 2+2?", "Name a color.", "Who wrote Hamlet?",
                 "Say hello in Spanish."]
    chats = [real_llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    exact = real_llm.generate(chats, params)
    for fast in (q4.generate(chats, params), [q4.generate([c], params)[0] for c in chats]):  # batch, one at a time
        common = [next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), 32)
                  for a, b in zip(exact, fast)]
        assert sum(common) / len(common) >= 14, common
        assert sum(c >= 8 for c in common) >= 5, common


@pytest.mark.real_model
def test_smollm2_greedy_output_is_the_same_with_and_without_onednn_prepacked_weights(real_model_path, monkeypatch):
    """The dense weights of --dtype auto (bf16, or fp32 where the CPU has no bf16 matmul) are reordered once into
    oneDNN's layout (quant.prepack_linear); batches of 6+ rows (a batch of 8, and the prompts' prefill) then
    multiply the prepacked copy. Greedy text must not change. (q_matmul, which takes batches of up to 64 rows on
    a CPU without a bf16 matmul, and the AMX kernels are turned off here so that they reach the dense copy.) In fp32
    the two orders of the sums differ in the last bits, so the KV cache is fp32 there: a bf16 cache would round
    those bits to 8, now and then onto different values, and the text then forks at a near-tie (measured: 1 chat
    of 8, at its 10th token)."""
    from justapi import LLM
    from justapi.model.kernel_policy import cpu_has_bf16_matmul

    chats = [f"Question {i}: name {i + 2} animals that live in the sea, and say why." for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kv = "auto" if cpu_has_bf16_matmul() else "float32"
    off = ("q_matmul", "amx", "dpbf16")  # the kernels that would take these batches from the dense copy
    packed = LLM(real_model_path, pool_blocks=128, dtype="auto", kv_cache_dtype=kv, disabled_kernels=off,
                 show_progress=False)
    assert packed.engine.model.layers[0].mlp.down.dense.is_mkldnn and packed.engine.model.lm_head.dense.is_mkldnn
    plain = LLM(real_model_path, pool_blocks=128, dtype="auto", kv_cache_dtype=kv, disabled_kernels=(*off, "prepack"),
                show_progress=False)
    assert not plain.engine.model.layers[0].mlp.down.dense.is_mkldnn
    assert [r.token_ids for r in packed.generate(chats, params)] == [r.token_ids for r in plain.generate(chats, params)]


@pytest.mark.real_model
def test_smollm2_output_is_the_same_with_and_without_the_units_kernels(real_model_path, monkeypatch):
    """Batches multiply the 4-bit weights, and the Q8_0 LM head, on AMX tiles (kernels/int4_matmul.cpp) or AVX-512
    BF16 vectors (units_avx512.cpp) instead of their bf16 copies on oneDNN (--disable-kernels amx,dpbf16). Torch's
    small-batch kernels, q8_small and q4_small, which would serve 1-5 rows on one side only, are routed out on both
    (TORCH_SMALL_MAX_ROWS = 0, --disable-kernels q8_small,q4_small).

    AMX: up to 32 rows the same values and the same sums as oneDNN's on a Xeon (tests/test_kernels.py), so greedy
    text must not change; prefill chunks of 16 tokens keep every step under 32 rows (from 48 rows the two sum in
    other orders). Vectors: the same weight values, but on a Zen 4 oneDNN rounds a few of each product's sums
    differently (1-3 elements of a layer's output, at any number of rows), so greedy text may fork at a near-tie:
    there the two models' next-token distributions over a prompt must agree (KL under 0.005 nats, half the bf16
    path's own distance from the exact one; measured 0.0026) and pick the same token wherever the top two logits
    are 0.1 apart."""
    from justapi import LLM
    from justapi.model import kernel_policy
    from justapi.model.kernel_policy import KernelPolicy

    monkeypatch.setattr(kernel_policy, "TORCH_SMALL_MAX_ROWS", 0)
    amx = KernelPolicy.make(torch.bfloat16, decode_kernels()).uses("amx")
    # no prefix cache: the second run's prefills must have the first's shapes
    opts = dict(pool_blocks=128, dtype="auto", prefix_cache=False, chunk_size=16, show_progress=False)
    llm = LLM(real_model_path, **opts, disabled_kernels=("q8_small", "q4_small"))
    if not hasattr(llm.engine.model.layers[0].mlp.down, "units"):
        pytest.skip("the C++ kernels have neither AMX nor AVX-512 BF16 here")
    assert hasattr(llm.engine.model.lm_head, "units")
    onednn = LLM(real_model_path, disabled_kernels=("amx", "dpbf16", "q8_small"), **opts)
    down = onednn.engine.model.layers[0].mlp.down
    assert not hasattr(down, "units") and down.dense.is_mkldnn
    if amx:
        chats = [f"Question {i}: name {i + 2} rivers of Europe, and say where they flow." for i in range(8)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        assert [r.token_ids for r in onednn.generate(chats, params)] == [r.token_ids for r in llm.generate(chats,
                                                                                                        params)]
        return
    ids = llm.engine.tokenizer.encode("Name the rivers of Europe, and say where each of them flows: the Danube "
                                      "flows from the Black Forest to the Black Sea, the Rhine")
    units, dense = (paged_prefill_logits(m.engine.model, ids, chunk=8).float() for m in (llm, onednn))
    a, b = torch.log_softmax(dense, -1), torch.log_softmax(units, -1)
    assert (a.exp() * (a - b)).sum(-1).max().item() < 0.005
    top2 = dense.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() > len(ids) // 2 and torch.equal(units.argmax(-1)[clear], dense.argmax(-1)[clear])


@pytest.mark.real_model
def test_smollm2_with_the_cpp_prefill_attention_agrees_with_torchs_flash_kernel(real_model_path, smollm2_exact):
    """Prompt chunks' attention in C++ (kernels/prefill_attention.cpp: bf16 products on AVX-512 BF16, fp32 on AVX2,
    where the model computes in fp32) instead of torch's fused kernel (--disable-kernels prefill_attention): the same
    rounding points in other orders of the sums, so greedy
    text may fork at a near-tie, and only there. Over a prompt prefilled whole and in chunks of 48 after a prefix
    (block size 4, shuffled blocks), the next-token distributions are as close to the exact path's (fp32 weights
    and cache, plain matmuls: the session's ``smollm2_exact``) as the torch path's are (KL from the exact ones, worst
    and mean position, within 1.25x of the torch path's; measured on a Zen 4: 0.0058 and 0.00054 against 0.0058
    and 0.00060), and the two pick the same token wherever the top two logits are 0.1 apart; generated greedily,
    each text is the torch path's, or forks at a near-tie of the torch path's
    (assert_greedy_forks_only_at_near_ties)."""
    from justapi import LLM

    opts = dict(pool_blocks=256, show_progress=False)
    llm = LLM(real_model_path, dtype="auto", **opts)
    if not llm.engine.model.policy.uses("prefill_attention"):
        pytest.skip("no C++ prefill attention here (AVX-512 BF16 and a bf16 model, or an AVX2 build and an fp32 "
                    "model; AMX CPUs keep torch's)")
    flash = LLM(real_model_path, dtype="auto", disabled_kernels=("prefill_attention",), **opts)
    ids = llm.engine.tokenizer.encode("The rivers of Europe, and where each of them flows: the Danube flows from the "
                                      "Black Forest to the Black Sea, the Rhine from the Alps to the North Sea, " * 4)

    for chunk in (len(ids), 48):
        assert_as_close_to_exact(smollm2_exact, llm, flash, ids, chunk)
    assert_greedy_forks_only_at_near_ties(llm, flash)


@pytest.mark.real_model
def test_smollm2_with_q4_small_agrees_with_torchs_int4_kernel(real_model_path, smollm2_exact):
    """1-2 rows times the 4-bit weights through q4_small (fp32 rows, the weights exact, fp32 FMAs) instead of torch's
    int4 kernel (bf16 rows; --disable-kernels q4_small), where there is no AMX: the sums differ in rounding and order,
    so greedy text may fork at a near-tie, and only there. Prefilled one and two tokens a step (single-stream and
    two-row decode shapes), the next-token distributions are at least as close to the exact path's as torch's
    kernel's are (KL, worst and mean position, within 1.25x), the two pick the same token wherever the top two
    logits are 0.1 apart, and greedy texts fork only at near-ties (assert_greedy_forks_only_at_near_ties)."""
    from justapi import LLM

    opts = dict(pool_blocks=256, dtype="auto", show_progress=False)
    llm = LLM(real_model_path, **opts)
    if llm.engine.model.layers[0].mlp.down.routes[0].kernel != "q4_small":
        pytest.skip("no q4_small here (it needs AVX-512 BF16 without AMX and a bf16 model)")
    int4 = LLM(real_model_path, disabled_kernels=("q4_small",), **opts)
    assert int4.engine.model.layers[0].mlp.down.routes[0].kernel == "torch_int4"
    ids = llm.engine.tokenizer.encode("The rivers of Europe, and where each of them flows: the Danube flows from the "
                                      "Black Forest to the Black Sea, the Rhine from the Alps to the North Sea.")

    for chunk in (1, 2):
        assert_as_close_to_exact(smollm2_exact, llm, int4, ids, chunk)
    assert_greedy_forks_only_at_near_ties(llm, int4)


# KL (nats; worst and mean position) below which two paths' distance from the exact path is not resolved where the
# model computes in fp32: there both sums are within ~1e-6 of each other, and what is left is where they round
# the bf16 cache's values (a flip moves a value by 2^-9) and q_matmul's rows differently, noise that alone costs up
# to 0.0021 nats at a position against fp32 (docs/benchmarks-archive.md)
FP32_KL_FLOOR = (0.001, 0.0001)


def assert_as_close_to_exact(exact, llm, reference, ids: list[int], chunk: int) -> None:
    """``ids`` prefilled ``chunk`` tokens a step by three engines: ``llm``'s next-token distributions are as close
    to ``exact``'s as ``reference``'s are (KL from the exact ones, worst and mean position, within 1.25x, or where
    the model computes in fp32 below FP32_KL_FLOOR), and ``llm`` picks ``reference``'s token wherever the
    reference's top two logits are 0.1 apart."""
    want, mine, theirs = (paged_prefill_logits(m.engine.model, ids, chunk=chunk).float()
                          for m in (exact, llm, reference))

    def kl(ref, other):
        a, b = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
        return (a.exp() * (a - b)).sum(-1)

    ours, theirs_kl = kl(want, mine), kl(want, theirs)
    worst, mean = FP32_KL_FLOOR if llm.engine.model.dtype == torch.float32 else (0.0, 0.0)
    assert ours.max() <= max(1.25 * theirs_kl.max(), worst), (ours, theirs_kl)
    assert ours.mean() <= max(1.25 * theirs_kl.mean(), mean), (ours, theirs_kl)
    top2 = theirs.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() > len(ids) // 2 and torch.equal(mine.argmax(-1)[clear], theirs.argmax(-1)[clear])


def assert_greedy_forks_only_at_near_ties(llm, reference) -> int:
    """Eight prompts (repeated prefixes, a list, 300 words) generated greedily for 32 tokens by two engines whose sums
    differ only in order: each text is the reference's, or forks where the reference's own top two logits were
    within 0.1, or within two bf16 units at the top logit's size, of each other (a bf16 model's logits are bf16:
    0.25 apart is two units at SmolLM2's top logits of 16-32); at most half fork. Returns the number of forks."""
    base = "Here is a list of facts about the planets of the solar system, one per line. "
    prompts = [base * (1 + i % 3) + f"Fact {i}: the planet with {i + 1} moons is" for i in range(6)]
    prompts += ["List three uses of copper:\n1.", " ".join(f"word{i}" for i in range(300)) + " Summarise:"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    forks = 0
    for prompt, x, y in zip(prompts, llm.generate(prompts, params), reference.generate(prompts, params)):
        if x.token_ids == y.token_ids:
            continue
        forks += 1
        k = next(j for j, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v)
        seq = reference.engine.tokenizer.encode(prompt) + y.token_ids[:k]
        top2 = paged_prefill_logits(reference.engine.model, seq, chunk=len(seq))[-1].float().topk(2).values
        unit = 2.0 ** (math.floor(math.log2(max(abs(top2[0].item()), 1.0))) - 7)  # bf16's spacing at the top logit
        assert top2[0] - top2[1] <= max(0.1, 2 * unit), (prompt[:40], k, top2)
    assert forks <= len(prompts) // 2
    return forks


class _TorchDecodeAttention:
    """An engine's C++ kernels, but the decode batch's attention through the torch path (attention._decode_attention:
    the same fp32 arithmetic over the same cache, summed in torch's order)."""

    def __init__(self, kernels):
        self._kernels = kernels

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def decode_attention(self, q, k_cache, v_cache, tables, lens, scale, window):
        from justapi.model.attention import _decode_attention

        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), seqs=[], decode_block_tables=tables,
                                 decode_context_lens=lens, decode_max_context=int(lens.max()))
        return _decode_attention(q, k_cache, v_cache, meta, scale, window or None)


@pytest.mark.real_model
def test_smollm2_decode_kernel_over_a_bf16_cache_keeps_greedy_text(real_model_path):
    """The C++ decode attention over SmolLM2's bf16 cache (--dtype auto; AVX-512: widened without crossing lanes,
    the queries and sums reordered to match) against the torch path's fp32 matmuls over the same bf16 values: only
    the order of the fp32 sums differs, so greedy text may fork at a near-tie, and only there."""
    from justapi import LLM

    opts = dict(dtype="auto", pool_blocks=256, show_progress=False)
    llm, reference = LLM(real_model_path, **opts), LLM(real_model_path, **opts)
    model = reference.engine.model
    if model.kernels is None or model.kv_dtype != torch.bfloat16:
        pytest.skip("the C++ kernels or a bf16 KV cache are not used here")
    model.kernels = _TorchDecodeAttention(model.kernels)
    assert_greedy_forks_only_at_near_ties(llm, reference)


@pytest.mark.real_model
def test_smollm2_greedy_output_is_the_same_with_and_without_padded_keys_in_fp32(real_model_path, monkeypatch):
    """Prefill chunks pad their keys to a multiple of attention.KEY_PAD for torch's fused kernel (zeros, masked
    out); the softmax then runs over other key tiles. In fp32 that moves results by rounding only, and greedy text
    must not change (prompts of ragged lengths, some sharing a cached prefix). The test fails when the padding is
    left unmasked. In bf16 (--dtype auto) a last-bit change flips near-ties, so text is not expected to match token
    for token there (measured in docs/benchmarks-archive.md); the tolerance tests against fp32 above run with the
    padding."""
    from justapi import LLM
    from justapi.model import attention

    base = "Here is a list of facts about the planets of the solar system, one per line. "
    prompts = [base * (1 + i % 3) + f"Fact {i}: the planet with {i + 1} moons is" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(real_model_path, pool_blocks=256, dtype="float32", show_progress=False)
    padded = [r.token_ids for r in llm.generate(prompts, params)]
    monkeypatch.setattr(attention, "KEY_PAD", 1)
    llm = LLM(real_model_path, pool_blocks=256, dtype="float32", show_progress=False)  # a fresh prefix cache
    assert [r.token_ids for r in llm.generate(prompts, params)] == padded


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _smaps_kb(address: int, field: str) -> int:
    """A field (``Rss``, ``AnonHugePages``) of the mapping that holds ``address`` (/proc/self/smaps), in KiB."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                return int(line.split()[1])
    return 0


def test_prefault_brings_an_untouched_pool_in_without_changing_it():
    """The KV pool's memory is faulted in by a background thread (hugepages.prefault), not by the first requests."""
    from justapi.model import hugepages

    pool = hugepages.zeros([(16, 1 << 20)], torch.float32, huge=False)  # 64 MiB, untouched
    before = _smaps_kb(pool[0].data_ptr(), "Rss")  # of the mapping, which the kernel may have merged with neighbours
    thread = hugepages.prefault(pool)
    if thread is None:
        pytest.skip("not Linux")
    thread.join(timeout=60)
    assert _smaps_kb(pool[0].data_ptr(), "Rss") - before >= 60 * 1024 and not pool[0].any()


def test_huge_page_arenas_hold_the_same_values_and_are_advised():
    from justapi.model import hugepages

    tensors = [torch.randn(300, 1000), torch.randint(0, 255, (1 << 20,), dtype=torch.uint8), torch.randn(7).bfloat16()]
    placed = hugepages.gather(tensors)
    zeros = hugepages.zeros([(3, 8000, 64), (5,)], torch.bfloat16)  # 3 MB: an arena
    assert [z.shape for z in zeros] == [(3, 8000, 64), (5,)] and all(not z.any() for z in zeros)
    for a, b in zip(tensors, placed):
        assert torch.equal(a, b) and b.is_contiguous() and b.data_ptr() % 64 == 0
    if not hugepages.available():
        pytest.skip("transparent huge pages are off here: the tensors stay where they are")
    assert placed[0].data_ptr() != tensors[0].data_ptr()
    assert placed[0].data_ptr() % hugepages.HUGE_PAGE == 0 and zeros[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(placed[0].data_ptr()) and "hg" in _vm_flags(zeros[0].data_ptr())
    # advised is not enough: a shared anonymous map is advised too, yet gets none (shmem follows shmem_enabled)
    assert "sh" not in _vm_flags(zeros[0].data_ptr())
    zeros[0].fill_(1)  # first touch: the kernel faults the advised range in as huge pages
    assert _smaps_kb(zeros[0].data_ptr(), "AnonHugePages") >= hugepages.HUGE_PAGE >> 10


@pytest.mark.real_model
def test_smollm2_weights_and_kv_cache_on_huge_pages_keep_greedy_output(real_model_path):
    """--no-huge-pages against the default: where the tensors lie must change nothing."""
    from justapi import LLM
    from justapi.model import hugepages

    chats = [f"Question {i}: name {i + 2} mountains of Asia, and say how high they are." for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    huge = LLM(real_model_path, pool_blocks=128, dtype="auto", show_progress=False)
    if hugepages.available():
        model, k_cache = huge.engine.model, huge.engine.runner.kv_caches[0][0]
        assert model.huge_pages and "hg" in _vm_flags(k_cache.data_ptr())
        down = model.layers[0].mlp.down
        # torch's int4 layout, q_matmul's, or the units (where q4_small and dpbf16 take every batch)
        four_bit = next(getattr(down, form) for form in ("packed", "q_bytes", "units") if hasattr(down, form))
        # a tied head's packed form: the units, or q_matmul's bytes (AVX2)
        embed = model.embed if model.embed is not None else next(
            getattr(model.lm_head, form) for form in ("units", "q_bytes") if hasattr(model.lm_head, form))
        assert "hg" in _vm_flags(four_bit.data_ptr()) and "hg" in _vm_flags(embed.data_ptr())
    plain = LLM(real_model_path, pool_blocks=128, dtype="auto", huge_pages=False, show_progress=False)
    # not carved out of an arena (its own storage); its pages' flags are not checked: the heap may hand it memory
    # that an earlier arena of this process advised
    plain_k = plain.engine.runner.kv_caches[0][0]
    assert not plain.engine.model.huge_pages and plain_k.untyped_storage().nbytes() == plain_k.nbytes
    assert [r.token_ids for r in huge.generate(chats, params)] == [r.token_ids for r in plain.generate(chats, params)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepacked_linear_matches_the_plain_product(dtype):
    from justapi.model.kernel_policy import KernelPolicy, cpu_has_bf16_matmul
    from justapi.model.quant import packed_linear, prepack_linear

    if dtype == torch.bfloat16 and not cpu_has_bf16_matmul():
        assert not KernelPolicy.make(dtype, None).uses("prepack")  # an emulated bf16 product gains nothing
        return
    assert KernelPolicy.make(dtype, None).uses("prepack")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 160, generator=g).to(dtype)
    packed = prepack_linear(w)
    assert packed.is_mkldnn and torch.equal(packed.to_dense(), w)
    for rows in (1, 6, 33, 512):
        x = torch.randn(rows, 160, generator=g).to(dtype)
        want = x.float() @ w.float().T
        got = packed_linear(x, packed)
        assert got.dtype == dtype and got.shape == (rows, 300)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4  # one bf16 rounding of an fp32 sum; fp32 sums' order
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol)


def test_int8_row_weights_are_within_half_a_step_and_match_their_own_dequantization():
    from justapi.model.kernel_policy import TORCH_SMALL_MAX_ROWS, KernelPolicy
    from justapi.model.quant import Int8RowWeight

    first_big = TORCH_SMALL_MAX_ROWS + 1  # the first batch past torch's small-batch kernels
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(500, 96, generator=g) * torch.rand(500, 1, generator=g) * 4).to(torch.bfloat16)
    head = Int8RowWeight(w, None, KernelPolicy.make(torch.bfloat16, None))
    scale = head.scale.float()[:, None]
    assert torch.equal(head.scale.float().to(torch.bfloat16), head.scale)  # bf16-exact: the kernel adds no rounding
    assert (head.q.abs() <= 127).all() and (scale.squeeze(1) * 127 >= w.float().abs().amax(1)).all()
    deq = head.q.float() * scale
    assert ((deq - w.float()).abs() <= scale / 2 + 1e-6).all()
    x = torch.randn(first_big - 1, 96, generator=g)
    want = x.to(torch.bfloat16).float() @ deq.T
    assert torch.allclose(head.matmul(x).float(), want, rtol=1e-2, atol=1e-2)
    big = torch.randn(first_big, 96, generator=g)  # from there on: the dense weight itself
    assert torch.equal(head.matmul(big), torch.nn.functional.linear(big.to(torch.bfloat16), w))


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_fused_rms_norm_and_hoisted_joint_rotary_are_bit_identical_to_the_formulas(style):
    """The forward pass looks the rotary tables up once per pass and rotates Q and K heads as one tensor, and uses
    torch's fused RMSNorm: on fp32 both give exactly what the per-layer, per-tensor formulas give."""
    from justapi.model.layers import RotaryEmbedding, rms_norm

    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 40):
        x, w = torch.randn(n, 576, generator=g) * 3, torch.randn(576, generator=g)
        assert torch.equal(rms_norm(x, w, 1e-5), w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))
    rope = RotaryEmbedding(64, 10000.0, 4096, style, "cpu")
    pos = torch.tensor([0, 5, 4095, 17])

    def formula(x):
        cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
        if style == "neox":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)

    q, k = torch.randn(4, 9, 64, generator=g), torch.randn(4, 3, 64, generator=g)
    joint = rope.rotate(torch.cat([q, k], dim=1), *rope.tables(pos))
    assert torch.equal(joint, torch.cat([formula(q), formula(k)], dim=1))
    assert not torch.equal(joint[:, :9], q)  # it rotates
