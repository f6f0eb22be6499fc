"""API keys: which paths need one, how a client presents it (``Authorization: Bearer``, or ``x-api-key`` as
Anthropic's clients send it), and the user a key stands for (fair shares)."""

from __future__ import annotations

import base64
import binascii

from .errors import error_response

# everything but /health needs a key when keys are configured: /metrics too, unless --open-metrics (its labels
# carry users' names and its gauges the load)
OPEN_PATHS = ("/health",)
# the pages a browser opens (the dashboard, the chat page): they take the key as an HTTP Basic password, which the
# browser asks for and resends with the page's own requests under these paths
PAGE_PATHS = ("/dashboard", "/chat")


class ApiKeys:
    """ASGI middleware: refuse a request without a configured key (401, OpenAI-style), and record the key's user
    in ``scope["state"]["api_user"]``. A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so a route
    still sees its client disconnect."""

    def __init__(self, app, keys: tuple[str, ...], open_metrics: bool) -> None:
        self.app = app
        self.users = {key: f"key-{i}" for i, key in enumerate(keys, 1)}
        self.open_paths = OPEN_PATHS + (("/metrics",) if open_metrics else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.users or under(scope["path"], self.open_paths):
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        key = presented_key(authorization, path) or headers.get(b"x-api-key", b"").decode("latin-1") or None
        user = self.users.get(key)
        if user is None:
            # a browser asks for the key (as a password) where the page says Basic, and resends it with the
            # page's own requests: the dashboard works without a client of its own
            www = {"WWW-Authenticate": 'Basic realm="justapi"'} if under(path, PAGE_PATHS) else None
            response = error_response(401, "invalid or missing API key", "authentication_error", headers=www,
                                      path=path)
            return await response(scope, receive, send)
        scope.setdefault("state", {})["api_user"] = user  # the fair-share user: a key is a tenant
        await self.app(scope, receive, send)


def presented_key(authorization: str, path: str) -> str | None:
    """The API key in an Authorization header: ``Bearer KEY``, or on the pages' paths HTTP Basic with the key as the
    password (any user name)."""
    scheme, _, value = authorization.partition(" ")
    if scheme == "Bearer":
        return value
    if scheme == "Basic" and under(path, PAGE_PATHS):
        try:
            return base64.b64decode(value, validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


def under(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``path`` is one of ``prefixes`` or below one (``/health`` and ``/health/x``, not ``/healthz``)."""
    return any(path == p or path.startswith(p + "/") for p in prefixes)
