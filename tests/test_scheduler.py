"""The scheduler without a model: hand-built runner outputs, tiny pools, exact expectations."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from justapi.config import SchedulerConfig
from justapi.core.block_pool import BlockPool
from justapi.core.outputs import Drafts, RunnerOutput
from justapi.core.limits import AdmissionError
from justapi.core.scheduler import Scheduler
from justapi.core.batching import StaticBatching
from justapi.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=64, block_size=4, chunk_size=8, max_seqs=32, max_prefill=4, max_decode=32, static=False,
         prefix_cache=False, max_model_len=4096, policy="fcfs"):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, chunk_size=chunk_size, max_seqs=max_seqs,
                          max_prefill=max_prefill, max_decode=max_decode, max_model_len=max_model_len,
                          prefix_cache=prefix_cache, policy=policy)
    return Scheduler(cfg, StaticBatching() if static else None)


def add(s, rid, n_prompt, max_tokens=4, base=100):
    return s.add_request(rid, [base + i for i in range(n_prompt)],
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True), {EOS}, seed=0)


def fake_run(s, out, token=7):
    """Sample ``token`` for every request whose tokens are all computed after this step."""
    res = RunnerOutput()
    for rid, n in out.num_scheduled_tokens.items():
        req = s.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens:
            res.sampled_token_ids[rid] = [token]
    return res


def step(s, token=7):
    out = s.schedule()
    finished = s.update(out, fake_run(s, out, token))
    s.check_integrity()
    return out, finished


def run_all(s, max_steps=10_000):
    done = {}
    for _ in range(max_steps):
        if not s.has_unfinished:
            return done
        _, outs = step(s)
        for o in outs:
            if o.finish_reason:
                done[o.request_id] = o.finish_reason
    raise AssertionError("requests never finished")


def test_scheduler_modules_do_not_import_torch():
    code = ("import sys, justapi.core.scheduler, justapi.core.radix_cache, justapi.core.block_pool, justapi.request;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_splits_exactly_under_the_budget():
    s = make(chunk_size=8)
    add(s, "a", 10)
    add(s, "b", 5)
    add(s, "c", 20)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 2, "b": 5, "c": 1}
    out, _ = step(s)  # a and b decode; c continues its prompt with the whole budget
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 3}


def test_decodes_are_never_starved_by_a_long_prompt():
    s = make(chunk_size=4, num_blocks=200)
    add(s, "short", 3, max_tokens=30)
    step(s)
    add(s, "long", 200, max_tokens=2)
    for _ in range(20):
        out, _ = step(s)
        assert out.num_scheduled_tokens.get("short") == 1
        assert out.num_scheduled_tokens.get("long", 0) <= 4


def test_max_prefill_and_max_seqs_limit_admission():
    s = make(chunk_size=100, max_prefill=2, max_seqs=3)
    for i in range(5):
        add(s, f"r{i}", 6)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1", "r2"]  # r0, r1 decode; one more admitted (max_seqs 3)
    assert len(s.running) == 3 and [r.request_id for r in s.waiting] == ["r3", "r4"]


def test_block_ids_and_reference_counts_are_exact():
    s = make(num_blocks=8, block_size=4, chunk_size=64)
    add(s, "a", 6, max_tokens=3)
    add(s, "b", 4, max_tokens=3)
    step(s)
    a, b = s.requests["a"], s.requests["b"]
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    assert s.pool.ref_counts[:4] == [1, 1, 1, 0]
    step(s)  # b's 5th token needs a new block
    assert b.block_ids == [2, 3]
    run_all(s)
    assert s.pool.num_free == 8


def test_preemption_picks_the_latest_admitted_and_resumes_it():
    s = make(num_blocks=6, block_size=4, chunk_size=64)
    add(s, "old", 8, max_tokens=8)
    add(s, "new", 8, max_tokens=8)
    step(s)  # 2 + 2 blocks used, 2 free
    assert s.pool.num_free == 2
    preempted_new = False
    for _ in range(6):
        step(s)
        if s.requests["new"].num_preemptions:
            preempted_new = True
            break
    assert preempted_new and s.requests["old"].num_preemptions == 0
    assert s.requests["new"] in s.waiting and s.requests["new"].num_computed_tokens == 0
    assert s.stats.num_preemptions == 1
    done = run_all(s)
    assert done == {"old": "length", "new": "length"}
    assert s.pool.num_free == 6


@pytest.mark.parametrize("policy", ["fcfs", "shortest"])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_random_workload_under_pressure_finishes_without_leaks(prefix_cache, policy):
    rng = random.Random(1)
    s = make(num_blocks=24, block_size=4, chunk_size=7, max_seqs=6, max_prefill=3, prefix_cache=prefix_cache,
             policy=policy)
    expected, arrivals = {}, []
    for i in range(40):
        n = rng.randint(1, 30)
        m = rng.randint(1, 20)
        if n + m > 24 * 4:
            continue
        arrivals.append((f"r{i}", n, m, rng.choice([100, 200])))
        expected[f"r{i}"] = m
    for rid, n, m, base in arrivals[:20]:
        add(s, rid, n, max_tokens=m, base=base)
    lengths = {}
    while s.has_unfinished or arrivals[20:]:
        if arrivals[20:] and rng.random() < 0.3:  # the rest arrive while the first ones run
            rid, n, m, base = arrivals.pop(20)
            add(s, rid, n, max_tokens=m, base=base)
        out, outs = step(s)
        for o in outs:
            lengths[o.request_id] = lengths.get(o.request_id, 0) + len(o.new_token_ids)
    assert lengths == expected
    assert s.stats.num_preemptions > 0
    cached = s.num_cached_blocks
    assert s.pool.num_free + cached == 24


def test_requests_that_can_never_fit_are_rejected_at_admission():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(AdmissionError, match="KV cache pool of 16 tokens"):
        add(s, "big", 10, max_tokens=10)
    with pytest.raises(AdmissionError, match="maximum context length of 64"):
        make(num_blocks=100, max_model_len=64).add_request("x", list(range(60)), SamplingParams(max_tokens=10), {2}, 0)
    with pytest.raises(AdmissionError, match="empty"):
        add(s, "empty", 0)
    assert not s.has_unfinished


def test_first_come_first_served_without_starvation():
    """A big request at the head is never overtaken, even while small ones keep arriving."""
    s = make(num_blocks=10, block_size=4, chunk_size=64, max_seqs=8)
    add(s, "small0", 8, max_tokens=12)
    step(s)
    add(s, "big", 30, max_tokens=4)  # needs 9 blocks: waits until small0 is gone
    i = 1
    admitted_order = []
    while "big" in s.requests:
        add(s, f"small{i}", 4, max_tokens=2)
        i += 1
        out, _ = step(s)
        admitted_order += [n.request_id for n in out.new_requests]
    assert admitted_order[0] == "big"


def test_abort_frees_blocks_mid_prefill_and_mid_decode():
    s = make(num_blocks=32, chunk_size=4)
    add(s, "prefilling", 20)
    add(s, "decoding", 3, max_tokens=50)
    step(s)
    step(s)
    s.abort_request("prefilling")
    s.check_integrity()
    out, _ = step(s)
    assert out.finished_request_ids == {"prefilling"}  # the next step tells the runner to drop its state
    for _ in range(2):
        step(s)
    assert s.requests["decoding"].num_output_tokens > 0
    out = s.abort_request("decoding")
    assert out.finish_reason == "abort"
    s.check_integrity()
    assert s.pool.num_free == 32
    out = s.schedule()
    assert out.finished_request_ids == {"decoding"}


def test_static_batching_runs_each_batch_to_the_end():
    s = make(static=True, max_seqs=3, chunk_size=64)
    add(s, "a", 4, max_tokens=2)
    add(s, "b", 4, max_tokens=6)
    add(s, "c", 4, max_tokens=4)
    add(s, "d", 4, max_tokens=1)
    first = True
    while "b" in s.requests:
        out, _ = step(s)
        assert "d" not in out.num_scheduled_tokens
        if first:
            assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
            first = False
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"d"}
    run_all(s)
    assert s.stats.batch_utilizations[0] == pytest.approx((2 + 6 + 4) / (3 * 6))


def test_continuous_batching_admits_into_freed_slots_at_once():
    s = make(max_seqs=2, chunk_size=64)
    add(s, "a", 4, max_tokens=1)
    add(s, "b", 4, max_tokens=10)
    add(s, "c", 4, max_tokens=1)
    step(s)  # a and b prefill; a finishes (1 token)
    out, _ = step(s)
    assert "c" in out.num_scheduled_tokens and "b" in out.num_scheduled_tokens


def test_block_pool_integrity_catches_a_double_owner():
    from collections import Counter

    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.check_integrity(Counter(ids))
    with pytest.raises(AssertionError):
        pool.check_integrity(Counter(ids + ids[:1]))
    pool.decref(ids)
    assert pool.num_free == 4


@pytest.mark.parametrize("num_blocks,drafted", [(6, False), (7, True)])
def test_draft_slots_only_take_blocks_no_decode_needs(num_blocks, drafted):
    """Two decodes that each need a new block, the first with a 4-token draft chain that needs one more: the drafts
    get that block only if it is left over once both decodes have theirs; never by preempting the second."""
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, chunk_size=16, prefix_cache=False, spec_method="draft",
                          gamma=4, branch=1, spec_max_batch=8)
    s = Scheduler(cfg)
    add(s, "a", 8, max_tokens=12)
    add(s, "b", 8, max_tokens=12, base=200)
    step(s)  # both prompts in one step; each samples its first token
    out = s.schedule()
    assert s.stats.num_preemptions == 0 and set(out.num_scheduled_tokens) == {"a", "b"}
    assert out.num_scheduled_tokens["b"] == 1 and "b" not in out.drafts  # no room left for b's drafts
    if drafted:
        assert out.drafts == {"a": Drafts(4)} and out.num_scheduled_tokens["a"] == 5
        assert len(s.requests["a"].block_ids) == 4  # positions 0..12: the draft block was granted
        sent = next(c for c in out.cached_requests if c.request_id == "a").new_block_ids
        assert len(sent) == 2  # the runner learns about both new blocks
    else:
        assert out.drafts == {} and out.num_scheduled_tokens["a"] == 1
    s.check_integrity()
