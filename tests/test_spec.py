"""Speculative decoding with the prompt-lookup proposer (--spec-method ngram): lossless, in batches, under preemption.

Draft-model chains and trees are in test_spec_draft.py; the verification rule itself is tested here.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.model.sampler import SampleRow, processed_probs, row_generator
from justapi.spec.ngram import propose_ngram
from justapi.spec.tree import DraftTree, spec_decode_tree
from spec_helpers import run_counting_passes


def test_ngram_proposes_the_continuation_of_the_latest_match():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], gamma=2) == [4, 9]  # "1 2 3" seen before: propose what followed
    assert propose_ngram([1, 2, 3, 7, 1, 2, 3, 8, 2, 3], gamma=3) == [8, 2, 3]  # the most recent match wins
    assert propose_ngram([5, 6, 7], gamma=4) == []  # nothing repeats
    assert propose_ngram([4, 4], gamma=3) == [4]  # a match at the very end proposes only what exists


def copy_prompts(llm, n, seed=0):
    """Prompts that repeat a random phrase a few times: what prompt lookup is for."""
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
        out.append(phrase * rng.randint(2, 5) + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 6))])
    return out


@pytest.fixture(scope="module")
def pair(tiny_model, tiny_exact):
    from conftest import TINY_EXACT

    return tiny_exact, LLM(tiny_model, spec_method="ngram", gamma=4, spec_max_batch=64, **TINY_EXACT)


def test_greedy_output_is_identical_alone_and_in_a_batch_of_16(pair):
    plain, spec = pair
    prompts = copy_prompts(plain, 16, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(16)]
    want = [r.token_ids for r in plain.generate(prompts, params)]
    alone = [spec.generate([p], q)[0].token_ids for p, q in zip(prompts[:4], params[:4])]
    assert alone == want[:4]
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    st = spec.engine.scheduler.stats
    assert st.spec_draft_tokens > 100 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert st.spec_mean_accepted_length > 1.0
    assert sum(st.spec_proposed_at) == st.spec_draft_tokens and st.spec_accepted_at[0] >= st.spec_accepted_at[-1]


def test_greedy_with_penalties_stop_tokens_and_max_tokens(pair):
    plain, spec = pair
    prompts = copy_prompts(plain, 6, seed=2)
    stop = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids[7]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2)]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert [len(r.token_ids) for r in got][2:4] == [1, 2]  # drafts never run past max_tokens


def test_preemption_and_prefix_cache_keep_output_and_blocks(tiny_model, pair):
    plain, _ = pair
    prompts = copy_prompts(plain, 12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    small = LLM(tiny_model, pool_blocks=40, block_size=4, max_seqs=12, show_progress=False, batch_invariant=True,
                spec_method="ngram", gamma=5, spec_max_batch=64)
    assert [r.token_ids for r in small.generate(prompts + prompts[:3], params)] == want + want[:3]
    sched = small.engine.scheduler
    assert sched.stats.num_preemptions > 0 and sched.stats.spec_accepted_tokens > 0
    sched.check_integrity()
    assert not sched.running and sched.pool.num_free + sched.num_cached_blocks == sched.pool.num_blocks


def test_speculation_stays_off_above_the_batch_limit(tiny_model):
    llm = LLM(tiny_model, pool_blocks=512, show_progress=False, spec_method="ngram", spec_max_batch=2)
    prompts = copy_prompts(llm, 8, seed=4)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.stats.spec_draft_tokens == 0  # 8 decoding at once, limit 2: no drafts


def test_one_target_pass_per_speculative_step(pair):
    """Every engine step runs the target model once, whether it verifies drafts or not. A lone request (its prompt
    in one chunk) therefore takes exactly as many passes as it emits tokens less the drafts accepted; a batch of 4
    also runs one pass a step."""
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = copy_prompts(plain, 4, seed=11)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    lone = run_counting_passes(spec, prompts[:1], params)
    assert lone.token_ids == want[:1]
    assert lone.spec_steps > 5 and lone.accepted_tokens > 5  # it speculated, and that saved passes
    assert lone.target_passes == [1] * (40 - lone.accepted_tokens)
    batch = run_counting_passes(spec, prompts, params)
    assert batch.token_ids == want
    assert batch.spec_steps > 20 and set(batch.target_passes) == {1}


def test_requests_asking_for_logprobs_never_speculate(pair):
    """Logprobs are reported per sampled token, so such a request decodes one token a step: alone, it verifies no
    draft and takes one pass per token; next to a request without logprobs, it adds nothing to the drafts."""
    plain, spec = pair
    prompts = copy_prompts(plain, 2, seed=11)
    with_lp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    without = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    same_without = run_counting_passes(spec, prompts[:1], without)
    assert same_without.accepted_tokens > 0  # the same request without logprobs speculates
    alone = run_counting_passes(spec, prompts[:1], with_lp)
    assert alone.spec_steps == alone.draft_tokens == 0
    assert alone.target_passes == [1] * 30 and alone.token_ids == same_without.token_ids
    assert [lp.token_id for lp in alone.logprobs[0]] == alone.token_ids[0]
    other_alone = run_counting_passes(spec, prompts[1:], without)
    mixed = run_counting_passes(spec, prompts, [with_lp, without])
    assert mixed.token_ids == alone.token_ids + other_alone.token_ids
    moved = lambda run: (run.spec_steps, run.draft_tokens, run.accepted_tokens)  # noqa: E731
    assert moved(mixed) == moved(other_alone) and mixed.spec_steps > 0  # all of them the other request's


def _chi_square(counts: dict[int, int], probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(t, 0) - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs) if p > 0)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float64, worked out here: the analytic target the draws are held to (the
    sampler's own processed_probs must agree with it, or a bug there would hide on both sides of the test)."""
    z = [float(x) / temperature for x in logits]
    e = [math.exp(x - max(z)) for x in z]
    p = torch.tensor([x / sum(e) for x in e], dtype=torch.float64)
    assert torch.allclose(processed_probs(logits, SamplingParams(temperature=temperature)).double(), p, atol=1e-6)
    return p


