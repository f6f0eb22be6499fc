"""Tool calling without a model: request checks, forced-call grammars, the parsers of each format, and streaming
deltas that add up to exactly the non-streamed calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from justapi.structured.tool_calls import ToolCallStream, parse_tool_calls, parser_for_template
from justapi.structured.tools import forced_calls_text, template_messages, tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_tool_requests_are_checked():
    assert tool_request(None, None, None) is None
    assert tool_request([WEATHER], None, None).mode == "auto"
    assert tool_request([WEATHER], "none", None).rendered is None
    named = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.mode == "named" and named.name == "get_time"
    for tools, choice, message in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER, WEATHER], None, "used twice"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "letters, digits"),
        ([{"type": "retrieval"}], None, "must be"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        (None, "required", "tool_choice requires tools"),
    ]:
        with pytest.raises(ValueError, match=message):
            tool_request(tools, choice, None)


def test_forced_grammars_are_json_schemas_every_valid_call_satisfies():
    required = tool_request([WEATHER, TIME], "required", False).spec()
    schema = json.loads(required.source)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "PST"}}],
                [{"name": "get_weather", "parameters": {"city": "Oslo"}}] * 2):  # not parallel: one call
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(named.spec().source) == WEATHER["function"]["parameters"]
    content, calls = parse_tool_calls(forced_calls_text(named, '{"city": "Oslo"}'), "forced")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


OUTPUTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                   '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]',
}
WANT = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_each_format_parses_whole_and_streamed_to_the_same_calls(parser):
    text = OUTPUTS[parser]
    content, calls = parse_tool_calls(text, parser)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
    assert content == ("" if parser == "llama3_json" else "Let me check.")
    for step in (1, 3, 7):  # streamed in pieces of several sizes: the deltas add up to the same answer
        stream = ToolCallStream(parser)
        deltas = []
        for end in range(step, len(text) + step, step):
            deltas += stream.feed(text[:end], final=end >= len(text))
        got_content = "".join(d.get("content", "") for d in deltas)
        names, args = {}, {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                if "name" in tc.get("function", {}):
                    assert tc["index"] not in names, "a call's name is sent once"
                    names[tc["index"]] = tc["function"]["name"]
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
        assert got_content.strip() == content
        assert [(names[i], args[i]) for i in sorted(names)] == [(c.name, c.arguments) for c in calls]


def test_text_without_calls_stays_content_and_markers_are_held_back_only_while_ambiguous():
    assert parse_tool_calls("Paris is sunny.", "hermes") == ("Paris is sunny.", [])
    assert parse_tool_calls("<tool_call>{not json</tool_call>", "hermes")[1] == []
    stream = ToolCallStream("hermes")
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]  # "<tool" may start a call: held back
    assert stream.feed("Hello <tools are fun", final=True) == [{"content": "<tools are fun"}]


def test_templates_name_their_format_and_messages_carry_calls_as_objects():
    assert parser_for_template("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("{{ tools }} [TOOL_CALLS]") == "mistral"
    assert parser_for_template("{{ messages }}") is None
    msgs = template_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    for bad, message in [([{"role": "tool", "content": "x"}], "tool_call_id"),
                         ([{"role": "user", "content": "", "tool_calls": []}], "only assistant"),
                         ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
                          "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            template_messages(bad)


DELIMITED = {"code": "print('</tool_call>'); x = [1]; y = '}; {\"name\": \"fake\"}'",
             "note": "[TOOL_CALLS] <tool_call>"}
TRICKY = {
    "hermes": '<tool_call>\n{"name": "run", "arguments": ' + json.dumps(DELIMITED) + '}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "run", "parameters": ' + json.dumps(DELIMITED) + '}',
    "mistral": '[TOOL_CALLS][{"name": "run", "arguments": ' + json.dumps(DELIMITED) + '}]',
}


@pytest.mark.parametrize("parser", sorted(TRICKY))
def test_arguments_holding_the_parsers_own_delimiters_stay_whole(parser):
    """A call whose argument strings contain the format's own markers (a closing tag, '; ', '}]', a start marker)
    parses to that one call, whole and streamed."""
    text = TRICKY[parser]
    content, calls = parse_tool_calls(text, parser)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", DELIMITED)] and content == ""
    stream = ToolCallStream(parser)
    deltas = []
    for end in range(5, len(text) + 5, 5):
        deltas += stream.feed(text[:end], final=end >= len(text))
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
    names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "name" in tc["function"]]
    assert names == ["run"] and json.loads(args) == DELIMITED
    assert "".join(d.get("content", "") for d in deltas).strip() == ""
