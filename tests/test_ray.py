"""--distributed-executor ray on Ray's multi-node simulation (ray.cluster_utils.Cluster: a head and two more nodes of
one CPU each, on this host): tensor-parallel ranks, prefill / decode workers and data-parallel replicas placed on
different nodes by a STRICT_SPREAD placement group give the single engine's greedy output; a replica actor killed
mid-load fails only what it had streamed. Needs the Ray extra (pip install 'justapi[ray]'), which CI installs."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig

from server_helpers import wait_until
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
    from justapi.engine.worker_pool import WorkerPoolEngine

    prompts, params, want = requests_and_reference
    kw = {"disaggregate": True} if mode == "disaggregate" else {"data_parallel": 2}
    engine = WorkerPoolEngine(EngineConfig(tiny_model, **kw, **RAY, **OPTS))
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
    from justapi.engine.worker_pool import WorkerPoolEngine

    engine = WorkerPoolEngine(EngineConfig(tiny_model, data_parallel=2, **RAY, **OPTS))
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


@contextlib.contextmanager
def serve_app(tiny_model, *flags):
    """``justapi serve --distributed-executor ray FLAGS`` as a Serve application on the cluster, Serve's proxy on a
    free loopback port, ready; its URL. Serve is shut down after."""
    import socket

    import httpx
    from ray import serve

    from justapi.startup import build_parser
    from justapi.ray_serve import build_application

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parsed = build_parser().parse_args(["serve", "--model", tiny_model, "--distributed-executor", "ray", "--threads",
                                        "1", "--port", str(port), *flags])
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        serve.run(build_application(parsed), name="justapi", route_prefix="/")
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 120, "the Serve app ready")
        yield url
    finally:
        serve.shutdown()


def test_serve_replicas_behind_the_prefix_router(cluster, tiny_model):
    """--data-parallel 2 --distributed-executor ray: two Ray Serve replicas behind Serve's HTTP proxy and the
    prefix-aware request router give the single engine's greedy text; one prefix stays on one replica; a replica
    killed mid-load fails only what it had streamed, the rest is served."""
    import concurrent.futures

    import httpx

    from server_helpers import metric

    with serve_app(tiny_model, "--data-parallel", "2", "--pool-blocks", "48", "--batch-invariant",
                   "--served-model-name", "tiny") as url:
        ref = LLM(tiny_model, **OPTS)
        prompts = [[5 + i, 6, 7, 8] * (3 + i) for i in range(6)]
        want = [o.text for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]

        def complete(prompt, max_tokens=12):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
            return r.status_code, r.json()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(complete, prompts))
        assert all(g[0] == 200 for g in got), got
        assert [g[1]["choices"][0]["text"] for g in got] == want
        code, too_big = complete([5] * 900, 4)  # within the model's length, beyond a replica's 48 blocks
        assert code == 400 and "block" in too_big["error"]["message"], too_big
        shared = list(range(3, 67))  # 4 blocks, one request after another: one replica, whose cache then hits
        for i in range(3):
            assert complete(shared + [100 + i], 2)[0] == 200
        # the replicas' load reports ride on their streams: wait for them
        wait_until(lambda: metric(httpx.get(url + "/metrics").text, "prefix_cache_hits") >= 8, 30,
                   "the shared prefix hitting one replica's cache")
        # kill the replica serving a long request mid-stream
        body = {"prompt": [9, 9, 9], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for n, line in enumerate(lines):
                if n > 10:
                    break
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if "EngineReplica" in a["name"]]
            assert len(names) == 2, names
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)  # Serve replaces it
            rest = [line for line in lines if line]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:  # served on meanwhile
                after = list(pool.map(complete, prompts[:4]))
        assert rest[-1] == "data: [DONE]"
        assert all(code == 200 for code, _ in after), after
        errored = any('"error"' in line for line in rest)  # the long request was on the killed replica
        m = httpx.get(url + "/metrics").text
        assert metric(m, "justapi_pd_requests_failed_total") == int(errored)


@pytest.mark.skipif(not os.environ.get("JUSTAPI_SLOW_TESTS"), reason="about 40 s (Serve's autoscaler looks at 10-30 s "
                    "of metrics): set JUSTAPI_SLOW_TESTS=1 to run it")
def test_serve_autoscales_the_replicas_on_ongoing_requests(cluster, tiny_model):
    """--data-parallel 1 --max-replicas 2: under more ongoing requests than the target, Serve adds a replica."""
    import concurrent.futures

    import httpx

    def running() -> int:
        return httpx.get(url + "/health").json().get("replica_states", {}).get("RUNNING", 0)

    with serve_app(tiny_model, "--data-parallel", "1", "--max-replicas", "2", "--target-ongoing-requests", "1",
                   "--upscale-delay", "1", "--pool-blocks", "256") as url:
        assert running() == 1
        deadline = time.monotonic() + 120
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        codes = []

        def client():  # keeps a request in flight until the second replica runs
            while running() < 2 and time.monotonic() < deadline:
                codes.append(httpx.post(url + "/v1/completions", json=body, timeout=120).status_code)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: client(), range(4)))
        print(f"scaled to {running()} replicas after {time.monotonic() - t0:.1f} s of load, {len(codes)} requests")
        assert running() == 2, "Serve did not add a replica"
        assert set(codes) == {200}
