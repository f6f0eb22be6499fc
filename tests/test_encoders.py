"""BERT-family encoders (issue 54 item 3): bert and nomic-bert GGUFs in llama.cpp's converter layout serve
/v1/embeddings (pooled as the file says) and, with a cross-encoder's head, /v1/rerank; held to transformers'
BertModel and NomicBertModel holding the same weights, and its BertTokenizerFast over the same vocabulary."""

from __future__ import annotations

import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.sampling_params import Pooling
from tiny_gguf import WORDPIECE, write_tiny_encoder

TEXTS = ["The cat sat on the mat, hello world!", "Paris is the capital of France.", "a dog", "Dogs? Cats!",
         "what is the capital of France, the cat sat on the mat and the dog sat on the cat's mat."]


def _hf_tokenizer(tmp_path):
    from transformers import BertTokenizerFast

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(WORDPIECE) + "\n")
    return BertTokenizerFast(str(vocab), do_lower_case=True)


def _hf_encoder(path: str, arch: str):
    """transformers' BertModel / NomicBertModel with the file's weights (mapped from llama.cpp's names)."""
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    from justapi.model.gguf_loader import load_tensors, open_gguf, read_model_config

    reader = open_gguf(path)
    cfg = read_model_config(reader, path)
    t = load_tensors(reader, path, torch.float32, False)
    sizes = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                 num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size, type_vocab_size=2,
                 layer_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.context_length)
    state = {"embeddings.word_embeddings.weight": t["token_embd.weight"],
             "embeddings.token_type_embeddings.weight": t["token_types.weight"],
             "embeddings.LayerNorm.weight": t["token_embd_norm.weight"],
             "embeddings.LayerNorm.bias": t["token_embd_norm.bias"]}
    if arch == "bert":
        model = BertModel(BertConfig(**sizes, hidden_act="gelu"), add_pooling_layer=False)
        state["embeddings.position_embeddings.weight"] = t["position_embd.weight"]
        names = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                 "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                 "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
        prefix = "encoder.layer"
    else:
        model = NomicBertModel(NomicBertConfig(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}))
        names = {"attn_output": "self_attn.o_proj", "attn_output_norm": "post_attention_layernorm",
                 "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
                 "layer_output_norm": "post_mlp_layernorm"}
        prefix = "layers"
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                if f"blk.{i}.{ours}.{kind}" in t:
                    state[f"{prefix}.{i}.{theirs}.{kind}"] = t[f"blk.{i}.{ours}.{kind}"]
        if arch == "nomic-bert":
            for name, part in zip(("q", "k", "v"), t[f"blk.{i}.attn_qkv.weight"].chunk(3)):
                state[f"layers.{i}.self_attn.{name}_proj.weight"] = part
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    return model.eval(), t


def test_wordpiece_tokenizer_rebuilt_from_the_file_matches_berts(tmp_path):
    """The vocabulary llama.cpp's converter rewrote (U+2581 before word-initial pieces, ## dropped) tokenizes as
    BERT's own WordPiece does: lowercased, punctuation split, continuations, [UNK], [CLS] ... [SEP]."""
    path = write_tiny_encoder(str(tmp_path / "bert.gguf"))
    llm = LLM(path, show_progress=False, pool_blocks=32)
    ref = _hf_tokenizer(tmp_path)
    for text in TEXTS + ["Ünknown wörds", "", "the [SEP] cat"]:
        assert llm.tokenizer.encode(text) == ref(text)["input_ids"], text
    legacy = write_tiny_encoder(str(tmp_path / "legacy.gguf"), legacy_specials=True)
    old = LLM(legacy, show_progress=False, pool_blocks=32).tokenizer
    assert [old.encode(t) for t in TEXTS] == [ref(t)["input_ids"] for t in TEXTS]  # [CLS] ... [SEP] all the same
    ids = ref(TEXTS[0])["input_ids"]
    assert (llm.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)
            == "the cat sat on the mat, hello world!")


@pytest.mark.parametrize("arch,pooling", [("bert", "mean"), ("bert", "cls"), ("nomic-bert", "mean")])
def test_encoder_embeddings_match_transformers(tmp_path, arch, pooling):
    """Each text's embedding, computed whole in one step though longer than a chunk (8) and batched with the
    others, equals transformers' pooled last_hidden_state, normalized, within 1e-5; alone, the same."""
    path = write_tiny_encoder(str(tmp_path / f"{arch}.gguf"), arch, pooling=pooling, seed=3)
    llm = LLM(path, dtype="float32", chunk_size=8, pool_blocks=64, show_progress=False)
    assert llm.engine.model_config.is_encoder and llm.engine.model_config.pooling == pooling
    model, _ = _hf_encoder(path, arch)
    ref_tok = _hf_tokenizer(tmp_path)
    got = llm.embed(TEXTS)
    for text, vec in zip(TEXTS, got):
        with torch.no_grad():
            h = model(torch.tensor([ref_tok(text)["input_ids"]])).last_hidden_state[0].double()
        want = h.mean(0) if pooling == "mean" else h[0]
        assert (torch.tensor(vec).double() - want / want.norm()).abs().max().item() < 1e-5, text
    assert llm.embed(TEXTS[-1:])[0] == pytest.approx(got[-1], abs=1e-6)
    assert len(ref_tok(TEXTS[-1])["input_ids"]) > 8  # longer than a chunk


