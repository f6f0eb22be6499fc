"""One request never takes the server down (issue 53): hostile sampling values, a request that fails inside the
engine, fan-out, requests without max_tokens, malformed bodies, clients that leave, slow clients, oversized labels.
Each test ends by checking that the server still serves a normal request."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from server_helpers import InProcessServer, metric, slow_steps, wait_until

NAME = "tiny"
FAIL_TEMPERATURE = 0.777  # a request sampled at this temperature fails inside the engine (the server below)


@pytest.fixture(scope="module")
def failing_sampling():
    """Sampling raises for rows at FAIL_TEMPERATURE, as a bug in one row's sampling would (until the module ends)."""
    import justapi.model.runner as runner

    real = runner.sample

    def sample(logits, rows, kernels=None):
        if any(r.params.temperature == FAIL_TEMPERATURE for r in rows):
            raise RuntimeError("a row that cannot be sampled")
        return real(logits, rows, kernels)

    runner.sample = sample
    yield
    runner.sample = real


SLOW = threading.Event()  # while set, each engine step of the module's server takes 10 ms more


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, failing_sampling):
    # a pool (40 blocks = 640 tokens) smaller than the context (1024): requests without max_tokens are capped by it
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "40", "--served-model-name", NAME, "--max-n", "4",
                           "--max-queue", "4", "--max-prompts", "64", "--max-choices", "128", "--threads", "1"],
                          str(tmp_path_factory.mktemp("logs") / "robust.log"), on_engine=slow_steps(0.01, SLOW))
    yield srv
    assert srv.stop() == 0


def post(server, path: str, body, timeout: float = 60) -> httpx.Response:
    if isinstance(body, (str, bytes)):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"},
                          timeout=timeout)
    return httpx.post(server.url + path, json=body, timeout=timeout)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"] and err["code"] == status
    for w in words:
        assert w in err["message"], err["message"]
    return err


def assert_serving(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


def wait_idle(server, timeout_s: float = 30) -> str:
    """/metrics once nothing runs or waits (polled)."""
    def idle() -> str | None:
        m = httpx.get(server.url + "/metrics", timeout=10).text
        return m if metric(m, "justapi_requests_running") == metric(m, "justapi_requests_waiting") == 0 else None

    return wait_until(idle, timeout_s, "the server idle")


def test_a_tiny_temperature_is_greedy_and_non_finite_values_are_refused(server):
    body = {"prompt": "hello", "max_tokens": 6, "ignore_eos": True}
    greedy = post(server, "/v1/completions", dict(body, temperature=0)).json()["choices"][0]["text"]
    tiny = post(server, "/v1/completions", '{"prompt": "hello", "max_tokens": 6, "ignore_eos": true, '
                                           '"temperature": 1e-40}')
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy
    for field, raw in (("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                       ("presence_penalty", "-Infinity"), ("min_p", "NaN")):
        r = post(server, "/v1/completions", f'{{"prompt": "hello", "max_tokens": 4, "{field}": {raw}}}')
        assert assert_error(r, 400)["param"] == field, r.text
    huge = post(server, "/v1/completions", dict(body, temperature=1e300, seed=1))  # flat, but a distribution
    assert huge.status_code == 200, huge.text
    assert_serving(server)


def test_a_request_failing_in_the_engine_fails_alone(server):
    """A request whose sampling raises ends with a 500 naming the failure; the requests beside it in the same
    steps finish, its blocks are freed and /health stays 200."""

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            normal = [c.post(server.url + "/v1/completions", json={"prompt": f"steady {i}", "max_tokens": 30,
                                                                   "temperature": 0, "ignore_eos": True})
                      for i in range(2)]
            bad = c.post(server.url + "/v1/completions", json={"prompt": "doomed", "max_tokens": 30,
                                                               "temperature": FAIL_TEMPERATURE})
            bad_stream = c.post(server.url + "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "doomed too"}], "max_tokens": 30,
                                      "temperature": FAIL_TEMPERATURE, "stream": True})
            return await asyncio.gather(*normal, bad, bad_stream)

    *normal, bad, bad_stream = asyncio.run(run())
    for r in normal:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30, r.text
    assert_error(bad, 500, "sampling", "a row that cannot be sampled")
    events = [line[6:] for line in bad_stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "sampling" in json.loads(events[-2])["error"]["message"]
    m = wait_idle(server)
    assert metric(m, "justapi_kv_blocks_used_by_requests") == 0
    assert 'finish_reason="error"' in m
    assert_serving(server)


def test_fan_out_counts_once_against_the_queue_and_is_bounded(server):
    """--max-queue 4: a request of 40 embedding inputs (or 12 choices) is one request; another comes in right after
    it. Prompts per request and prompts x n are bounded by --max-prompts and --max-choices."""

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            many = c.post(server.url + "/v1/embeddings", json={"input": [f"text {i}" for i in range(40)]})
            fan = c.post(server.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 4, "max_tokens": 2})
            after = c.post(server.url + "/v1/completions", json={"prompt": "right after", "max_tokens": 2})
            return await asyncio.gather(many, fan, after)

    many, fan, after = asyncio.run(run())
    assert many.status_code == 200 and len(many.json()["data"]) == 40, many.text
    assert fan.status_code == 200 and len(fan.json()["choices"]) == 12, fan.text
    assert after.status_code == 200, after.text
    assert_error(post(server, "/v1/completions", {"prompt": [[1]] * 65, "max_tokens": 1}), 400, "at most 64")
    assert_error(post(server, "/v1/embeddings", {"input": ["x"] * 65}), 400, "at most 64")
    assert_error(post(server, "/v1/completions", {"prompt": [[1]] * 40, "n": 4, "max_tokens": 1}), 400, "160")
    assert_serving(server)


def test_no_max_tokens_means_as_many_as_fit_and_an_explicit_excess_is_a_400(server):
    """The pool (640 tokens) is smaller than the context (1024): a chat without max_tokens runs to the pool's end,
    not a 400; an explicit max_tokens past what fits stays a 400 naming the pool."""
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "temperature": 0,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == 640
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 700}), 400, "KV cache pool")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2000}), 400, "context length")
    assert_serving(server)


