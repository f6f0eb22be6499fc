"""Scheduling over HTTP (issue 29): deadlines end requests with what they have and free their blocks, priority
and shortest-prompt-first change who is served first, API keys are tenants of the fair policy, and --ttft-slo
refuses with 429 and Retry-After. In-process servers on the tiny model, steps slowed to make queues."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from server_helpers import InProcessServer, labelled, metric, slow_steps

KEYS = ("k-one", "k-two")


async def wait_idle(c: httpx.AsyncClient, url: str, key: str | None = None) -> str:
    deadline = time.monotonic() + 30
    while True:
        m = (await c.get(url + "/metrics")).text
        if metric(m, "justapi_requests_running") == 0 and metric(m, "justapi_requests_waiting") == 0:
            return m
        assert time.monotonic() < deadline, "the server never went idle"
        await asyncio.sleep(0.05)


async def until(c: httpx.AsyncClient, url: str, running: int, waiting: int = 0, at_least: bool = False) -> None:
    """Wait (polling /metrics) until the engine holds ``running`` requests computing and ``waiting`` queued (with
    ``at_least``: ``running`` or more of the ``running + waiting`` it holds are computing)."""
    deadline = time.monotonic() + 30
    while True:
        m = (await c.get(url + "/metrics")).text
        state = metric(m, "justapi_requests_running"), metric(m, "justapi_requests_waiting")
        if state == (running, waiting) or at_least and state[0] >= running and sum(state) == running + waiting:
            return
        assert time.monotonic() < deadline, f"(running, waiting) never reached {(running, waiting)}: it is {state}"
        await asyncio.sleep(0.01)


async def read_stream(c: httpx.AsyncClient, url: str, body: dict, headers: dict) -> tuple[str, dict, float]:
    """A streamed completion: its text, its last chunk's choice, and its seconds."""
    t0 = time.monotonic()
    text, last = "", None
    async with c.stream("POST", url + "/v1/completions", json=dict(body, stream=True), headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                last = choice
    return text, last, time.monotonic() - t0


@pytest.fixture(scope="module")
def priority_server(tiny_model, tmp_path_factory):
    srv = InProcessServer(["--model", tiny_model, "--max-seqs", "1", "--pool-blocks", "200", "--threads", "1",
                           "--scheduling-policy", "priority", "--request-timeout", "2.5",
                           "--api-key", ",".join(KEYS), "--open-metrics"],  # the tests read /metrics keyless
                          str(tmp_path_factory.mktemp("logs") / "priority.log"), on_engine=slow_steps(0.02))
    yield srv
    assert srv.stop() == 0


def test_timeouts_end_requests_behind_a_queue_with_what_they_have(priority_server):
    """A request with a 1-second timeout behind a long one ends in about a second (finish_reason length,
    stop_reason timeout), streamed or not; the long one ends at --request-timeout with its text so far; no block
    stays in use."""
    srv = priority_server
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    long_body = {"prompt": "a long one", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    short = {"prompt": "queued behind it", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "timeout": 1}

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=auth) as c:  # (a key for /metrics too)
            before = (await c.get(srv.url + "/metrics")).text
            filler = asyncio.create_task(read_stream(c, srv.url, long_body, auth))
            await until(c, srv.url, running=1)  # it runs (--max-seqs 1); the next two wait behind it
            t0 = time.monotonic()
            plain = asyncio.create_task(c.post(srv.url + "/v1/completions", json=short, headers=auth))
            streamed = asyncio.create_task(read_stream(c, srv.url, short, auth))
            embed = asyncio.create_task(c.post(srv.url + "/v1/embeddings", headers=auth,
                                               json={"input": "queued too", "timeout": 1}))
            r = await plain
            plain_s = time.monotonic() - t0
            results = await streamed, await filler
            after = await wait_idle(c, srv.url)
            return before, r, plain_s, results, after, await embed

    before, r, plain_s, ((s_text, s_last, s_secs), (f_text, f_last, f_secs)), after, embed = asyncio.run(run())
    assert embed.status_code == 408 and "timeout" in embed.json()["error"]["message"]  # nothing to give: an error
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("length", "timeout", "")
    assert 0.9 <= plain_s <= 2.0
    assert (s_last["finish_reason"], s_last["stop_reason"], s_text) == ("length", "timeout", "")
    assert 0.9 <= s_secs <= 2.0
    # the long one: cut by --request-timeout mid-decode, with what it had generated
    assert (f_last["finish_reason"], f_last["stop_reason"]) == ("length", "timeout") and len(f_text) > 0
    assert 2.3 <= f_secs <= 4.0
    assert metric(after, "justapi_request_timeouts_total") - metric(before, "justapi_request_timeouts_total") == 4
    assert metric(after, "justapi_kv_blocks_used_by_requests") == 0
    srv.engine.scheduler.check_integrity()


def test_priority_serves_the_urgent_request_first_and_keys_are_users(priority_server):
    srv = priority_server
    gold, basic = ({"Authorization": f"Bearer {k}"} for k in KEYS)
    body = {"prompt": "who goes first", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    finished: list[str] = []

    async def one(c, name, priority, headers, **more):
        r = await c.post(srv.url + "/v1/completions", json=dict(body, priority=priority, **more), headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["stop_reason"] != "timeout", name
        finished.append(name)

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=basic) as c:  # (a key for /metrics too)
            # The filler is long enough (30 steps of >= 0.02 s) to still run when the urgent one comes; the others
            # are short, so that all five end well inside --request-timeout (2.5 s), served one at a time.
            filler = asyncio.create_task(one(c, "filler", 0, basic, max_tokens=30))
            await until(c, srv.url, running=1)
            tasks = [asyncio.create_task(one(c, f"low{i}", 5, basic)) for i in range(3)]
            await until(c, srv.url, running=1, waiting=3)  # the low ones queue first
            tasks.append(asyncio.create_task(one(c, "urgent", -1, gold)))
            await asyncio.gather(filler, *tasks)
            bad = await c.post(srv.url + "/v1/completions", json=dict(body, priority="high"), headers=gold)
            return bad, await wait_idle(c, srv.url)

    bad, m = asyncio.run(run())
    # the urgent one arrived last but displaced nothing as urgent (the filler has priority 0 > -1: it was preempted)
    assert finished.index("urgent") < min(finished.index(f"low{i}") for i in range(3))
    assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]
    assert labelled(m, "justapi_tokens_served_by_user_total", user="key-1") > 0
    assert labelled(m, "justapi_tokens_served_by_user_total", user="key-2") > 0
    assert labelled(m, "justapi_time_to_first_token_by_priority_seconds_count", priority="5") >= 3
    assert labelled(m, "justapi_time_to_first_token_by_priority_seconds_count", priority="-1") >= 1


def test_shortest_serves_a_short_prompt_before_a_long_one_queued_first(tiny_model, tmp_path):
    srv = InProcessServer(["--model", tiny_model, "--max-seqs", "1", "--pool-blocks", "200", "--threads", "1",
                           "--scheduling-policy", "shortest"], str(tmp_path / "shortest.log"),
                          on_engine=slow_steps(0.02))
    try:
        finished: list[str] = []

        async def one(c, name, prompt, max_tokens=20):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await c.post(srv.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            finished.append(name)
            return r.json()["usage"]["prompt_tokens"]

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                # 60 steps of >= 20 ms: still running when the short one comes at 0.4 s (with 20 it had ended by
                # then less 40 ms, and a slow moment let the long one take the slot first)
                filler = asyncio.create_task(one(c, "filler", "hold the slot", max_tokens=60))
                await until(c, srv.url, running=1)
                long = asyncio.create_task(one(c, "long", "a long prompt " * 60))
                await until(c, srv.url, running=1, waiting=1)  # the long one queues first
                short = asyncio.create_task(one(c, "short", "short"))
                return await asyncio.gather(filler, long, short)

        _, long_tokens, short_tokens = asyncio.run(run())
        assert long_tokens > 100 > short_tokens
        assert finished == ["filler", "short", "long"]  # under fcfs: filler, long, short
    finally:
        assert srv.stop() == 0


def test_fair_shares_let_a_light_user_past_a_heavy_backlog(tiny_model, tmp_path):
    srv = InProcessServer(["--model", tiny_model, "--max-seqs", "2", "--pool-blocks", "200", "--threads", "1",
                           "--scheduling-policy", "fair"], str(tmp_path / "fair.log"), on_engine=slow_steps(0.01))
    try:
        body = {"prompt": "share", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        done: list[str] = []

        async def one(c, name, user):
            r = await c.post(srv.url + "/v1/completions", json=dict(body, user=user))
            assert r.status_code == 200, r.text
            done.append(name)

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                heavy = [asyncio.create_task(one(c, f"heavy{i}", "heavy")) for i in range(12)]
                # early in the first pair (60 steps of at least 10 ms), never on a boundary between pairs, and
                # after every heavy one is queued (coming before some would let it pass them by arrival)
                await until(c, srv.url, running=2, waiting=10)
                done_before = len(done)
                light = asyncio.create_task(one(c, "light", "light"))
                await asyncio.gather(light, *heavy)
                return done_before

        done_before = asyncio.run(run())
        # two slots, twelve heavy requests queued first: under fcfs the light one would finish last. Under fair
        # shares it takes the next free slot: the pair running when it came finishes, then its own pair (where it
        # may finish a moment after the heavy one beside it)
        assert done.index("light") <= done_before + 3, done
    finally:
        assert srv.stop() == 0


def test_ttft_slo_refuses_with_retry_after_and_measures_its_error(tiny_model, tmp_path):
    gate = threading.Event()
    srv = InProcessServer(["--model", tiny_model, "--max-seqs", "4", "--pool-blocks", "400", "--threads", "1",
                           "--chunk-size", "16", "--ttft-slo", "1.8"], str(tmp_path / "slo.log"),
                          on_engine=slow_steps(0.05, gate))
    try:
        prompt = " ".join(f"w{i}" for i in range(60))  # a few chunks of 16 each at 50 ms a step

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                gate.set()
                post = lambda: c.post(srv.url + "/v1/completions", json=body)  # noqa: E731
                first = [asyncio.create_task(post()) for _ in range(4)]  # every slot; the engine measures steps
                await until(c, srv.url, running=1, waiting=3, at_least=True)  # all four in, and a step measured
                waiting = await asyncio.gather(*(post() for _ in range(2)))  # a slot wait, nothing finished yet:
                warm = await asyncio.gather(*first)  # no finish rate to predict by, so no refusal (it was a 500)
                assert [r.status_code for r in warm + waiting] == [200] * 6, [r.text for r in warm + waiting]
                burst = [asyncio.create_task(post()) for _ in range(20)]
                while metric((await c.get(srv.url + "/metrics")).text, "justapi_slo_refusals_total") == 0:
                    await asyncio.sleep(0.01)
                # the queue is at the SLO: longer prompts through the other families are refused in their shapes
                ask = [{"role": "user", "content": prompt * 4}]
                others = await asyncio.gather(
                    c.post(srv.url + "/v1/messages", json={"model": "tiny-llama", "max_tokens": 4, "messages": ask}),
                    c.post(srv.url + "/api/chat", json={"model": "tiny-llama", "messages": ask, "stream": False}))
                burst = await asyncio.gather(*burst)
                gate.clear()
                m = await wait_idle(c, srv.url)
                later = await c.post(srv.url + "/v1/completions", json=dict(body, prompt="a short one"))
                return burst, m, later, others

        burst, m, later, (anthropic, ollama) = asyncio.run(run())
        assert anthropic.status_code == ollama.status_code == 429, (anthropic.text, ollama.text)
        assert anthropic.json()["error"]["type"] == "rate_limit_error" and "retry-after" in anthropic.headers
        assert "predicted time to first token" in ollama.json()["error"]
        codes = [r.status_code for r in burst]
        assert 200 in codes and 429 in codes, codes
        refused = next(r for r in burst if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert "predicted time to first token" in refused.json()["error"]["message"]
        assert later.status_code == 200, later.text  # with the queue drained a short prompt is admitted again
        assert metric(m, "justapi_slo_refusals_total") == codes.count(429) + 2
        assert metric(m, "justapi_ttft_prediction_error_seconds_count") >= codes.count(200)
    finally:
        assert srv.stop() == 0


def test_every_api_family_carries_priority_and_timeout(priority_server):
    """JustAPI's scheduling fields on Anthropic's, Ollama's and the Responses API's requests: urgent ones sent
    through each family after two queued low-priority OpenAI requests are all served before them; an Ollama
    request's timeout ends it behind the queue with what it has."""
    srv = priority_server
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    ask = [{"role": "user", "content": "who goes first"}]
    urgent = {"anthropic": ("/v1/messages", {"max_tokens": 8, "messages": ask}),
              "ollama": ("/api/chat", {"messages": ask, "stream": False, "options": {"num_predict": 8}}),
              "responses": ("/v1/responses", {"input": "who goes first", "max_output_tokens": 8})}
    finished: list[str] = []

    async def post(c, who, path, body):
        r = await c.post(srv.url + path, json=body)
        assert r.status_code == 200, r.text
        finished.append(who)
        return r.json()

    async def run(model):
        async with httpx.AsyncClient(timeout=60, headers=auth) as c:
            before = (await c.get(srv.url + "/metrics")).text
            low = {"prompt": "low", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "priority": 5}
            filler = asyncio.create_task(post(c, "filler", "/v1/completions", dict(low, max_tokens=30, priority=0)))
            await until(c, srv.url, running=1)
            tasks = [asyncio.create_task(post(c, f"low{i}", "/v1/completions", low)) for i in range(2)]
            await until(c, srv.url, running=1, waiting=2)
            for who, (path, body) in urgent.items():
                tasks.append(asyncio.create_task(post(c, who, path, dict(body, model=model, priority=-1))))
            await until(c, srv.url, running=1, waiting=5)
            late = asyncio.create_task(post(c, "late", "/api/generate", {
                "model": model, "prompt": "too late", "stream": False, "timeout": 0.3, "priority": 9}))
            await asyncio.gather(filler, *tasks)
            return before, await late, await wait_idle(c, srv.url)

    model = httpx.get(srv.url + "/v1/models", headers=auth).json()["data"][0]["id"]
    before, late, after = asyncio.run(run(model))
    assert max(finished.index(who) for who in urgent) < min(finished.index(f"low{i}") for i in range(2)), finished
    assert labelled(after, "justapi_time_to_first_token_by_priority_seconds_count", priority="-1") >= 3
    assert late["done"] and late["response"] == ""  # its deadline passed in the queue
    assert metric(after, "justapi_request_timeouts_total") - metric(before, "justapi_request_timeouts_total") == 1
