"""Prefill/decode disaggregation: PdScheduler routing, worker processes with KV shipped over torch.distributed (gloo),
greedy output identical to the colocated engine, no leaked blocks, and a decode worker killed mid-stream."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig
from justapi.core.pd_scheduler import PdScheduler, WorkerInfo
from justapi.sampling_params import Pooling
from justapi.structured.spec import StructuredOutput
from server_helpers import wait_until

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
          "required": ["n", "s"], "additionalProperties": False}


def test_routing_prefers_the_least_loaded_then_prefix_hits_and_handles_dead_workers():
    pd = PdScheduler([WorkerInfo(0, "prefill", num_blocks=100, block_size=4),
                      WorkerInfo(1, "prefill", num_blocks=100, block_size=4),
                      WorkerInfo(2, "decode", num_blocks=100, block_size=4, free_blocks=100),
                      WorkerInfo(3, "decode", num_blocks=100, block_size=4, free_blocks=2)])
    shared = list(range(40))
    assert pd.route("a", shared + [1]) == 0  # tie: the lower rank
    assert pd.route("b", [7] * 9) == 1  # least loaded
    assert pd.route("c", shared + [2]) == 0  # worker 0 holds the shared prefix, load within the slack
    assert pd.route("d", shared + [3]) == 0
    assert pd.route("e", shared + [4]) == 0
    assert pd.route("f", shared + [5]) == 1  # 4 vs 1 requests: beyond the slack, load wins
    assert pd.route_decode("a", 41) == 2  # worker 3 has no room for 11 blocks
    assert pd.route_decode("b", 4) == 3  # room for 2 blocks: the least loaded
    pd.transferred("a", 1000, 11, 0.01)
    assert pd.requests["a"].phase == "decode" and pd.stats.kv_bytes == 1000
    retry, fail = pd.worker_died(2)
    assert retry == [] and fail == ["a"]
    retry, fail = pd.worker_died(0)  # c, d, e were still in prefill there; worker 1 is alive
    assert sorted(retry) == ["c", "d", "e"] and fail == []
    assert pd.route("c", shared + [2]) == 1


def test_bad_disaggregation_settings_fail_naming_the_flag(tiny_model):
    with pytest.raises(ValueError, match="--prefill-workers must be a positive integer"):
        EngineConfig(tiny_model, disaggregate=True, prefill_workers=0)
    with pytest.raises(ValueError, match="--decode-workers needs --disaggregate"):
        EngineConfig(tiny_model, decode_workers=2)
    with pytest.raises(ValueError, match="drop --static-batching"):
        EngineConfig(tiny_model, disaggregate=True, static_batching=True)
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(tiny_model, disaggregate=True, spec_method="ngram")
    with pytest.raises(ValueError, match="--decode-tp needs --disaggregate"):
        EngineConfig(tiny_model, decode_tp=2)
    with pytest.raises(ValueError, match="--prefill-tp must be a positive integer"):
        EngineConfig(tiny_model, disaggregate=True, prefill_tp=0)
    cfg = EngineConfig(tiny_model, disaggregate=True)
    assert (cfg.prefill_workers, cfg.decode_workers, cfg.prefill_tp, cfg.decode_tp) == (1, 1, 1, 1)
    cfg = EngineConfig(tiny_model, disaggregate=True, tp=2, decode_tp=3)
    assert (cfg.prefill_tp, cfg.decode_tp) == (2, 3)


def mixed_requests(n=12, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 271) for _ in range(40)]
    prompts, params = [], []
    for i in range(n):
        body = [rng.randrange(3, 271) for _ in range(rng.choice([3, 17, 60, 150]))]
        prompts.append(shared + body if i % 3 == 0 else body)  # some share a prefix
        params.append(SamplingParams(temperature=0, max_tokens=rng.choice([1, 5, 24, 40]), ignore_eos=True,
                                     logprobs=2 if i == 5 else None))
    if n > 2:  # sampled and seeded: the same tokens on every path, its randomness keyed by (seed, position)
        params[2] = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    for i, spec in ((4, StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")), (7, StructuredOutput.json_schema(SCHEMA))):
        if i >= n:
            break
        # constrained: the prefill worker samples the first token under the grammar, the decode worker goes on
        params[i] = SamplingParams(temperature=0, max_tokens=40, structured=spec)
    return prompts, params


def run_all(engine, prompts, params, timeout_s=240):
    done, failed = {}, {}
    for i, (p, q) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, q)
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished:
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        failed.update(dict(engine.take_failures()))
    return done, failed


def settled(engine, timeout_s=30):
    """The workers' integrity answers once none holds a request, a handoff or a transfer: a prefill worker's last
    transfer reports (Sent) and releases come in after the outputs have. Polled: no fixed wait. Past the deadline
    the last answers come back as they are, for the caller's assertions to name the worker still holding something."""
    answers = {}

    def idle() -> bool:
        answers.update(engine.check_integrity())  # (reads the messages that came before each answer)
        return all(h["running"] == h["handoffs"] == h["transfers"] == h["blocks_held_by_requests"] == 0
                   for _, h in answers.values())

    try:
        wait_until(idle, timeout_s, "the workers idle")
    except AssertionError:
        pass  # the caller's assertions name the worker
    return answers


