"""Fill-in-the-middle (issue 55 item 3): completions' ``suffix`` and llama.cpp's /infill on a model with FIM
tokens, the prompt in PSM order; refused by name on a model without them."""

from __future__ import annotations

import json

import httpx

from justapi import LLM, SamplingParams
from tiny_gguf import FIM_TOKENS, write_tiny_model


def test_suffix_and_infill_build_the_psm_prompt(tmp_path):
    from server_helpers import InProcessServer

    path = write_tiny_model(str(tmp_path / "coder.gguf"), "qwen2", fim=True, seed=3)
    llm = LLM(path, dtype="float32", pool_blocks=32, show_progress=False)
    tok = llm.tokenizer
    ids = llm.engine.fim_prompt("def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    pre, suf, mid, sep = (tok.encode(t, add_special_tokens=False)[0] for t in FIM_TOKENS)
    assert ids[0] == pre and ids[-1] == mid and suf in ids
    assert tok.decode(ids[1:ids.index(suf)]) == "def add(a, b):\n    return "
    with_files = llm.engine.fim_prompt("x", "y", [("util.py", "z = 1")], "ret")
    assert with_files[0] == sep and tok.decode(with_files[1:with_files.index(pre)]) == "util.py\nz = 1"
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "32"], str(tmp_path / "s.log"))
    try:
        body = {"prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))", "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body).json()
        assert r["choices"][0]["text"] == want and r["usage"]["prompt_tokens"] == len(ids)
        infill = {"input_prefix": body["prompt"], "input_suffix": body["suffix"], "n_predict": 6, "temperature": 0}
        whole = httpx.post(srv.url + "/infill", json=infill).json()
        assert whole["content"] == want and whole["stop"] and whole["tokens_evaluated"] == len(ids)
        streamed = httpx.post(srv.url + "/infill", json={**infill, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
        assert "".join(c["content"] for c in chunks) == want and chunks[-1]["stop"]
    finally:
        assert srv.stop() == 0


def test_a_model_without_fim_tokens_refuses_suffix(tiny_model, tmp_path):
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "32"], str(tmp_path / "s.log"))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2})
        assert r.status_code == 400 and "fill-in-the-middle tokens" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0
