"""Rerankers and scoring (issue 54 item 3): a Qwen3-Reranker file as llama.cpp's converter writes it (pooling rank,
cls.output holding the head's "yes" and "no" rows, a rerank template) scored against transformers, and
/v1/rerank and /v1/score over HTTP in Jina's, Cohere's and vLLM's request shapes."""

from __future__ import annotations

import pytest
import torch

from justapi import LLM
from hf_reference import hf_model
from tiny_gguf import write_tiny_model

YES, NO = 100, 120  # the tiny vocabulary's stand-ins for "yes" and "no"
QUERY = "what sat on the mat?"
DOCS = ["the cat sat on the mat", "hello world", "a mat", "the answer is no"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("rerank") / "qwen3-reranker.gguf"), "qwen3",
                            rerank=(YES, NO), seed=4, tied=False)


def _reference_scores(path: str, prompts: list[list[int]]) -> list[float]:
    """transformers' Qwen3ForCausalLM on the same file: P(yes) against no at each prompt's last token."""
    ref = hf_model(path, head_dim=16)  # transformers ignores qwen3's key_length
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = ref(torch.tensor([ids])).logits[0, -1]
            out.append(torch.softmax(logits[[YES, NO]], -1)[0].item())
    return out


def test_qwen3_reranker_scores_match_transformers_in_a_generating_batch(reranker):
    """Each pair, as the file's rerank template fills it, scored through cls.output and a softmax over yes/no:
    within 1e-5 of transformers' P(yes); alone, or batched with generation, the same scores."""
    from justapi import SamplingParams

    llm = LLM(reranker, dtype="float32", pool_blocks=64, block_size=4, show_progress=False)
    assert llm.engine.model_config.pooling == "rank" and llm.engine.model_config.classifier_labels == ("yes", "no")
    prompts = [llm.engine.pair_prompt(QUERY, d) for d in DOCS]
    text = llm.tokenizer.decode(prompts[0], skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n<Query>: " + QUERY) and "<Document>: " + DOCS[0] in text
    got = llm.score(QUERY, DOCS)
    want = _reference_scores(reranker, prompts)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert len(set(round(s, 4) for s in got)) == len(DOCS)  # the documents are told apart
    from justapi.sampling_params import Pooling

    mixed = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
             *[SamplingParams.for_embedding(Pooling("rank", normalize=False))] * len(DOCS)]
    results = llm.generate([prompts[0][:7], *prompts], mixed)
    assert [r.outputs[0].embedding[0] for r in results[1:]] == pytest.approx(got, abs=1e-6)
    assert len(results[0].outputs[0].token_ids) == 6


def test_rerank_and_score_over_http_in_each_shape(reranker, tmp_path):
    """/v1/rerank with Jina's shape (strings, top_n, documents returned) and Cohere's (``{"text"}`` documents at
    /v2/rerank, return_documents false), /v1/score with vLLM's 1:N and N:N pairs (sent with OpenAI's client's
    generic post), every score equal to the offline engine's; clear 400s for bad requests, then it serves on."""
    import httpx
    import openai

    from server_helpers import InProcessServer

    want = LLM(reranker, dtype="float32", pool_blocks=64, show_progress=False).score(QUERY, DOCS)
    srv = InProcessServer(["--model", reranker, "--dtype", "float32", "--pool-blocks", "64"],
                          str(tmp_path / "rerank.log"))
    try:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        jina = httpx.post(srv.url + "/v1/rerank", json={"model": name, "query": QUERY, "documents": DOCS,
                                                        "top_n": 2}).json()
        best = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in jina["results"]] == best
        assert [r["relevance_score"] for r in jina["results"]] == pytest.approx([want[i] for i in best], abs=1e-5)
        assert [r["document"]["text"] for r in jina["results"]] == [DOCS[i] for i in best]
        assert jina["usage"]["total_tokens"] > 0 and jina["object"] == "list"
        cohere = httpx.post(srv.url + "/v2/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                          "return_documents": False}).json()
        assert sorted(r["index"] for r in cohere["results"]) == [0, 1, 2, 3]
        assert all("document" not in r for r in cohere["results"])
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        one_to_n = client.post("/score", body={"text_1": QUERY, "text_2": DOCS}, cast_to=object)
        assert [d["score"] for d in one_to_n["data"]] == pytest.approx(want, abs=1e-5)
        assert [d["index"] for d in one_to_n["data"]] == [0, 1, 2, 3] and one_to_n["data"][0]["object"] == "score"
        n_to_n = httpx.post(srv.url + "/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
        assert [d["score"] for d in n_to_n["data"]] == pytest.approx(want[:2], abs=1e-5)
        for path, body, words in [("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
                                  ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
                                  ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "x"}]}, "documents"),
                                  ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "1:N or N:N"),
                                  ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
                                  ("/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "nope"}, "nope"),
                                  ("/v1/embeddings", {"input": "hi"}, "reranker")]:
            r = httpx.post(srv.url + path, json=body)
            assert 400 <= r.status_code < 500 and words in r.json()["error"]["message"], (path, body, r.text)
        again = httpx.post(srv.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS[0]}).json()
        assert again["data"][0]["score"] == pytest.approx(want[0], abs=1e-5)
    finally:
        assert srv.stop() == 0


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path):
    """A model whose file pools for embeddings scores pairs by the cosine of their embeddings (vLLM's rule)."""
    import httpx
    import numpy as np

    from server_helpers import InProcessServer

    path = write_tiny_model(str(tmp_path / "embed.gguf"), "qwen3", pooling="mean", seed=6)
    vectors = LLM(path, dtype="float32", pool_blocks=32, show_progress=False).embed([QUERY] + DOCS[:2])
    want = [float(np.dot(vectors[0], v)) for v in vectors[1:]]  # unit vectors
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "32"], str(tmp_path / "e.log"))
    try:
        got = httpx.post(srv.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS[:2]}).json()
        assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-5)
    finally:
        assert srv.stop() == 0
