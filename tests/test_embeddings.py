"""Embeddings (issue 27 item 5): a decoder's final hidden states (after the last norm), pooled as the file says
(``{arch}.pooling_type``: last token or mean), L2-normalized; computed as prefill-only requests in the same batches
as generation; served at /v1/embeddings in OpenAI's shape."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.sampling_params import Pooling
from hf_reference import hf_model
from tiny_gguf import write_tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]  # chunks of 8: one to four per prompt


def _reference(path: str, kind: str) -> list[torch.Tensor]:
    """transformers' last_hidden_state (after the final norm) of each prompt alone, pooled, normalized (fp64)."""
    model = hf_model(path)
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            h = model.model(torch.tensor([ids])).last_hidden_state[0].double()
            v = h.mean(0) if kind == "mean" else h[-1]
            out.append(v / v.norm())
    return out


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_states_in_a_generating_batch(tmp_path, kind):
    """A tiny random model whose file says ``kind``: embeddings of prompts prefilled in chunks of 8, in one batch
    with generating requests, equal transformers' pooled states (fp32 path: within 1e-5), and the generating
    requests' text equals theirs alone. The prefix cache serves a repeated last-token embedding (not a mean one,
    which needs every row) and the vectors do not change; ``dimensions`` cuts, then normalizes."""
    path = write_tiny_model(str(tmp_path / f"embed-{kind}.gguf"), "llama", hidden=64, pooling=kind)
    llm = LLM(path, dtype="float32", chunk_size=8, pool_blocks=128, show_progress=False)
    assert llm.engine.model_config.pooling == kind
    want = _reference(path, kind)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen_prompts = [list(range(40, 60)), list(range(7, 12))]
    alone = [r.token_ids for r in llm.generate(gen_prompts, greedy)]
    embed = SamplingParams.for_embedding(Pooling(kind))
    mixed = llm.generate(gen_prompts + PROMPTS, [greedy] * 2 + [embed] * len(PROMPTS))
    assert [r.token_ids for r in mixed[:2]] == alone
    for r, w in zip(mixed[2:], want):
        got = torch.tensor(r.outputs[0].embedding, dtype=torch.float64)
        assert got.shape == (64,) and r.token_ids == [] and r.finish_reason == "stop"
        torch.testing.assert_close(got, w, atol=1e-5, rtol=0)
    again = llm.generate(PROMPTS, embed)
    assert all(r.num_cached_tokens > 0 for r in again[1:3]) == (kind == "last")
    for r, w in zip(again, want):
        torch.testing.assert_close(torch.tensor(r.outputs[0].embedding, dtype=torch.float64), w, atol=1e-5, rtol=0)
    raw = llm.embed(PROMPTS, normalize=False)
    cut = llm.embed(PROMPTS, dimensions=16)
    for full, short in zip(raw, cut):
        head = torch.tensor(full[:16], dtype=torch.float64)
        torch.testing.assert_close(torch.tensor(short, dtype=torch.float64), head / head.norm(), atol=1e-6, rtol=0)
    assert llm.engine.scheduler.pool.num_used == llm.engine.scheduler.num_cached_blocks  # nothing held but the cache


def test_embeddings_under_tensor_parallelism_and_packed_weights_match(tmp_path):
    """--dtype auto (packed 4-bit weights, bf16 compute where the CPU has it) stays close to the exact embedding;
    the pooled states come from the same forward pass as logits, so every path that computes logits serves them."""
    path = write_tiny_model(str(tmp_path / "embed-q4.gguf"), "llama", hidden=256, intermediate=256, num_heads=4,
                            num_kv_heads=2, qtype="Q4_0", weight_scale=0.05, pooling="mean")
    exact = LLM(path, dtype="float32", show_progress=False).embed(PROMPTS)
    auto = LLM(path, show_progress=False).embed(PROMPTS)
    for a, b in zip(exact, auto):
        assert float(np.dot(a, b)) > 0.999  # cosine of unit vectors
    tp = LLM(path, dtype="float32", tp=2, show_progress=False)
    try:
        for a, b in zip(exact, tp.embed(PROMPTS)):  # each rank's partial sums all-reduced: fp32 rounding apart
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        assert tp.engine.model.comm.calls > 0  # two ranks computed them
    finally:
        tp.engine.close()


