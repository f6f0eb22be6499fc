"""A chat answer on the way out: a reasoning model's thinking told from its answer (``Thinking``), and the
answer's text made ``content`` and ``tool_calls`` (``ChatTools``), whole (``message``) or as streamed deltas
(``stream``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import TOOL_CALL_PARSERS
from ..structured import reasoning
from ..structured.tool_calls import ToolCallStream, parse_tool_calls
from ..structured.tools import ToolRequest, forced_calls_text


@dataclass(frozen=True)
class ChatTools:
    request: ToolRequest
    parser: str | None  # the format of free ("auto") answers; None where the template names none

    @classmethod
    def of(cls, request: ToolRequest | None, parser: str | None) -> ChatTools | None:
        """None when the answer is plain text: no tools, or ``tool_choice: none``. ValueError when tools are
        offered under ``auto`` but no parser knows how this model writes calls."""
        if request is None or request.mode == "none":
            return None
        if request.mode == "auto" and parser is None:
            raise ValueError(f"this chat template names no tool-call format; serve with --tool-call-parser "
                             f"({', '.join(TOOL_CALL_PARSERS)}) to use tools with tool_choice auto")
        return cls(request, parser)

    def _text_and_format(self, text: str) -> tuple[str, str]:
        if self.request.forced:
            return forced_calls_text(self.request, text), "forced"
        return text, self.parser

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished answer and its finish reason (``tool_calls`` when it made any)."""
        if self.request.forced and finish_reason != "stop":  # cut off (max_tokens) before the calls were complete
            return {"role": "assistant", "content": text}, finish_reason
        body, fmt = self._text_and_format(text)
        content, calls = parse_tool_calls(body, fmt)
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)

    def stream(self) -> ToolDeltas:
        return ToolDeltas(self)


class ToolDeltas:
    """One streamed choice: ``feed(new_text)`` → OpenAI ``delta`` dicts; ``finish()`` the rest."""

    def __init__(self, tools: ChatTools) -> None:
        self.tools = tools
        self.text = ""
        self.made_calls = False
        self._parser = ToolCallStream("forced" if tools.request.forced else tools.parser)

    def feed(self, new_text: str, final: bool = False) -> list[dict]:
        self.text += new_text
        body, _ = self.tools._text_and_format(self.text)
        deltas = self._parser.feed(body, final=final)
        self.made_calls = self.made_calls or any("tool_calls" in d for d in deltas)
        return deltas


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's answer: its thinking (``reasoning_content``) told from its content
    (structured.reasoning); ``inside``: the prompt itself opened the thinking (DeepSeek-R1's template)."""

    inside: bool
    include: bool  # the reasoning goes back to the client (vLLM's include_reasoning)
    # (open, close) token ids where a constraint must wait for the thinking to end (structured output, forced
    # tools): open is -1 where the prompt opened it; None where the prompt closed it (thinking off) or the tags
    # are not single tokens (the constraint then applies from the first token)
    think_tokens: tuple[int, int] | None = None

    @classmethod
    def of(cls, engine, prompt_ids: list[int], include: bool) -> Thinking | None:
        """None where the model has no reasoning format. Reads the prompt's last tokens (run in a thread)."""
        if engine.reasoning_parser is None:
            return None
        tok = engine.tokenizer
        tail = tok.decode(prompt_ids[-16:], skip_special_tokens=False)
        inside = reasoning.prompt_opens_thinking(tail)
        open_ids, close_ids = (tok.encode(tag, add_special_tokens=False) for tag in (reasoning.OPEN, reasoning.CLOSE))
        think = None
        if len(open_ids) == len(close_ids) == 1 and not tail.rstrip().endswith(reasoning.CLOSE):
            think = (-1 if inside else open_ids[0], close_ids[0])
        return cls(inside, include, think)

    def split(self, text: str) -> tuple[str | None, str]:
        return reasoning.split(text, self.inside)

    def stream(self) -> reasoning.ReasoningStream:
        return reasoning.ReasoningStream(self.inside)


def steered(params, thinking: Thinking | None, budget: int | None):
    """A reasoning request whose constraint waits on its thinking, or whose thinking has a budget, gets its think
    tokens (the runner steers by them). ValueError for a budget on a model without thinking."""
    if budget is not None and (thinking is None or thinking.think_tokens is None):
        raise ValueError("thinking_budget needs a reasoning model whose thinking is on (single-token <think> and "
                         "</think>)")
    if thinking is None or thinking.think_tokens is None or (params.structured is None and budget is None):
        return params
    return dataclasses.replace(params, think_tokens=thinking.think_tokens, thinking_budget=budget)
