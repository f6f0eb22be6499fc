"""What every API family's routes share (server/openai, server/scoring, server/native, ...): the engine once it is
loaded, the settings, and the steps each request goes through whatever its wire format: the model name checked,
its fan-out bounded, its engine settings made (user and deadline), its choices validated and queued, run to the end
(a client that leaves aborts them) or streamed, pooled. One place for each, so no family copies another's."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..server_config import ServerConfig
from ..engine.async_llm import AsyncLLM, QueueFullError, SloRefusal
from ..engine.protocol import Engine
from ..sampling_params import Pooling, SamplingParams
from .dashboard import DashboardFeed
from .errors import ENGINE_ERRORS, ApiError, engine_error, internal_error_message
from .metrics import Metrics
from .protocol import unknown_fields
from .inputs import prepare_grammar
from .serving import Choice, make_choices, new_id, run_choices

log = logging.getLogger("justapi.server")
MAX_WARNED_FIELDS = 1024  # distinct unknown field names warned about (a client inventing names cannot fill the log)


class Front:
    """The server's state and the request steps every family's routes take."""

    def __init__(self, config: ServerConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.metrics = Metrics()
        self.dashboard = DashboardFeed()
        self.engine: Engine | None = None
        self.llm: AsyncLLM | None = None
        self.load_error: str | None = None
        self._warned_fields: set[str] = set()

    # --- checks ------------------------------------------------------------------------------------------------
    def ready_llm(self) -> AsyncLLM:
        if self.llm is None:
            raise ApiError(503, self.load_error or "the model is still loading", "service_unavailable")
        return self.llm

    def accept(self, req) -> None:
        """A request body's first checks: fields the server does not know (``check_fields``), its model name."""
        self.check_fields(req)
        self.check_model(req.model)

    def check_fields(self, req) -> None:
        """Fields the server does not know, ignored with a warning naming them (once a name), or under
        --strict-fields refused."""
        names = unknown_fields(req)
        if names and self.config.strict_fields:
            raise ApiError(400, f"unknown field{'s' * (len(names) > 1)}: {', '.join(names[:20])} "
                                "(this server runs with --strict-fields)", param=names[0])
        new = [n for n in names if n not in self._warned_fields]
        if new and len(self._warned_fields) < MAX_WARNED_FIELDS:
            self._warned_fields.update(new)
            log.warning("ignoring request fields this server does not know: %s", ", ".join(new[:20]))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    def check_generates(self) -> None:
        """A request to generate text, refused by an encoder before its prompt is rendered (it has no template)."""
        cfg = self.engine.model_config
        if cfg.is_encoder:
            raise ApiError(400, f"this model is an encoder ({cfg.arch}): it serves /v1/embeddings, /v1/rerank and "
                                "/v1/score, not generated text")

    def check_fan_out(self, num_prompts: int, n: int, field: str) -> None:
        """Bound what one request may start, before any of it is tokenized or queued."""
        config = self.config
        if num_prompts > config.max_prompts:
            raise ApiError(400, f"{field} may hold at most {config.max_prompts} entries, got {num_prompts}",
                           param=field)
        if num_prompts * n > config.max_choices:
            raise ApiError(400, f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences; at most "
                                f"{config.max_choices} per request", param="n")

    def check_token_ids(self, prompts: list, field: str) -> None:
        """Token-id prompts checked before anything decodes them (echo): the engine's own check, as a 400."""
        try:
            for p in prompts:
                if not isinstance(p, str):
                    self.engine.check_token_ids(p)
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    def embedding_pooling(self, dimensions: int | None = None) -> Pooling:
        """How the model's file pools an embedding, cut to ``dimensions``: a 400 for a reranker (it scores, it
        does not embed), a pooling the engine does not compute, or dimensions outside the hidden size."""
        cfg = self.engine.model_config
        if dimensions is not None and not 1 <= dimensions <= cfg.hidden_size:
            raise ApiError(400, f"dimensions must be in 1..{cfg.hidden_size} for this model, got {dimensions}",
                           param="dimensions")
        if cfg.pooling == "rank":
            raise ApiError(400, "this model is a reranker: it scores (query, document) pairs at /v1/rerank and "
                                "/v1/score, it has no embeddings")
        try:
            return Pooling(cfg.pooling, dimensions=dimensions)
        except ValueError as e:
            raise ApiError(400, f"this model cannot serve embeddings: {e}") from None

    # --- engine settings -----------------------------------------------------------------------------------------
    def user(self, raw: Request, user: str | None) -> str | None:
        """Whose request it is: the API key's name where keys are configured, else the client's own word."""
        return getattr(raw.state, "api_user", None) or user

    def deadline(self, timeout: float | None) -> float | None:
        """The request's timeout or --request-timeout, the shorter, as a time.monotonic() deadline."""
        timeouts = [t for t in (timeout, self.config.request_timeout) if t is not None]
        return time.monotonic() + min(timeouts) if timeouts else None

    def validate(self, llm: AsyncLLM, choices: list[Choice]) -> None:
        """Refuse now (4xx) a request that could never run or finds the queue full: before a stream starts, since
        once it has, errors can only travel inside it. Its choices count once against the queue, as one request."""
        try:
            for c in choices:  # each admitted once, here: the engine queues what this gives
                if self.config.clamp_max_tokens and c.params.max_tokens is not None:
                    room = llm.engine.check_request(c.prompt_ids, dataclasses.replace(c.params, max_tokens=None))
                    c.params = dataclasses.replace(c.params, max_tokens=min(c.params.max_tokens, room))
                c.params, c.admitted = llm.validate(c.prompt_ids, c.params), True
            llm.check_queue()
            llm.check_slo(choices[0].prompt_ids, choices[0].params)
        except (QueueFullError, ValueError) as e:
            if isinstance(e, SloRefusal):
                self.metrics.slo_refusals.inc()
            raise engine_error(e) from None

    # --- running ---------------------------------------------------------------------------------------------------
    async def pooled(self, raw: Request, ids_list: list[list[int]], pooling: Pooling, user: str | None,
                     timeout: float | None, id_prefix: str = "embd") -> tuple[list[list[float]], int]:
        """(each prompt's pooled vector, the prompts' tokens): embeddings, or a reranker's scores. ``id_prefix``:
        the request id's, which names its API family in the metrics (server.metrics.API_FAMILIES)."""
        llm = self.ready_llm()
        params = dataclasses.replace(SamplingParams.for_embedding(pooling), user=self.user(raw, user),
                                     deadline=self.deadline(timeout))
        choices = [Choice(i, i, ids, params) for i, ids in enumerate(ids_list)]
        self.validate(llm, choices)
        await collect(raw, llm, new_id(id_prefix), choices)
        if any(c.final.embedding is None for c in choices):  # its deadline passed before it was computed
            raise ApiError(408, "the request was not computed within its timeout", "timeout")
        return [c.final.embedding for c in choices], sum(len(c.prompt_ids) for c in choices)


    async def answer(self, raw: Request, req, ids: list[int], params: SamplingParams, grammar_field: str,
                     id_prefix: str, make_answer: Callable, streaming: bool, media_type: str = "text/event-stream"):
        """The shared tail of a family's generation route, for one prompt: its grammar compiled (an error naming
        ``grammar_field``), validated and queued, then streamed in the family's framing (``make_answer(rid)``'s
        ``events``) or run to the end and given whole (its ``whole(choice)``; its ``on_output``, if any, sees each
        output as it comes)."""
        await prepare_grammar(self.engine, req, params, field=grammar_field)
        llm = self.ready_llm()
        choices = make_choices([ids], params)
        self.validate(llm, choices)
        rid = new_id(id_prefix)
        answer = make_answer(rid)
        if streaming:
            return stream(raw, llm, rid, choices, answer.events, media_type)
        await collect(raw, llm, rid, choices, getattr(answer, "on_output", None))
        return await asyncio.to_thread(answer.whole, choices[0])


