"""Anthropic's Messages API (issue 55 item 7) as the `anthropic` client drives it: messages whole and streamed,
system prompts and content blocks, stop_sequences, tools with tool_use and tool_result, thinking blocks from a
reasoning model, count_tokens, errors in Anthropic's shape."""

from __future__ import annotations

import os

import anthropic
import httpx
import pytest

from justapi import LLM, SamplingParams
from tiny_gguf import OPENING_TEMPLATE, write_tiny_model

TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "chat_templates", "chatml_tools.jinja")
WEATHER = {"name": "get_weather", "description": "the weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--dtype", "float32", "--served-model-name",
                           "tiny", "--api-key", "sk-ant", "--chat-template", TOOLS_TEMPLATE],
                          str(tmp_path_factory.mktemp("anthropic") / "s.log"))
    yield srv, anthropic.Anthropic(base_url=srv.url, api_key="sk-ant", max_retries=0)
    assert srv.stop() == 0


def test_messages_whole_and_streamed(served, tiny_model):
    """The conversation (a system prompt, text blocks) through the template: greedy text equal to the offline
    engine's; the stream's text deltas add up to it, its events in Anthropic's order; usage, stop reasons,
    stop_sequences."""
    srv, client = served
    system, ask = "be brief", [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    greedy = {"extra_body": {"temperature": 0}}  # (this client version has no temperature argument)
    msg = client.messages.create(model="tiny", max_tokens=8, system=system, messages=ask, **greedy)
    llm = LLM(tiny_model, dtype="float32", pool_blocks=32, show_progress=False, chat_template=TOOLS_TEMPLATE)
    ids = llm.engine.render_chat([{"role": "system", "content": system}, {"role": "user", "content": "the cat"}], True)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert msg.content[0].type == "text" and msg.content[0].text == want.text
    assert msg.usage.input_tokens == len(ids) and msg.usage.output_tokens == len(want.token_ids)
    assert msg.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    with client.messages.stream(model="tiny", max_tokens=8, system=system, messages=ask, **greedy) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want.text and final.content[0].text == want.text
    raw = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "sk-ant"},
                     json={"model": "tiny", "max_tokens": 8, "messages": ask, "stream": True, "temperature": 0}).text
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and "content_block_stop" in names
    stop = want.text[2:4]
    cut = client.messages.create(model="tiny", max_tokens=8, messages=ask, stop_sequences=[stop], **greedy)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and stop not in cut.content[0].text
    assert client.messages.count_tokens(model="tiny", system=system, messages=ask).input_tokens == len(ids)
    from server_helpers import labelled

    metrics = httpx.get(srv.url + "/metrics", headers={"x-api-key": "sk-ant"}).text
    assert labelled(metrics, "justapi_requests_by_api_total", api="anthropic") >= 4


def test_tool_use_and_tool_result(served):
    """A forced tool (tool_choice tool): a tool_use block whose input satisfies the schema, stop_reason tool_use,
    whole and streamed; the next turn carries the tool_use and its tool_result back through the template."""
    srv, client = served
    ask = [{"role": "user", "content": "weather in Oslo?"}]
    kw = dict(model="tiny", max_tokens=60, messages=ask, tools=[WEATHER], extra_body={"temperature": 0},
              tool_choice={"type": "tool", "name": "get_weather"})
    msg = client.messages.create(**kw)
    use = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(use) == 1 and use[0].name == "get_weather"
    assert set(use[0].input) == {"city"} and isinstance(use[0].input["city"], str)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use[0].input]
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                  "content": "sunny"}]}]
    again = client.messages.create(model="tiny", max_tokens=5, messages=follow, tools=[WEATHER],
                                   extra_body={"temperature": 0},
                                   tool_choice={"type": "none"})
    alone = client.messages.count_tokens(model="tiny", messages=ask, tools=[WEATHER], tool_choice={"type": "none"})
    assert again.content[0].type == "text" and again.usage.input_tokens > alone.input_tokens + 10


def test_errors_in_anthropics_shape(served):
    srv, client = served
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "claude-opus" in e.value.message
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "sk-ant"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                         "max_tokens": 5})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "image" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):  # max_tokens is required
        httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "sk-ant"}, json={"model": "tiny", "messages": []})
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])


def test_thinking_blocks(tmp_path):
    """A reasoning model's thinking as a thinking block before the text, whole and streamed (thinking_delta)."""
    from server_helpers import InProcessServer

    path = write_tiny_model(str(tmp_path / "r1.gguf"), "qwen3", seed=9, chat_template=OPENING_TEMPLATE,
                            context_length=256)
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64", "--served-model-name", "r1"],
                          str(tmp_path / "s.log"))
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        kw = dict(model="r1", max_tokens=6, messages=[{"role": "user", "content": "the cat"}],
                  extra_body={"temperature": 0},
                  thinking={"type": "enabled", "budget_tokens": 1024})
        msg = client.messages.create(**kw)
        assert msg.content[0].type == "thinking" and msg.content[0].thinking
        with client.messages.stream(**kw) as s:
            final = s.get_final_message()
        assert final.content[0].type == "thinking" and final.content[0].thinking == msg.content[0].thinking
    finally:
        assert srv.stop() == 0