def test_bert_cross_encoder_reranks_as_transformers_scores(tmp_path):
    """A cross-encoder (cls and cls.output, one label; pooling rank): each (query, document) pair as BERT pairs
    them ([CLS] q [SEP] d [SEP]), its [CLS] state through tanh(cls) and cls.output, scored by the sigmoid (vLLM's
    and sentence-transformers'): equal to transformers' BertModel with the same head, within 1e-5."""
    path = write_tiny_encoder(str(tmp_path / "rerank.gguf"), rerank=True, seed=5)
    llm = LLM(path, dtype="float32", chunk_size=8, pool_blocks=64, show_progress=False)
    model, t = _hf_encoder(path, "bert")
    ref_tok = _hf_tokenizer(tmp_path)
    query, docs = "what is the capital of France?", TEXTS
    got = llm.score(query, docs)
    for doc, score in zip(docs, got):
        ids = ref_tok(query, doc)["input_ids"]
        assert llm.engine.pair_prompt(query, doc) == ids
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0, 0]
            logit = torch.tanh(h @ t["cls.weight"].T + t["cls.bias"]) @ t["cls.output.weight"].T + t["cls.output.bias"]
        assert abs(score - torch.sigmoid(logit).item()) < 1e-5
    assert len(set(round(s, 5) for s in got)) == len(docs)


def test_an_encoder_refuses_what_it_cannot_serve_and_serves_over_http(tmp_path):
    """An encoder generates nothing: a completion is a 400 naming /v1/embeddings, --tp 2 is refused at start-up by
    name; /v1/embeddings (OpenAI's client) and /v1/rerank answer as the offline engine does."""
    import httpx
    import openai

    from server_helpers import InProcessServer

    path = write_tiny_encoder(str(tmp_path / "bert.gguf"))
    with pytest.raises(ValueError, match="--tp cannot serve an encoder"):
        LLM(path, tp=2, show_progress=False, pool_blocks=32)
    with pytest.raises(ValueError, match="--static-batching cannot serve an encoder"):
        LLM(path, static_batching=True, show_progress=False, pool_blocks=32)
    llm = LLM(path, dtype="float32", pool_blocks=32, show_progress=False)
    with pytest.raises(ValueError, match="encoder"):
        llm.generate(["the cat"], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="pooling 'rank' does not fit"):
        llm.generate(["the cat"], SamplingParams.for_embedding(Pooling("rank", normalize=False)))
    full = [2] + [5] * 62 + [3]  # the whole context (64): a pooling request outputs nothing, so it fits
    assert len(llm.embed([full])[0]) == 32
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.embed([full + [3]])
    want = llm.embed(TEXTS[:2])
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "32"], str(tmp_path / "e.log"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        got = client.embeddings.create(model=httpx.get(srv.url + "/v1/models").json()["data"][0]["id"],
                                       input=TEXTS[:2])
        assert [d.embedding for d in got.data] == [pytest.approx(v, abs=1e-5) for v in want]
        for route, body in (("/v1/completions", {"prompt": "the cat", "max_tokens": 2}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(srv.url + route, json=body)
            assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"], r.text
        ranked = httpx.post(srv.url + "/v1/rerank", json={"query": "a cat", "documents": TEXTS[:3]}).json()
        assert len(ranked["results"]) == 3  # an embedding encoder ranks by cosine similarity
    finally:
        assert srv.stop() == 0


def test_mixed_encoder_batches_give_each_prompt_its_vector_alone(tmp_path):
    """Prompts of every length, several a step and some over the step's token budget, each get the vector they get
    alone, bit for bit on the batch-invariant path (no prompt is ever split: attention sees the whole of it)."""
    path = write_tiny_encoder(str(tmp_path / "bert.gguf"), seed=7)
    llm = LLM(path, chunk_size=8, pool_blocks=64, batch_invariant=True, show_progress=False)
    alone = [llm.embed([t])[0] for t in TEXTS]
    params = SamplingParams.for_embedding(Pooling("mean"))
    together = llm.generate(TEXTS * 2, params)
    assert [r.outputs[0].embedding for r in together] == alone * 2
