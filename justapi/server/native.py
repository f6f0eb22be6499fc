"""JustAPI's own endpoints: /health, /metrics (Prometheus), /engine/steps (the step log), /tokenize and
/detokenize; the dashboard's routes are installed beside them (server.dashboard)."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import ApiError, error_response
from .front import Front
from .inputs import chat_prompt, encoded
from .protocol import DetokenizeRequest, TokenizeRequest, message_dicts

STEPS_A_PAGE = 1024  # step records one GET /engine/steps returns at most (each with a cell per running request)


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.get("/health")
    async def health():
        if front.llm is None:
            return error_response(503, front.load_error or "the model is loading", "service_unavailable")
        if front.llm.dead is not None:
            return error_response(503, f"the engine stopped: {front.llm.dead}", "service_unavailable")
        serving, detail = front.engine.health()
        if not serving:
            return error_response(503, f"no worker left in a pool: {detail}", "service_unavailable")
        return {"status": "degraded" if "dead_workers" in detail else "ok", **detail}

    @api.get("/metrics")
    async def metrics():
        return Response(front.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/engine/steps")
    async def engine_steps(since: int = 0, limit: int = STEPS_A_PAGE):
        """The engine's step records from ``since`` on (engine.step_log), ``limit`` at most: what each step computed,
        and where the engine thread's time went. Ask again from ``next`` for the rest."""
        if not 1 <= limit <= STEPS_A_PAGE:
            raise ApiError(400, f"limit must be in 1..{STEPS_A_PAGE}, got {limit}", param="limit")
        records, next_seq = front.ready_llm().step_log.since(since, limit)
        steps = await asyncio.to_thread(lambda: [r.as_dict() for r in records])  # off the event loop: ~10 ms a page
        return {"steps": steps, "next": next_seq}

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        front.ready_llm()
        front.accept(req)
        if req.messages is not None:
            try:
                messages = message_dicts(req.messages)
            except ValueError as e:
                raise ApiError(400, str(e), param="messages") from None
            ids = await chat_prompt(front.engine, messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await encoded("prompt", front.engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            raise ApiError(400, "give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": front.engine.limits.max_model_len}

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        front.ready_llm()
        front.accept(req)
        vocab = front.engine.limits.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        text = await asyncio.to_thread(front.engine.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    return api
