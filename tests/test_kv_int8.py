"""--kv-cache-dtype int8: rows quantized as they are written (C++ and torch give the same bits: test_kernels'
rope_write_kv test), read by the decode and prefill kernels as they are (close to exact attention over the rows' own
values), and an engine whose greedy output does not depend on batching, chunking, preemption, the prefix cache, its
disk tier, tensor parallelism, disaggregation or speculative decoding."""

from __future__ import annotations

import random

import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig
from justapi.model.attention import SeqSpan, _sequence_attention, quantize_rows, widen


def int8_cache(kv_heads: int, blocks: int, bs: int, dim: int, g: torch.Generator) -> torch.Tensor:
    return quantize_rows(torch.randn(kv_heads, blocks, bs, dim, generator=g) * 2)


def test_quantize_rows_round_trips_within_half_a_step_of_each_group_and_keeps_zeros():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g) * torch.logspace(-3, 3, 50).unsqueeze(1)
    x[7] = 0
    x[9, 32:] *= 1000  # an outlier group leaves the other's steps alone
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 72)
    back = widen(rows, torch.float32)
    step = (x.view(50, 2, 32).abs().amax(-1, keepdim=True) / 127).expand(50, 2, 32).reshape(50, 64)
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all() and (back[7] == 0).all()
    assert rows[:, :64].abs().max() == 127


def _exact(q, k_rows, v_rows, table, ctx, scale, window=0):
    """fp64 causal attention of the chunk's last len(q) positions over the rows' own values (dequantized)."""
    bs = k_rows.shape[2]
    blocks = table[: -(-ctx // bs)]
    k = widen(k_rows[:, blocks].flatten(1, 2)[:, :ctx], torch.float64)
    v = widen(v_rows[:, blocks].flatten(1, 2)[:, :ctx], torch.float64)
    n, heads = q.shape[:2]
    group = heads // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.double(), k) * scale
    pos = torch.arange(ctx - n, ctx)[:, None]
    keys = torch.arange(ctx)[None, :]
    hidden = (keys > pos) | ((keys <= pos - window) if window else torch.zeros_like(keys > pos))
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,hkd->qhd", probs, v)


@pytest.mark.parametrize("dim", [32, 64, 128, 256])  # 32: the portable path
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (6, 2), (16, 2)])
def test_int8_decode_kernel_is_exact_attention_over_the_rows_values_alone_or_batched(cpp_kernels, dim, heads,
                                                                                     kv_heads):
    g = torch.Generator().manual_seed(3)
    bs, lens = 16, torch.tensor([700, 20, 33, 1, 400, 64, 17, 250])
    k_cache, v_cache = int8_cache(kv_heads, 360, bs, dim, g), int8_cache(kv_heads, 360, bs, dim, g)
    tables = torch.randperm(360, generator=g).view(8, 45)
    q = torch.randn(8, heads, dim, generator=g)
    batch = cpp_kernels.decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, 0)
    for i in range(8):
        alone = cpp_kernels.decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1],
                                             dim ** -0.5, 0)
        assert torch.equal(alone[0], batch[i])
        want = _exact(q[i : i + 1], k_cache, v_cache, tables[i], int(lens[i]), dim ** -0.5)[0]
        torch.testing.assert_close(batch[i].double(), want, atol=2e-6, rtol=1e-5)
    windowed = cpp_kernels.decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, 50)
    want = _exact(q[:1], k_cache, v_cache, tables[0], 700, dim ** -0.5, 50)[0]
    torch.testing.assert_close(windowed[0].double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (4, 1, 256)])
def test_int8_prefill_kernel_is_as_close_as_the_torch_path_it_replaces(cpp_kernels, heads, kv_heads, dim):
    """Against fp64 over the rows' values: within the error of the path it replaces (torch over the widened rows in
    the model's dtype: bf16 where the kernel packs bf16 tiles, fp32 on the AVX2 build)."""
    if not cpp_kernels.prefill_attention_available():
        pytest.skip("the C++ kernels were built without AVX-512 BF16 or AVX2")
    from justapi.model.attention import _sequence_attention_fused

    compute, floor = (torch.float32, 1e-5) if cpp_kernels.prefill_attention_fp32() else (torch.bfloat16, 1e-3)
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = int8_cache(kv_heads, 64, 16, dim, g), int8_cache(kv_heads, 64, 16, dim, g)
    for n, ctx, window in ((1, 1, 0), (37, 37, 0), (70, 300, 0), (130, 700, 512)):
        table = torch.randperm(64, generator=g)[: -(-ctx // 16)]
        q = torch.randn(n, heads, dim, generator=g) * 2
        exact = _exact(q, k_cache, v_cache, table, ctx, dim ** -0.5, window)
        got = cpp_kernels.prefill_attention(q, k_cache, v_cache, table, ctx, dim ** -0.5, window)
        torch_path = _sequence_attention_fused(q, k_cache, v_cache, SeqSpan(0, n, ctx, table), dim ** -0.5, compute,
                                               window or None)
        err, torch_err = (got - exact).abs(), (torch_path - exact).abs()
        assert err.max() <= max(1.25 * torch_err.max(), floor), (n, ctx, err.max(), torch_err.max())
        plain = _sequence_attention(q, k_cache, v_cache, SeqSpan(0, n, ctx, table), dim ** -0.5, window or None)
        torch.testing.assert_close(plain.double(), exact, atol=2e-5, rtol=1e-5)  # the batch-invariant path: fp32


@pytest.fixture(scope="module")
def model64(tmp_path_factory) -> str:
    """The tiny llama with two KV heads of 64 (int8 keeps a scale per 32 values; the decode kernel's vector path;
    --tp 2 splits the heads)."""
    from tiny_gguf import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("int8") / "tiny-64.gguf"), "llama", hidden=128, num_heads=2,
                            num_kv_heads=2, context_length=1024)