@pytest.mark.parametrize("prefill,decode", [(1, 1), (1, 2)])
def test_greedy_output_identical_to_the_colocated_engine_and_no_leaked_blocks(tiny_model, prefill, decode):
    from justapi.engine.worker_pool import WorkerPoolEngine

    opts = dict(pool_blocks=256, batch_invariant=True, chunk_size=64, show_progress=False)
    prompts, params = mixed_requests()
    want = LLM(tiny_model, **opts).generate(prompts, params)
    engine = WorkerPoolEngine(EngineConfig(tiny_model, disaggregate=True, prefill_workers=prefill,
                                           decode_workers=decode, num_threads=1, **opts))
    try:
        done, failed = run_all(engine, prompts, params)
        assert not failed
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
        assert [done[f"r{i}"].finish_reason for i in range(len(prompts))] == [w.finish_reason for w in want]
        lp = done["r5"].logprobs
        assert lp is not None and len(lp) == len(done["r5"].token_ids)
        st = engine.pd.stats
        handed_off = sum(1 for q in params if q.max_tokens > 1)  # a 1-token request ends on its prefill worker
        answers = settled(engine)  # the last transfer reports collected
        assert st.kv_transfers == handed_off and st.kv_bytes > 0 and st.kv_blocks > 0
        if decode == 2:
            assert all(w.load == 0 for w in engine.pd.workers.values())
        for rank, (problem, held) in answers.items():
            assert problem is None, (rank, problem)
            assert (held["running"] == held["handoffs"] == held["transfers"] == held["blocks_held_by_requests"]
                    == 0), (rank, held)
            assert held["free_blocks"] + held["cached_blocks"] == held["num_blocks"]
        with pytest.raises(ValueError, match="embeddings are not served with --disaggregate"):
            engine.add_request("embed", prompts[0], SamplingParams.for_embedding(Pooling()))
    finally:
        engine.close()


