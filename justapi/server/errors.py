"""OpenAI-style errors: ``{"error": {...}}`` with an HTTP status, for the routes' own checks, validation failures,
engine refusals and over-large bodies. Nothing a client sends may end in a traceback or a 500."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.limits import AdmissionError
from ..engine.async_llm import QueueFullError
from ..engine.protocol import EngineDeadError, RequestFailedError


log = logging.getLogger("justapi.server")


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


OLLAMA_PATHS = "/api/"  # Ollama's routes answer errors in its shape: {"error": "message"}
ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's: {"type": "error", "error": {"type": ..., "message": ...}}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """An error in the shape of the API family ``path`` belongs to: Ollama's, Anthropic's, or OpenAI's."""
    if path.startswith(OLLAMA_PATHS):
        body = {"error": message}
    elif path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# what the engine front raises about a request once its stream has started: answered inside the stream as such
ENGINE_ERRORS = (QueueFullError, AdmissionError, EngineDeadError, RequestFailedError)


def engine_error(exc: BaseException) -> ApiError | None:
    """The HTTP answer for an error the engine front raised about a request; None for anything else (a bug)."""
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return ApiError(429, str(exc), "rate_limit_error", headers=headers)
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return ApiError(500, str(exc), "server_error")
    if isinstance(exc, ValueError):  # AdmissionError included
        return ApiError(400, str(exc), param="prompt")
    return None


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413, streamed or not."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = length is not None and length.isdigit() and int(length) > self.max_bytes
        seen = 0

        async def limited_receive():
            nonlocal seen, too_big
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                too_big = True
                raise _BodyTooLarge()
            return message

        if too_big:
            return await self._reject(scope, receive, send)
        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope, receive, send):
        resp = error_response(413, f"the request body exceeds the limit of {self.max_bytes} bytes",
                              path=scope.get("path", ""))
        await resp(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class InternalErrors:
    """ASGI middleware, the last resort: an exception no route turned into an answer is logged with its traceback
    under an error id, and answered as an OpenAI-style 500 naming that id (a stream already started just ends)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except RecursionError:  # a body (or a schema in it) nested past what the parsers recurse through
            if not started:
                await error_response(400, "the request is nested too deeply", path=scope.get("path", ""))(
                    scope, receive, send)
        except Exception:
            message = internal_error_message(log, f"{scope.get('method')} {scope.get('path')}")
            if not started:
                await error_response(500, message, "server_error", path=scope.get("path", ""))(scope, receive, send)


def internal_error_message(logger, where: str) -> str:
    """Log the exception being handled under a new error id; the message a client gets, naming only that id."""
    error_id = uuid.uuid4().hex[:16]
    logger.exception("internal error %s on %s", error_id, where)
    return f"internal server error {error_id} (the server's log has its details)"


def _shaped(request, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
            headers: dict | None = None) -> JSONResponse:
    return error_response(status, message, type_, param, headers, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _shaped(request, exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        problems = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            if err.get("type") == "json_invalid":
                problems.append("the request body is not valid JSON")
            else:
                problems.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        param = None
        errs = exc.errors()
        if errs and errs[0].get("type") != "json_invalid":  # its location is a character offset, not a field
            loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
            param = loc[0] if loc else None
        return _shaped(request, 400, "; ".join(problems[:5]), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body could not be parsed (it must be UTF-8 JSON)"
        return _shaped(request, exc.status_code, message)
