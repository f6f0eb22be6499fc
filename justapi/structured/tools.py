"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``: checked, turned into what the chat
template renders, and — for ``required`` or a named function — into a grammar that forces a valid call.

With ``auto`` the model answers freely and its text is parsed (structured.tool_calls). With ``required`` or a
named function the output is constrained the way vLLM does it: a named function's output is its arguments object
(validated by the parameters schema), ``required``'s a JSON list of ``{"name", "parameters"}`` items, one per call;
either way every call parses and its arguments validate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .spec import StructuredOutput

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple  # each {"type": "function", "function": {"name", "description"?, "parameters"?}}
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function a named tool_choice forces
    parallel: bool = True

    @property
    def rendered(self) -> list[dict] | None:
        """The tools the chat template sees (none under ``tool_choice: none``)."""
        return [dict(t) for t in self.tools] if self.tools and self.mode != "none" else None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def spec(self) -> StructuredOutput | None:
        """The grammar that forces a call, for ``required`` and a named function."""
        if self.mode == "named":
            return StructuredOutput.json_schema(self._parameters(self.name))
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": self._parameters(n)},
                      "required": ["name", "parameters"], "additionalProperties": False} for n in self.names]
            schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput.json_schema(schema)
        return None

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def _parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)


def tool_request(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None:
    """The request's tool fields checked (ValueError naming the problem); None when it has no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice requires tools")
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    checked, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in seen:
            raise ValueError(f"tools[{i}]: the function name {name!r} is used twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        checked.append({"type": "function", "function": dict(fn)})
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice in (None, "auto"):
        return ToolRequest(tuple(checked), "auto", parallel=parallel)
    if tool_choice in ("none", "required"):
        return ToolRequest(tuple(checked), tool_choice, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in seen:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(sorted(seen))})")
        return ToolRequest(tuple(checked), "named", name, parallel)
    raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                     "{\"name\": ...}}")


def forced_calls_text(request: ToolRequest, text: str) -> str:
    """A forced output in the one JSON form the streaming parser reads: a list of {name, parameters}."""
    if request.mode == "named":
        return f'[{{"name": {json.dumps(request.name)}, "parameters": {text}'
    return text


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: an assistant's ``tool_calls`` with arguments as objects
    (templates write them with ``tojson``); a tool message's ``tool_call_id`` kept. ValueError on malformed ones."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
            m["tool_calls"] = [_template_call(i, k, c) for k, c in enumerate(_list(m["tool_calls"], i))]
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}]: a tool message needs the tool_call_id it answers")
        out.append(m)
    return out


def _list(value, i: int) -> list:
    if not isinstance(value, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    return value


def _template_call(i: int, k: int, call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls[{k}] must have function.name and function.arguments")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"messages[{i}].tool_calls[{k}].function.arguments is not valid JSON") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


GENERIC_TOOL_PROMPT = (
    "You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object of its name and arguments inside <tool_call></tool_call> "
    "(one block per call):\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>\nA function's result comes back inside <tool_response></tool_response>."
)


def with_generic_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A conversation for a chat template that renders no tools (SmolLM2's, Gemma's), as llama.cpp's server serves
    one: the functions and how to call them (the hermes format, which structured.tool_calls reads) in the system
    message; earlier calls written into their assistant turns; results as user turns in <tool_response>."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    prompt = GENERIC_TOOL_PROMPT.format(tools=listing)
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m.pop("tool_calls")]
            m["content"] = (m.get("content") or "") + "".join(
                f"\n<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}] + out[1:]
    return [{"role": "system", "content": prompt}] + out
