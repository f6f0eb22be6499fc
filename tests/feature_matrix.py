"""Every engine feature on one model: the same greedy tokens per request, alone and under each feature (issue 54
item 5's check, and Gemma 3's before it)."""

from __future__ import annotations

import random

from justapi import LLM, SamplingParams
from justapi.structured.spec import StructuredOutput

EXACT = dict(pool_blocks=256, block_size=4, batch_invariant=True, show_progress=False)


def assert_every_engine_feature_gives_the_same_tokens(path: str, vocab: int = 280, structured: bool = True,
                                                      grammar_in_workers: bool = True) -> None:
    """Six prompts sharing a 12-token prefix (and, with ``structured``, a seventh constrained by a regex), each
    greedy alone on the exact path, then together: batched with the prefix cache, in 3-token chunks in a pool
    small enough to preempt, drafted by the model itself as trees, by prompt lookup, under --tp 2 and with
    prefill/decode disaggregation. Every engine gives each request's tokens; the features are checked to have
    acted (cache hits, preemptions, accepted drafts). ``grammar_in_workers`` false: the constrained request is left
    out of the --tp 2 and disaggregated runs (whose processes would each import and build the grammar compiler:
    seconds a family; the grammar's path there is the same for every family, tested by test_tp and test_pd)."""
    import concurrent.futures

    from justapi.config import EngineConfig
    from justapi.engine.worker_pool import WorkerPoolEngine
    from test_pd import run_all

    # the engines in other processes start (their interpreters import torch) while the in-process ones run
    starting = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    tp2 = starting.submit(LLM, path, tp=2, **EXACT)
    pd = starting.submit(WorkerPoolEngine, EngineConfig(path, disaggregate=True, num_threads=1, **EXACT))
    try:
        rng = random.Random(2)
        shared = [rng.randrange(3, vocab) for _ in range(12)]
        prompts = [shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))] for _ in range(6)]
        params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(prompts)
        if structured:
            prompts.append(prompts[0][:9])
            params.append(SamplingParams(temperature=0, max_tokens=24,
                                         structured=StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")))
        base = LLM(path, **EXACT)
        # batched with the prefix cache on the batch-invariant path: each request's tokens alone (two checked here)
        alone = [r.token_ids for r in base.generate(prompts, params)]
        assert [base.generate([p], q)[0].token_ids for p, q in zip(prompts[:2], params[:2])] == alone[:2]
        assert base.engine.scheduler.cache.hits > 0
        if structured:
            assert base.tokenizer.decode(alone[-1]).count("-") == 1
        engines = {
            "chunked, preempted": LLM(path, **{**EXACT, "pool_blocks": 14, "chunk_size": 3}),
            "draft tree": LLM(path, draft_model=path, gamma=3, branch=2, spec_max_batch=64, **EXACT),
            "ngram": LLM(path, spec_method="ngram", gamma=3, spec_max_batch=64, **EXACT),
        }
        for name, llm in engines.items():
            assert [r.token_ids for r in llm.generate(prompts, params)] == alone, name
        assert engines["chunked, preempted"].engine.scheduler.stats.num_preemptions > 0
        assert engines["draft tree"].engine.scheduler.stats.spec_accepted_tokens > 0
        n = len(prompts) if grammar_in_workers or not structured else len(prompts) - 1
        assert [r.token_ids for r in tp2.result().generate(prompts[:n], params[:n])] == alone[:n], "tp 2"
        done, failed = run_all(pd.result(), prompts[:n], params[:n])
        assert not failed and [done[f"r{i}"].token_ids for i in range(n)] == alone[:n], "disaggregated"
    finally:
        starting.shutdown(wait=True)
        if tp2.exception() is None:
            tp2.result().engine.close()
        if pd.exception() is None:
            pd.result().close()
