"""``justapi serve`` as a child process on the real SmolLM2 GGUF: loading state, streaming equivalence, disconnects,
the request log and a clean exit on SIGTERM. The server tests' one run of the command itself; the others serve
the same app in process (server_helpers.InProcessServer)."""

from __future__ import annotations


import httpx
import openai
import pytest

from server_helpers import ServerProcess, metric, wait_until

pytestmark = pytest.mark.real_model
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def server(real_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "real.log"
    srv = ServerProcess(["--model", real_model_path, "--pool-blocks", "512", "--batch-invariant",
                         "--served-model-name", NAME], str(log))
    yield srv
    assert srv.stop() == 0, "SIGTERM should end the server cleanly"
    assert "request cmpl-" in srv.read_log()  # one INFO line per request


def test_health_is_503_while_the_model_loads(server):
    assert 503 in server.health_statuses and 200 in server.health_statuses


def test_streamed_chat_equals_non_streamed_on_smollm2(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=24, temperature=0, stream=True) if ch.choices)
    assert streamed == whole.choices[0].message.content
    assert "Paris" in streamed


def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"model": NAME, "prompt": "Write a long story about a dragon.", "max_tokens": 1000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: a generator dropped after `break` is closed, and the stream with it
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        m = httpx.get(server.url + "/metrics").text
        assert metric(m, "justapi_kv_blocks_used_by_requests") > 0 and metric(m, "justapi_requests_running") == 1
    def freed() -> str | None:
        m = httpx.get(server.url + "/metrics").text
        idle = metric(m, "justapi_kv_blocks_used_by_requests") == 0 and metric(m, "justapi_requests_running") == 0
        return m if idle else None

    m = wait_until(freed, 30, "the KV blocks freed after the client went away")
    assert metric(m, "justapi_kv_blocks_used") == metric(m, "prefix_cache_blocks")
    assert metric(m, "justapi_generation_tokens_total") < 1000  # it was stopped, not run to the end