def test_workers_schedule_by_priority_and_end_requests_at_their_deadlines(tiny_model):
    """--scheduling-policy priority on both pools: greedy output as colocated; a request past its deadline in the
    prefill queue and one cut mid-decode end with finish_reason length / stop_reason timeout, leaving no block."""
    from dataclasses import replace

    from justapi.engine.worker_pool import WorkerPoolEngine

    opts = dict(pool_blocks=256, batch_invariant=True, chunk_size=64, show_progress=False)
    prompts, params = mixed_requests(8, seed=3)
    params = [replace(q, priority=i % 3) for i, q in enumerate(params)]
    want = LLM(tiny_model, **opts).generate(prompts, params)
    engine = WorkerPoolEngine(EngineConfig(tiny_model, disaggregate=True, num_threads=1, scheduling_policy="priority",
                                   **opts))
    try:
        late = SamplingParams(temperature=0, max_tokens=5, deadline=time.monotonic() - 1)
        # 800 tokens take well over 0.4 s, however fast the CPU (600 in 0.8 s did not on one)
        long = SamplingParams(temperature=0, max_tokens=800, ignore_eos=True, deadline=time.monotonic() + 0.4)
        done, failed = run_all(engine, prompts + [prompts[0], prompts[1]], params + [late, long])
        assert not failed
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
        late_out, long_out = done[f"r{len(prompts)}"], done[f"r{len(prompts) + 1}"]
        assert (late_out.finish_reason, late_out.stop_reason, late_out.token_ids) == ("length", "timeout", [])
        assert (long_out.finish_reason, long_out.stop_reason) == ("length", "timeout"), len(long_out.token_ids)
        assert 0 < len(long_out.token_ids) < 800
        for rank, (problem, held) in settled(engine).items():
            assert problem is None, (rank, problem)
            assert held["running"] == held["handoffs"] == held["blocks_held_by_requests"] == 0, (rank, held)
    finally:
        engine.close()


def test_each_pool_with_its_own_tensor_parallel_size_gives_the_colocated_output(tiny_model):
    """Prefill on 2 ranks (the tiny model's 2 KV heads split), decode on 4 (each KV head replicated on two): the
    KV is gathered from one layout and spread over the other."""
    from justapi.engine.worker_pool import WorkerPoolEngine

    opts = dict(pool_blocks=256, batch_invariant=True, chunk_size=64, show_progress=False)
    prompts, params = mixed_requests(8, seed=3)
    want = LLM(tiny_model, **opts).generate(prompts, params)
    engine = WorkerPoolEngine(EngineConfig(tiny_model, disaggregate=True, prefill_tp=2, decode_tp=4, num_threads=1,
                                           **opts))
    try:
        assert [len(f) for f in engine.followers] == [1, 3]
        assert [w["tp"] for w in engine.health()[1]["workers"]] == [2, 4]
        done, failed = run_all(engine, prompts, params)
        assert not failed
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
        assert engine.pd.stats.kv_transfers >= 1
        for rank, (problem, held) in engine.check_integrity().items():
            assert problem is None, (rank, problem)
        os.kill(engine.followers[1][2].pid, signal.SIGKILL)  # a decode shard dies: its worker is stopped, clearly
        engine.followers[1][2].join(10)
        engine.step()
        serving, detail = engine.health()
        assert not serving and detail["dead_workers"] == ["decode worker 1"]
    finally:
        engine.close()


def test_requests_routed_to_a_dead_prefill_worker_are_retried_on_another(tiny_model):
    from justapi.engine.worker_pool import WorkerPoolEngine

    opts = dict(pool_blocks=128, batch_invariant=True, show_progress=False)
    prompts, params = mixed_requests(4, seed=2)
    want = LLM(tiny_model, **opts).generate(prompts, params)
    engine = WorkerPoolEngine(EngineConfig(tiny_model, disaggregate=True, prefill_workers=2, decode_workers=1,
                                   num_threads=1, **opts))
    try:
        os.kill(engine.procs[0].pid, signal.SIGKILL)
        engine.procs[0].join(10)
        done, failed = run_all(engine, prompts, params)  # routed before the death is noticed: half go to rank 0
        assert not failed and engine.pd.stats.retried >= 1
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
        assert engine.health()[0] and engine.health()[1]["dead_workers"] == ["prefill worker 0"]
    finally:
        engine.close()