def test_clamp_max_tokens_cuts_an_excess_to_what_fits(tiny_model, tmp_path):
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "40", "--clamp-max-tokens", "--threads", "1"],
                          str(tmp_path / "clamp.log"))
    try:
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 5000, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 640, r.text
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {
        "type": "function", "function": "get_weather"}, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object"}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {
        "type": "function", "function": {"name": ["x"]}}, "tools": [{"type": "function", "function": {
            "name": "get_weather"}}]}, "tools"),
    ("/v1/completions", {"prompt": [5, 10 ** 9], "echo": True, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [-1], "max_tokens": 1}, "prompt"),
    ("/v1/embeddings", {"input": [[1, 2, 10 ** 9]]}, "input"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["s"] * 17}, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": "s" * 513}, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "user": "u" * 300}, "user"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": '
     '{"name": "deep", "schema": ' + '{"type": "array", "items": ' * 3000 + '{}' + '}' * 3000 + '}}}', None),
])
def test_malformed_bodies_are_400s_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    assert_serving(server)


def test_an_internal_error_is_a_500_with_an_id_and_the_server_goes_on(server, monkeypatch):
    import justapi.server.openai.routes as api

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(api, "completion_prompts", broken)
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    err = assert_error(r, 500, "internal server error")
    assert err["type"] == "server_error" and "Traceback" not in r.text
    error_id = err["message"].split()[3]
    assert f"internal error {error_id}" in server.read_log()
    monkeypatch.undo()

    def broken_delta(self, choice, out):
        raise KeyError("a bug while streaming")

    monkeypatch.setattr(api.CompletionChunks, "delta", broken_delta)
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    message = json.loads(events[-2])["error"]["message"]
    assert message.startswith("internal server error") and f"internal error {message.split()[3]}" in server.read_log()
    monkeypatch.undo()
    assert_serving(server)


def test_a_client_that_gives_up_on_a_plain_request_frees_its_blocks(server):
    """A non-streamed request of 600 tokens (>= 6 s: steps slowed by 10 ms) whose client leaves after 0.5 s is
    aborted: the server is idle, with no block owned by a request, within 3 s of the start."""
    body = {"prompt": "leaving early", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    SLOW.set()
    try:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", body, timeout=0.5)
        m = wait_idle(server)
        idle_s = time.monotonic() - t0
    finally:
        SLOW.clear()
    assert metric(m, "justapi_kv_blocks_used_by_requests") == 0
    assert 'finish_reason="abort"' in m
    assert idle_s < 3.0, idle_s
    assert_serving(server)


def test_a_silent_connection_is_closed_and_labels_are_short(server, monkeypatch):
    """A client that connects and sends half a request head is disconnected after the head's deadline; a long
    user name takes at most 64 characters of a metrics label."""
    from justapi.server.http_guard import GuardedH11Protocol

    monkeypatch.setattr(GuardedH11Protocol, "head_timeout_s", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server, not by our 10 s timeout
        assert time.monotonic() - t0 < 5
    monkeypatch.undo()
    user = "u" * 250
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": user}).status_code == 200
    m = httpx.get(server.url + "/metrics", timeout=10).text
    assert "u" * 64 + '"' in m and "u" * 65 not in m
    assert_serving(server)


@pytest.mark.parametrize("which", ["tiny", "gemma3"])
def test_token_bytes_rebuild_split_characters(which, tiny_model, request):
    """Each token's bytes (logprobs' ``bytes``) joined give the text's UTF-8, characters split across tokens
    included: byte-level BPE (the tiny llama) and SentencePiece with byte fallback (Gemma 3)."""
    from justapi.model.gguf_loader import open_gguf
    from justapi.model.tokenizer import Tokenizer

    path = tiny_model if which == "tiny" else request.getfixturevalue("gemma3_path")
    tok = Tokenizer(path, open_gguf(path))
    text = "naïve café — 東京 🙂 𓀀𒀀 done"  # the last two are rare enough for byte pieces in Gemma's vocabulary
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some character is split across tokens here


def test_chat_logprobs_bytes_of_a_split_character(server):
    """A chat answer's logprobs carry each token's own bytes: joined, they are the answer's UTF-8 (a character
    split across tokens gives no EF BF BD)."""
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "東京 🙂"}], "max_tokens": 24,
                                              "temperature": 0, "ignore_eos": True, "logprobs": True,
                                              "top_logprobs": 2, "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    joined = bytes(b for entry in content for b in entry["bytes"])
    assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]
    for entry in content:
        for alt in entry["top_logprobs"]:
            assert isinstance(alt["bytes"], list)


