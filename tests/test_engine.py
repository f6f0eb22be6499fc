"""End-to-end engine behaviour: batching equivalence, preemption, prefix cache, sampling, stop handling."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from justapi import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts_for(llm, n, seed=0, lo=3, hi=90):
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tokens(results):
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def engines(tiny_model, tiny_exact):
    """``engines(**options)``: an engine on the tiny model, one per set of options, shared by the module's tests
    (the default options are the session's ``tiny_exact``)."""
    from conftest import TINY_EXACT

    built = {tuple(sorted(TINY_EXACT.items())): tiny_exact}

    def build(**kw):
        opts = dict(TINY_EXACT)
        opts.update(kw)
        key = tuple(sorted(opts.items()))
        if key not in built:
            built[key] = LLM(tiny_model, **opts)
        return built[key]

    return build


def test_batching_never_changes_greedy_output(engines):
    """Alone vs 32 at once, chunk sizes 1/7/512, a pool small enough to preempt often, static vs continuous."""
    base = engines()
    prompts = prompts_for(base, 32, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=8 + (i * 7) % 40, ignore_eos=True) for i in range(32)]
    alone = [base.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert tokens(base.generate(prompts, params)) == alone
    for chunk in (1, 7, 512):
        assert tokens(engines(chunk_size=chunk).generate(prompts, params)) == alone, f"chunk_size={chunk}"
    small = engines(pool_blocks=40, block_size=4, max_seqs=32)
    assert tokens(small.generate(prompts, params)) == alone
    assert small.engine.scheduler.stats.num_preemptions > 10
    static = engines(static_batching=True)
    assert tokens(static.generate(prompts, params)) == alone
    assert static.engine.scheduler.stats.batch_utilizations
    for llm in (base, small, static):
        sched = llm.engine.scheduler
        sched.check_integrity()
        assert not sched.running and sched.pool.num_free + sched.num_cached_blocks == sched.pool.num_blocks


@pytest.mark.parametrize("policy", ["priority", "fair", "shortest"])
def test_scheduling_policies_never_change_greedy_output(engines, policy):
    """The order requests run in and who is preempted change, each request's greedy tokens do not: with mixed
    priorities and users, under preemption, with the prefix cache and with prompt-lookup speculation."""
    base = engines()
    prompts = prompts_for(base, 24, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=6 + (i * 5) % 30, ignore_eos=True, priority=i % 3,
                             user=f"u{i % 4}") for i in range(24)]
    alone = [base.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    small = engines(pool_blocks=40, block_size=4, scheduling_policy=policy)
    assert tokens(small.generate(prompts, params)) == alone
    assert small.engine.scheduler.stats.num_preemptions > 5
    speculating = engines(scheduling_policy=policy, spec_method="ngram", max_seqs=4)
    assert tokens(speculating.generate(prompts, params)) == alone
    for llm in (small, speculating):
        llm.engine.scheduler.check_integrity()


def test_batch_invariance_takes_the_float32_path(tmp_path):
    """bf16 rounding turns last-bit reduction differences into different tokens, so --batch-invariant is fp32."""
    from justapi.config import EngineConfig
    from justapi.model.quant import Int4Weight
    from tiny_gguf import write_tiny_model

    path = write_tiny_model(str(tmp_path / "q4.gguf"), "llama", hidden=128, intermediate=256, qtype="Q4_1")
    assert isinstance(LLM(path, show_progress=False).engine.model.layers[0].mlp.down, Int4Weight)  # auto: 4-bit
    llm = LLM(path, batch_invariant=True, show_progress=False)
    assert llm.engine.model.dtype == torch.float32 and isinstance(llm.engine.model.layers[0].mlp.down, torch.Tensor)
    with pytest.raises(ValueError, match="--batch-invariant runs the float32 path"):
        EngineConfig(model=path, dtype="bfloat16", batch_invariant=True)


def test_kv_cache_dtype_follows_the_compute_dtype_and_a_bf16_pool_holds_twice_the_blocks(tmp_path, monkeypatch):
    """--kv-cache-dtype auto: bf16 for a 4-bit file under --dtype auto, whether it computes in bf16 (a CPU with a
    bf16 matmul) or in fp32 (one without, simulated here); bf16 under --dtype bfloat16; fp32 on the exact fp32 path.
    A pool sized from memory gets twice the blocks in bf16. An explicit float32 overrides auto."""
    from justapi.config import EngineConfig
    from justapi.engine import engine_core
    from justapi.model import kernel_policy
    from tiny_gguf import write_tiny_model

    monkeypatch.setattr(engine_core, "available_memory_bytes", lambda: 64 << 20)
    path = write_tiny_model(str(tmp_path / "q4.gguf"), "llama", hidden=128, intermediate=256, qtype="Q4_1")
    auto = LLM(path, show_progress=False).engine
    half = LLM(path, dtype="bfloat16", show_progress=False).engine
    exact = LLM(path, dtype="float32", show_progress=False).engine
    wide = LLM(path, dtype="bfloat16", kv_cache_dtype="float32", show_progress=False).engine
    assert auto.model.dtype == (torch.bfloat16 if kernel_policy.cpu_has_bf16_matmul() else torch.float32)
    assert auto.model.kv_dtype == torch.bfloat16 and auto.runner.kv_caches[0][1].dtype == torch.bfloat16
    with monkeypatch.context() as m:
        real_probe = kernel_policy.probe_cpu
        m.setattr(kernel_policy, "probe_cpu", lambda k: dataclasses.replace(real_probe(k), bf16_matmul=False))
        fp32_route = LLM(path, show_progress=False).engine
        assert fp32_route.model.dtype == torch.float32 and fp32_route.model.kv_dtype == torch.bfloat16
    assert half.model.kv_dtype == torch.bfloat16 and half.runner.kv_caches[0][1].dtype == torch.bfloat16
    assert exact.model.kv_dtype == torch.float32 and exact.runner.kv_caches[0][0].dtype == torch.float32
    assert wide.model.dtype == torch.bfloat16 and wide.model.kv_dtype == torch.float32
    assert half.scheduler.pool.num_blocks == 2 * exact.scheduler.pool.num_blocks == 2 * wide.scheduler.pool.num_blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert all(len(r.token_ids) == 12 for r in LLM(path, show_progress=False).generate([[5, 6, 7], [8] * 40], params))
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        EngineConfig(model=path, kv_cache_dtype="fp4")


def test_cpp_decode_kernel_keeps_greedy_output(engines):
    """The C++ paged decode-attention kernel against the pure-torch path: same greedy tokens, batched."""
    with_kernel, without = engines(), engines(cpu_kernels=False)
    assert with_kernel.engine.model.kernels is not None and without.engine.model.kernels is None
    prompts = prompts_for(with_kernel, 24, seed=7, hi=300)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert tokens(with_kernel.generate(prompts, params)) == tokens(without.generate(prompts, params))


def test_prefix_cache_on_and_off_agree_under_eviction(engines):
    """~400 prompts drawn from a random tree of shared prefixes, pool far smaller than their total."""
    rng = random.Random(5)
    on = engines(pool_blocks=40, block_size=4)
    off = engines(pool_blocks=40, block_size=4, prefix_cache=False)
    vocab = on.engine.model_config.vocab_size
    nodes = [[]]
    for _ in range(60):  # a random tree: each node extends a random earlier one
        parent = rng.choice(nodes)
        nodes.append(parent + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))])
    prompts = [rng.choice(nodes[1:]) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))] for _ in range(400)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    total_blocks = sum(-(-(len(p) + 6) // 4) for p in prompts)
    assert total_blocks > 10 * 40
    got_on = tokens(on.generate(prompts, params))
    got_off = tokens(off.generate(prompts, params))
    assert got_on == got_off
    cache = on.engine.scheduler.cache
    assert cache.hits > 0 and cache.hit_ratio > 0.2
    sched = on.engine.scheduler
    sched.check_integrity()
    assert sched.pool.num_free + sched.num_cached_blocks == sched.pool.num_blocks


def test_multi_turn_chat_reuses_previous_turns(engines):
    on = engines(block_size=4)
    off = engines(block_size=4, prefix_cache=False)
    for llm in (on, off):
        history = [{"role": "system", "content": "You are terse."}]
        replies = []
        for turn in range(4):
            history.append({"role": "user", "content": f"question number {turn} about the world"})
            res = llm.chat(history, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
            replies.append(res.token_ids)
            history.append({"role": "assistant", "content": res.text})
        llm.replies = replies
        llm.last_cached = res.num_cached_tokens
    assert on.replies == off.replies
    assert on.last_cached > 20 and off.last_cached == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(engines):
    llm = engines()
    prompts = prompts_for(llm, 6, seed=2)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert tokens(llm.generate(prompts, params)) == alone
    small = engines(pool_blocks=30, block_size=4)
    assert tokens(small.generate(prompts, params)) == alone  # preempted and recomputed: same draws
    assert small.engine.scheduler.stats.num_preemptions > 0
    other = llm.generate(prompts[:1], SamplingParams(temperature=0.9, seed=99, max_tokens=20, ignore_eos=True))
    assert other[0].token_ids != alone[0]


def test_greedy_rows_pick_the_first_maximum_and_mixed_batches_keep_their_rows():
    from justapi.model.sampler import SampleRow, sample

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    logits[:, 7] = logits[:, 250] = logits.max() + 1  # a tie: the lower id wins, as argmax
    logits[2, 40] = logits.max() + 5
    greedy = SampleRow(SamplingParams(temperature=0), 0, [])
    assert sample(logits, [greedy] * 4)[0] == [7, 7, 40, 7]
    logits[1, 99] = logits.max() + 5  # the only token a top-1 sampled row can draw
    hot = SampleRow(SamplingParams(temperature=1.0, top_k=1), 0, [])  # a sampled row between greedy ones
    assert sample(logits, [greedy, hot, greedy, greedy])[0] == [7, 99, 40, 7]


def test_sampling_filters_and_penalties(engines):
    llm = engines()
    p = prompts_for(llm, 1, seed=3)[0]
    top1 = llm.generate([p], SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True))[0]
    greedy = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids
    tiny_p = llm.generate([p], SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=10, ignore_eos=True))[0]
    assert tiny_p.token_ids == greedy.token_ids
    min_p = llm.generate([p], SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=10, ignore_eos=True))[0]
    assert min_p.token_ids == greedy.token_ids
    rep = llm.generate([p], SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0, max_tokens=30,
                                           ignore_eos=True))[0]
    plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(set(rep.token_ids)) > len(set(plain.token_ids))


