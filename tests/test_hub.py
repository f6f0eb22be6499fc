"""Models by name (justapi.hub): ``justapi pull`` and ``--model hf:`` as real processes against a local server that
speaks the hub's file API (tests/hub_server.py, through ``HF_ENDPOINT``): the quantization chosen by name, a transfer
cut midway resumed with a Range request, a wrong checksum refused and its download removed, the cache served
offline, and an unreachable hub said in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hub_server import HubServer
from tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> bytes:
    path = write_tiny_model(str(tmp_path_factory.mktemp("hub") / "tiny.gguf"), "llama", context_length=256, seed=4)
    with open(path, "rb") as f:
        return f.read()


def justapi(args: list[str], endpoint: str, home: str) -> subprocess.CompletedProcess:
    offline = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # conftest's, for transformers: not for a hub client
    env = {k: v for k, v in os.environ.items() if k not in offline}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=home, HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "justapi.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_pull_chooses_resumes_and_checks(gguf, tmp_path):
    """The default quantization (Q4_K_M) or the one named; a transfer cut at half resumed from there (the server
    sees a Range request) into a file equal to the hub's; a file whose bytes do not match the listed SHA-256
    refused, nothing of it left in the cache; an unknown quantization named with what the repository has."""
    big = gguf + bytes(range(256)) * (96 * 1024)  # 24 MiB: cut past huggingface_hub's first 10 MiB read
    repos = {"org/tiny-GGUF": {"tiny-Q4_K_M.gguf": big, "tiny-Q8_0.gguf": gguf + b"\0" * 64, "README.md": b"hi"},
             "org/bad-GGUF": {"bad-Q4_K_M.gguf": gguf}}
    home = str(tmp_path / "hf")
    with HubServer(repos, cut_first={"tiny-Q4_K_M.gguf"}, wrong_sha={"bad-Q4_K_M.gguf"}) as hub:
        done = justapi(["pull", "org/tiny-GGUF"], hub.url, home)
        assert done.returncode == 0, done.stderr
        path = done.stdout.strip()
        assert path.endswith("tiny-Q4_K_M.gguf") and open(path, "rb").read() == big
        ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("tiny-Q4_K_M.gguf")]
        assert len(ranges) == 2 and ranges[0] is None  # resumed from what it had read:
        assert ranges[1].startswith("bytes=") and 0 < int(ranges[1][6:].rstrip("-")) <= len(big) // 2

        q8 = justapi(["pull", "org/tiny-GGUF:Q8_0"], hub.url, home)
        assert q8.returncode == 0 and open(q8.stdout.strip(), "rb").read() == repos["org/tiny-GGUF"]["tiny-Q8_0.gguf"]

        bad = justapi(["pull", "org/bad-GGUF"], hub.url, home)
        assert bad.returncode == 2 and "checksum mismatch" in bad.stderr and len(bad.stderr.splitlines()) == 1
        assert not [f for _, _, fs in os.walk(home) for f in fs if "bad" in f or f.endswith(".incomplete")]

        missing = justapi(["pull", "org/tiny-GGUF:IQ2_XXS"], hub.url, home)
        assert missing.returncode == 2 and "no .gguf file for IQ2_XXS; it has: tiny-Q4_K_M.gguf, tiny-Q8_0.gguf" \
            in missing.stderr
        unknown = justapi(["pull", "org/nothing-here"], hub.url, home)
        assert unknown.returncode == 2 and "org/nothing-here" in unknown.stderr


def test_the_cache_serves_offline_and_hf_models_load(gguf, tmp_path):
    """With the hub unreachable, a pulled repository is served from the cache (``--model hf:`` too: the model
    generates), and one never pulled is a one-line error naming the hub."""
    home = str(tmp_path / "hf")
    with HubServer({"org/tiny-GGUF": {"tiny-Q4_K_M.gguf": gguf}}) as hub:
        assert justapi(["pull", "org/tiny-GGUF"], hub.url, home).returncode == 0
    gone = hub.url  # nothing listens there now
    cached = justapi(["pull", "org/tiny-GGUF"], gone, home)
    assert cached.returncode == 0 and open(cached.stdout.strip(), "rb").read() == gguf
    generated = justapi(["generate", "--model", "hf:org/tiny-GGUF", "--prompt", "hello", "--max-tokens", "3"], gone,
                        home)
    assert generated.returncode == 0, generated.stderr
    never = justapi(["pull", "org/other-GGUF"], gone, home)
    assert never.returncode == 2 and f"cannot reach the hub at {gone}" in never.stderr
    assert "org/other-GGUF is not in the cache" in never.stderr