def test_embeddings_endpoint_on_smollm2(real_model_path, tmp_path):
    """/v1/embeddings on SmolLM2 (no pooling type in its file: the last token), as OpenAI's client sends it: one
    input or several, float or base64 (the same vectors), ``dimensions``, usage; token-id inputs equal text ones;
    clear 4xx errors for bad requests, after which the server still serves."""
    import httpx
    import openai

    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", real_model_path, "--pool-blocks", "128"], str(tmp_path / "embed.log"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        texts = ["The cat sat on the mat.", "Paris is the capital of France.", "x"]
        floats = client.embeddings.create(model=name, input=texts, encoding_format="float")
        assert [d.index for d in floats.data] == [0, 1, 2] and len(floats.data[0].embedding) == 576
        assert all(abs(np.linalg.norm(d.embedding) - 1) < 1e-5 for d in floats.data)
        ids = srv.engine.tokenizer.encode(texts[1])
        assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(ids)
        b64 = httpx.post(srv.url + "/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(b64["data"][1]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, floats.data[1].embedding, atol=1e-6)
        by_ids = httpx.post(srv.url + "/v1/embeddings", json={"input": ids}).json()
        np.testing.assert_allclose(by_ids["data"][0]["embedding"], floats.data[1].embedding, atol=1e-5)
        short = client.embeddings.create(model=name, input=texts[0], dimensions=64)
        assert len(short.data[0].embedding) == 64 and abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5
        for body, status, words in [({"input": "hi", "dimensions": 0}, 400, "dimensions"),
                                    ({"input": "hi", "dimensions": 577}, 400, "dimensions"),
                                    ({"input": []}, 400, "input"), ({"input": ""}, 400, "input"),
                                    ({"input": "hi", "model": "nope"}, 404, "nope"),
                                    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
                                    ({"input": [10 ** 9]}, 400, "token")]:
            r = httpx.post(srv.url + "/v1/embeddings", json=body)
            assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
        again = client.embeddings.create(model=name, input=texts[0])
        np.testing.assert_allclose(again.data[0].embedding, floats.data[0].embedding, atol=1e-5)
    finally:
        assert srv.stop() == 0


def test_cls_pooling_takes_the_first_state_and_an_unknown_pooling_type_is_refused(tmp_path):
    """A file pooling by cls gets its first token's final state (as llama.cpp pools it, whatever the model),
    normalized, equal to transformers', also when the prompt is in the prefix cache; a pooling type llama.cpp does
    not define is refused at start-up, naming it and the ones it knows."""
    from justapi.model.gguf_loader import ModelLoadError
    from test_cli_and_inputs import rewrite_gguf

    path = write_tiny_model(str(tmp_path / "cls.gguf"), "llama", pooling="cls")
    llm = LLM(path, dtype="float32", show_progress=False, pool_blocks=32, block_size=4)
    got = llm.embed([PROMPTS[1]])[0]
    llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))  # the prompt's blocks now in the prefix cache
    assert llm.embed([PROMPTS[1]])[0] == got  # the first row is computed again, not taken from the cache
    static = LLM(path, dtype="float32", show_progress=False, pool_blocks=32, block_size=4, static_batching=True)
    static.generate([PROMPTS[1]], SamplingParams(max_tokens=2))
    assert static.embed([PROMPTS[1]])[0] == pytest.approx(got, abs=1e-6)
    with torch.no_grad():
        h = hf_model(path).model(torch.tensor([PROMPTS[1]])).last_hidden_state[0, 0].double()
    assert (torch.tensor(got).double() - h / h.norm()).abs().max().item() < 1e-5
    bad = rewrite_gguf(path, str(tmp_path / "bad.gguf"), replace_keys={"llama.pooling_type": 9})
    with pytest.raises(ModelLoadError, match=r"pooling_type 9 is not one of llama.cpp's: 0 \(none\), 1 \(mean\)"):
        LLM(bad, show_progress=False, pool_blocks=32)
