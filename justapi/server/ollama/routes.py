"""Ollama's API: ``GET /``, /api/chat and /api/generate (NDJSON streams by default), /api/embed and the legacy
/api/embeddings, /api/tags, /api/show, /api/ps, /api/version; errors as ``{"error": ...}`` (server.errors). Each
request onto the engine through server.front, as OpenAI's are; tool calls and thinking in Ollama's shapes.

The served model answers to its name and to ``NAME:latest``; ``keep_alive``, ``num_ctx`` and other load-time
options are accepted and ignored here (one model, loaded with the server's settings): a several-model server
(server.models_app) acts on ``keep_alive`` before the request reaches this."""

import asyncio
import json
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ...structured.tools import tool_request
from ..chat_tools import ChatTools, Thinking, steered
from ..errors import ApiError
from ..front import Front
from ..inputs import chat_prompt, encoded
from ..serving import Choice
from .models import model_entry, show
from .protocol import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ShowRequest

OLLAMA_VERSION = "0.12.6"  # the API version these routes follow


def router(front: Front) -> APIRouter:
    api = APIRouter()
    _listing_routes(api, front)
    _generation_routes(api, front)
    _embedding_routes(api, front)
    return api


def identity_routes(api) -> None:
    """/ and /api/version: how Ollama's clients tell a server is there (the several-model server's too)."""

    @api.get("/")
    @api.head("/")
    async def root():
        return PlainTextResponse("Ollama is running")

    @api.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}


def _listing_routes(api: APIRouter, front: Front) -> None:
    """/, /api/version, /api/tags, /api/ps, /api/show: what Ollama's clients ask before they generate."""

    identity_routes(api)

    @api.get("/api/tags")
    async def tags():
        front.ready_llm()
        return {"models": [await asyncio.to_thread(model_entry, front.engine.config.model, front.model_name)]}

    @api.get("/api/ps")
    async def ps():
        front.ready_llm()
        entry = await asyncio.to_thread(model_entry, front.engine.config.model, front.model_name)
        return {"models": [{**entry, "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0,
                            "context_length": front.engine.limits.max_model_len}]}

    @api.post("/api/show")
    async def show_model(req: ShowRequest):
        _check(front, req)
        return await asyncio.to_thread(show, front.engine, front.model_name)


def _generation_routes(api: APIRouter, front: Front) -> None:
    @api.post("/api/chat")
    async def chat(req: ChatRequest, raw: Request):
        _check(front, req)
        front.check_generates()
        engine = front.engine
        try:
            tool_req = tool_request(req.tools, None, None)
            tools = ChatTools.of(tool_req, engine.tool_parser)
            messages = _template_messages(req.messages)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        ids = await chat_prompt(engine, messages, True, tool_req.rendered if tool_req else None,
                                req.template_variables())
        thinking = await asyncio.to_thread(Thinking.of, engine, ids, True)
        params = steered(_params_of(front, req, raw), thinking, None)
        return await _run(front, raw, req, ids, params, thinking, tools, "message")

    @api.post("/api/generate")
    async def generate(req: GenerateRequest, raw: Request):
        _check(front, req)
        front.check_generates()
        if req.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported")
        if req.images:
            raise ApiError(400, "images are not supported (text models only)")
        if req.template:
            raise ApiError(400, "template (a Go template) is not supported; send raw: true with the prompt as the "
                                "model should see it")
        engine = front.engine
        if not req.prompt and not req.context:  # Ollama's way to load a model: nothing to generate
            return {"model": front.model_name, "created_at": _now(), "response": "", "done": True,
                    "done_reason": "load"}
        if req.raw or not engine.chat_template.available:
            ids = await encoded("prompt", engine.tokenizer.encode, req.prompt, not req.raw)
        else:
            turns = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": req.prompt}]
            ids = await chat_prompt(engine, turns, True, None, req.template_variables())
        front.check_token_ids([req.context or []], "context")
        ids = list(req.context or []) + ids
        thinking = None if req.raw else await asyncio.to_thread(Thinking.of, engine, ids, True)
        return await _run(front, raw, req, ids, steered(_params_of(front, req, raw), thinking, None), thinking, None,
                          "response")


def _embedding_routes(api: APIRouter, front: Front) -> None:
    @api.post("/api/embed")
    async def embed(req: EmbedRequest, raw: Request):
        _check(front, req)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        front.check_fan_out(len(inputs), 1, "input")
        vectors, tokens, seconds = await _embeddings(front, raw, inputs, req.truncate, req.dimensions)
        return {"model": front.model_name, "embeddings": vectors, "total_duration": int(seconds * 1e9),
                "load_duration": 0, "prompt_eval_count": tokens}

    @api.post("/api/embeddings")
    async def embeddings_legacy(req: EmbeddingsRequest, raw: Request):
        _check(front, req)
        vectors, _, _ = await _embeddings(front, raw, [req.prompt], True, None)
        return {"embedding": vectors[0]}


def _check(front: Front, req) -> None:
    front.ready_llm()
    front.check_fields(req)
    name = getattr(req, "model", None) or getattr(req, "name", None)
    if name not in (front.model_name, f"{front.model_name}:latest"):
        raise ApiError(404, f"model {name!r} not found; this server serves {front.model_name!r}")