def test_the_worker_listener_survives_stray_connections(monkeypatch):
    """Ray workers dial the server's listener: a peer that hangs up, one without the key, a silent one and one naming
    no expected rank are dropped, and the real workers still connect; their connections keep no read timeout."""
    import multiprocessing.connection as mp_connection
    import os

    from justapi.distributed import channel

    # a whole second: the handshake's receive timeout is set in whole seconds (SO_RCVTIMEO), and 0.5 would set none
    monkeypatch.setattr(channel, "HANDSHAKE_S", 1.0)
    key = os.urandom(16)
    listener = channel.WorkerListener("127.0.0.1", key)
    try:
        for rank in (0, 1):
            listener.expect(rank)
        socket.create_connection(listener.address).close()
        with pytest.raises(mp_connection.AuthenticationError):
            mp_connection.Client(listener.address, authkey=b"not the key")
        silent = socket.create_connection(listener.address)
        channel.connect(listener.address, key, 7)
        workers = [channel.connect(listener.address, key, rank) for rank in (0, 1)]
        conns = listener.take({0, 1}, lambda rank: True, time.monotonic() + 30)
        got, reading_since = [], []

        def read():
            reading_since.append(time.monotonic())
            got.append(conns[1].recv())

        reader = threading.Thread(target=read)
        reader.start()
        # the reader waits past the handshake's timeout, counted from its own start on a slow machine too: the
        # accepted connection must not time out (a timed-out recv raises and ends the reader)
        def read_past_handshake() -> bool:
            assert reader.is_alive(), "the accepted connection's read ended (timed out) before the worker sent"
            return bool(reading_since) and time.monotonic() > reading_since[0] + channel.HANDSHAKE_S + 0.5

        wait_until(read_past_handshake, 30, "the reader reading past the handshake's timeout")
        assert reader.is_alive(), "the accepted connection's read ended (timed out) before the worker sent"
        workers[1].send("late")
        reader.join(10)
        assert got == ["late"]
        conns[0].send("hello")
        assert workers[0].recv() == "hello"
        silent.close()
    finally:
        listener.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_across_a_token_boundary_leaks_nothing(server, stream):
    """A stop string made of the end of one token and the start of the next ends the text right before it, streamed
    (no delta carries text past it) or not."""
    body = {"prompt": "the boundary", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = post(server, "/v1/completions", dict(body, logprobs=0)).json()["choices"][0]
    text, offsets = full["text"], full["logprobs"]["text_offset"]
    cut = next(o for o in offsets[3:] if 2 <= o <= len(text) - 2 and "\ufffd" not in text[o - 2 : o + 2]
               and text.find(text[o - 2 : o + 2]) == o - 2)
    stop = text[cut - 2 : cut + 2]  # two characters of one token, two of the next
    if not stream:
        r = post(server, "/v1/completions", dict(body, stop=[stop])).json()["choices"][0]
        assert (r["text"], r["finish_reason"], r["stop_reason"]) == (text[: cut - 2], "stop", stop)
        return
    r = post(server, "/v1/completions", dict(body, stop=[stop], stream=True))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: cut - 2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_under_a_grammar_are_finite_json(server, stream):
    """Tokens a grammar forbids have logprob -inf, reported as vLLM's floor (-9999.0): strict JSON, streamed or
    not (found by the soak benchmark: a 500, or -Infinity in a stream)."""
    body = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "structured_outputs": {"choice": ["yes", "no", "maybe"]},
            "stream": stream}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    payloads = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    docs = [json.loads(p, parse_constant=lambda c: pytest.fail(f"{c} in {p}")) for p in payloads or [r.text]]
    alts = [a["logprob"] for d in docs for c in d["choices"] for e in ((c.get("logprobs") or {}).get("content") or [])
            for a in e["top_logprobs"]]
    assert alts and min(alts) >= -9999.0
    assert -9999.0 in alts  # an alternative the grammar forbids


def test_streamed_text_with_split_characters_equals_the_whole(server):
    """The tiny model's byte-level tokens split multibyte characters all the time: the streamed deltas, joined, are
    the non-streamed text exactly (nothing lost or doubled where a character spans tokens)."""
    wholes = []
    for seed in range(4):
        body = {"prompt": "東京 🙂 naïve", "max_tokens": 40, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        wholes.append(post(server, "/v1/completions", body).json()["choices"][0]["text"])
        r = post(server, "/v1/completions", dict(body, stream=True))
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == wholes[-1]
    assert any(ord(ch) > 127 for text in wholes for ch in text)  # multibyte characters were made
