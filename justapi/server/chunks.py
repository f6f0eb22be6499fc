"""The SSE payloads of a streamed completion or chat completion, one builder per route (OpenAI's chunk shapes)."""

from __future__ import annotations

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
            return dict(self.base, choices=[{"index": c.index, "text": c.prefix, "logprobs": None, "finish_reason": None}])
        return None

    def delta(self, c: Choice, out):
        if not out.new_text and not out.finished and not out.new_logprobs:
            return []
        lps = completion_logprobs(self.tok, out.new_logprobs, self.offsets[c.index])
        self.offsets[c.index] += len(out.new_text)
        return [dict(self.base, choices=[{"index": c.index, "text": out.new_text, "logprobs": lps,
                                          "finish_reason": out.finish_reason}])]

    def usage(self, u: dict):
        return dict(self.base, choices=[], usage=u)


class ChatChunks:
    """SSE payloads of /v1/chat/completions: a role chunk, content deltas, a finish chunk per choice."""

    def __init__(self, rid: str, model: str, tok) -> None:
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}
        self.tok = tok

    def start(self, c: Choice):
        return dict(self.base, choices=[{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}])

    def delta(self, c: Choice, out):
        chunks = []
        if out.new_text or out.new_logprobs:
            chunks.append(dict(self.base, choices=[{"index": c.index, "delta": {"content": out.new_text},
                                                    "logprobs": chat_logprobs(self.tok, out.new_logprobs),
                                                    "finish_reason": None}]))
        if out.finished:
            chunks.append(dict(self.base, choices=[{"index": c.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": out.finish_reason}]))
        return chunks

    def usage(self, u: dict):
        return dict(self.base, choices=[], usage=u)