async def until_disconnected(raw: Request) -> None:
    """Returns once the client has gone away (polled: Starlette tells it only to a receive)."""
    while not await raw.is_disconnected():
        await asyncio.sleep(0.25)


async def collect(raw: Request, llm: AsyncLLM, rid: str, choices: list[Choice], on_output=None) -> None:
    """Run the choices to the end; a client that goes away aborts them. ``on_output(choice, output)`` sees each
    output as it comes (a family's timings)."""

    async def consume():
        async for choice, out in run_choices(llm, rid, choices):
            if on_output is not None:
                on_output(choice, out)

    work = asyncio.create_task(consume())

    watcher = asyncio.create_task(until_disconnected(raw))
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


def stream(raw: Request, llm: AsyncLLM, rid: str, choices: list[Choice], events_of: Callable,
           media_type: str = "text/event-stream") -> StreamingResponse:
    """Stream the choices' outputs in a family's framing: ``events_of(outputs, fail)`` turns the async iterator of
    (choice, output) into the family's encoded events; ``fail(exc)`` gives the ApiError to send for an exception
    raised midway (the engine's word on the request, or an internal error logged under an id)."""
    gen = run_choices(llm, rid, choices)

    def fail(e: Exception) -> ApiError:
        err = engine_error(e) if isinstance(e, ENGINE_ERRORS) else None
        if err is None:  # not the engine's word on the request (a tool parser's bug, say): logged with an id
            err = ApiError(500, internal_error_message(log, raw.url.path), "server_error")
        return err

    async def events() -> AsyncIterator[str]:
        try:
            async for event in events_of(gen, fail):
                yield event
        finally:
            await gen.aclose()

    return StreamingResponse(events(), media_type=media_type, headers={"Cache-Control": "no-cache"})