def test_a_decode_worker_killed_mid_stream_fails_its_requests_and_serving_goes_on(tiny_model, tmp_path):
    import httpx

    from server_helpers import ServerProcess, metric, undocumented_metrics

    srv = ServerProcess(["--model", tiny_model, "--pool-blocks", "256", "--disaggregate",
                         "--prefill-workers", "1", "--decode-workers", "2", "--threads", "1"],
                        str(tmp_path / "pd.log"), timeout_s=300)
    try:
        # long enough to still stream after the client has read 5 tokens and asked /health (400 left ~0.2 s)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {") and '"text"' in line:
                    got += 1
                if got == 5:
                    break
            health = httpx.get(srv.url + "/health").json()
            assert health["status"] == "ok" and health["decode_workers_alive"] == 2
            serving = [w for w in health["workers"] if w["role"] == "decode" and w["requests"] == 1]
            assert len(serving) == 1, health
            os.kill(serving[0]["pid"], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert any('"error"' in line and "decode worker" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "degraded" and health["decode_workers_alive"] == 1
        assert any("decode worker" in w for w in health["dead_workers"])
        for _ in range(3):  # later requests are served by the remaining workers
            ok = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 12}, timeout=60)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12
        # the router refuses what no worker could ever hold, naming the limit, before sending it anywhere
        for prompt, max_tokens, limit in (([5] * 1100, 4, "maximum context length"), ([5] * 8, 1020, "maximum context"),
                                          ([], 4, "empty")):
            bad = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
            assert bad.status_code == 400 and limit in bad.json()["error"]["message"], bad.text
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "justapi_pd_requests_failed_total") == 1
        assert metric(m, "justapi_pd_kv_transfers_total") >= 4
        assert 'justapi_pd_workers_alive{pool="decode"} 1.0' in m
        assert undocumented_metrics(m) == set()  # docs/metrics.md lists them
    finally:
        assert srv.stop() == 0
    assert "decode worker" in srv.read_log() and "died" in srv.read_log()


def test_ttft_slo_with_disaggregation_predicts_from_the_prefill_workers(tiny_model, tmp_path):
    """--ttft-slo --disaggregate: the prefill workers report their step costs and backlog; a burst beyond the SLO is
    partly refused with 429 and Retry-After, the rest served, and every served request's prediction is measured."""
    import asyncio

    import httpx

    from server_helpers import InProcessServer, dashboard_events, metric

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "400", "--disaggregate", "--threads", "1",
                           "--chunk-size", "8", "--ttft-slo", "0.1"], str(tmp_path / "pd-slo.log"), timeout_s=300)
    try:
        rng = random.Random(7)

        def body():
            return {"prompt": [rng.randrange(3, 271) for _ in range(200)], "max_tokens": 2, "temperature": 0}

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                # until a load report with the worker's step costs has come in (a request admitted with a
                # prediction); a fixed wait beat the server's idle pipe reads by only ~0.1 s
                deadline = time.monotonic() + 30
                while True:
                    warm = await c.post(srv.url + "/v1/completions", json=body())
                    assert warm.status_code == 200, warm.text
                    m = (await c.get(srv.url + "/metrics")).text
                    if metric(m, "justapi_ttft_prediction_error_seconds_count") > 0:
                        break
                    assert time.monotonic() < deadline, "no step costs came from the prefill worker"
                    await asyncio.sleep(0.3)
                burst = await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body()) for _ in range(60)))
                return burst, (await c.get(srv.url + "/metrics")).text

        burst, m = asyncio.run(run())
        codes = [r.status_code for r in burst]
        assert 200 in codes and 429 in codes, codes
        assert int(next(r for r in burst if r.status_code == 429).headers["retry-after"]) >= 1
        assert metric(m, "justapi_slo_refusals_total") == codes.count(429)
        assert metric(m, "justapi_ttft_prediction_error_seconds_count") >= codes.count(200)
        # the dashboard's feed shows both pools and the KV transfers between them
        feed = dashboard_events(srv.url, 1)[0]
        assert sorted(w["role"] for w in feed["pools"]) == ["decode", "prefill"]
        assert feed["transfers"]["kv_transfers"] >= codes.count(200) and feed["window"]["requests"] >= 1
    finally:
        assert srv.stop() == 0