def test_verification_keeps_the_target_distribution_chi_square():
    """20,000 seeded draws of the first emitted token when the draft is one fixed token, against p itself.

    The 99.9% chi-square quantile for 7 degrees of freedom is 24.3; a wrong resampling rule (sampling from p again
    instead of from p without the rejected draft) over-weights the draft token and scores in the hundreds.
    """
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0])
    params = SamplingParams(temperature=0.8, top_k=0, max_tokens=4)
    p = _tempered(logits, 0.8)
    draft = 7  # the most likely token: accepted often, but not always
    n = 20000
    right: dict[int, int] = {}
    wrong: dict[int, int] = {}
    for seed in range(n):
        row = SampleRow(params, seed, [])
        tok = spec_decode_tree(torch.stack([logits, logits]), DraftTree.chain([draft]), row)[0][0]
        right[tok] = right.get(tok, 0) + 1
        # the wrong rule: on rejection, resample from p (the draft can come back)
        u = torch.rand((), generator=row_generator(seed ^ 0x5BD1E995, 0, "cpu")).item()
        bad = draft if u < float(p[draft]) else int(torch.multinomial(p, 1, generator=row_generator(seed, 0, "cpu")))
        wrong[bad] = wrong.get(bad, 0) + 1
    assert _chi_square(right, p, n) < 24.3
    assert _chi_square(wrong, p, n) > 100


def test_tree_verification_with_several_candidates_keeps_the_distribution_chi_square():
    """Three point-mass candidates at the root (the draft's top 3), 20,000 seeded draws of the first token.

    A wrong rule that tries each later candidate with its original probability instead of renormalising after the
    rejections before it under-weights them (c2 comes out at (1 - p(c1)) · p(c2)), and fails the same threshold.
    """
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0])
    params = SamplingParams(temperature=0.8, max_tokens=4)
    p = _tempered(logits, 0.8)
    tree = DraftTree()
    for tok in (7, 0, 2):
        tree.add(tok, -1)
    n = 20000
    right: dict[int, int] = {}
    wrong: dict[int, int] = {}
    for seed in range(n):
        tok = spec_decode_tree(torch.stack([logits] * 4), tree, SampleRow(params, seed, []))[0][0]
        right[tok] = right.get(tok, 0) + 1
        u = torch.rand(3, generator=row_generator(seed ^ 0x5BD1E995, 0, "cpu"))
        bad = next((c for j, c in enumerate((7, 0, 2)) if float(u[j]) < float(p[c])), None)
        if bad is None:
            rest = p.clone()
            rest[[7, 0, 2]] = 0
            bad = int(torch.multinomial(rest / rest.sum(), 1, generator=row_generator(seed, 0, "cpu")))
        wrong[bad] = wrong.get(bad, 0) + 1
    assert _chi_square(right, p, n) < 24.3  # 99.9% quantile, 7 degrees of freedom
    assert _chi_square(wrong, p, n) > 100