def test_stop_tokens_stop_strings_and_logprobs(engines):
    llm = engines()
    p = prompts_for(llm, 1, seed=4)[0]
    ref = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3))[0]
    assert ref.finish_reason == "length" and len(ref.logprobs) == 20
    for lp, tok in zip(ref.logprobs, ref.token_ids):
        assert lp.token_id == tok and len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the top token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    stop_tok = ref.token_ids[5]
    first = ref.token_ids.index(stop_tok)
    res = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert res.finish_reason == "stop" and res.token_ids == ref.token_ids[: first + 1]
    text = ref.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    res = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[needle]))[0]
    assert res.finish_reason == "stop" and res.text == text[: text.index(needle)]
    sched = llm.engine.scheduler
    assert not sched.running and sched.pool.num_free + sched.num_cached_blocks == sched.pool.num_blocks


def test_eos_ends_a_request_unless_ignored(engines):
    llm = engines()
    eos = llm.tokenizer.eos_token_id
    assert eos in llm.engine.tokenizer.eos_token_ids
    p = prompts_for(llm, 1, seed=12)[0]  # the tiny model's greedy continuation of this prompt samples EOS third
    ref = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12 and eos in ref.token_ids[:-1], ref.token_ids
    at = ref.token_ids.index(eos)
    res = llm.generate([p], SamplingParams(temperature=0, max_tokens=12))[0]
    assert res.finish_reason == "stop" and res.token_ids == ref.token_ids[: at + 1]
    assert res.text == llm.tokenizer.decode(ref.token_ids[:at], skip_special_tokens=True)  # EOS is not text


