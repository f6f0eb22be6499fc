"""Reasoning models' thinking, kept out of the answer: the ``<think> ... </think>`` families (Qwen3, QwQ,
DeepSeek-R1 and its distills) write their reasoning first, then the answer. ``split`` parts a finished text,
``ReasoningStream`` parts a streamed one delta by delta, holding back what may be the start of the closing tag.

A template that opens the thinking in the prompt itself (DeepSeek-R1's generation prompt ends with ``<think>\\n``)
leaves the model's text without the opening tag: ``inside`` says the text starts within the thinking.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def parser_for_template(source: str | None) -> str | None:
    """The reasoning format a chat template's model writes: "think" where the template handles think tags."""
    return "think" if source and CLOSE in source else None


def prompt_opens_thinking(prompt_text_tail: str) -> bool:
    """Whether a rendered prompt ends inside a think block (its last <think> after its last </think>)."""
    return prompt_text_tail.rfind(OPEN) > prompt_text_tail.rfind(CLOSE)


def split(text: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a finished answer. Without a closing tag, a text that began inside the
    thinking is all reasoning (cut off while thinking); one that did not is all content."""
    body = text
    stripped = body.lstrip()
    if stripped.startswith(OPEN):
        body, inside = stripped[len(OPEN):], True
    end = body.find(CLOSE)
    if end < 0:
        return (body.strip("\n"), "") if inside else (None, text)
    if not inside and not stripped.startswith(OPEN):
        return None, text  # a closing tag the answer merely mentions
    return body[:end].strip("\n"), body[end + len(CLOSE):].lstrip("\n")


class ReasoningStream:
    """One streamed answer: ``feed(new_text)`` → (reasoning delta, content delta), either possibly empty."""

    def __init__(self, inside: bool) -> None:
        self.state = "thinking" if inside else "start"  # start: the opening tag may come; answer: past the thinking
        self.pending = ""  # text held back: a possible tag not yet complete
        self.lead = True  # newlines right after a tag are dropped, as split() drops them

    def feed(self, new_text: str, final: bool = False) -> tuple[str, str]:
        text = self.pending + new_text
        self.pending = ""
        reasoning, content = "", ""
        while text:
            if self.state == "start":
                probe = text.lstrip()
                if probe.startswith(OPEN):
                    text, self.state, self.lead = probe[len(OPEN):], "thinking", True
                    continue
                if OPEN.startswith(probe) and not final:
                    self.pending = text  # may still become the opening tag
                    return reasoning, content
                self.state = "answer"
                continue
            if self.state == "thinking":
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning += self._trimmed(text[:end].rstrip("\n"))
                    text, self.state, self.lead = text[end + len(CLOSE):], "answer_lead", True
                    continue
                if final:
                    return reasoning + self._trimmed(text.rstrip("\n")), content
                # held back: a possible start of the closing tag, and the newlines before it (split drops them)
                keep = _partial_suffix(text, CLOSE)
                emit = text[: len(text) - keep]
                kept_newlines = len(emit) - len(emit.rstrip("\n"))
                reasoning += self._trimmed(emit[: len(emit) - kept_newlines])
                self.pending = text[len(emit) - kept_newlines:]
                return reasoning, content
            if self.state == "answer_lead":  # the newlines after </think>
                text = text.lstrip("\n")
                if not text:
                    return reasoning, content
                self.state = "answer"
                continue
            content += text
            text = ""
        return reasoning, content

    def _trimmed(self, piece: str) -> str:
        if self.lead:
            piece = piece.lstrip("\n")
            self.lead = not piece
        return piece


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back until the next delta decides)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
