"""Ollama's API (issue 55 item 8) as the `ollama` client drives it: chat and generate, whole and streamed (NDJSON),
options, format, think, list, show, ps, version, embed and the legacy embeddings, errors in Ollama's shape."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from justapi import LLM, SamplingParams
from tiny_gguf import write_tiny_model

ASK = [{"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--dtype", "float32",
                           "--served-model-name", "tiny"], str(tmp_path_factory.mktemp("ollama") / "s.log"))
    yield srv, ollama.Client(host=srv.url)
    assert srv.stop() == 0


def test_chat_and_generate_whole_and_streamed(served, tiny_model):
    """options (num_predict, temperature, seed, stop) reach the engine: greedy text equals the offline engine's
    for the same rendered prompt; streamed chunks add up to the whole answer, the last one done with Ollama's counts
    and durations; generate's context continues the prompt."""
    srv, client = served
    llm = LLM(tiny_model, dtype="float32", pool_blocks=32, show_progress=False)
    want = llm.generate([llm.engine.render_chat(ASK, True)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    options = {"num_predict": 8, "temperature": 0, "num_ctx": 4096}
    whole = client.chat(model="tiny", messages=ASK, options=options)
    assert whole.message.content.startswith(want[:4]) and whole.done
    assert whole.eval_count <= 8 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    parts = list(client.chat(model="tiny:latest", messages=ASK, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length") and not parts[0].done
    gen = client.generate(model="tiny", prompt="the cat", options=options, keep_alive="5m")
    streamed = "".join(p.response for p in client.generate(model="tiny", prompt="the cat", options=options,
                                                           stream=True))
    assert gen.response == streamed and gen.context and gen.done
    raw = client.generate(model="tiny", prompt="the cat", raw=True, options=options)
    assert raw.prompt_eval_count < gen.prompt_eval_count  # no template around a raw prompt
    seeded = [client.generate(model="tiny", prompt="a", options={"num_predict": 6, "seed": 3}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_format_json_and_a_schema(served):
    srv, client = served
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    out = client.chat(model="tiny", messages=ASK, format=schema, options={"num_predict": 40, "temperature": 0})
    assert isinstance(json.loads(out.message.content)["a"], bool)
    out = client.generate(model="tiny", prompt="x", format="json", options={"num_predict": 60, "temperature": 0})
    assert out.done_reason == "length" or isinstance(json.loads(out.response), dict)


def test_listing_routes_and_embeddings(served):
    srv, client = served
    assert httpx.get(srv.url + "/").text == "Ollama is running"
    assert httpx.get(srv.url + "/api/version").json()["version"]
    models = client.list().models
    assert [m.model for m in models] == ["tiny:latest"] and models[0].details.format == "gguf"
    assert models[0].details.family == "llama" and models[0].size > 0
    shown = client.show("tiny")
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "llama"
    assert [m.model for m in client.ps().models] == ["tiny:latest"]
    emb = client.embed(model="tiny", input=["the cat", "a dog"])
    assert len(emb.embeddings) == 2 and len(emb.embeddings[0]) == 64
    legacy = client.embeddings(model="tiny", prompt="the cat")
    assert legacy.embedding == pytest.approx(emb.embeddings[0], abs=1e-5)
    from server_helpers import labelled

    metrics = httpx.get(srv.url + "/metrics").text
    assert labelled(metrics, "justapi_requests_by_api_total", api="ollama") >= 3  # labelled by API family


def test_errors_in_ollamas_shape(served):
    """An unknown model is a 404, a bad option a 400, each as {"error": "..."}; the client raises ResponseError
    with that message."""
    srv, client = served
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=ASK)
    assert e.value.status_code == 404 and "llama3" in e.value.error
    r = httpx.post(srv.url + "/api/generate", json={"model": "tiny", "prompt": "x", "options": {"temperature": -1}})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "temperature" in r.json()["error"]
    r = httpx.post(srv.url + "/api/chat", json={"model": "tiny", "messages": "nope"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(srv.url + "/api/generate", json={"model": "tiny", "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and "suffix" in r.json()["error"]


def test_think_parts_the_thinking(tmp_path):
    """think: the thinking of a reasoning model comes as message.thinking (chat) or thinking (generate), whole and
    streamed; think false turns it off in the template."""
    from server_helpers import InProcessServer
    from tiny_gguf import OPENING_TEMPLATE

    path = write_tiny_model(str(tmp_path / "r1.gguf"), "qwen3", seed=9, chat_template=OPENING_TEMPLATE,
                            context_length=256)
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64", "--served-model-name", "r1"],
                          str(tmp_path / "s.log"))
    try:
        client = ollama.Client(host=srv.url)
        out = client.chat(model="r1", messages=ASK, think=True, options={"num_predict": 6, "temperature": 0})
        assert out.message.thinking and out.message.content == ""  # never closed its thinking: all of it
        parts = list(client.chat(model="r1", messages=ASK, think=True, stream=True,
                                 options={"num_predict": 6, "temperature": 0}))
        assert "".join(p.message.thinking or "" for p in parts) == out.message.thinking
    finally:
        assert srv.stop() == 0


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _says_a_call(engine):
    """An ``on_engine`` that makes the random model say CALL, through a grammar set on each request the engine
    queues: the tokens, the text, the parsing and the shapes are the server's own."""
    import dataclasses

    from justapi.structured.spec import StructuredOutput

    queue = engine.queue
    call = StructuredOutput("choice", json.dumps([CALL]))

    def forced(rid, ids, params):
        return queue(rid, ids, dataclasses.replace(params, structured=call))

    engine.queue = forced


def test_tool_calls_in_ollamas_shape(tiny_model, tmp_path):
    """Tools through the ollama client on a template without tools (the generic tool prompt renders them): the
    model's call comes back as message.tool_calls with its arguments as an object, whole and streamed, and the
    conversation goes on with the call and the tool's result (tool_name)."""
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--served-model-name", "tiny"],
                          str(tmp_path / "s.log"), on_engine=_says_a_call)
    try:
        client = ollama.Client(host=srv.url)
        ask = [{"role": "user", "content": "weather in Oslo?"}]
        options = {"num_predict": 160, "temperature": 0}
        whole = client.chat(model="tiny", messages=ask, tools=[WEATHER], options=options)
        bare = client.chat(model="tiny", messages=ask, options=options)
        assert whole.prompt_eval_count > bare.prompt_eval_count + 20  # the tool's description is in the prompt
        assert bare.message.tool_calls is None and "<tool_call>" in bare.message.content  # no tools: text
        (call,) = whole.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Oslo"})
        assert whole.message.content == "" and whole.done_reason == "stop"
        parts = list(client.chat(model="tiny", messages=ask, tools=[WEATHER], options=options, stream=True))
        assert [c.function for p in parts for c in p.message.tool_calls or []] == [call.function]
        assert parts[-1].done and "".join(p.message.content for p in parts) == ""
        follow = ask + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
        again = client.chat(model="tiny", messages=follow, tools=[WEATHER], options=options)
        assert again.prompt_eval_count > whole.prompt_eval_count + 10  # the call and its result rendered
    finally:
        assert srv.stop() == 0
