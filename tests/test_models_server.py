"""Several models behind one server (server.models_app, engine.models): a real ``justapi serve`` with three tiny
models (one a broken file) from a --models-dir with a models.toml, each model in a process of its own, driven with
the openai and ollama client libraries."""

from __future__ import annotations


import httpx
import ollama
import openai
import pytest

from justapi import LLM, SamplingParams
from server_helpers import ServerProcess, labelled, undocumented_metrics
from tiny_gguf import write_tiny_model

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(str(folder / "alpha.gguf"), "llama", context_length=1024, seed=1)
    write_tiny_model(str(folder / "beta.gguf"), "qwen3", context_length=1024, seed=2)
    (folder / "broken.gguf").write_bytes(b"GGUF, but nothing a reader can parse")
    (folder / "models.toml").write_text('[aliases]\nchat = "alpha"\n\n[flags]\nbeta = ["--max-seqs", "4"]\n')
    return folder


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    srv = ServerProcess(["--models-dir", str(models_dir), "--max-loaded-models", "1", "--idle-unload", "600",
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
    file alone gives; with --max-loaded-models 1 the next model's first request unloads the idle one; a file that
    fails to load answers its requests with the reason, naming the model, and the others go on serving; the
    listings (OpenAI's, Ollama's) name every model with its state."""
    url = server.url
    assert states(url) == {"alpha": "unloaded", "beta": "unloaded", "broken": "unloaded"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    answer = lambda model: client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,  # noqa: E731
                                                     extra_body={"ignore_eos": True}).choices[0].text
    assert answer("chat") == greedy(str(models_dir / "alpha.gguf"))
    assert states(url)["alpha"] == "loaded"
    assert answer("beta") == greedy(str(models_dir / "beta.gguf"))
    assert states(url) == {"alpha": "unloaded", "beta": "loaded", "broken": "unloaded"}
    with pytest.raises(openai.APIStatusError) as failed:
        answer("broken")
    assert failed.value.status_code == 503
    assert "the model 'broken' failed to load" in failed.value.message and "GGUF" in failed.value.message
    assert answer("alpha")  # the others serve on
    with pytest.raises(openai.NotFoundError, match="'gamma' does not exist"):
        answer("gamma")
    listed = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert listed["alpha"]["aliases"] == ["chat"] and "failed to load" in listed["broken"]["error"]
    tags = ollama.Client(host=url).list()
    assert sorted(m.model for m in tags.models) == ["alpha:latest", "beta:latest", "broken:latest"]
    text = httpx.get(url + "/metrics").text
    assert labelled(text, "justapi_model_unloads_total", model="alpha", reason="evicted") == 1
    assert labelled(text, "justapi_model_load_failures_total", model="broken") == 1
    assert labelled(text, "justapi_model_state", model="alpha", state="loaded") == 1
    assert labelled(text, "justapi_requests_by_api_total", model="alpha", api="openai") == 1  # since it reloaded
    assert not undocumented_metrics(text)
