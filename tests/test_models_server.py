"""Several models behind one server (server.models_app, engine.models): a real ``justapi serve`` with three tiny
models (one a broken file) from a --models-dir with a models.toml, each model in a process of its own, driven with
the openai and ollama client libraries."""

from __future__ import annotations

import os
import signal

import httpx
import ollama
import openai
import pytest

from justapi import LLM, SamplingParams
from server_helpers import ServerProcess, labelled, undocumented_metrics, wait_until
from tiny_gguf import write_tiny_encoder, write_tiny_model

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(str(folder / "alpha.gguf"), "llama", context_length=1024, seed=1)
    write_tiny_model(str(folder / "beta.gguf"), "qwen3", context_length=1024, seed=2)
    write_tiny_encoder(str(folder / "embedder.gguf"))  # an embedding model beside the chat models
    (folder / "broken.gguf").write_bytes(b"GGUF, but nothing a reader can parse")
    # beta drafts with a tiny llama of the same vocabulary: a draft model of its own
    draft = write_tiny_model(str(tmp_path_factory.mktemp("draft") / "draft.gguf"), "llama", context_length=1024,
                             num_layers=1, seed=3)
    (folder / "models.toml").write_text(f'[aliases]\nchat = "alpha"\n\n[flags]\nbeta = ["--draft-model", "{draft}"]\n')
    return folder


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    srv = ServerProcess(["--models-dir", str(models_dir), "--max-loaded-models", "1", "--idle-unload", "3",
                         "--batch-invariant", "--pool-blocks", "128"], str(tmp_path_factory.mktemp("log") / "log"))
    yield srv
    srv.stop()


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}


def greedy(path: str) -> str:
    llm = LLM(path, batch_invariant=True, pool_blocks=128, show_progress=False)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text


def test_each_model_loads_on_demand_and_answers_as_it_does_alone(server, models_dir):
    """Nothing loads until asked; a model answers (through its alias too) with the greedy text an engine of that
    file alone gives, drafts with the draft model its models.toml flags name, an embedding model embeds beside
    them; with --max-loaded-models 1 the next model's first request unloads the idle one; a file that fails to load
    answers its requests with the reason, naming the model, and the others go on serving; the listings (OpenAI's,
    Ollama's) name every model with its state."""
    url = server.url
    assert states(url) == {"alpha": "unloaded", "beta": "unloaded", "broken": "unloaded", "embedder": "unloaded"}
    want = {name: greedy(str(models_dir / f"{name}.gguf")) for name in ("alpha", "beta")}
    # what no model's process serves, or no JSON, is answered here, and loads nothing
    assert httpx.post(url + "/healthz", json={"model": "alpha", "keep_alive": -1}).status_code == 404
    assert httpx.post(url + "/v1/completions", content=b"model=alpha&prompt=hi").status_code == 400
    assert set(states(url).values()) == {"unloaded"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=1)
    answer = lambda model: client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,  # noqa: E731
                                                     extra_body={"ignore_eos": True}).choices[0].text
    with pytest.raises(openai.APIStatusError) as failed:  # retried once by the client: the failure is remembered
        answer("broken")
    assert failed.value.status_code == 503
    assert "the model 'broken' failed to load" in failed.value.message and "GGUF" in failed.value.message
    assert answer("chat") == want["alpha"]  # the others serve
    assert states(url)["alpha"] == "loaded"
    vectors = [d.embedding for d in client.embeddings.create(model="embedder", input=["one", "two"]).data]
    alone = LLM(str(models_dir / "embedder.gguf"), batch_invariant=True, show_progress=False).embed(["one", "two"])
    assert max(abs(a - b) for v, w in zip(vectors, alone) for a, b in zip(v, w)) < 1e-5
    assert answer("beta") == want["beta"]
    assert states(url) == {"alpha": "unloaded", "beta": "loaded", "broken": "failed", "embedder": "unloaded"}
    with pytest.raises(openai.NotFoundError, match="'gamma' does not exist"):
        answer("gamma")
    listed = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert listed["alpha"]["aliases"] == ["chat"] and "failed to load" in listed["broken"]["error"]
    tags = ollama.Client(host=url).list()
    assert sorted(m.model for m in tags.models) == ["alpha:latest", "beta:latest", "broken:latest", "embedder:latest"]
    text = httpx.get(url + "/metrics").text
    assert labelled(text, "justapi_model_unloads_total", model="alpha", reason="evicted") == 1
    assert labelled(text, "justapi_model_load_failures_total", model="broken") == 1
    assert labelled(text, "justapi_model_state", model="beta", state="loaded") == 1
    assert labelled(text, "justapi_requests_by_api_total", model="beta", api="openai") == 1
    assert labelled(text, "justapi_spec_draft_tokens_total", model="beta") > 0  # its draft at work, lossless
    assert "text/html" in httpx.get(url + "/dashboard?model=beta").headers["content-type"]  # a model's dashboard
    with httpx.stream("GET", url + "/dashboard/events?model=beta", timeout=30) as events:
        assert events.status_code == 200 and next(events.iter_lines()) == "retry: 2000"
    assert not undocumented_metrics(text)


def model_health(url: str, name: str) -> dict:
    return next(m for m in httpx.get(url + "/health").json()["models"] if m["name"] == name)


def test_idle_models_unload_and_a_dead_process_restarts(server):
    """Ollama's keep_alive 0 unloads a model after its answer, an empty /api/generate loads it (and with keep_alive
    0 unloads it at once); a model whose process dies mid-stream ends that stream, and its next request starts it
    again; --idle-unload: a model unloads once idle that long."""
    url = server.url
    client = ollama.Client(host=url)
    assert client.generate(model="alpha", prompt="one", options={"num_predict": 3}, keep_alive=0).done
    wait_until(lambda: model_health(url, "alpha")["state"] == "unloaded", 30, "the unload after keep_alive 0")
    assert client.generate(model="beta", prompt="").done_reason == "load"
    assert model_health(url, "beta")["state"] == "loaded"
    assert client.generate(model="beta", prompt="", keep_alive=0).done_reason == "unload"
    assert model_health(url, "beta")["state"] == "unloaded"

    body = {"model": "alpha", "prompt": "stream", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(model_health(url, "alpha")["pid"], signal.SIGKILL)
        with pytest.raises(httpx.RemoteProtocolError):  # broken off where the process died: not a whole answer
            list(lines)
    wait_until(lambda: model_health(url, "alpha")["state"] == "failed", 30, "the death noticed")
    assert "exited with status -9" in model_health(url, "alpha")["error"]
    again = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert again.completions.create(model="alpha", prompt="again", max_tokens=3).choices[0].text is not None
    assert model_health(url, "alpha")["state"] == "loaded"
    wait_until(lambda: model_health(url, "alpha")["state"] == "unloaded", 30, "the idle unload (3 s)")
    text = httpx.get(url + "/metrics").text
    assert labelled(text, "justapi_model_unloads_total", model="alpha", reason="keep_alive") == 1
    assert labelled(text, "justapi_model_unloads_total", model="alpha", reason="died") == 1
    assert labelled(text, "justapi_model_unloads_total", model="alpha", reason="idle") == 1
    assert labelled(text, "justapi_model_unloads_total", model="beta", reason="keep_alive") == 1
