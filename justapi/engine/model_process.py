"""One model of a several-model server (engine.models) in a process of its own: a ``justapi serve`` of that model
alone on a loopback port, started, waited on until it serves, and stopped. A process per model keeps a model that
fails to load or dies from taking the others with it, and gives its memory back to the system when it unloads.

The child's log lines pass through to the server's stderr, each prefixed with the model's name; the last of them
explain a child that exits before it serves.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import sys
import time

import httpx

LOG_TAIL_LINES = 20  # a child's last log lines kept to explain its failure
STOP_GRACE_S = 10.0  # seconds a stopping child has to exit before it is killed


class LoadFailed(Exception):
    """The model's process exited, or answered that its model failed to load: the message says why."""


def free_port() -> int:
    """A loopback port nothing listens on now (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ModelProcess:
    """A started child serving one model at ``url``."""

    def __init__(self, name: str, argv: list[str]) -> None:
        """``argv``: ``justapi serve``'s flags for the child, without --host and --port (added here)."""
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "justapi.cli", "serve", *argv, "--host", "127.0.0.1",
                     "--port", str(self.port)]
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._logs: asyncio.Task | None = None

    async def start(self, timeout_s: float) -> float:
        """Start the child and wait until it serves; the seconds it took. LoadFailed where it exits first, answers
        that its model failed, or is not serving within ``timeout_s`` (it is stopped then)."""
        started = time.monotonic()
        # a session of its own: stopping it stops whatever it started too (worker processes, ranks)
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self._logs = asyncio.create_task(self._pass_logs())
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    problem = await self._health(client)
                    if problem is None:
                        await self._check_identity(client)
                        return time.monotonic() - started
                    if problem != "loading":
                        raise LoadFailed(problem)
                    if time.monotonic() - started > timeout_s:
                        raise LoadFailed(f"not serving after {timeout_s:.0f} s")
                    await asyncio.sleep(0.1)
        except BaseException:
            await self.stop()
            raise

    async def _health(self, client: httpx.AsyncClient) -> str | None:
        """None: serving; "loading"; or why it never will."""
        assert self.proc is not None
        if self.proc.returncode is not None:
            await self._logs_read()
            return f"its process exited with status {self.proc.returncode}{self._last_error()}"
        try:
            r = await client.get(f"{self.url}/health")
        except httpx.TransportError:
            return "loading"  # not listening yet
        if r.status_code == 200:
            return None
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"/health answered {r.status_code}"
        return "loading" if message == "the model is loading" else message

    async def _check_identity(self, client: httpx.AsyncClient) -> None:
        """The server on the port is this model's (another process may have taken the port meanwhile)."""
        try:
            names = [m["id"] for m in (await client.get(f"{self.url}/v1/models")).json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            names = []
        if self.name not in names:
            raise LoadFailed(f"another server answers on its port {self.port}")

    def _last_error(self) -> str:
        """The child's own one-line error (``justapi: error: ...``) or its last log line, for a failure message."""
        for line in reversed(self.tail):
            if "error" in line.lower():
                return f": {line.removeprefix('justapi: error: ')}"
        return f": {self.tail[-1]}" if self.tail else ""

    async def _pass_logs(self) -> None:
        """The child's stderr, line by line, read in blocks (a line of any length never stops the reading, which
        would block the child once the pipe is full)."""
        assert self.proc is not None and self.proc.stderr is not None
        pending = b""
        while block := await self.proc.stderr.read(1 << 16):
            *lines, pending = (pending + block).split(b"\n")
            for raw in lines:
                self._log_line(raw)
            if len(pending) > 1 << 16:
                self._log_line(pending)
                pending = b""
        if pending:
            self._log_line(pending)

    def _log_line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        self.tail.append(line[:2000])
        print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    async def _logs_read(self) -> None:
        """Wait (a little) for the child's last log lines."""
        if self._logs is not None:
            await asyncio.wait([self._logs], timeout=5)

    @property
    def exited(self) -> int | None:
        """The child's exit status once it has exited (None while it runs)."""
        return None if self.proc is None else self.proc.returncode

    async def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after STOP_GRACE_S) and wait for it."""
        if self.proc is None or self.proc.returncode is not None:
            self._signal_group(signal.SIGKILL)  # what it started may outlive it
            return
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
        except asyncio.TimeoutError:
            self._signal_group(signal.SIGKILL)
            await self.proc.wait()
        await self._logs_read()

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # gone already
