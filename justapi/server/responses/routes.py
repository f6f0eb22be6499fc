"""OpenAI's Responses API, stateless: ``POST /v1/responses`` whole or as its typed event stream. Input items through
the chat template, function tools and ``text.format`` as the chat route's, reasoning as reasoning items; each
request onto the engine through server.front. Nothing is stored: ``previous_response_id`` is refused (send the
conversation as input items), ``store`` is accepted and ignored."""

import asyncio
import dataclasses
import json

from fastapi import APIRouter, Request

from ...structured.tools import template_messages, tool_request
from ..chat_tools import ChatTools, Thinking, steered
from ..errors import ApiError
from ..front import Front
from ..inputs import chat_prompt
from ..serving import Choice, now
from .protocol import ResponsesRequest


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        front.ready_llm()
        front.accept(req)
        front.check_generates()
        if req.previous_response_id:
            raise ApiError(400, "previous_response_id: this server stores no responses; send the conversation as "
                                "input items", param="previous_response_id")
        engine = front.engine
        try:
            tools, choice = req.chat_tools()
            tool_req = tool_request(tools, choice, req.parallel_tool_calls)
            chat_tools = ChatTools.of(tool_req, engine.tool_parser)
            messages = template_messages(req.template_messages())
            params = req.sampling_params(front.user(raw, req.user), front.deadline(req.timeout))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if chat_tools is not None and chat_tools.request.forced:
            if params.structured is not None:
                raise ApiError(400, "a required or named tool_choice cannot be combined with text.format",
                               param="tool_choice")
            params = dataclasses.replace(params, structured=chat_tools.request.spec())
        ids = await chat_prompt(engine, messages, True, tool_req.rendered if tool_req else None,
                                req.template_variables())
        thinking = await asyncio.to_thread(Thinking.of, engine, ids, True)
        params = steered(params, thinking, None)
        field = "tool_choice" if chat_tools is not None and chat_tools.request.forced else "text"
        return await front.answer(raw, req, ids, params, field, "resp", lambda rid: _Answer(
            rid, front.model_name, req, thinking, chat_tools, len(ids)), req.stream)

    return api


class _Answer:
    """One answer as a Responses object: reasoning, message and function_call output items, usage, status."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, thinking: Thinking | None,
                 tools: ChatTools | None, input_tokens: int) -> None:
        self.rid, self.model, self.req, self.thinking, self.tools = rid, model, req, thinking, tools
        self.input_tokens = input_tokens
        self.created = now()
        self.seq = 0
        self.ids = rid.split("-", 1)[1]

    def _response(self, status: str, output: list, out=None) -> dict:
        req = self.req
        usage = None
        if out is not None:
            usage = {"input_tokens": self.input_tokens,
                     "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.input_tokens + len(out.token_ids)}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": f"resp_{self.ids}", "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, "instructions": req.instructions, "metadata": req.metadata or {},
                "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": req.reasoning or {"effort": None, "summary": None},
                "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "store": False}

    def _items(self, out) -> list[dict]:
        """The finished answer's output items, in order."""
        reasoning, text = self.thinking.split(out.text) if self.thinking is not None else (None, out.text)
        calls = []
        if self.tools is not None:
            message, _ = self.tools.message(text, out.finish_reason)
            text = message.get("content") or ""
            calls = message.get("tool_calls") or []
        items = [_reasoning_item(f"rs_{self.ids}", reasoning)] if reasoning else []
        if text or not calls:
            items.append(_message_item(f"msg_{self.ids}", text, "completed"))
        items += [_call_item(f"fc_{self.ids}_{k}", c) for k, c in enumerate(calls)]
        return items

    def whole(self, choice: Choice) -> dict:
        out = choice.final
        status = "incomplete" if out.finish_reason == "length" else "completed"
        return self._response(status, self._items(out), out)

    def _event(self, kind: str, **data) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    async def events(self, outputs, fail):
        """The typed event sequence: response.created and .in_progress; a reasoning item's and the message's
        text deltas as they come (each item added, its text done, the item done); function calls at the end, each
        with its arguments in one delta; response.completed (or .incomplete) with the whole response."""
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        stream_thoughts = self.thinking.stream() if self.thinking is not None else None
        open_item, texts, index = None, {"reasoning": "", "message": ""}, -1
        try:
            async for _, out in outputs:
                thought, piece = (stream_thoughts.feed(out.new_text, final=out.finished) if stream_thoughts
                                  else ("", out.new_text))
                for kind, value in (("reasoning", thought), ("message", piece)):
                    if not value or (kind == "message" and self.tools is not None):
                        continue
                    if open_item != kind:
                        if open_item is not None:
                            for event in self._close(open_item, index, texts[open_item]):
                                yield event
                        index, open_item = index + 1, kind
                        for event in self._open(kind, index):
                            yield event
                    texts[kind] += value
                    delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    yield self._event(delta, item_id=self._item_id(kind), output_index=index, content_index=0,
                                      delta=value)
                if not out.finished:
                    continue
                if open_item is not None:
                    for event in self._close(open_item, index, texts[open_item]):
                        yield event
                items = self._items(out)
                for item in items[index + 1:] if self.tools is None else [
                        i for i in items if i["type"] != "reasoning"]:
                    index += 1
                    for event in self._whole_item(item, index):
                        yield event
                status = "incomplete" if out.finish_reason == "length" else "completed"
                yield self._event(f"response.{status}", response=self._response(status, items, out))
        except Exception as e:
            err = fail(e)
            yield self._event("error", code=str(err.status), message=err.message, param=None)

    def _item_id(self, kind: str) -> str:
        return f"rs_{self.ids}" if kind == "reasoning" else f"msg_{self.ids}"

    def _open(self, kind: str, index: int):
        if kind == "reasoning":
            yield self._event("response.output_item.added", output_index=index,
                              item={"type": "reasoning", "id": self._item_id(kind), "summary": [], "content": []})
            return
        yield self._event("response.output_item.added", output_index=index,
                          item={"type": "message", "id": self._item_id(kind), "status": "in_progress",
                                "role": "assistant", "content": []})
        yield self._event("response.content_part.added", item_id=self._item_id(kind), output_index=index,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def _close(self, kind: str, index: int, text: str):
        item_id = self._item_id(kind)
        if kind == "reasoning":
            yield self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text)
            yield self._event("response.output_item.done", output_index=index, item=_reasoning_item(item_id, text))
            return
        yield self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                          text=text)
        yield self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                          part={"type": "output_text", "text": text, "annotations": []})
        yield self._event("response.output_item.done", output_index=index,
                          item=_message_item(item_id, text, "completed"))

    def _whole_item(self, item: dict, index: int):
        """An item that did not stream (a message beside tool calls, a function call): added, its text or
        arguments in one delta, done."""
        if item["type"] == "function_call":
            yield self._event("response.output_item.added", output_index=index,
                              item=dict(item, arguments="", status="in_progress"))
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)
            return
        for event in self._open("message", index):
            yield event
        text = item["content"][0]["text"]
        yield self._event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                          delta=text)
        for event in self._close("message", index, text):
            yield event


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call: dict) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}
