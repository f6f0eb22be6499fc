"""OpenAI's Responses API (issue 55 item 6), stateless, as the `openai` client drives it: input items and
instructions, output_text, streaming events, function tools and their calls and outputs, text.format, reasoning
items, what is refused."""

from __future__ import annotations

import json

import openai
import pytest

from justapi import LLM, SamplingParams
from tiny_gguf import OPENING_TEMPLATE, write_tiny_model

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--dtype", "float32",
                           "--served-model-name", "tiny"], str(tmp_path_factory.mktemp("responses") / "s.log"))
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    assert srv.stop() == 0


def test_a_response_whole_and_streamed(served, tiny_model):
    """instructions and input items through the chat template: output_text equals the offline engine's greedy
    text; the stream's text deltas add up to it, in the event order the client parses; usage; max_output_tokens
    makes it incomplete."""
    srv, client = served
    items = [{"role": "user", "content": [{"type": "input_text", "text": "the cat"}]}]
    r = client.responses.create(model="tiny", instructions="be brief", input=items, max_output_tokens=8,
                                temperature=0)
    llm = LLM(tiny_model, dtype="float32", pool_blocks=32, show_progress=False)
    ids = llm.engine.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}],
                                 True)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert r.output_text == want.text and r.usage.input_tokens == len(ids)
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    events = list(client.responses.create(model="tiny", instructions="be brief", input=items, max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                      "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].response.output_text == want.text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    plain = client.responses.create(model="tiny", input="the cat", max_output_tokens=3, store=True)
    assert plain.output[0].type == "message"


def test_function_tools_calls_and_outputs(served):
    """A required function call (the grammar) comes as a function_call item, whole and streamed; the next request
    carries it and its function_call_output back as input items."""
    srv, client = served
    kw = dict(model="tiny", input="weather in Oslo?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    r = client.responses.create(**kw)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert [o.arguments for o in final.output if o.type == "function_call"] == [call.arguments]
    follow = [{"role": "user", "content": "weather in Oslo?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    again = client.responses.create(model="tiny", input=follow, tools=[WEATHER], max_output_tokens=4)
    assert again.usage.input_tokens > r.usage.input_tokens


def test_text_format_and_refusals(served):
    srv, client = served
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="x", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "out", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["a"], bool)
    for kw, words in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                      ({"tools": [{"type": "web_search"}]}, "function tools"),
                      ({"input": [{"type": "input_image"}]}, "not served")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", **{"input": "x", **kw})
        assert words in e.value.message


def test_reasoning_items(tmp_path):
    from server_helpers import InProcessServer

    path = write_tiny_model(str(tmp_path / "r1.gguf"), "qwen3", seed=9, chat_template=OPENING_TEMPLATE,
                            context_length=256)
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64", "--served-model-name", "r1"],
                          str(tmp_path / "s.log"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = client.responses.create(model="r1", input="the cat", max_output_tokens=6, temperature=0)
        assert r.output[0].type == "reasoning" and r.output[0].content[0].text
        events = list(client.responses.create(model="r1", input="the cat", max_output_tokens=6, temperature=0,
                                              stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == r.output[0].content[0].text
    finally:
        assert srv.stop() == 0
