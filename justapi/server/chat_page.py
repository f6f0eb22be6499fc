"""The chat page: ``/chat``, a static page shipped in the package (server/static/chat.*, no build step, no CDN) that
talks to the server's own ``/v1/models`` and ``/v1/chat/completions``: pick a model, type, watch the answer stream,
stop it, see its speed, the reasoning of reasoning models folded away. Behind --api-key the browser asks for the key
(HTTP Basic, as for the dashboard) and the page is served with it, so that its own API requests carry it."""


import html
import importlib.resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .auth import presented_key
from .errors import ApiError

STATIC = importlib.resources.files("justapi.server") / "static"
FILES = {"chat.js": "text/javascript", "chat.css": "text/css"}
KEY_SLOT = '<meta name="justapi-key" content="">'


def install(app: FastAPI) -> None:
    @app.get("/chat")
    async def chat_page(request: Request):
        page = (STATIC / "chat.html").read_text()
        key = presented_key(request.headers.get("authorization", ""), "/chat")
        if key:  # the key the browser sent for this page (checked by ApiKeys): its requests need it too
            page = page.replace(KEY_SLOT, f'<meta name="justapi-key" content="{html.escape(key, quote=True)}">')
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})

    @app.get("/chat/{name}")
    async def chat_file(name: str):
        if name not in FILES:
            raise ApiError(404, f"the chat page has no file {name!r}", "not_found_error")
        return Response((STATIC / name).read_bytes(), media_type=FILES[name], headers={"Cache-Control": "no-cache"})
