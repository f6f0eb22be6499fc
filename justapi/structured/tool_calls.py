"""Tool calls in a model's output: one parser per format (chosen for the chat template, or by
``--tool-call-parser``), whole or as it streams.

Formats (what the model writes after the chat template asked it to call functions):
- ``hermes`` (Qwen 2.5/3, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly after some text;
- ``llama3_json`` (Llama 3.1+): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``; several calls separated by ``;``);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``.

Streaming follows OpenAI's deltas: text before the calls as content; each call's id, type and name once the name is
complete, then its arguments as growing JSON text. Partial JSON is read with ``partial-json-parser``; what was
sent of the arguments is always a prefix of the final ``json.dumps`` of them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import partial_json_parser
from partial_json_parser.core.options import Allow

from ..config import TOOL_CALL_PARSERS

@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for_template(template: str | None) -> str | None:
    """The format a chat template asks tool calls in, recognised by its markers; None if it renders no tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|eom_id|>" in template or '"parameters"' in template:
        return "llama3_json"
    return None


class _Format:
    """Where the calls are in a text: ``split(text)`` → (content, the calls' JSON texts, possibly unfinished)."""

    args_key = "arguments"
    markers: tuple[str, ...] = ()

    def split(self, text: str) -> tuple[str, list[str]]:
        raise NotImplementedError

    def held_back(self, content: str) -> int:
        """How many trailing characters of ``content`` might still turn out to start a call marker."""
        for n in range(min(len(content), max((len(m) for m in self.markers), default=0)), 0, -1):
            if any(m.startswith(content[-n:]) for m in self.markers):
                return n
        return 0


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or list starting at ``start`` ends (the index after it), strings read as strings, so
    a marker inside an argument is not taken for the format's own; None while it is unfinished."""
    depth, in_string, escaped = 0, False, False
    for k in range(start, len(text)):
        ch = text[k]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _objects(text: str, start: int, before: str, limit: int | None = None) -> tuple[list[str], int | None]:
    """The JSON objects from ``start`` on (``limit`` at most), each preceded by ``before`` (separators) and
    whitespace, the last possibly unfinished; and the index after the last finished one (None: unfinished or none).
    Stops at the first thing that is not an object."""
    calls: list[str] = []
    end = None
    while limit is None or len(calls) < limit:
        i = start
        while i < len(text) and (text[i].isspace() or (before and text.startswith(before, i))):
            i += len(before) if before and text.startswith(before, i) else 1
        if i >= len(text) or text[i] != "{":
            break
        end = _json_end(text, i)
        if end is None:
            return calls + [text[i:].strip()], None
        calls.append(text[i:end])
        start = end
    return calls, end


class _Hermes(_Format):
    markers = ("<tool_call>",)

    def split(self, text):
        head, sep, _ = text.partition("<tool_call>")
        if not sep:
            return text, []
        calls, i = [], len(head)
        while i >= 0:  # each block's object read as JSON: a "</tool_call>" inside an argument stays in it
            found, end = _objects(text, i + len("<tool_call>"), "", limit=1)
            if not found:  # no object (yet): the block's text, which parsing keeps as content unless it becomes one
                calls.append(text[i + len("<tool_call>") :].split("</tool_call>")[0].strip())
                break
            calls += found
            if end is None:
                break
            i = text.find("<tool_call>", end)
        return head.rstrip() if calls else head, calls


class _Llama3Json(_Format):
    args_key = "parameters"
    markers = ("<|python_tag|>",)

    def split(self, text):
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        stripped = body.lstrip()
        if not stripped.startswith("{"):
            return (text, []) if "<|python_tag|>" not in text else ("", [])
        return "", _objects(stripped, 0, ";")[0]  # objects read as JSON: a "; " inside an argument stays in it

    def held_back(self, content):
        # the answer is either a call (it starts with "{") or text: nothing can be sent before its first character
        return len(content) if not content.strip() else super().held_back(content)


def _list_calls(text: str) -> list[str]:
    """The items of a (possibly unfinished) JSON list of calls, each as JSON text."""
    items = _partial(text.strip() or "[")
    return [json.dumps(c) for c in items if isinstance(c, dict)] if isinstance(items, list) else []


class _Mistral(_Format):
    markers = ("[TOOL_CALLS]",)

    def split(self, text):
        head, sep, rest = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        return head.rstrip(), _list_calls(rest)


class _Forced(_Format):
    """A call forced by a grammar (structured.tools): a JSON list of {"name", "parameters"}, nothing else."""

    args_key = "parameters"

    def split(self, text):
        return "", _list_calls(text)

    def held_back(self, content):
        return len(content)


FORMATS = {"hermes": _Hermes(), "llama3_json": _Llama3Json(), "mistral": _Mistral(), "forced": _Forced()}
assert set(TOOL_CALL_PARSERS) <= set(FORMATS)


def _partial(text: str, allow=Allow.ALL & ~Allow.STR):
    """``text`` parsed as far as it goes; None where nothing can be read yet. Partial strings are left out by
    default: a name or a key is only taken once its closing quote came."""
    try:
        return partial_json_parser.loads(text, allow)
    except Exception:  # MalformedJSON and json errors alike: not (yet) a call
        return None


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """The finished output → (content, calls). Text that looks like a call but is not valid JSON stays content."""
    fmt = FORMATS[parser]
    content, raw = fmt.split(text)
    calls = []
    for r in raw:
        try:
            obj = json.loads(r)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(ToolCall(obj["name"], json.dumps(obj.get(fmt.args_key, {}), ensure_ascii=False)))
    return content, calls


class ToolCallStream:
    """Turns a streamed output into OpenAI deltas: ``feed(text_so_far)`` → list of delta dicts (``{"content"}``
    or ``{"tool_calls": [...]}``); ``finish()`` sends what was held back."""

    def __init__(self, parser: str) -> None:
        self.fmt = FORMATS[parser]
        self.content_sent = 0
        self.calls: list[dict] = []  # per call: id, name sent?, arguments sent

    def feed(self, text: str, final: bool = False) -> list[dict]:
        content, raw = self.fmt.split(text)
        deltas = []
        keep = 0 if (raw or final) else self.fmt.held_back(content)
        if len(content) - keep > self.content_sent:
            deltas.append({"content": content[self.content_sent : len(content) - keep]})
            self.content_sent = len(content) - keep
        for i, r in enumerate(raw):
            deltas.extend(self._call_delta(i, r, final or i < len(raw) - 1))
        return deltas

    def _call_delta(self, index: int, raw: str, done: bool) -> list[dict]:
        obj = _partial(raw) if not done else _loads(raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        out = []
        if index == len(self.calls):
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "sent": "", "last": ""}
            self.calls.append(call)
            out.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                        "function": {"name": obj["name"], "arguments": ""}}]})
        call = self.calls[index]
        args = obj.get(self.fmt.args_key)
        if args is None:
            return out
        now = json.dumps(args, ensure_ascii=False)
        if done:
            stable = now
        else:  # what two successive readings agree on, short of closing brackets: a value may still grow
            stable = _common_prefix(now, call["last"]).rstrip("}]")
            call["last"] = now
        if len(stable) > len(call["sent"]) and stable.startswith(call["sent"]):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": stable[len(call["sent"]):]}}]})
            call["sent"] = stable
        return out

    def finish(self, text: str) -> list[dict]:
        return self.feed(text, final=True)


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _partial(text, Allow.ALL)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
