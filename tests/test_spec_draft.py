"""Speculative decoding with a draft model (--draft-model): chains and trees (--branch), lossless in every setting.

A draft that is the target itself is accepted almost always; a tiny random draft of the same vocabulary almost
never. Both must give exactly the non-speculative greedy output, alone and in a batch of 16, under preemption and
with the prefix cache; sampled output must keep the target's distribution.
"""

from __future__ import annotations

import random

import pytest

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig
from spec_helpers import run_counting_passes
from tiny_gguf import write_tiny_model

OPTS = dict(pool_blocks=512, show_progress=False, batch_invariant=True)


@pytest.fixture(scope="module")
def random_draft(tiny_dir) -> str:
    """One layer, other random weights, the tiny target's vocabulary."""
    return write_tiny_model(str(tiny_dir / "tiny-draft.gguf"), "llama", num_layers=1, seed=7, context_length=256)


@pytest.fixture(scope="module")
def smollm2_random_draft(real_model_path, tmp_path_factory) -> str:
    """One layer, hidden 64, random weights, SmolLM2's vocabulary."""
    return write_tiny_model(str(tmp_path_factory.mktemp("draft") / "smol-draft.gguf"), "llama", num_layers=1,
                            hidden=64, vocab_from=real_model_path, context_length=2048, seed=3)


@pytest.fixture(scope="module")
def plain(tiny_exact):
    return tiny_exact


@pytest.fixture(scope="module")
def spec_llm(tiny_model):
    """``spec_llm(draft_path, gamma, branch)``: a speculating engine on the tiny target, one per setting, shared by
    the module's tests (every counter they check holds over all the runs of one setting)."""
    built = {}

    def build(draft: str, gamma: int, branch: int) -> LLM:
        if (draft, gamma, branch) not in built:
            built[draft, gamma, branch] = LLM(tiny_model, draft_model=draft, gamma=gamma, branch=branch,
                                              spec_max_batch=64, **OPTS)
        return built[draft, gamma, branch]

    return build


def prompts_and_params(n=16, seed=1):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 271) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("draft,gamma,branch", [
    ("self", 4, 1), ("self", 4, 2), ("random", 4, 1), ("random", 3, 3),
], ids=["self-chain", "self-tree", "random-chain", "random-tree"])
def test_greedy_output_is_identical_alone_and_in_a_batch_of_16(tiny_model, random_draft, plain, spec_llm, draft, gamma,
                                                               branch):
    prompts, params = prompts_and_params()
    want = [r.token_ids for r in plain.generate(prompts, params)]
    spec = spec_llm(tiny_model if draft == "self" else random_draft, gamma, branch)
    assert [spec.generate([p], q)[0].token_ids for p, q in zip(prompts[:3], params[:3])] == want[:3]
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    st = spec.engine.scheduler.stats
    nodes = sum(branch**d for d in range(1, gamma + 1))
    assert st.spec_steps > 50 and st.spec_draft_tokens == nodes * st.spec_steps - _short_trees(spec)
    if draft == "self":  # the draft is the target: every level accepted, except where max_tokens cut the tree
        assert st.spec_acceptance_rate * nodes / gamma > 0.95 and st.spec_mean_accepted_length > gamma
    else:
        assert st.spec_accepted_at[0] < 0.3 * st.spec_proposed_at[0]
    assert st.spec_proposed_at[0] == st.spec_steps and st.spec_accepted_at == sorted(st.spec_accepted_at, reverse=True)
    spec.engine.scheduler.check_integrity()


def _short_trees(llm) -> int:
    """Nodes missing from trees cut short by max_tokens (the last steps of a request draft fewer levels)."""
    st = llm.engine.scheduler.stats
    cfg = llm.engine.scheduler.config
    full = sum(cfg.branch**d for d in range(1, cfg.gamma + 1))
    levels = st.spec_proposed_at  # steps that drafted each level
    built = sum(count * cfg.branch ** (k + 1) for k, count in enumerate(levels))
    return full * st.spec_steps - built


