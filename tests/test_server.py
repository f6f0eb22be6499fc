"""``justapi serve`` (in process, on loopback) driven by the official openai client and raw HTTP.

The one test of the command as a child process, signals and all, is in test_server_real.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import openai
import pytest

from server_helpers import InProcessServer, metric, slow_steps

KEY = "test-key"
NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "300", "--api-key", KEY,
                           "--served-model-name", NAME, "--max-model-len", "512", "--max-n", "4",
                           "--threads", "1", "--batch-invariant"], str(log))
    yield srv
    assert srv.stop() == 0, "the server should shut down cleanly"
    assert "request cmpl-" in srv.read_log()  # one INFO line per request


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=body, headers=headers, timeout=60, **kw)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def assert_still_serving(client):
    r = client.completions.create(model=NAME, prompt="the cat", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_completions_and_chat_with_the_openai_client(client):
    r = client.completions.create(model=NAME, prompt="the cat sat", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == NAME
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello there"}],
                                       max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens == 6
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model=NAME, prompt="in the beginning", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    pieces, usage = [], None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        pieces.extend(ch.text for ch in chunk.choices)
    assert "".join(pieces) == whole
    assert usage.completion_tokens == 20
    msgs = [{"role": "user", "content": "tell me a story"}]
    whole = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=15, temperature=0).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=15, temperature=0, stream=True) if ch.choices)
    assert streamed == whole


def test_usage_reports_cached_prompt_tokens_and_streamed_chat_usage(client):
    """``usage.prompt_tokens_details.cached_tokens``: 0 for a new prompt, all its full 16-token blocks when it comes
    again; a chat stream with ``include_usage`` ends with one usage chunk whose counts are the non-streamed ones."""
    prompt = f"{uuid.uuid4().hex} " + "a long prompt that the prefix cache keeps for the next time " * 6
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 100 and again.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert n - 16 <= again.usage.prompt_tokens_details.cached_tokens < n  # the last token is always computed
    assert again.choices[0].text == first.choices[0].text

    msgs = [{"role": "user", "content": f"{uuid.uuid4().hex} tell me about the prefix cache " * 4}]
    kw = dict(model=NAME, messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].usage is not None
    assert chunks[-1].choices == []
    u, w = chunks[-1].usage, whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (w.prompt_tokens, 12, w.prompt_tokens + 12)
    assert w.completion_tokens == 12 and w.total_tokens == w.prompt_tokens + 12
    assert w.prompt_tokens_details.cached_tokens == 0
    assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens - 16  # the same chat again: found in the cache
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert all(c.usage is None for c in client.chat.completions.create(stream=True, **kw))  # not asked: no usage


def test_32_concurrent_streaming_clients_each_get_their_own_text(server, client):
    prompts = [f"story number {i} begins with" for i in range(32)]
    expected = [client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
                .choices[0].text for p in prompts]

    async def one(aclient, prompt):
        text = ""
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                  extra_body={"ignore_eos": True}, stream=True)
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(main()) == expected


def test_n_logprobs_echo_and_token_prompts(client):
    r = client.completions.create(model=NAME, prompt=["ab", "cd"], n=2, max_tokens=4, temperature=0.8, seed=1,
                                  logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in r.choices)
    # keyed by token text: two byte-level tokens that both decode to U+FFFD share a key
    assert all(1 <= len(top) <= 2 and max(top.values()) <= 0 for c in r.choices for top in c.logprobs.top_logprobs)
    e = client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("hello")
    ids = client.completions.create(model=NAME, prompt=[10, 20, 30], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_stop_strings_and_seeds(client):
    base = client.completions.create(model=NAME, prompt="once upon", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[5:7]
    r = client.completions.create(model=NAME, prompt="once upon", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True}, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    a = client.completions.create(model=NAME, prompt="x", max_tokens=10, temperature=1.0, seed=42,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=NAME, prompt="x", max_tokens=10, temperature=1.0, seed=42,
                                  extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text


BAD_REQUESTS = [
    ("malformed JSON", b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("wrong type", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("missing prompt", {"max_tokens": 3}, 400, "prompt"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ("negative temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n too large", {"prompt": "hi", "n": 100}, 400, "n must be at most 4"),
    ("unknown model", {"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
    ("prompt too long", {"prompt": "word " * 600, "max_tokens": 4}, 400, "maximum context length"),
    ("logit_bias outside vocab", {"prompt": "hi", "logit_bias": {"999999": 1.0}}, 400, "logit_bias: token id 999999"),
    ("logit_bias not an id", {"prompt": "hi", "logit_bias": {"cat": 1.0}}, 400, "logit_bias keys must be token ids"),
    ("logit_bias too large", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "[-100, 100]"),
    ("repetition_penalty zero", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_tokens over max_tokens", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("token id outside vocab", {"prompt": [1, 999999]}, 400, "0.."),
]


@pytest.mark.parametrize("what,body,status,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_requests_get_clear_errors(server, client, what, body, status, message):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    assert err["code"] == status
    assert_still_serving(client)


def test_bad_chat_requests_and_auth(server, client):
    r = post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"prompt": "hi"})
    assert r.status_code == 400
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "hi"}, key=None).status_code == 401
    assert post(server, "/v1/completions", {"prompt": "hi"}, key="wrong").status_code == 401
    r = post(server, "/v1/completions", json.dumps({"prompt": "x" * 5_000_000}))
    assert r.status_code == 413
    assert_still_serving(client)


def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"prompt": "hello world"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"])
    back = post(server, "/detokenize", {"tokens": r.json()["tokens"]})
    assert back.json()["prompt"] == "hello world"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["count"] > 3


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text


def test_metrics_need_the_key_where_keys_are_set(server):
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # probes need no key


def test_metrics_parse_and_move(server, client):
    before = _metrics(server)
    long_prompt = "the same long shared prefix " * 10
    for suffix in ("one", "two"):
        client.completions.create(model=NAME, prompt=long_prompt + suffix, max_tokens=4, temperature=0)
    after = _metrics(server)
    assert metric(after, "justapi_prompt_tokens_total") > metric(before, "justapi_prompt_tokens_total")
    assert metric(after, "justapi_generation_tokens_total") >= metric(before, "justapi_generation_tokens_total") + 8
    assert metric(after, "prefix_cache_hits") > metric(before, "prefix_cache_hits")
    assert metric(after, "prefix_cache_misses") >= metric(before, "prefix_cache_misses")
    hits, misses = metric(after, "prefix_cache_hits"), metric(after, "prefix_cache_misses")
    assert metric(after, "prefix_cache_hit_ratio") == pytest.approx(hits / (hits + misses))
    assert metric(after, "prefix_cache_blocks") > 0
    assert metric(after, "justapi_kv_blocks_total") == 300
    assert metric(after, "justapi_scheduled_tokens_total") > metric(before, "justapi_scheduled_tokens_total")
    assert metric(after, "justapi_engine_steps_total") > metric(before, "justapi_engine_steps_total")
    assert (metric(after, "justapi_time_to_first_token_seconds_count")
            > metric(before, "justapi_time_to_first_token_seconds_count"))
    assert "justapi_e2e_request_latency_seconds_bucket" in after
    assert "justapi_time_per_output_token_seconds_bucket" in after


def test_step_log_accounts_for_every_scheduled_token(server, client):
    """GET /engine/steps: the records since a point cover the steps of a request alone, every token it computed
    once (the prompt's, in prefill chunks, then one a decode step), with the phases' times inside the step's."""
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/engine/steps", timeout=10).status_code == 401
    first = httpx.get(server.url + "/engine/steps?since=1000000000", headers=auth, timeout=10).json()["next"]
    r = client.completions.create(model=NAME, prompt="count the steps of this one request", max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True})
    body = httpx.get(server.url + f"/engine/steps?since={first}", headers=auth, timeout=10).json()
    steps = body["steps"]
    assert [s["seq"] for s in steps] == list(range(first, body["next"]))
    work = [s["work"] for s in steps if s["work"]["num_tokens"]]
    prompt = r.usage.prompt_tokens
    assert sum(w["num_tokens"] for w in work) == prompt + 7 - 1  # the last output token is never fed back
    assert sum(w["num_prefill_tokens"] for w in work) == prompt
    assert sum(w["num_decodes"] for w in work) == 7 - 1
    for s in steps:
        w = s["work"]
        assert 0 <= w["schedule"] + w["execute"] + w["update"] + w["detokenize"] <= s["step"]
        assert min(s["idle"], s["commands"], s["deliver"]) >= 0


