"""Data-parallel replicas (``--data-parallel N``): the router every multi-engine mode shares (core.router), replicas
as worker processes giving the single engine's greedy output, prefix-aware routing, and a replica killed mid-load."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig
from justapi.core.router import PrefixRouter
from justapi.engine.worker_loop import REPORT_INTERVAL_S
from justapi.sampling_params import Pooling

from test_pd import mixed_requests, run_all

OPTS = dict(pool_blocks=256, batch_invariant=True, chunk_size=64, show_progress=False)


def test_router_prefers_a_prefix_hit_within_the_slack_and_round_robin_ignores_prompts():
    r = PrefixRouter("prefix", slack=1, block_size=4)
    r.add("a", 100)
    r.add("b", 100)
    shared = list(range(16))
    assert r.choose(shared + [1], {"a": 0, "b": 0}) == "a"  # no hit anywhere, equal loads: the first added
    assert r.choose([9] * 8, {"a": 1, "b": 0}) == "b"  # no hit: the least loaded
    assert r.choose(shared + [2], {"a": 1, "b": 1}) == "a"  # a holds the 4 shared blocks
    assert r.choose(shared + [3], {"a": 2, "b": 1}) == "a"  # one more request than b: within the slack
    assert r.choose(shared + [4], {"a": 3, "b": 1}) == "b"  # two more: load wins
    assert r.prefix_blocks("b", shared) == 4  # and b holds the prefix from now on
    small = PrefixRouter(block_size=4)
    small.add("x", 2)
    small.remember("x", list(range(12)))  # 3 blocks in a shadow of 2: the deepest is forgotten, as a radix cache would
    assert small.prefix_blocks("x", list(range(12))) == 2
    rr = PrefixRouter("round-robin", block_size=4)
    for e in ("a", "b"):
        rr.add(e, 100)
    assert [rr.choose(shared, {"a": 5, "b": 0}) for _ in range(3)] == ["a", "b", "a"]
    with pytest.raises(ValueError, match="router policy"):
        PrefixRouter("random")


def test_bad_data_parallel_settings_fail_naming_the_flag(tiny_model):
    with pytest.raises(ValueError, match="--data-parallel must be a positive integer"):
        EngineConfig(tiny_model, data_parallel=0)
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(tiny_model, data_parallel=2, disaggregate=True)
    with pytest.raises(ValueError, match="drop --static-batching"):
        EngineConfig(tiny_model, data_parallel=2, static_batching=True)
    with pytest.raises(ValueError, match="--router must be one of"):
        EngineConfig(tiny_model, router="random")
    with pytest.raises(ValueError, match="--router-prefix-slack"):
        EngineConfig(tiny_model, router_prefix_slack=-1)


def test_replicas_give_the_single_engine_output_and_keep_a_shared_prefix_on_one_replica(tiny_model):
    from justapi.engine.worker_pool import WorkerPoolEngine

    prompts, params = mixed_requests()
    reference = LLM(tiny_model, **OPTS)
    want = reference.generate(prompts, params)
    engine = WorkerPoolEngine(EngineConfig(tiny_model, data_parallel=2, num_threads=1, **OPTS))
    try:
        assert [w.role for w in engine.pd.workers.values()] == ["replica", "replica"]
        done, failed = run_all(engine, prompts, params)
        assert not failed
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
        assert [done[f"r{i}"].finish_reason for i in range(len(prompts))] == [w.finish_reason for w in want]
        assert all(w.routed > 0 for w in engine.pd.workers.values())  # both replicas served
        # one after another, prompts sharing 64 tokens: all on one replica, whose prefix cache then hits
        shared, ranks = [7 + i % 200 for i in range(64)], []
        for i in range(3):
            engine.add_request(f"s{i}", shared + [3 + i], SamplingParams(temperature=0, max_tokens=2))
            ranks.append(engine.pd.requests[f"s{i}"].prefill_rank)
            while engine.has_unfinished:
                engine.step()
        assert len(set(ranks)) == 1, ranks
        deadline = time.monotonic() + 40 * REPORT_INTERVAL_S  # until the replicas' load reports show the hits
        while engine.pd.workers[ranks[0]].cache_hits < 2 * 4 and time.monotonic() < deadline:
            engine.step()
        assert engine.pd.workers[ranks[0]].cache_hits >= 2 * 4  # the 2nd and 3rd found the 4 shared blocks
        embed = {}
        engine.add_request("embed", prompts[0], SamplingParams.for_embedding(Pooling()))  # a replica is a whole engine
        while engine.has_unfinished:
            embed.update({o.request_id: o for o in engine.step() if o.finished})
        assert embed["embed"].embedding == pytest.approx(reference.embed([prompts[0]])[0], abs=1e-5)
        for rank, (problem, held) in engine.check_integrity().items():
            assert problem is None, (rank, problem)
            assert held["running"] == held["blocks_held_by_requests"] == 0
    finally:
        engine.close()


def test_requests_routed_to_a_dead_replica_before_it_streamed_are_retried(tiny_model):
    from justapi.engine.worker_pool import WorkerPoolEngine

    prompts, params = mixed_requests(4, seed=2)
    want = LLM(tiny_model, **OPTS).generate(prompts, params)
    engine = WorkerPoolEngine(EngineConfig(tiny_model, data_parallel=2, num_threads=1, **OPTS))
    try:
        os.kill(engine.procs[0].pid, signal.SIGKILL)
        engine.procs[0].join(10)
        done, failed = run_all(engine, prompts, params)  # routed before the death is noticed: some go to replica 0
        assert not failed and engine.pd.stats.retried >= 1
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
        serving, detail = engine.health()
        assert serving and detail["dead_workers"] == ["replica worker 0"] and detail["replica_workers_alive"] == 1
    finally:
        engine.close()


def test_a_replica_killed_mid_load_fails_what_it_streamed_and_the_other_serves_on(tiny_model, tmp_path):
    import httpx

    from server_helpers import ServerProcess, labelled, metric, undocumented_metrics

    srv = ServerProcess(["--model", tiny_model, "--pool-blocks", "256", "--data-parallel", "2", "--threads", "1"],
                        str(tmp_path / "dp.log"), timeout_s=300)
    try:
        # long enough to still stream after the client has read 5 tokens and asked /health (400 left ~0.2 s)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        others: list[int] = []

        def side_request(i):  # traffic on the other replica meanwhile, which must all be served
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [40 + i] * 20, "max_tokens": 30,
                                                              "temperature": 0, "ignore_eos": True}, timeout=120)
            others.append(r.status_code)

        with httpx.Client(timeout=60) as client, client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: {") and '"text"' in line
                if got == 5:
                    break
            health = httpx.get(srv.url + "/health").json()
            assert health["status"] == "ok" and health["replica_workers_alive"] == 2
            serving = [w for w in health["workers"] if w["requests"] == 1]
            assert len(serving) == 1, health
            os.kill(serving[0]["pid"], signal.SIGKILL)
            side = [threading.Thread(target=side_request, args=(i,)) for i in range(4)]
            for t in side:
                t.start()
            rest = [line for line in lines if line]
        for t in side:
            t.join(120)
        assert any('"error"' in line and "replica worker" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert others == [200] * 4  # sent as it died: retried on the other replica if routed to the dead one
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "degraded" and health["replica_workers_alive"] == 1
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "justapi_pd_requests_failed_total") == 1  # only the one that had streamed tokens
        dead = str(serving[0]["rank"])
        assert labelled(m, "justapi_worker_alive", worker=dead, role="replica") == 0.0
        assert undocumented_metrics(m) == set()  # docs/metrics.md lists them
        assert labelled(m, "justapi_worker_requests_routed_total", worker=str(1 - int(dead)), role="replica") >= 4
    finally:
        assert srv.stop() == 0
    assert "replica worker" in srv.read_log() and "died" in srv.read_log()
