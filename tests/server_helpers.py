"""Start and stop real ``justapi serve`` processes on loopback ports for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
                self.health_statuses.add(status)
                if status == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.read_log()}")

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


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text, parsed with prometheus-client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    raise KeyError(name)
