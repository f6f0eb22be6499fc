"""--distributed-executor ray on Ray's multi-node simulation (ray.cluster_utils.Cluster: a head and two more nodes of
one CPU each, on this host): tensor-parallel ranks, prefill / decode workers and data-parallel replicas placed on
different nodes by a STRICT_SPREAD placement group give the single engine's greedy output; a replica actor killed
mid-load fails only what it had streamed. Needs the Ray extra (pip install 'justapi[ray]'), which CI installs."""

from __future__ import annotations

import time

import pytest

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig

from test_pd import mixed_requests, run_all

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'justapi[ray]' to run the Ray tests")

OPTS = dict(pool_blocks=256, batch_invariant=True, chunk_size=64, show_progress=False, num_threads=1)
RAY = dict(distributed_executor="ray", placement_strategy="STRICT_SPREAD")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def requests_and_reference(tiny_model):
    prompts, params = mixed_requests(6, seed=5)
    ref = LLM(tiny_model, **OPTS)
    return prompts, params, [w.token_ids for w in ref.generate(prompts, params)]


def nodes(procs) -> set[str]:
    return {p.node_id for p in procs}


def test_tensor_parallel_ranks_on_two_nodes(cluster, tiny_model, requests_and_reference):
    prompts, params, want = requests_and_reference
    llm = LLM(tiny_model, tp=2, **RAY, **OPTS)
    try:
        follower = llm.engine.executor.procs[0]
        assert follower.node_id != ray.get_runtime_context().get_node_id()  # rank 0 here, rank 1 on another node
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.engine.close()


@pytest.mark.parametrize("mode", ["disaggregate", "data_parallel"])
def test_workers_on_separate_nodes_give_the_single_engine_output(cluster, tiny_model, requests_and_reference, mode):
    from justapi.engine.pd_engine import PdEngine

    prompts, params, want = requests_and_reference
    kw = {"disaggregate": True} if mode == "disaggregate" else {"data_parallel": 2}
    engine = PdEngine(EngineConfig(tiny_model, **kw, **RAY, **OPTS))
    try:
        assert len(nodes(engine.procs)) == 2  # prefill and decode (or the two replicas) on different nodes
        late = SamplingParams(temperature=0, max_tokens=5, deadline=time.monotonic() - 1)  # deadlines travel
        done, failed = run_all(engine, prompts + [prompts[0]], params + [late])
        assert not failed
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == want
        assert done[f"r{len(prompts)}"].stop_reason == "timeout"
        if mode == "disaggregate":
            assert engine.pd.stats.kv_transfers >= 1
        for rank, (problem, held) in engine.check_integrity().items():
            assert problem is None, (rank, problem)
    finally:
        engine.close()


def test_a_replica_actor_killed_mid_load_fails_only_what_it_streamed(cluster, tiny_model):
    """Ray reports the actor's death; its requests that had streamed a token fail, the others are served by the
    other replica; nothing hangs."""
    from justapi.engine.pd_engine import PdEngine

    engine = PdEngine(EngineConfig(tiny_model, data_parallel=2, **RAY, **OPTS))
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for i in range(6):
            engine.add_request(f"r{i}", [10 + i] * 30, params)
        first: set[str] = set()
        done, deadline = {}, time.monotonic() + 120
        while len(first) < 2:  # both replicas are streaming
            for out in engine.step():
                first.add(out.request_id)
            assert time.monotonic() < deadline
        victim = engine.procs[0]
        streamed = {rid for rid in first if engine.pd.requests[rid].prefill_rank == 0}
        ray.kill(victim.actor, no_restart=True)
        failed = {}
        while engine.has_unfinished:
            assert time.monotonic() < deadline, "requests hang"
            for out in engine.step():
                first.add(out.request_id)
                if out.finished:
                    done[out.request_id] = out
            failed.update(dict(engine.take_failures()))
        on_dead = {rid for rid in first if rid not in done}
        assert set(failed) == on_dead and streamed <= on_dead  # what had streamed there, and only that
        assert len(done) == 6 - len(failed) and all(len(o.token_ids) == 200 for o in done.values())
        assert engine.pd.stats.failed == len(failed)
        serving, detail = engine.health()
        assert serving and detail["dead_workers"] == ["replica worker 0"]
    finally:
        engine.close()
