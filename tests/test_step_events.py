"""The step events the dashboard draws (engine.step_log's StepWork) agree with the scheduler's own outputs: every
scheduled token appears once, in the cell of its step, and a request's cells tile its positions (restarting only
after a preemption); the pool's three parts add up; the prefix cache's shared prefixes are the ones requests hit."""

from __future__ import annotations

import random

from justapi import LLM, SamplingParams


def _run_recording(llm: LLM, prompts, params):
    """Drive the engine step by step; each step's SchedulerOutput (as the runner got it), its StepWork and the
    request outputs, in order."""
    engine = llm.engine
    scheduled = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        scheduled.append(out)
        return out

    engine.scheduler.schedule = spy
    try:
        for i, (p, q) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, q)
        steps, outputs = [], {}
        while engine.has_unfinished:
            reports = engine.step()
            if not scheduled[-1].empty:
                steps.append((scheduled[-1], engine.last_step))
            for r in reports:
                outputs[r.request_id] = r
    finally:
        del engine.scheduler.schedule
    return steps, outputs


def _check_tiling(steps, outputs, prompts):
    """Each request's cells continue where the previous one ended, or restart after its preemption; together they
    compute the prompt and every output token but the last."""
    expected: dict[str, int] = {}
    for sched, work in steps:
        assert {c[0] for c in work.cells} == set(sched.num_scheduled_tokens)
        assert len(work.cells) == len(sched.num_scheduled_tokens), "a request appears twice in one step"
        for rid, kind, start, tokens, accepted in work.cells:
            assert tokens == sched.num_scheduled_tokens[rid]
            assert kind == "spec" if rid in sched.drafts else kind in ("prefill", "decode")
            if rid in expected:
                assert start == expected[rid], f"{rid}: a gap or an overlap at {start}"
            else:
                assert start % 4 == 0  # a first admission starts at 0 or after cached whole blocks
            expected[rid] = start + (1 + accepted if kind == "spec" else tokens)
        assert sum(c[3] for c in work.cells) == work.num_tokens == sched.total_num_scheduled_tokens
        for rid in work.preempted:
            expected.pop(rid, None)  # recomputed from the start (or its cached prefix) later
        assert set(work.finished) <= set(outputs)
    for i, p in enumerate(prompts):
        out = outputs[f"r{i}"]
        assert expected[f"r{i}"] == len(p) + len(out.token_ids) - 1
    assert {rid for _, w in steps for rid in w.finished} == set(outputs)


def test_step_events_agree_with_the_scheduler_under_chunking_preemption_and_speculation(tiny_model):
    rng = random.Random(3)
    llm = LLM(tiny_model, pool_blocks=40, block_size=4, chunk_size=13, max_seqs=12, spec_method="ngram", gamma=3,
              show_progress=False)
    vocab = llm.engine.model_config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(16)]
    prompts = []
    for i in range(14):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        prompts.append((shared if i % 2 else []) + phrase * rng.randint(2, 4))
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(14)]
    steps, outputs = _run_recording(llm, prompts, params)
    _check_tiling(steps, outputs, prompts)
    kinds = {c[1] for _, w in steps for c in w.cells}
    assert {"prefill", "decode", "spec"} <= kinds
    assert any(w.preempted for _, w in steps), "the pool is small enough to preempt"
    pool = llm.engine.scheduler.pool
    for _, w in steps:
        held, evictable, free = w.kv_blocks
        assert held + evictable + free == pool.num_blocks and min(w.kv_blocks) >= 0
    assert steps[-1][1].prefix_hits > 0  # the shared 16 tokens: four whole blocks found again
    llm.engine.scheduler.check_integrity()  # the locked-blocks counter among the rest
    shared_prefixes = llm.engine.scheduler.cache.shared_prefixes(3)
    assert shared_prefixes and list(shared_prefixes[0][0][:16]) == shared and shared_prefixes[0][1] >= 2


def test_static_batching_records_whole_batches(tiny_model):
    llm = LLM(tiny_model, pool_blocks=256, static_batching=True, max_seqs=4, show_progress=False)
    prompts = [[5 + i, 9, 11, 13 + i] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(6)]
    steps, outputs = _run_recording(llm, prompts, params)
    _check_tiling(steps, outputs, prompts)
    batches = [frozenset(c[0] for c in w.cells) for _, w in steps]
    assert batches[0] == {"r0", "r1", "r2", "r3"}
    assert all(b <= batches[0] or not b & batches[0] for b in batches), "a second batch joined the first"


def test_a_request_aborted_between_steps_is_in_the_next_step_s_finished(tiny_model):
    llm = LLM(tiny_model, pool_blocks=64, show_progress=False)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"a{i}", [5 + i, 9, 11, 13], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("a1").finished
    engine.step()
    work = engine.last_step
    assert "a1" in work.finished and "a1" not in {c[0] for c in work.cells}
    engine.step()
    assert "a1" not in engine.last_step.finished  # once
    while engine.has_unfinished:
        engine.step()
