"""``justapi serve`` for the server tests, on loopback ports: in this process (InProcessServer, the CLI's own flags,
engine and app, served by uvicorn from a thread) or as a real child process (ServerProcess, for the end-to-end test).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``justapi serve`` child process; ``url`` is its base URL once it answers /health."""

    def __init__(self, args: list[str], log_path: str, timeout_s: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "justapi.cli", "serve", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        self.health_statuses: set[int] = set()  # what /health answered while the server started

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                return False
            self.health_statuses.add(status)
            return status == 200

        try:
            wait_until(healthy, timeout_s, "the server's /health")
        except AssertionError:
            self.stop()
            raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.read_log()}") from None

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class InProcessServer:
    """``justapi serve ARGS`` run inside the test process: the same flag parsing, engine, app and HTTP stack as the
    command, without a new interpreter importing torch and loading the kernels again.

    ``on_engine(engine)`` runs on the loaded engine before it serves (to instrument it). The server's log lines go
    to ``log_path``. ``stop()`` shuts it down as SIGTERM would and answers 0 when it ended cleanly.
    """

    def __init__(self, args: list[str], log_path: str, timeout_s: float = 120, on_engine=None) -> None:
        import logging
        import threading

        import torch
        import uvicorn

        from justapi import startup

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.engine = None

        def keep(engine):
            if on_engine is not None:
                on_engine(engine)
            self.engine = engine

        self._threads = torch.get_num_threads()  # --threads sets the process-wide count: restored on stop
        self._logger = logging.getLogger("justapi")
        self._level = self._logger.level
        self._handler = logging.FileHandler(log_path)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.INFO)
        parsed = startup.build_parser().parse_args(["serve", "--port", str(self.port), *args])
        app, _ = startup.serve_app(parsed, on_engine=keep)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, access_log=False,
                                                    log_config=None, log_level="warning",
                                                    timeout_graceful_shutdown=5, **startup.uvicorn_stack()))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name=f"justapi-serve-{self.port}", daemon=True)
        self.thread.start()
        self.health_statuses: set[int] = set()

        def healthy() -> bool:
            if not self.thread.is_alive():
                self.stop()
                raise RuntimeError(f"server ended ({self.error!r}):\n{self.read_log()}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
            except httpx.HTTPError:
                return False
            self.health_statuses.add(health.status_code)
            if "failed to load" in health.text:
                self.stop()
                raise RuntimeError(f"{health.json()['error']['message']}:\n{self.read_log()}")
            return health.status_code == 200

        try:
            wait_until(healthy, timeout_s, "the server's /health")
        except AssertionError:
            self.stop()
            raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.read_log()}") from None

    def _serve(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # reported by stop() and the start-up wait
            self.error = e

    def read_log(self) -> str:
        self._handler.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout_s: float = 30) -> int:
        """Shut down (close connections, stop the engine loop); 0 when the server thread ended cleanly."""
        import torch

        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        if self._handler in self._logger.handlers:
            self._logger.removeHandler(self._handler)
            self._handler.close()
            self._logger.setLevel(self._level)
            torch.set_num_threads(self._threads)
        return 0 if not self.thread.is_alive() and self.error is None and self.server.started else 1


def slow_steps(seconds: float, gate: threading.Event | None = None):
    """An ``on_engine`` that makes each step take ``seconds`` more (while ``gate`` is set, if given)."""

    def instrument(engine):
        step = engine.step

        def slowed():
            if gate is None or gate.is_set():
                time.sleep(seconds)
            return step()

        engine.step = slowed

    return instrument


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text, parsed with prometheus-client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    raise KeyError(name)


def labelled(text: str, name: str, **labels) -> float:
    """The value of the sample of ``name`` with exactly these labels in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise KeyError((name, labels))


def documented_metrics() -> set[str]:
    """The metric names docs/metrics.md's table lists."""
    page = (pathlib.Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", page, flags=re.M))


def undocumented_metrics(text: str) -> set[str]:
    """Names in a /metrics text that docs/metrics.md does not list (histograms by their family name)."""
    from prometheus_client.parser import text_string_to_metric_families

    documented, out = documented_metrics(), set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # prometheus_client's own creation times
            name = re.sub(r"_(bucket|sum|count)$", "", sample.name) if family.type == "histogram" else sample.name
            if name not in documented:
                out.add(name)
    return out


def dashboard_events(url: str, n: int, headers=None) -> list[dict]:
    """The first ``n`` messages of a server's dashboard event stream (/dashboard/events)."""
    messages = []
    with httpx.stream("GET", url + "/dashboard/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                messages.append(json.loads(line[6:]))
                if len(messages) == n:
                    break
    return messages


def wait_until(condition, timeout_s: float = 60, what: str = "the condition"):
    """Poll ``condition()`` until it returns something truthy (returned), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(0.05)