def _params_of(front: Front, req, raw: Request):
    try:
        return req.sampling_params(front.user(raw, None), front.deadline(req.timeout))
    except ValueError as e:
        raise ApiError(400, str(e)) from None


async def _run(front: Front, raw: Request, req, ids: list[int], params, thinking, tools, kind: str):
    """Run one answer and give it in Ollama's shape: NDJSON chunks, or one object (``kind``: chat's
    ``message`` or generate's ``response``)."""
    return await front.answer(raw, req, ids, params, "format", "ollama", lambda rid: _Answer(
        front.model_name, kind, thinking, tools, len(ids), ids if kind == "response" else None), req.stream,
        "application/x-ndjson")


async def _embeddings(front: Front, raw: Request, texts: list[str], truncate: bool, dimensions: int | None):
    engine = front.engine
    pooling = front.embedding_pooling(dimensions)
    start = time.monotonic()
    ids = await encoded("input", lambda: [engine.tokenizer.encode(t) for t in texts])
    if truncate:  # Ollama cuts an input to the context instead of refusing it
        ids = [i[: engine.limits.max_model_len] for i in ids]
    vectors, tokens = await front.pooled(raw, ids, pooling, None, None, "ollama")
    return vectors, tokens, time.monotonic() - start


class _Answer:
    """One answer in Ollama's shape: text deltas parted into thinking and content, tool calls as objects, and the
    final object's counts and nanosecond durations."""

    def __init__(self, model: str, kind: str, thinking: Thinking | None, tools: ChatTools | None, prompt_tokens: int,
                 context: list[int] | None) -> None:
        self.model, self.kind, self.thinking, self.tools = model, kind, thinking, tools
        self.prompt_tokens, self.context = prompt_tokens, context
        self.start = time.monotonic_ns()
        self.first: int | None = None  # when the first output came: the prompt's evaluation ended
        self.reasoning = thinking.stream() if thinking is not None else None
        self.text = ""

    def on_output(self, choice, out) -> None:
        if self.first is None:
            self.first = time.monotonic_ns()

    def _body(self, content: str, thought: str, done: bool) -> dict:
        body = {"model": self.model, "created_at": _now()}
        if self.kind == "message":
            message = {"role": "assistant", "content": content}
            if thought:
                message["thinking"] = thought
            body["message"] = message
        else:
            body["response"] = content
            if thought:
                body["thinking"] = thought
        return {**body, "done": done}

    def _final(self, out, body: dict) -> dict:
        end = time.monotonic_ns()
        first = self.first or end
        body.update(done_reason="length" if out.finish_reason == "length" else "stop",
                    total_duration=end - self.start, load_duration=0, prompt_eval_count=self.prompt_tokens,
                    prompt_eval_duration=first - self.start, eval_count=len(out.token_ids),
                    eval_duration=max(end - first, 1))
        if self.context is not None:
            body["context"] = self.context + list(out.token_ids)
        return body

    def _calls_and_content(self, text: str, finish_reason) -> tuple[str, list | None]:
        if self.tools is None:
            return text, None
        message, _ = self.tools.message(text, finish_reason)
        calls = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in message.get("tool_calls") or []]
        return message.get("content") or "", calls or None

    def whole(self, choice: Choice) -> dict:
        out = choice.final
        reasoning, text = self.thinking.split(out.text) if self.thinking is not None else (None, out.text)
        content, calls = self._calls_and_content(text, out.finish_reason)
        body = self._body(content, reasoning or "", True)
        if calls:
            body["message"]["tool_calls"] = calls
        return self._final(out, body)

    async def events(self, outputs, fail):
        """The stream: a chunk per text delta (thinking and content apart), then the final object; an error
        midway as {"error": ...}. With tools, the content comes whole at the end, its calls parsed, as Ollama
        streams them."""
        try:
            async for choice, out in outputs:
                self.on_output(choice, out)
                thought, content = (self.reasoning.feed(out.new_text, final=out.finished)
                                    if self.reasoning is not None else ("", out.new_text))
                if self.tools is not None:
                    self.text += content
                    content = ""
                if (thought or content) and not (out.finished and self.tools is not None):
                    yield json.dumps(self._body(content, thought, False)) + "\n"
                if out.finished:
                    body = self._body("", "", True)
                    if self.tools is not None:
                        text, calls = self._calls_and_content(self.text, out.finish_reason)
                        body = self._body(text, thought, True)
                        if calls:
                            body["message"]["tool_calls"] = calls
                    yield json.dumps(self._final(out, body)) + "\n"
        except Exception as e:
            yield json.dumps({"error": fail(e).message}) + "\n"


def _template_messages(messages) -> list[dict]:
    """Ollama's messages as the chat template takes them (ValueError naming a malformed one): a tool result's
    tool_name as its call id, images refused (text models only)."""
    from ...structured.tools import template_messages

    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise ValueError(f"messages[{i}]: images are not supported (text models only)")
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.role == "tool":
            message["tool_call_id"] = m.tool_name or f"call_{i}"
            if m.tool_name:
                message["name"] = m.tool_name
        out.append(message)
    return template_messages(out)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")

