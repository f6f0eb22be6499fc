"""The HTTP server: OpenAI-compatible routes, SSE streaming, /health and /metrics (errors: errors.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..config import ServerConfig
from ..engine.async_llm import AsyncLLM, QueueFullError, SloRefusal
from ..engine.protocol import Engine
from ..sampling_params import Pooling, SamplingParams
from .auth import ApiKeys
from .chat_tools import ChatTools
from .chunks import ChatChunks, CompletionChunks
from .dashboard import DashboardFeed
from .dashboard import install as install_dashboard
from .errors import (ENGINE_ERRORS, ApiError, BodyLimit, InternalErrors, engine_error, error_response,
                     install_error_handlers, internal_error_message)
from .inputs import chat_prompt, completion_prompts, encoded, prepare_grammar
from .metrics import Metrics
from .scoring import install_scoring
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest,
                       message_dicts)
from .serving import (Choice, chat_logprobs, completion_logprobs, embedding_data, make_choices, new_id, now,
                      run_choices, sse, usage)

log = logging.getLogger("justapi.server")
STEPS_A_PAGE = 1024  # step records one GET /engine/steps returns at most (each with a cell per running request)


class ServerState:
    """What the routes share: the engine once it is loaded, the metrics, the settings."""

    def __init__(self, config: ServerConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.metrics = Metrics()
        self.dashboard = DashboardFeed()
        self.engine: Engine | None = None
        self.llm: AsyncLLM | None = None
        self.load_error: str | None = None

    def ready_llm(self) -> AsyncLLM:
        if self.llm is None:
            raise ApiError(503, self.load_error or "the model is still loading", "service_unavailable")
        return self.llm


def build_app(config: ServerConfig, model_name: str, load_engine: Callable[[], Engine]) -> FastAPI:
    """The FastAPI app; ``load_engine`` runs in a thread at start-up while /health answers 503."""
    state = ServerState(config, model_name)

    def on_finish(rid, out, timing) -> None:
        state.metrics.observe(out, timing)
        state.dashboard.observe(rid, out, timing)
        ttft = (timing.first_token - timing.arrival) if timing.first_token else float("nan")
        total = (timing.finished or timing.arrival) - timing.arrival
        predicted = timing.predicted_ttft if timing.predicted_ttft is not None else float("nan")
        log.info("request %s: %d prompt tokens (%d cached), %d output tokens, TTFT %.3f s (predicted %.3f s), "
                 "total %.3f s, %s", rid, out.num_prompt_tokens, out.num_cached_tokens, len(out.token_ids), ttft,
                 predicted, total, out.stop_reason if out.stop_reason == "timeout" else out.finish_reason)

    def load() -> None:
        try:
            engine = load_engine()
        except Exception as e:
            state.load_error = f"the model failed to load: {e}"
            log.error(state.load_error)
            return
        llm = AsyncLLM(engine, config.max_queue, config.stats_interval_s, on_finish, config.ttft_slo)
        state.metrics.attach(lambda: llm.stats)
        llm.start()
        state.engine, state.llm = engine, llm
        log.info("ready: serving %s as %r", engine.config.model, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=load, name="justapi-load", daemon=True)
        loader.start()
        yield
        if state.llm is not None:
            state.llm.shutdown()
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="JustAPI", lifespan=lifespan)
    app.state.justapi = state
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeys, keys=config.api_keys, open_metrics=config.open_metrics)
    app.add_middleware(InternalErrors)  # the outermost of ours: whatever the others raise is answered too

    def _params(req, raw: Request, max_tokens, logprobs) -> SamplingParams:
        """The engine's settings for a request: its sampling fields, its user (the API key's name where keys are
        configured, else its user field) and its deadline (its timeout or --request-timeout, the shorter)."""
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        user = getattr(raw.state, "api_user", None) or req.user
        timeouts = [t for t in (req.timeout, config.request_timeout) if t is not None]
        deadline = time.monotonic() + min(timeouts) if timeouts else None
        try:
            return req.sampling_params(max_tokens, logprobs, user, deadline)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def _validate(llm: AsyncLLM, choices: list[Choice]) -> None:
        """Refuse now (4xx) a request that could never run or finds the queue full: before a stream starts, since
        once it has, errors can only travel inside it. Its choices count once against the queue, as one request."""
        try:
            for c in choices:
                if config.clamp_max_tokens and c.params.max_tokens is not None:
                    room = llm.validate(c.prompt_ids, dataclasses.replace(c.params, max_tokens=None))
                    c.params = dataclasses.replace(c.params, max_tokens=min(c.params.max_tokens, room))
                llm.validate(c.prompt_ids, c.params)
            llm.check_queue()
            llm.check_slo(choices[0].prompt_ids, choices[0].params)
        except (QueueFullError, ValueError) as e:
            if isinstance(e, SloRefusal):
                state.metrics.slo_refusals.inc()
            raise engine_error(e) from None

    @app.get("/health")
    async def health():
        if state.llm is None:
            return error_response(503, state.load_error or "the model is loading", "service_unavailable")
        if state.llm.dead is not None:
            return error_response(503, f"the engine stopped: {state.llm.dead}", "service_unavailable")
        serving, detail = state.engine.health()
        if not serving:
            return error_response(503, f"no worker left in a pool: {detail}", "service_unavailable")
        return {"status": "degraded" if "dead_workers" in detail else "ok", **detail}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/engine/steps")
    async def engine_steps(since: int = 0, limit: int = STEPS_A_PAGE):
        """The engine's step records from ``since`` on (engine.step_log), ``limit`` at most: what each step computed,
        and where the engine thread's time went. Ask again from ``next`` for the rest."""
        if not 1 <= limit <= STEPS_A_PAGE:
            raise ApiError(400, f"limit must be in 1..{STEPS_A_PAGE}, got {limit}", param="limit")
        records, next_seq = state.ready_llm().step_log.since(since, limit)
        steps = await asyncio.to_thread(lambda: [r.as_dict() for r in records])  # off the event loop: ~10 ms a page
        return {"steps": steps, "next": next_seq}

    if config.dashboard:
        install_dashboard(app, state.ready_llm, lambda: state.engine.tokenizer, state.dashboard,
                          config.dashboard_prompt_text)

    @app.get("/v1/models")
    async def models():
        state.ready_llm()  # 503 while loading: clients poll this route for readiness
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "justapi",
                                              "max_model_len": state.engine.limits.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.ready_llm()
        _check_model(req.model)
        tok = state.engine.tokenizer
        if req.messages is not None:
            try:
                messages = message_dicts(req.messages)
            except ValueError as e:
                raise ApiError(400, str(e), param="messages") from None
            ids = await chat_prompt(state.engine, messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await encoded("prompt", tok.encode, req.prompt, req.add_special_tokens)
        else:
            raise ApiError(400, "give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.ready_llm()
        _check_model(req.model)
        vocab = state.engine.limits.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        text = await asyncio.to_thread(state.engine.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model")

    def _common_checks(req) -> None:
        _check_model(req.model)
        if state.engine.model_config.is_encoder:  # before its prompt is rendered: an encoder has no template
            raise ApiError(400, f"this model is an encoder ({state.engine.model_config.arch}): it serves "
                                "/v1/embeddings, /v1/rerank and /v1/score, not generated text")
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem)
        if req.n > config.max_n:
            raise ApiError(400, f"n must be at most {config.max_n}, got {req.n}", param="n")

    def _check_fan_out(num_prompts: int, n: int, field: str) -> None:
        """Bound what one request may start, before any of it is tokenized or queued."""
        if num_prompts > config.max_prompts:
            raise ApiError(400, f"{field} may hold at most {config.max_prompts} entries, got {num_prompts}",
                           param=field)
        if num_prompts * n > config.max_choices:
            raise ApiError(400, f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences; at most "
                                f"{config.max_choices} per request", param="n")

    def _check_token_ids(prompts: list, field: str) -> None:
        """Token-id prompts checked before anything decodes them (echo): the engine's own check, as a 400."""
        try:
            for p in prompts:
                if not isinstance(p, str):
                    state.engine.check_token_ids(p)
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        llm = state.ready_llm()
        _common_checks(req)
        tok = state.engine.tokenizer
        prompts = req.prompt if isinstance(req.prompt, list) and not isinstance(req.prompt[0], int) else [req.prompt]
        _check_fan_out(len(prompts), req.n, "prompt")
        _check_token_ids(prompts, "prompt")
        params = _params(req, raw, req.max_tokens, req.logprobs)
        ids_list, echo = await encoded("prompt", completion_prompts, tok, prompts, req.echo)
        await prepare_grammar(state.engine, req, params)
        choices = make_choices(ids_list, params, echo)
        _validate(llm, choices)
        rid = new_id("cmpl")
        if req.stream:
            return _stream(raw, llm, rid, choices, req, CompletionChunks(rid, model_name, tok))
        await _collect(raw, llm, rid, choices)
        return {"id": rid, "object": "text_completion", "created": now(), "model": model_name,
                "choices": await asyncio.to_thread(_completion_entries, tok, choices), "usage": usage(choices)}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        llm = state.ready_llm()
        _check_model(req.model)
        engine = state.engine
        hidden = engine.model_config.hidden_size
        if req.dimensions is not None and not 1 <= req.dimensions <= hidden:
            raise ApiError(400, f"dimensions must be in 1..{hidden} for this model, got {req.dimensions}",
                           param="dimensions")
        if engine.model_config.pooling == "rank":
            raise ApiError(400, "this model is a reranker: it scores (query, document) pairs at /v1/rerank and "
                                "/v1/score, it has no embeddings")
        try:
            pooling = Pooling(engine.model_config.pooling, dimensions=req.dimensions)
        except ValueError as e:
            raise ApiError(400, f"this model cannot serve embeddings: {e}") from None
        inputs = req.inputs()
        _check_fan_out(len(inputs), 1, "input")
        _check_token_ids(inputs, "input")
        ids_list, _ = await encoded("input", completion_prompts, engine.tokenizer, inputs, False)
        vectors, tokens = await _pooled(raw, llm, ids_list, pooling, req)
        return {"object": "list", "model": model_name,
                "data": [embedding_data(i, v, req.encoding_format) for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _pooled(raw: Request, llm: AsyncLLM, ids_list: list[list[int]], pooling: Pooling, req):
        """(each prompt's pooled vector, the prompts' tokens): embeddings, or a reranker's scores; ``req`` gives
        the user and the timeout."""
        timeouts = [t for t in (req.timeout, config.request_timeout) if t is not None]
        params = dataclasses.replace(SamplingParams.for_embedding(pooling),
                                     user=getattr(raw.state, "api_user", None) or req.user,
                                     deadline=time.monotonic() + min(timeouts) if timeouts else None)
        choices = [Choice(i, i, ids, params) for i, ids in enumerate(ids_list)]
        _validate(llm, choices)
        await _collect(raw, llm, new_id("embd"), choices)
        if any(c.final.embedding is None for c in choices):  # its deadline passed before it was computed
            raise ApiError(408, f"the request was not computed within its timeout ({min(timeouts):g} s)", "timeout")
        return [c.final.embedding for c in choices], sum(len(c.prompt_ids) for c in choices)

    install_scoring(app, state, _pooled, _check_model, _check_fan_out)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        llm = state.ready_llm()
        _common_checks(req)
        engine = state.engine
        try:
            tool_req = req.tool_request()
            tools = ChatTools.of(tool_req, engine.tool_parser)
        except ValueError as e:
            raise ApiError(400, str(e), param="tools") from None
        try:
            messages = req.message_dicts()
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = await chat_prompt(engine, messages, req.add_generation_prompt, tool_req.rendered if tool_req else None)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, raw, max_tokens, top)
        if tools is not None and tools.request.forced:
            if params.structured is not None:
                raise ApiError(400, "tool_choice required or a named function cannot be combined with "
                                    "response_format or structured_outputs", param="tool_choice")
            params = dataclasses.replace(params, structured=tools.request.spec())
        await prepare_grammar(engine, req, params, forced_tool=tools is not None and tools.request.forced)
        choices = make_choices([ids], params)
        _validate(llm, choices)
        rid = new_id("chatcmpl")
        tok = engine.tokenizer
        if req.stream:
            return _stream(raw, llm, rid, choices, req, ChatChunks(rid, model_name, tok, tools))
        await _collect(raw, llm, rid, choices)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": model_name,
                "choices": await asyncio.to_thread(lambda: [_chat_choice(c, tok, tools) for c in choices]),
                "usage": usage(choices)}

    return app


def _chat_choice(c: Choice, tok, tools: ChatTools | None) -> dict:
    message = {"role": "assistant", "content": c.final.text}
    reason = c.final.finish_reason
    if tools is not None:
        message, reason = tools.message(c.final.text, reason)
    return {"index": c.index, "message": message, "logprobs": chat_logprobs(tok, c.final.logprobs),
            "finish_reason": reason, "stop_reason": c.final.stop_reason}


def _completion_entries(tok, choices: list[Choice]) -> list[dict]:
    """A finished completions response's choices, logprobs decoded (in a thread: a long answer's are many)."""
    return [{"index": c.index, "text": c.prefix + c.final.text,
             "logprobs": completion_logprobs(tok, c.final.logprobs, len(c.prefix)),
             "finish_reason": c.final.finish_reason, "stop_reason": c.final.stop_reason} for c in choices]


async def _collect(raw: Request, llm: AsyncLLM, rid: str, choices: list[Choice]) -> None:
    """Run the choices to the end; a client that goes away aborts them."""

    async def consume():
        async for _ in run_choices(llm, rid, choices):
            pass

    work = asyncio.create_task(consume())

    async def watch():
        while not await raw.is_disconnected():
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():  # the client went away (or the handler was cancelled): abort the choices
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ApiError(499, "client disconnected")
    exc = work.exception()
    if exc is not None:
        raise engine_error(exc) or exc


def _stream(raw: Request, llm: AsyncLLM, rid: str, choices: list[Choice], req, chunk) -> StreamingResponse:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    gen = run_choices(llm, rid, choices)

    async def events():
        try:
            for c in choices:
                first = chunk.start(c)
                if first is not None:
                    yield sse(first)
            async for choice, out in gen:
                for payload in chunk.delta(choice, out):
                    yield sse(payload)
            if include_usage:
                yield sse(chunk.usage(usage(choices)))
            yield sse("[DONE]")
        except Exception as e:  # once streaming, an error travels inside the stream, which still ends with [DONE]
            err = engine_error(e) if isinstance(e, ENGINE_ERRORS) else None
            if err is None:  # not the engine's word on the request (a tool parser's bug, say): logged with an id
                err = ApiError(500, internal_error_message(log, raw.url.path), "server_error")
            yield sse({"error": {"message": err.message, "type": err.type, "code": err.status}})
            yield sse("[DONE]")
        finally:
            await gen.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