def test_preemption_prefix_cache_and_blocks_with_a_tree(tiny_model, plain):
    prompts, _ = prompts_and_params(14, seed=3)
    prompts = [[9, 8, 7, 6, 5, 4, 3, 9, 8, 7, 6, 5] + p for p in prompts]  # a shared prefix: later ones hit the cache
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    small = LLM(tiny_model, draft_model=tiny_model, gamma=3, branch=2, spec_max_batch=64, pool_blocks=40,
                block_size=4, max_seqs=12, show_progress=False, batch_invariant=True)
    assert [r.token_ids for r in small.generate(prompts, params)] == want
    sched = small.engine.scheduler
    assert sched.stats.num_preemptions > 0 and sched.stats.spec_accepted_tokens > 0
    assert sched.cache.hits > 0
    sched.check_integrity()
    assert not sched.running and sched.pool.num_free + sched.num_cached_blocks == sched.pool.num_blocks
    small.engine.step()  # the runner drops finished requests' state at the next step
    assert not small.engine.runner.states and not small.engine.runner.proposer.positions


def test_speculation_off_per_request_and_above_the_batch_limit(tiny_model):
    spec = LLM(tiny_model, draft_model=tiny_model, spec_max_batch=4, **OPTS)
    prompts, _ = prompts_and_params(4, seed=4)
    off = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculative=False)
    spec.generate(prompts, off)
    assert spec.engine.scheduler.stats.spec_steps == 0  # every request opted out
    prompts8, _ = prompts_and_params(8, seed=5)
    spec.generate(prompts8, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    st = spec.engine.scheduler.stats
    assert 0 < st.spec_steps < 8 * 16 / 2  # only once at most 4 requests were left decoding
    mixed = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculative=i == 0) for i in range(2)]
    before = st.spec_steps
    spec.generate(prompts[:2], mixed)
    assert 0 < st.spec_steps - before <= 16  # only the first request speculated


@pytest.mark.parametrize("branch", [1, 2], ids=["chain", "tree"])
def test_one_target_pass_per_speculative_step(tiny_model, plain, spec_llm, branch):
    """Per step: the draft runs once per level it drafts (gamma 4), the target once to verify them all. A lone
    request's target passes are its tokens less the accepted drafts; a batch of 4 is verified in one pass a step.
    A request asking for logprobs never speculates: no draft pass, one target pass per token."""
    spec = spec_llm(tiny_model, 4, branch)
    prompts, _ = prompts_and_params(4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    lone = run_counting_passes(spec, prompts[:1], params)
    assert lone.token_ids == want[:1]
    assert lone.accepted_tokens > 15  # the draft is the target: most levels accepted
    assert lone.target_passes == [1] * (30 - lone.accepted_tokens)
    assert sum(lone.draft_passes) == lone.proposed_levels and max(lone.draft_passes) == 4
    batch = run_counting_passes(spec, prompts, params)
    assert batch.token_ids == want and batch.spec_steps > 10
    assert set(batch.target_passes) == {1} and max(batch.draft_passes) == 4
    logprobs = run_counting_passes(spec, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                      logprobs=1))
    assert logprobs.token_ids == want[:1] and len(logprobs.logprobs[0]) == 30
    assert logprobs.spec_steps == 0 and set(logprobs.draft_passes) == {0} and logprobs.target_passes == [1] * 30


