"""The SSE payloads of a streamed completion or chat completion, one builder per route (OpenAI's chunk shapes)."""

from __future__ import annotations

from .chat_tools import ChatTools, Thinking, ToolDeltas
from .serving import Choice, chat_logprobs, completion_logprobs, now


class CompletionChunks:
    """SSE payloads of /v1/completions: text deltas with their logprobs and text offsets."""

    def __init__(self, rid: str, model: str, tok) -> None:
        self.base = {"id": rid, "object": "text_completion", "created": now(), "model": model}
        self.tok = tok
        self.offsets: dict[int, int] = {}

    def start(self, c: Choice):
        self.offsets[c.index] = len(c.prefix)
        if c.prefix:
            return dict(self.base, choices=[{"index": c.index, "text": c.prefix, "logprobs": None,
                                             "finish_reason": None}])
        return None

    def delta(self, c: Choice, out):
        if not out.new_text and not out.finished and not out.new_logprobs:
            return []
        lps = completion_logprobs(self.tok, out.new_logprobs, self.offsets[c.index])
        self.offsets[c.index] += len(out.new_text)
        choice = {"index": c.index, "text": out.new_text, "logprobs": lps, "finish_reason": out.finish_reason}
        if out.finished:
            choice["stop_reason"] = out.stop_reason  # as vLLM streams it: the stop string or token, or "timeout"
        return [dict(self.base, choices=[choice])]

    def usage(self, u: dict):
        return dict(self.base, choices=[], usage=u)


class ChatChunks:
    """SSE payloads of /v1/chat/completions: a role chunk, content (or tool-call) deltas, a finish chunk per
    choice."""

    def __init__(self, rid: str, model: str, tok, tools: ChatTools | None = None,
                 thinking: Thinking | None = None) -> None:
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}
        self.tok = tok
        self.tools = tools
        self.thinking = thinking
        self.tool_deltas: dict[int, ToolDeltas] = {}
        self.reasoning: dict[int, object] = {}  # each choice's structured.reasoning.ReasoningStream

    def start(self, c: Choice):
        if self.tools is not None:
            self.tool_deltas[c.index] = self.tools.stream()
        if self.thinking is not None:
            self.reasoning[c.index] = self.thinking.stream()
        return dict(self.base, choices=[{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}])

    def delta(self, c: Choice, out):
        chunks = []
        text = out.new_text
        thoughts = self.reasoning.get(c.index)
        if thoughts is not None:
            thought, text = thoughts.feed(out.new_text, final=out.finished)
            if thought and self.thinking.include:
                chunks.append(dict(self.base, choices=[{"index": c.index, "delta": {"reasoning_content": thought,
                                                                                    "reasoning": thought},
                                                        "logprobs": None, "finish_reason": None}]))
        tools = self.tool_deltas.get(c.index)
        if tools is not None:
            for d in tools.feed(text, final=out.finished):
                chunks.append(dict(self.base, choices=[{"index": c.index, "delta": d, "logprobs": None,
                                                        "finish_reason": None}]))
        elif text or (out.new_logprobs and thoughts is None):
            chunks.append(dict(self.base, choices=[{"index": c.index, "delta": {"content": text},
                                                    "logprobs": chat_logprobs(self.tok, out.new_logprobs),
                                                    "finish_reason": None}]))
        if out.finished:
            reason = out.finish_reason
            if tools is not None and tools.made_calls and reason == "stop":
                reason = "tool_calls"
            chunks.append(dict(self.base, choices=[{"index": c.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": reason, "stop_reason": out.stop_reason}]))
        return chunks

    def usage(self, u: dict):
        return dict(self.base, choices=[], usage=u)
