"""The HTTP server: the app, its middleware and lifespan (the engine loaded in the background), and one router per
API family over the shared Front (server.front): OpenAI (server.openai, server.responses), Anthropic (server.anthropic),
Ollama (server.ollama), scoring, JustAPI's own (server.native)."""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..server_config import ServerConfig
from ..engine.async_llm import AsyncLLM
from ..engine.protocol import Engine
from . import infill, native, scoring
from .auth import ApiKeys
from .chat_page import install as install_chat_page
from .dashboard import install as install_dashboard
from .errors import BodyLimit, InternalErrors, install_error_handlers
from .front import Front
from .anthropic import routes as anthropic
from .ollama import routes as ollama
from .responses import routes as responses
from .openai import routes as openai

log = logging.getLogger("justapi.server")


def build_app(config: ServerConfig, model_name: str, load_engine: Callable[[], Engine]) -> FastAPI:
    """The FastAPI app: one router per API family over the shared Front; ``load_engine`` runs in a thread at
    start-up while /health answers 503."""
    state = Front(config, model_name)

    def on_finish(rid, out, timing) -> None:
        state.metrics.observe(out, timing, rid)
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
    install_middleware(app, config)
    app.include_router(native.router(state))
    install_chat_page(app)
    if config.dashboard:
        install_dashboard(app, state.ready_llm, lambda: state.engine.tokenizer, state.dashboard,
                          config.dashboard_prompt_text)
    app.include_router(openai.router(state))
    app.include_router(scoring.router(state))
    app.include_router(ollama.router(state))
    app.include_router(anthropic.router(state))
    app.include_router(responses.router(state))
    app.include_router(infill.router(state))
    return app


def install_middleware(app: FastAPI, config: ServerConfig) -> None:
    """What every request passes through, the one-model server's and the several-model one's alike: the error
    handlers, the body limit, the key check, CORS where origins are allowed, internal errors answered."""
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeys, keys=config.api_keys, open_metrics=config.open_metrics)
    if config.origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in config.origins)
    app.add_middleware(InternalErrors)  # the outermost of ours: whatever the others raise is answered too
