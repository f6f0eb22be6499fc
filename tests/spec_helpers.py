"""Run requests through an engine one step at a time, counting the forward passes of its target and draft models."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

_ids = itertools.count()


@dataclass
class CountedRun:
    """What ``run_counting_passes`` saw: tokens per request, passes per engine step, the speculation counters' moves."""

    token_ids: list[list[int]]
    logprobs: list[list | None]
    target_passes: list[int] = field(default_factory=list)  # per engine step
    draft_passes: list[int] = field(default_factory=list)  # per engine step (all zeros without a draft model)
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    proposed_levels: int = 0  # sum over speculative steps of the levels drafted (``spec_proposed_at``)


def _count(mp: pytest.MonkeyPatch, model, calls: list[int]) -> None:
    forward = model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mp.setattr(model, "forward", counted)


def run_counting_passes(llm, prompts, params) -> CountedRun:
    """Add every prompt at once and step the engine until they finish, counting model passes step by step.

    The target is the model the runner verifies with; the draft, the proposer's (a separate model object even when
    it is loaded from the same file)."""
    with pytest.MonkeyPatch.context() as mp:
        return _run(llm, prompts, params, mp)


def _run(llm, prompts, params, mp: pytest.MonkeyPatch) -> CountedRun:
    engine = llm.engine
    runner = engine.runner
    target, draft = [0], [0]
    _count(mp, runner.model, target)
    proposer = getattr(runner, "proposer", None)
    if proposer is not None:
        assert proposer.model is not runner.model
        _count(mp, proposer.model, draft)
    params = params if isinstance(params, list) else [params] * len(prompts)
    st = engine.scheduler.stats
    before = (st.spec_steps, st.spec_draft_tokens, st.spec_accepted_tokens, sum(st.spec_proposed_at))
    rids = [f"counted-{next(_ids)}" for _ in prompts]
    for rid, prompt, p in zip(rids, prompts, params):
        engine.add_request(rid, list(prompt), p)
    run = CountedRun([[] for _ in prompts], [None for _ in prompts])
    while engine.has_unfinished:
        t0, d0 = target[0], draft[0]
        for out in engine.step():
            i = rids.index(out.request_id)
            run.token_ids[i] = list(out.token_ids)
            run.logprobs[i] = out.logprobs
        run.target_passes.append(target[0] - t0)
        run.draft_passes.append(draft[0] - d0)
    after = (st.spec_steps, st.spec_draft_tokens, st.spec_accepted_tokens, sum(st.spec_proposed_at))
    run.spec_steps, run.draft_tokens, run.accepted_tokens, run.proposed_levels = (a - b for a, b in zip(after, before))
    return run