def test_n_completions_and_token_prompts(engines):
    llm = engines()
    p = prompts_for(llm, 1, seed=6)[0]
    res = llm.generate(p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert len(res.outputs) == 3 and len({tuple(o.token_ids) for o in res.outputs}) > 1
    assert res.prompt_token_ids == p


@pytest.mark.real_model
def test_smollm2_batching_and_preemption_equivalence(real_model_path, smollm2_exact):
    prompts = ["The capital of France is", "List three fruits:", "def add(a, b):", "Roses are red,",
               "The meaning of life is", "In 1492, Columbus", "Water is made of", "My favourite book is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = smollm2_exact
    batched = tokens(base.generate(prompts, params))
    # the first two alone: a batch-of-one step costs as much as a step of 8 rows on this fp32 path, so the other
    # engines below are held to the batch of 8, which these two tie to the unbatched output
    assert [base.generate([p], params)[0].token_ids for p in prompts[:2]] == batched[:2]
    torch_path = LLM(real_model_path, pool_blocks=256, batch_invariant=True, show_progress=False,
                     cpu_kernels=False)
    # the C++ kernels (attention, norm, rotary) change no token
    assert tokens(torch_path.generate(prompts, params)) == batched
    del torch_path
    chunked = LLM(real_model_path, pool_blocks=10, block_size=4, chunk_size=3, batch_invariant=True,
                  show_progress=False)
    assert tokens(chunked.generate(prompts[:6], params)) == batched[:6]
    assert chunked.engine.scheduler.stats.num_preemptions > 0


def test_step_log_keeps_the_latest_records_in_order():
    from justapi.engine.step_log import StepLog

    log = StepLog(size=3)
    for i in range(5):
        log.append(float(i), 0.0, 0.0, 0.01, 0.0, None, 1, 0)
    records, next_seq = log.since(0)
    assert [r.seq for r in records] == [2, 3, 4] and next_seq == 5  # the two oldest left the buffer
    assert [r.start for r in records] == [2.0, 3.0, 4.0]
    assert log.since(4)[0][0].seq == 4 and log.since(5) == ([], 5)
    assert records[0].as_dict()["step"] == 0.01
