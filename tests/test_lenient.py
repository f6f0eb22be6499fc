"""A lenient OpenAI surface (issue 55 item 3): fields the server does not know are ignored with a warning naming
them (refused under --strict-fields), ``x-api-key`` beside Bearer, CORS for --allowed-origins, /v1/models/{id}."""

from __future__ import annotations

import httpx
import pytest

from server_helpers import InProcessServer

ORIGIN = "http://app.example"
UNKNOWN = {"metadata": {"run": "x"}, "store": False, "prompt_cache_key": "k", "service_tier": "auto",
           "stream_options": {"include_usage": True, "shiny": 1}}


@pytest.fixture(scope="module")
def lenient(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("lenient") / "server.log"
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--api-key", "k1,k2",
                           "--allowed-origins", ORIGIN], str(log))
    yield srv
    assert srv.stop() == 0


def test_unknown_fields_are_ignored_with_a_warning_naming_them(lenient):
    """Real clients' extra fields (metadata, store, prompt_cache_key, service_tier, a nested one) leave the answer
    as it is without them; the log names each once."""
    headers = {"Authorization": "Bearer k1"}
    body = {"prompt": "the cat", "max_tokens": 5, "temperature": 0, "stream": True}
    plain = httpx.post(lenient.url + "/v1/completions", json=body, headers=headers)
    extra = httpx.post(lenient.url + "/v1/completions", json={**body, **UNKNOWN}, headers=headers)
    assert plain.status_code == extra.status_code == 200, extra.text
    texts = [[line for line in r.text.splitlines() if '"text"' in line] for r in (plain, extra)]
    assert [t.split('"text":')[1][:20] for t in texts[0]] == [t.split('"text":')[1][:20] for t in texts[1]]
    assert '"usage"' in extra.text  # stream_options still honoured beside its unknown part
    chat = httpx.post(lenient.url + "/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "web_search_options": {},
        "prediction": {"type": "content", "content": "x"}})
    assert chat.status_code == 200, chat.text
    log = open(lenient.log_path).read()
    for name in ("metadata", "store", "prompt_cache_key", "service_tier", "stream_options.shiny", "web_search_options",
                 "prediction"):
        assert name in log
    assert log.count("prompt_cache_key") == 1  # once a name, not once a request


def test_x_api_key_cors_and_the_model_route(lenient):
    """Anthropic's clients send x-api-key: accepted as Bearer is, a wrong one is a 401; a browser on the allowed
    origin gets its preflight answered and CORS headers on answers (a 401 too), another origin none;
    /v1/models/{id} answers the served model and 404 for another."""
    url = lenient.url
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "k2"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "nope"}).status_code == 401
    preflight = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example", "x-api-key": "k1"})
    assert "access-control-allow-origin" not in other.headers
    name = httpx.get(url + "/v1/models", headers={"x-api-key": "k1"}).json()["data"][0]["id"]
    card = httpx.get(url + f"/v1/models/{name}", headers={"x-api-key": "k1"})
    assert card.status_code == 200 and card.json()["id"] == name
    missing = httpx.get(url + "/v1/models/gpt-9", headers={"x-api-key": "k1"})
    assert missing.status_code == 404 and "gpt-9" in missing.json()["error"]["message"]


def test_strict_fields_refuses_unknown_ones_naming_them(tiny_model, tmp_path):
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "32", "--strict-fields"], str(tmp_path / "s.log"))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "frobnicate": 1,
                                                          "stream_options": {"include_usage": True, "x": 2},
                                                          "stream": True})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "frobnicate" in message and "stream_options.x" in message and "--strict-fields" in message
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        assert srv.stop() == 0


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(lenient):
    """stream_options.continuous_usage_stats (vLLM's): each chunk carries its usage so far, the completion tokens
    counting up to the final usage chunk's."""
    import json

    r = httpx.post(lenient.url + "/v1/chat/completions", headers={"x-api-key": "k1"}, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] > 0 for e in events)
