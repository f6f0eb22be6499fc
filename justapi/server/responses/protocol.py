"""OpenAI's Responses request: input items as the chat template's messages, function tools and ``text.format`` as
the chat route's tools and structured output."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from ...sampling_params import SamplingParams
from ...structured.spec import StructuredOutput, from_response_format
from ..protocol import MAX_USER_CHARS, Scheduled


class ResponsesRequest(Scheduled):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    reasoning: dict | None = None  # {"effort": ...}: "none" turns a template's thinking off
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored (stateless)
    previous_response_id: str | None = None
    metadata: dict | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    def template_messages(self) -> list[dict]:
        """The input as OpenAI chat messages (ValueError naming a malformed or unsupported item)."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            out += _item(i, item, out)
        return out

    def chat_tools(self) -> tuple[list | None, Any]:
        """(tools, tool_choice) in the chat route's form; hosted tools (web search, file search, ...) refused."""
        if not self.tools:
            return None, self.tool_choice
        tools = []
        for i, t in enumerate(self.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise ValueError(f"tools[{i}]: only function tools are served, not {str(t.get('type'))[:30]!r} (hosted "
                                 "tools run on OpenAI's servers)")
            tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("parameters") or {"type": "object"}}})
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        return tools, choice

    def structured(self) -> StructuredOutput | None:
        fmt = (self.text or {}).get("format")
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_schema":  # the chat route's response_format, with the schema beside its name
            return from_response_format({"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "output"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}})
        return from_response_format(fmt)

    def template_variables(self) -> dict:
        effort = (self.reasoning or {}).get("effort")
        return {} if effort is None else {"enable_thinking": effort != "none"}

    def sampling_params(self, user: str | None, deadline: float | None) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_output_tokens,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, structured=self.structured(),
                              user=user, deadline=deadline, priority=self.priority)


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{k}]: a {str(kind)[:30]!r} part is not served (text only)")
        parts.append(part["text"])
    return "".join(parts)


def _item(i: int, item: dict, so_far: list[dict]) -> list[dict]:
    """One input item as chat messages: a message, a function call (joined to the assistant turn before it), a
    function call's output; reasoning items of earlier turns dropped."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{where}.role must be user, assistant, system or developer")
        return [{"role": role, "content": _text_of(item.get("content", ""), where)}]
    if kind == "function_call":
        call = {"id": str(item.get("call_id", f"call_{i}")), "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": item.get("arguments") or "{}"}}
        if so_far and so_far[-1]["role"] == "assistant":
            so_far[-1].setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output", "")
        return [{"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                 "content": output if isinstance(output, str) else json.dumps(output)}]
    if kind == "reasoning":
        return []
    raise ValueError(f"{where}: an item of type {str(kind)[:30]!r} is not served (message, function_call, "
                     "function_call_output and reasoning are)")
