"""Anthropic's Messages request, and its content blocks as the chat template's OpenAI-style messages."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from ...sampling_params import SamplingParams
from ..protocol import MAX_USER_CHARS, Scheduled, WireModel


class Metadata(WireModel):
    user_id: str | None = Field(default=None, max_length=MAX_USER_CHARS)


class AnthropicMessage(WireModel):
    role: str
    content: str | list[dict]


class CountTokensRequest(WireModel):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None

    def template_messages(self) -> list[dict]:
        """The conversation as OpenAI-style messages (ValueError naming a malformed or unsupported block)."""
        out = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        for i, m in enumerate(self.messages):
            if m.role not in ("user", "assistant"):
                raise ValueError(f"messages[{i}].role must be user or assistant, got {m.role[:20]!r}")
            out += _turn(i, m)
        return out

    def openai_tools(self) -> tuple[list | None, Any]:
        """(tools, tool_choice) in OpenAI's form."""
        if not self.tools:
            return None, None
        tools = []
        for i, t in enumerate(self.tools):
            if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema", {}), dict):
                raise ValueError(f"tools[{i}] needs a name and an input_schema object (server tools, such as "
                                 "web_search, are not served)")
            tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema", {"type": "object"})}})
        kind = (self.tool_choice or {}).get("type", "auto")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": (self.tool_choice or {}).get("name")}}
        if choice is None:
            raise ValueError(f"tool_choice.type must be auto, any, tool or none, got {str(kind)[:20]!r}")
        return tools, choice

    def template_variables(self) -> dict:
        kind = (self.thinking or {}).get("type")
        return {} if kind is None else {"enable_thinking": kind == "enabled"}

    def thinking_budget(self) -> int | None:
        if (self.thinking or {}).get("type") != "enabled":
            return None
        budget = self.thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError("thinking.budget_tokens must be a non-negative integer")
        return budget


class MessagesRequest(CountTokensRequest, Scheduled):
    model: str
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None

    def sampling_params(self, user: str | None, deadline: float | None) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=1.0 if self.temperature is None else
                              self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=self.top_k or 0, stop=list(self.stop_sequences or []), user=user,
                              deadline=deadline, priority=self.priority)


def _text(content, where: str) -> str:
    """A system prompt or a tool result: a string or text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValueError(f"{where}: only text blocks are served, got {str(block)[:60]}")
        parts.append(block["text"])
    return "".join(parts)


def _turn(i: int, m: AnthropicMessage) -> list[dict]:
    """One Anthropic message as OpenAI-style messages: tool results become tool messages, tool_use blocks an
    assistant's tool_calls; thinking blocks of earlier turns are dropped (templates drop them too)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text, calls, results = [], [], []
    for k, block in enumerate(m.content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{k}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            calls.append({"id": str(block.get("id", f"toolu_{i}_{k}")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and m.role == "user":
            body = _text(block.get("content", ""), where)
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": body})
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue
        else:
            raise ValueError(f"{where}: a {str(kind)[:30]!r} block is not served in a {m.role} message (text, "
                             "tool_use and tool_result are; images and documents are not)")
    out = results
    if text or calls or not results:
        message = {"role": m.role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out = out + [message]
    return out
