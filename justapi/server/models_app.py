"""The HTTP server for several models (``justapi serve`` with --model repeated or --models-dir): each request goes to
the server process of the model it names (engine.models loads it first where it is not loaded), streamed back as
that process answers; the listings (/v1/models, /api/tags, /api/ps), /health and /metrics (every loaded model's,
labelled with its name, and the registry's own) are answered here.

A request names its model in its JSON body's ``model`` (every API family does), or in a ``model`` query parameter
(GET routes such as /engine/steps); none names the first model. Ollama's ``keep_alive`` (seconds or a duration such
as ``5m``; 0 unloads after the answer, negative keeps the model) sets how long the model stays once idle; an empty
/api/generate or /api/chat loads the model (or with ``keep_alive`` 0 unloads it), as Ollama's does.
"""


import asyncio
import json
import logging
import math
import re
import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ..engine.models import ModelSet, ModelSlot, ModelUnavailable
from ..server_config import ServerConfig
from .api import install_middleware
from .auth import under
from .chat_page import install as install_chat_page
from .errors import ApiError
from .front import until_disconnected
from .ollama.models import model_entry
from .ollama.routes import identity_routes

log = logging.getLogger("justapi.models")
# not passed between the client and a model's process: they describe one connection, not the request
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE_S = 365 * 86400.0  # longer is "until evicted"
# what a model's process serves: only these are passed on (and load a model); anything else is a 404 here
MODEL_PATHS = ("/v1", "/v2", "/api", "/tokenize", "/detokenize", "/engine", "/dashboard", "/infill", "/rerank",
               "/score", "/completion", "/completions", "/chat/completions", "/embeddings")


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive as seconds: a number, or a Go duration (``5m``, ``1h30m``, ``-1``); None where absent;
    beyond a year, or negative, -1 (until evicted). ApiError(400) for anything else."""
    seconds = None
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        elif isinstance(value, str):
            text = value.strip()
            parts = _DURATION.findall(text)
            if re.fullmatch(r"-?\d+(\.\d+)?", text):
                seconds = float(text)
            elif parts and "".join(n + u for n, u in parts) == text:
                seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    except OverflowError:
        seconds = float("inf")
    if value is None:
        return None
    if seconds is None or math.isnan(seconds):
        raise ApiError(400, f"keep_alive must be seconds or a duration such as '5m', not {value!r}",
                       param="keep_alive")
    return -1.0 if seconds < 0 or seconds > MAX_KEEP_ALIVE_S else seconds


def build_models_app(config: ServerConfig, models: ModelSet) -> FastAPI:
    """The several-model server's app over ``models`` (its processes start and stop with the app)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=None,
                                                                                              max_keepalive_connections=64))
    metrics = RegistryMetrics(models, client, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        models.start()
        yield
        await models.close()
        await client.aclose()

    app = FastAPI(title="JustAPI", lifespan=lifespan)
    install_middleware(app, config)
    install_chat_page(app)
    _listing_routes(app, models)

    @app.get("/metrics")
    async def merged_metrics():
        return Response(await metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(request: Request, path: str):
        if not under(request.url.path, MODEL_PATHS):
            raise ApiError(404, f"no route {request.url.path}", "not_found_error")
        body = await request.body()
        payload = _json_object(body)
        if body and payload is None:  # what a model's process refuses anyway, refused before anything loads for it
            raise ApiError(400, "the request body must be a JSON object (Content-Type: application/json)")
        name = payload.get("model") if payload is not None else request.query_params.get("model")
        slot = _resolve(models, name if isinstance(name, str) or name is None else str(name))
        keep_alive = keep_alive_seconds(payload.get("keep_alive")) if payload is not None else None
        if payload is not None and payload.get("model") not in (None, slot.name):
            body = json.dumps({**payload, "model": slot.name}).encode()  # the model's process knows one name
        if request.url.path in ("/api/generate", "/api/chat") and payload is not None and _loads_only(payload):
            return await _load_or_unload(models, slot, keep_alive, request.url.path)
        started = time.monotonic()
        slot = await _acquire(models, slot.name)
        metrics.waited(slot, time.monotonic() - started)
        try:
            return await _relay(client, models, slot, request, body, keep_alive)
        except BaseException:  # whatever stopped it before its answer streams: the model is not held for ever
            models.release(slot, keep_alive)
            raise

    return app


def _listing_routes(app: FastAPI, models: ModelSet) -> None:
    @app.get("/health")
    async def health():
        keys = ("name", "state", "error", "pid", "in_flight", "waiting", "expires_in", "load_seconds")
        return {"status": "ok", "models": [{k: m[k] for k in keys} for m in models.listing()]}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_openai_entry(m) for m in models.listing()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        slot = _resolve(models, name)
        return next(_openai_entry(m) for m in models.listing() if m["name"] == slot.name)

    identity_routes(app)

    @app.get("/api/tags")
    async def tags():
        return {"models": [await asyncio.to_thread(_tag, m) for m in models.listing()]}

    @app.get("/api/ps")
    async def ps():
        loaded = [m for m in models.listing() if m["state"] == "loaded"]
        return {"models": [{**await asyncio.to_thread(_tag, m), "size_vram": 0,
                            "expires_at": _expiry(m["expires_in"])} for m in loaded]}


def _tag(m: dict) -> dict:
    """Ollama's listing entry of a model, read from its file; a file that does not read is listed by its name."""
    try:
        return model_entry(m["path"], m["name"])
    except Exception:  # a broken or vanished file: its requests say why, the listing goes on
        return {"name": f"{m['name']}:latest", "model": f"{m['name']}:latest", "size": m["size"],
                "details": {"format": "gguf"}}


def _openai_entry(m: dict) -> dict:
    """OpenAI's model object, with the registry's word on it (state, and why it failed) as extra fields."""
    entry = {"id": m["name"], "object": "model", "created": 0, "owned_by": "justapi", "state": m["state"],
             "aliases": m["aliases"]}
    return entry | ({"error": m["error"]} if m["state"] == "failed" else {})


def _expiry(expires_in: float | None) -> str:
    if expires_in is None:
        return "2318-01-01T00:00:00Z"  # what Ollama says of a model kept until evicted
    when = datetime.fromtimestamp(time.time() + expires_in, timezone.utc)
    return when.isoformat().replace("+00:00", "Z")


def _json_object(body: bytes) -> dict | None:
    """The request body as a JSON object, or None (no body, or not an object: its model's process will say why)."""
    if not body:
        return None
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _resolve(models: ModelSet, name: str | None) -> ModelSlot:
    """The slot a request names (``NAME:latest`` as Ollama's clients say it too); a 404 naming the models else."""
    try:
        if name is not None and name not in models.names and name.endswith(":latest"):
            name = name.removesuffix(":latest")
        return models.resolve(name)
    except ModelUnavailable as e:
        raise ApiError(e.status, str(e), "not_found_error", "model") from None


async def _acquire(models: ModelSet, name: str) -> ModelSlot:
    try:
        return await models.acquire(name)
    except ModelUnavailable as e:
        raise ApiError(e.status, str(e), "service_unavailable" if e.status == 503 else "not_found_error",
                       "model") from None


def _loads_only(payload: dict) -> bool:
    """An Ollama request with nothing to generate: its way to load (or unload) a model."""
    return not payload.get("prompt") and not payload.get("messages") and not payload.get("context")


async def _load_or_unload(models: ModelSet, slot: ModelSlot, keep_alive: float | None, path: str) -> dict:
    if keep_alive == 0:
        if slot.state == "loaded" and not slot.busy:
            await models.unload(slot, "keep_alive")
        else:  # in use: it goes once its requests are done
            models.keep(slot, 0)
        reason = "unload"
    else:
        models.release(await _acquire(models, slot.name), keep_alive)
        reason = "load"
    now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    empty = {"message": {"role": "assistant", "content": ""}} if path == "/api/chat" else {"response": ""}
    return {"model": slot.name, "created_at": now, **empty, "done": True, "done_reason": reason}


async def _relay(client: httpx.AsyncClient, models: ModelSet, slot: ModelSlot, request: Request, body: bytes,
                 keep_alive: float | None) -> Response:
    """The request passed to the model's process and its answer streamed back; the model released once the answer
    ends (a client that leaves closes the upstream request, which aborts it there; one that leaves before the
    answer's head, as a whole answer's comes at its end, cancels it). The caller releases the model where this
    raises."""
    assert slot.process is not None
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
    raw_path = request.scope.get("raw_path") or request.url.path.encode()  # as sent: no decoding twice
    url = httpx.URL(slot.process.url).copy_with(raw_path=raw_path + (b"?" + request.scope["query_string"]
                                                                      if request.scope.get("query_string") else b""))
    sending = asyncio.ensure_future(client.send(client.build_request(request.method, url, headers=headers,
                                                                     content=body), stream=True))
    watching = asyncio.ensure_future(until_disconnected(request))
    await asyncio.wait([sending, watching], return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    if not sending.done():
        sending.cancel()
        raise ApiError(499, "client disconnected")
    try:
        upstream = sending.result()
    except httpx.TransportError:
        why = models.died(slot) or f"the model {slot.name!r} did not answer"
        raise ApiError(503, why, "service_unavailable", "model") from None

    async def chunks():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError:
            # the model's process went away mid-answer: its status is sent already, so the connection is broken
            # off (an incomplete answer, not one that looks whole)
            log.warning("the model %r stopped mid-answer: %s", slot.name, models.died(slot) or "its connection broke")
            raise
        finally:
            await upstream.aclose()
            models.release(slot, keep_alive)

    kept = [(k, v) for k, v in upstream.headers.multi_items() if k.lower() not in HOP_HEADERS]
    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=dict(kept))


class RegistryMetrics:
    """/metrics of the several-model server: each loaded model's own metrics with a ``model`` label, then the
    registry's (states, loads, unloads by reason, load times, requests waiting for a load, memory reserved)."""

    def __init__(self, models: ModelSet, client: httpx.AsyncClient, config: ServerConfig) -> None:
        self.models, self.client = models, client
        self.auth = {"Authorization": f"Bearer {config.api_keys[0]}"} if config.api_keys else {}
        self.registry = CollectorRegistry()
        self.load_wait = Histogram("justapi_model_load_wait_seconds", "time a request waited for its model to load "
                                   "(0 where it was loaded)", ["model"], registry=self.registry,
                                   buckets=(0.001, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.registry.register(_RegistryCollector(models))

    def waited(self, slot: ModelSlot, seconds: float) -> None:
        self.load_wait.labels(slot.name).observe(seconds)

    async def render(self) -> bytes:
        loaded = [s for s in self.models.slots.values() if s.state == "loaded" and s.process is not None]
        texts = await asyncio.gather(*(self._scrape(s) for s in loaded))
        merged: dict[str, Metric] = {}
        for slot, text in zip(loaded, texts):
            for family in text_string_to_metric_families(text) if text else ():
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    into.add_sample(s.name, {"model": slot.name, **s.labels}, s.value, s.timestamp)
        children = CollectorRegistry()
        children.register(_Fixed(list(merged.values())))
        return generate_latest(children) + generate_latest(self.registry)

    async def _scrape(self, slot: ModelSlot) -> str:
        try:
            r = await self.client.get(f"{slot.process.url}/metrics", headers=self.auth, timeout=5)
            return r.text if r.status_code == 200 else ""
        except (httpx.TransportError, AttributeError):
            return ""  # it stopped meanwhile


class _Fixed:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families


class _RegistryCollector:
    """The registry's state read at each scrape."""

    def __init__(self, models: ModelSet) -> None:
        self.models = models

    def collect(self):
        states = GaugeMetricFamily("justapi_model_state", "1 for the state each model is in", labels=["model", "state"])
        loads = CounterMetricFamily("justapi_model_loads", "models' completed loads", labels=["model"])
        failures = CounterMetricFamily("justapi_model_load_failures", "models' failed loads", labels=["model"])
        unloads = CounterMetricFamily("justapi_model_unloads", "models unloaded, by reason (idle, evicted, "
                                      "keep_alive, died)", labels=["model", "reason"])
        seconds = GaugeMetricFamily("justapi_model_load_seconds", "a model's latest load, seconds", labels=["model"])
        waiting = GaugeMetricFamily("justapi_model_requests_waiting", "requests waiting for their model to load",
                                    labels=["model"])
        reserved = GaugeMetricFamily("justapi_model_memory_reserved_bytes", "the models' memory budget a model holds "
                                     "(its file, its process, its KV pool)", labels=["model"])
        for slot in self.models.slots.values():
            for state in ("unloaded", "loading", "loaded", "failed"):
                states.add_metric([slot.name, state], float(slot.state == state))
            loads.add_metric([slot.name], slot.loads)
            failures.add_metric([slot.name], slot.load_failures)
            for reason in ("idle", "evicted", "keep_alive", "died"):
                unloads.add_metric([slot.name, reason], slot.unloads[reason])
            if slot.load_seconds is not None:
                seconds.add_metric([slot.name], slot.load_seconds)
            waiting.add_metric([slot.name], slot.waiting)
            reserved.add_metric([slot.name], slot.reserved)
        budget = GaugeMetricFamily("justapi_models_memory_budget_bytes", "the models' memory budget")
        budget.add_metric([], self.models.config.budget_bytes)
        return [states, loads, failures, unloads, seconds, waiting, reserved, budget]