def test_full_queue_answers_429_then_recovers(tiny_model, tmp_path):
    slow = threading.Event()  # while set each step takes 20 ms more: a full queue stays full meanwhile

    srv = InProcessServer(["--model", tiny_model, "--max-seqs", "1", "--max-queue", "1",
                           "--pool-blocks", "200"], str(tmp_path / "q.log"), on_engine=slow_steps(0.02, slow))
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "x", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body) for _ in range(6)))

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert 429 in statuses and 200 in statuses

        async def until(c, want):
            deadline = time.monotonic() + 30
            while True:
                m = (await c.get(srv.url + "/metrics")).text
                state = metric(m, "justapi_requests_running"), metric(m, "justapi_requests_waiting")
                if state == want:
                    return
                if time.monotonic() > deadline:
                    pytest.fail(f"(running, waiting) never reached {want} in 30 s: it is {state}")
                await asyncio.sleep(0.01)

        async def stream_while_full():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "x", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
                slow.set()
                busy = [asyncio.create_task(c.post(srv.url + "/v1/completions", json=body))]
                await until(c, (1, 0))  # it runs (--max-seqs 1)
                busy.append(asyncio.create_task(c.post(srv.url + "/v1/completions", json=body)))
                await until(c, (1, 1))  # it waits (--max-queue 1): the queue is full
                streamed = await c.post(srv.url + "/v1/completions", json=dict(body, stream=True))
                slow.clear()
                return streamed, await asyncio.gather(*busy)

        streamed, busy = asyncio.run(stream_while_full())
        assert streamed.status_code == 429  # refused before the stream starts, not inside it
        assert "busy" in streamed.json()["error"]["message"]
        assert [r.status_code for r in busy] == [200, 200]  # the requests already taken run to the end
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        slow.clear()
        assert srv.stop() == 0


def test_route_annotations_are_types_not_strings():
    """Ray Serve's ingress pickles the app by value, closures and all: a postponed (string) annotation then names a
    global the pickle left behind, and FastAPI reads the request body as query parameters (a 400 for every call). So
    the route modules do not use ``from __future__ import annotations``."""
    import inspect

    from justapi.server_config import ServerConfig
    from justapi.server.api import build_app

    def endpoints(routes):
        for r in routes:
            if hasattr(r, "original_router"):  # FastAPI's included routers
                yield from endpoints(r.original_router.routes)
            elif hasattr(r, "endpoint"):
                yield r

    routes = list(endpoints(build_app(ServerConfig(), "m", lambda: None).routes))
    assert len(routes) > 30
    postponed = [(r.path, name) for r in routes for name, p in inspect.signature(r.endpoint).parameters.items()
                 if isinstance(p.annotation, str)]
    assert postponed == []