def test_a_head_size_int8_cannot_group_is_refused_in_one_line(tiny_model):
    from justapi.model.gguf_loader import ModelLoadError

    with pytest.raises(ModelLoadError, match="head size is 16; use bfloat16"):
        LLM(tiny_model, kv_cache_dtype="int8", show_progress=False)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
INT8 = dict(kv_cache_dtype="int8", batch_invariant=True, show_progress=False)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randint(3, 80))] for i in range(n)]


def test_int8_greedy_output_does_not_depend_on_batching_preemption_the_prefix_cache_or_its_disk_tier(model64,
                                                                                                    tmp_path):
    prompts = _prompts(24)
    base = LLM(model64, pool_blocks=512, prefix_cache=False, **INT8)
    assert base.engine.runner.kv_caches[0][0].dtype == torch.int8
    alone = [base.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [r.token_ids for r in base.generate(prompts, GREEDY)] == alone
    for opts in (dict(chunk_size=7), dict(pool_blocks=40, block_size=4), dict(spec_method="ngram"),
                 dict(draft_model=model64, gamma=3, branch=2, spec_max_batch=64),  # draft trees: KV moved by row
                 dict(pool_blocks=40, block_size=4, prefix_cache_dir=str(tmp_path / "kv"),
                      prefix_cache_dir_reads="always")):
        llm = LLM(model64, **{"pool_blocks": 512, **opts}, **INT8)
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == alone, opts
        llm.engine.scheduler.check_integrity()
        if "prefix_cache_dir" in opts:
            llm.engine.close()
            again = LLM(model64, **opts, **INT8)  # a restart: the int8 blocks from disk
            assert [r.token_ids for r in again.generate(prompts, GREEDY)] == alone
            assert again.engine.scheduler.kv.disk_hits > 0
            again.engine.close()
    small = LLM(model64, pool_blocks=40, block_size=4, max_seqs=24, prefix_cache=False, **INT8)
    assert [r.token_ids for r in small.generate(prompts, GREEDY)] == alone
    assert small.engine.scheduler.stats.num_preemptions > 0


def test_int8_holds_about_twice_the_tokens_of_bf16_in_the_same_memory(model64):
    bf16 = LLM(model64, kv_cache_dtype="bfloat16", kv_memory="64M", show_progress=False).engine
    int8 = LLM(model64, kv_cache_dtype="int8", kv_memory="64M", show_progress=False).engine
    dim = int8.model_config.head_dim
    assert int8.scheduler.pool.num_blocks == pytest.approx(bf16.scheduler.pool.num_blocks * 2 * dim / (dim + dim / 8),
                                                           rel=0.01)


def test_int8_under_tensor_parallelism_and_disaggregation(model64):
    from justapi.engine.worker_pool import WorkerPoolEngine
    from test_pd import run_all

    prompts = _prompts(8, seed=2)
    params = [GREEDY] * len(prompts)
    want = [r.token_ids for r in LLM(model64, pool_blocks=256, **INT8).generate(prompts, GREEDY)]
    tp = LLM(model64, pool_blocks=256, tp=2, **INT8)
    try:
        assert [r.token_ids for r in tp.generate(prompts, GREEDY)] == want
    finally:
        tp.engine.close()
    engine = WorkerPoolEngine(EngineConfig(model64, disaggregate=True, pool_blocks=256, num_threads=1, **INT8))
    try:
        done, failed = run_all(engine, prompts, params)
        assert not failed and [done[f"r{i}"].token_ids for i in range(len(prompts))] == want
        assert engine.pd.stats.kv_transfers == len(prompts)
    finally:
        engine.close()
