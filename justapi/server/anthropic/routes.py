"""Anthropic's Messages API: ``POST /v1/messages`` (whole, or streamed as Anthropic's event sequence) and
``POST /v1/messages/count_tokens``; errors in Anthropic's shape (server.errors). Each request onto the engine
through server.front; thinking blocks from reasoning models, tool_use blocks from tool calls."""

import asyncio
import dataclasses
import json

from fastapi import APIRouter, Request

from ...structured.tools import template_messages, tool_request
from ..chat_tools import ChatTools, Thinking, steered
from ..errors import ApiError
from ..front import Front
from ..inputs import chat_prompt
from ..serving import Choice
from .protocol import CountTokensRequest, MessagesRequest


def router(front: Front) -> APIRouter:
    api = APIRouter()

    async def prompt_of(req) -> tuple[list[int], ChatTools | None]:
        """The request's token ids as the chat template renders it, and its tools."""
        front.check_fields(req)
        front.check_model(req.model)
        front.check_generates()
        engine = front.engine
        try:
            tools, choice = req.openai_tools()
            tool_req = tool_request(tools, choice, None)
            chat_tools = ChatTools.of(tool_req, engine.tool_parser)
            messages = template_messages(req.template_messages())
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        ids = await chat_prompt(engine, messages, True, tool_req.rendered if tool_req else None,
                                req.template_variables())
        return ids, chat_tools

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        front.ready_llm()
        ids, _ = await prompt_of(req)
        return {"input_tokens": len(ids)}

    @api.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request):
        front.ready_llm()
        ids, tools = await prompt_of(req)
        engine = front.engine
        thinking = await asyncio.to_thread(Thinking.of, engine, ids, True)
        user = req.metadata.user_id if req.metadata else None
        try:
            params = req.sampling_params(front.user(raw, user), front.deadline(req.timeout))
            if tools is not None and tools.request.forced:
                params = dataclasses.replace(params, structured=tools.request.spec())
            budget = req.thinking_budget()
            params = steered(params, thinking, budget if thinking is not None and thinking.think_tokens else None)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return await front.answer(raw, req, ids, params, "tools", "msg",
                                  lambda rid: _Answer(rid, front.model_name, thinking, tools, len(ids)), req.stream)

    return api


class _Answer:
    """One answer as an Anthropic message: thinking, text and tool_use blocks, the stop reason, usage."""

    def __init__(self, rid: str, model: str, thinking: Thinking | None, tools: ChatTools | None,
                 input_tokens: int) -> None:
        self.rid, self.model, self.thinking, self.tools, self.input_tokens = rid, model, thinking, tools, input_tokens

    def _message(self, content: list, stop_reason, stop_sequence, output_tokens: int) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def _tool_blocks(self, text: str, finish_reason) -> tuple[str, list[dict]]:
        if self.tools is None:
            return text, []
        message, _ = self.tools.message(text, finish_reason)
        blocks = [{"type": "tool_use", "id": c["id"].replace("call", "toolu", 1), "name": c["function"]["name"],
                   "input": json.loads(c["function"]["arguments"])} for c in message.get("tool_calls") or []]
        return message.get("content") or "", blocks

    def _stop(self, out, made_calls: bool) -> tuple[str, str | None]:
        if made_calls:
            return "tool_use", None
        if out.finish_reason == "length":
            return "max_tokens", None
        if isinstance(out.stop_reason, str) and out.stop_reason != "timeout":
            return "stop_sequence", out.stop_reason
        return "end_turn", None

    def whole(self, choice: Choice) -> dict:
        out = choice.final
        reasoning, text = self.thinking.split(out.text) if self.thinking is not None else (None, out.text)
        text, calls = self._tool_blocks(text, out.finish_reason)
        content = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        content += ([{"type": "text", "text": text}] if text or not calls else []) + calls
        return self._message(content, *self._stop(out, bool(calls)), len(out.token_ids))

    async def events(self, outputs, fail):
        """Anthropic's event sequence: message_start; per block content_block_start, its deltas, content_block_stop
        (a thinking block, then a text block; tool_use blocks at the end, each input whole in one delta);
        message_delta with the stop reason and usage; message_stop. An error midway: an error event."""
        yield _event("message_start", {"type": "message_start", "message": self._message([], None, None, 0)})
        index, open_kind = -1, None
        reasoning = self.thinking.stream() if self.thinking is not None else None
        text = ""
        try:
            async for _, out in outputs:
                thought, piece = (reasoning.feed(out.new_text, final=out.finished) if reasoning is not None
                                  else ("", out.new_text))
                for kind, value in (("thinking", thought), ("text", piece)):
                    if not value or (kind == "text" and self.tools is not None):
                        continue
                    if open_kind != kind:
                        if open_kind is not None:
                            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        index, open_kind = index + 1, kind
                        yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": _empty_block(kind)})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": _delta(kind, value)})
                text += piece
                if not out.finished:
                    continue
                calls = []
                if self.tools is not None:
                    text, calls = self._tool_blocks(text, out.finish_reason)
                    if text:
                        calls = [{"type": "text", "text": text}] + calls
                if open_kind == "thinking":
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": {"type": "signature_delta", "signature": ""}})
                if open_kind is not None:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                for block in calls:  # whole blocks: text (with tools), then each tool_use with its input at once
                    index += 1
                    start = dict(block, input={}) if block["type"] == "tool_use" else dict(block, text="")
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": start})
                    delta = ({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                             if block["type"] == "tool_use" else {"type": "text_delta", "text": block["text"]})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": delta})
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                stop_reason, stop_sequence = self._stop(out, any(b["type"] == "tool_use" for b in calls))
                yield _event("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": {"output_tokens": len(out.token_ids)}})
                yield _event("message_stop", {"type": "message_stop"})
        except Exception as e:
            err = fail(e)
            yield _event("error", {"type": "error", "error": {"type": "api_error" if err.status >= 500 else
                                                              "invalid_request_error", "message": err.message}})


def _empty_block(kind: str) -> dict:
    return {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}


def _delta(kind: str, value: str) -> dict:
    return ({"type": "thinking_delta", "thinking": value} if kind == "thinking"
            else {"type": "text_delta", "text": value})


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