def test_tree_verification_walks_to_the_accepted_child_chi_square():
    """A depth-2 tree, branch 2, every node with its own logits: the first two emitted tokens, jointly.

    The second token must follow the logits row of the node that was accepted first (a wrong row or a wrong rule
    shows up as a different joint distribution). 22 outcomes: (x, y) for x a candidate, (x, end) otherwise.
    """
    from scipy.stats import chi2

    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0])
    tree = DraftTree()
    first = [tree.add(7, -1), tree.add(0, -1)]
    for node in first:
        tree.add(1, node)
        tree.add(2, node)
    rows = torch.stack([base.roll(r) for r in range(len(tree) + 1)])
    params = SamplingParams(temperature=1.0, max_tokens=8)
    probs = [_tempered(r, 1.0) for r in rows]
    expected = {}
    for x in range(8):
        if x in (7, 0):
            node = first[(7, 0).index(x)]
            for y in range(8):
                expected[(x, y)] = float(probs[0][x] * probs[node + 1][y])
        else:
            expected[(x, None)] = float(probs[0][x])
    n = 20000
    counts: dict = {}
    for seed in range(n):
        emitted, path = spec_decode_tree(rows, tree, SampleRow(params, seed, []))
        key = (emitted[0], emitted[1] if emitted[0] in (7, 0) else None)
        assert len(path) == len(emitted) - 1 and [tree.tokens[i] for i in path] == emitted[: len(path)]
        counts[key] = counts.get(key, 0) + 1
    stat = sum((counts.get(k, 0) - n * q) ** 2 / (n * q) for k, q in expected.items())
    assert set(counts) <= set(expected) and stat < chi2.ppf(0.999, len(expected) - 1), stat


def test_sampled_speculative_output_follows_the_model_distribution(tmp_path):
    """End to end on a tiny model: sampled output tokens 2-4, with and without speculation, 3000 seeds each.

    The prompt is the model's own sampled text, so prompt lookup proposes tokens the model finds plausible: some
    drafts are accepted, most are rejected and resampled. Two-sample chi-square over tokens seen at least 20 times
    in total, against the 99.9% quantile; then each sample alone, tokens 1-4, against the exact distribution it
    was drawn from.
    """
    from stats_helpers import (assert_follows_model, assert_rejects_model, assert_same_token_distribution,
                               model_next_token_logits, tempered)
    from tiny_gguf import write_tiny_model

    path = write_tiny_model(str(tmp_path / "t.gguf"), "llama", weight_scale=0.2, seed=5)
    opts = dict(pool_blocks=2048, show_progress=False, max_seqs=64, max_decode=64)
    plain = LLM(path, **opts)
    spec = LLM(path, spec_method="ngram", gamma=3, spec_max_batch=1000, **opts)
    own = plain.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True, seed=1))[0]
    prompt = [5, 6, 7] + own.token_ids
    n = 3000
    # temperature 3 flattens this peaked model enough that drafts are accepted about 7% of the time
    params = [SamplingParams(temperature=3.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    a = plain.generate([prompt] * n, params)
    b = spec.generate([prompt] * n, params)
    st = spec.engine.scheduler.stats
    assert st.spec_accepted_tokens > 100 and st.spec_draft_tokens - st.spec_accepted_tokens > 1000  # both paths ran
    assert_same_token_distribution(a, b)
    # the analytic control: both samples against the model's own distribution given each draw's earlier tokens
    # (transformers runs the model), so a fault both paths share, such as the temperature, is caught too
    assert_follows_model(a, tempered(model_next_token_logits(path, prompt, a, (0, 1, 2, 3)), 3.0))
    logits_b = model_next_token_logits(path, prompt, b, (0, 1, 2, 3))
    assert_follows_model(b, tempered(logits_b, 3.0))
    assert_rejects_model(b, tempered({1: logits_b[1]}, 2.5))  # the control tells temperature 2.5 from 3


def test_server_exports_speculation_metrics(tiny_model, tmp_path):
    import httpx

    from server_helpers import InProcessServer, metric

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "200", "--spec-method", "ngram",
                           "--gamma", "3"], str(tmp_path / "spec.log"))
    try:
        prompt = [7, 8, 9, 10, 11] * 8
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        m = httpx.get(srv.url + "/metrics").text
        drafts, accepted = metric(m, "justapi_spec_draft_tokens_total"), metric(m, "justapi_spec_accepted_tokens_total")
        assert drafts > 0 and 0 <= accepted <= drafts
        assert metric(m, "justapi_spec_acceptance_rate") == pytest.approx(accepted / drafts)
        assert metric(m, "justapi_spec_mean_accepted_length") >= 1.0
        assert 'justapi_spec_acceptance_rate_by_position{position="0"}' in m
        # a request asking for logprobs decodes one token a step: no drafts, and one logprob per token
        lp = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                            "ignore_eos": True, "logprobs": 1}, timeout=60)
        assert lp.status_code == 200 and lp.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        assert len(lp.json()["choices"][0]["logprobs"]["token_logprobs"]) == 40
        assert metric(httpx.get(srv.url + "/metrics").text, "justapi_spec_draft_tokens_total") == drafts
    finally:
        assert srv.stop() == 0


@pytest.mark.real_model
def test_smollm2_copy_task_greedy_identical_with_ngram(smollm2_copy_task, real_model_path):
    chats, params, want, opts = smollm2_copy_task
    spec = LLM(real_model_path, spec_method="ngram", gamma=4, spec_max_batch=16, **opts)
    assert spec.generate([chats[0]], params)[0].token_ids == want[0]
    assert [r.token_ids for r in spec.generate(chats, params)] == want
    st = spec.engine.scheduler.stats
    assert st.spec_acceptance_rate > 0.3  # the answer copies the prompt
