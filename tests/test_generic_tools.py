"""Tools on any model (issue 55 item 2): a chat template that renders no tools (the tiny models', SmolLM2's) gets
the functions and the call format in its system message, as llama.cpp's server does, and the calls are read in the
hermes format; forced and named calls stay enforced by the grammar."""

from __future__ import annotations

import json

import openai

from justapi import LLM

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}},
                                                "required": ["city"], "additionalProperties": False}}}


def test_the_tools_and_earlier_calls_are_written_into_the_conversation(tiny_model):
    llm = LLM(tiny_model, pool_blocks=16, show_progress=False)
    assert not llm.engine.chat_template.renders_tools and llm.engine.tool_parser == "hermes"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = llm.tokenizer.decode(llm.engine.render_chat(messages, True, [WEATHER]), skip_special_tokens=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nbe brief\n\nYou can call functions")
    assert json.dumps(WEATHER["function"]) in system and "<tool_call>" in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text


def test_tool_calls_over_http_on_a_template_without_tools(tiny_model, tmp_path):
    """auto no longer refused (a 200: the model answers as it will), a named function gives a call whose
    arguments satisfy its schema, and the conversation goes on with the call and its result."""
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64"], str(tmp_path / "s.log"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        ask = [{"role": "user", "content": "weather in Oslo?"}]
        auto = client.chat.completions.create(model="tiny-llama", messages=ask, tools=[WEATHER], max_tokens=8)
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
        named = client.chat.completions.create(model="tiny-llama", messages=ask, tools=[WEATHER], max_tokens=60,
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                               temperature=0)
        call = named.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        follow = ask + [named.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        again = client.chat.completions.create(model="tiny-llama", messages=follow, tools=[WEATHER], max_tokens=4)
        assert again.usage.prompt_tokens > named.usage.prompt_tokens
    finally:
        assert srv.stop() == 0