def test_sampled_output_with_a_draft_tree_follows_the_model_distribution(tmp_path):
    """Sampled tokens 1-3 with and without speculation (gamma 2, branch 2), 2500 seeds each.

    The draft is the target itself, so its top-2 candidates carry most of the mass: at temperature 1.5 the first
    level is accepted about 85% of the time and rejected the rest, and a rule that forgets to take a rejected
    candidate out of p before the next try or the resample scores 2-3x the threshold (measured). Two-sample
    chi-square over tokens seen at least 20 times in total, against the 99.9% quantile. (A draft that is almost
    never accepted would not catch that: its resample then draws from the same random stream as plain sampling.)
    Then each sample alone, tokens 1-4, against the exact distribution it was drawn from.
    """
    from stats_helpers import (assert_follows_model, assert_rejects_model, assert_same_token_distribution,
                               model_next_token_logits, tempered)

    target = write_tiny_model(str(tmp_path / "t.gguf"), "llama", weight_scale=0.2, seed=5)
    opts = dict(pool_blocks=2048, show_progress=False, max_seqs=64, max_decode=64)
    plain = LLM(target, **opts)
    spec = LLM(target, draft_model=target, gamma=2, branch=2, spec_max_batch=1000, **opts)
    n = 2500
    params = [SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    a = plain.generate([[5, 6, 7]] * n, params)
    b = spec.generate([[5, 6, 7]] * n, params)
    st = spec.engine.scheduler.stats
    assert st.spec_accepted_at[0] > 1000 and st.spec_steps - st.spec_accepted_at[0] > 200  # both paths ran
    assert_same_token_distribution(a, b)
    # the analytic control: both samples against the model's own distribution given each draw's earlier tokens
    assert_follows_model(a, tempered(model_next_token_logits(target, [5, 6, 7], a, (0, 1, 2, 3)), 1.5))
    logits_b = model_next_token_logits(target, [5, 6, 7], b, (0, 1, 2, 3))
    assert_follows_model(b, tempered(logits_b, 1.5))
    assert_rejects_model(b, tempered({1: logits_b[1]}, 1.2))  # the control tells temperature 1.2 from 1.5


def test_engine_config_refuses_bad_speculation_settings(tiny_model):
    with pytest.raises(ValueError, match="--gamma must be a positive integer"):
        EngineConfig(tiny_model, draft_model=tiny_model, gamma=0)
    with pytest.raises(ValueError, match="--branch must be a positive integer"):
        EngineConfig(tiny_model, draft_model=tiny_model, branch=0)
    with pytest.raises(ValueError, match="--branch needs a proposer"):
        EngineConfig(tiny_model, branch=2)
    with pytest.raises(ValueError, match="--branch above 1 builds a draft tree, which needs --draft-model"):
        EngineConfig(tiny_model, spec_method="ngram", branch=2)
    with pytest.raises(ValueError, match="--gamma needs a proposer"):
        EngineConfig(tiny_model, gamma=4)
    with pytest.raises(ValueError, match="two proposers"):
        EngineConfig(tiny_model, spec_method="ngram", draft_model=tiny_model)
    with pytest.raises(ValueError, match="30 nodes, more than the node budget --spec-tree-nodes 20"):
        EngineConfig(tiny_model, draft_model=tiny_model, branch=2, gamma=4, spec_tree_nodes=20)
    EngineConfig(tiny_model, draft_model=tiny_model, branch=2, gamma=4)  # 30 nodes: within the default 64


@pytest.mark.real_model
# on the real model a chain that is nearly always accepted and a tree that nearly never is (every combination runs
# on the tiny model above; two here keep the suite's time)
@pytest.mark.parametrize("draft,gamma,branch", [("self", 4, 1), ("random", 2, 2)], ids=["self-chain", "random-tree"])
def test_smollm2_greedy_identical_with_draft_models(real_model_path, smollm2_random_draft, smollm2_copy_task, draft,
                                                    gamma, branch):
    chats, params, want, opts = smollm2_copy_task
    path = real_model_path if draft == "self" else smollm2_random_draft
    spec = LLM(real_model_path, draft_model=path, gamma=gamma, branch=branch, spec_max_batch=16, **opts)
    assert [r.token_ids for r in spec.generate(chats, params)] == want
    st = spec.engine.scheduler.stats
    if draft == "self":
        assert st.spec_accepted_at[0] > 0.95 * st.spec_proposed_at[0]
    else:
        assert st.spec_accepted_at[0] < 0.2 * st.spec_proposed_at[0]


def test_server_with_a_draft_tree_exports_metrics_and_honours_speculative_false(tiny_model, tmp_path):
    import httpx

    from server_helpers import InProcessServer, metric

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "200", "--draft-model", tiny_model,
                           "--gamma", "3", "--branch", "2"], str(tmp_path / "draft.log"))
    try:
        body = {"prompt": [7, 8, 9, 10], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        m = httpx.get(srv.url + "/metrics").text
        drafts, accepted = metric(m, "justapi_spec_draft_tokens_total"), metric(m, "justapi_spec_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= drafts  # the draft is the target: its first choices are accepted
        assert metric(m, "justapi_spec_mean_accepted_length") > 2.0
        assert 'justapi_spec_acceptance_rate_by_position{position="2"}' in m
        off = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": False}, timeout=60)
        assert off.status_code == 200 and off.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        assert metric(httpx.get(srv.url + "/metrics").text, "justapi_spec_draft_tokens_total") == drafts
        lp = httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": 2}, timeout=60)  # logprobs: no drafts
        assert lp.status_code == 200 and lp.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        assert metric(httpx.get(srv.url + "/metrics").text, "justapi_spec_draft_tokens_total") == drafts
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": "sometimes"}, timeout=60)
        assert bad.status_code == 400 and "speculative" in bad.text
    finally:
        assert srv.stop() == 0
