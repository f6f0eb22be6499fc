"""A local server speaking the part of the Hugging Face hub's HTTP API that ``huggingface_hub`` downloads through:
a repository's info with its files' sizes and SHA-256 (``/api/models/ORG/REPO[/revision/REV]``) and the files
themselves (``/ORG/REPO/resolve/REV/FILE``: HEAD for the metadata, GET with Range for a resumed transfer). The
tests point ``HF_ENDPOINT`` at it; it records each request, and can misbehave on purpose: cut a file's first transfer
midway (``cut_first``), or list a wrong checksum (``wrong_sha``)."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from server_helpers import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    """``repos``: {"org/repo": {"file name": bytes}}."""

    def __init__(self, repos: dict[str, dict[str, bytes]], cut_first: set[str] = frozenset(),
                 wrong_sha: set[str] = frozenset()) -> None:
        self.repos, self.cut_first, self.wrong_sha = repos, set(cut_first), set(wrong_sha)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the hub server did not start")
            self._thread.join(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def listed_sha(self, name: str, data: bytes) -> str:
        return "0" * 64 if name in self.wrong_sha else hashlib.sha256(data).hexdigest()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.requests.append((request.method, request.url.path, request.headers.get("range")))
            return await call_next(request)

        @app.get("/api/models/{org}/{repo}")
        @app.get("/api/models/{org}/{repo}/revision/{revision}")
        async def info(org: str, repo: str, revision: str = "main"):
            files = self.repos.get(f"{org}/{repo}")
            if files is None:
                return JSONResponse({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            siblings = [{"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest(),
                         "lfs": {"sha256": self.listed_sha(name, data), "size": len(data), "pointerSize": 134}}
                        for name, data in files.items()]
            return {"id": f"{org}/{repo}", "modelId": f"{org}/{repo}", "sha": COMMIT, "private": False,
                    "siblings": siblings, "tags": ["gguf"]}

        @app.api_route("/{org}/{repo}/resolve/{revision}/{name:path}", methods=["GET", "HEAD"])
        async def resolve(org: str, repo: str, revision: str, name: str, request: Request):
            data = self.repos.get(f"{org}/{repo}", {}).get(name)
            if data is None:
                return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self.listed_sha(name, data)}"',
                       "Accept-Ranges": "bytes"}
            start = int(request.headers.get("range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
            if request.method == "HEAD":
                return Response(headers={**headers, "Content-Length": str(len(data))})
            body = data[start:]
            headers["Content-Length"] = str(len(body))
            status = 200
            if start:
                status, headers["Content-Range"] = 206, f"bytes {start}-{len(data) - 1}/{len(data)}"
            cut = name in self.cut_first and not start
            if cut:
                self.cut_first.discard(name)
            return StreamingResponse(_chunks(body, cut), status, headers)

        return app


async def _chunks(body: bytes, cut: bool):
    """The body in pieces; ``cut``: half of it, a stall, then the connection broken (the client has read the half
    by then: a reset right after the write would discard it in the client's socket)."""
    half = len(body) // 2
    yield body[:half]
    if cut:
        await asyncio.sleep(0.5)  # the misbehaving network's stall, not a test's wait
        raise ConnectionAbortedError("cut on purpose")
    yield body[half:]
