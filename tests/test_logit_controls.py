"""logit_bias, repetition_penalty and min_tokens (issue 55 item 3): each against its reference on a tiny model,
the same with and without speculative decoding, and over HTTP."""

from __future__ import annotations

import torch

from justapi import LLM, SamplingParams
from hf_reference import hf_model

PROMPT = [(5 * i + 7) % 260 + 3 for i in range(12)]


def test_repetition_penalty_matches_transformers_greedy(tiny_model):
    """Greedy text under repetition_penalty 1.5 (prompt and output tokens, logits > 0 divided, < 0 multiplied)
    equals transformers' with its RepetitionPenaltyLogitsProcessor, token for token, and differs from plain."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ref, penalty = hf_model(tiny_model), RepetitionPenaltyLogitsProcessor(1.5)
    want = []
    with torch.no_grad():
        for _ in range(16):
            ids = torch.tensor([PROMPT + want])
            want.append(int(penalty(ids, ref(ids).logits[:, -1]).argmax()))
    llm = LLM(tiny_model, dtype="float32", pool_blocks=64, show_progress=False)
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    got = llm.generate([PROMPT], SamplingParams(repetition_penalty=1.5, **greedy))[0].token_ids
    assert got == want
    assert got != llm.generate([PROMPT], SamplingParams(**greedy))[0].token_ids


def test_logit_bias_and_min_tokens_hold_and_release_eos(tiny_model):
    """EOS biased by +100 ends a greedy output at once; with min_tokens 5 it is held back for five tokens, then
    ends it (finish_reason stop); a bias of -100 on the greedy choice moves greedy off it. The same tokens with
    prompt-lookup speculation and in a batch beside plain requests."""
    llm = LLM(tiny_model, dtype="float32", pool_blocks=64, show_progress=False)
    eos = llm.tokenizer.eos_token_id
    greedy = dict(temperature=0, max_tokens=12)
    at_once = llm.generate([PROMPT], SamplingParams(logit_bias=((eos, 100.0),), **greedy))[0]
    assert at_once.token_ids == [eos]
    held = SamplingParams(logit_bias=((eos, 100.0),), min_tokens=5, **greedy)
    out = llm.generate([PROMPT], held)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    plain = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **greedy))[0].token_ids
    banned = llm.generate([PROMPT], SamplingParams(ignore_eos=True, logit_bias=((plain[0], -100.0),), **greedy))
    assert banned[0].token_ids[0] != plain[0]
    spec = LLM(tiny_model, dtype="float32", pool_blocks=64, show_progress=False, spec_method="ngram", gamma=3)
    mixed = spec.generate([PROMPT, PROMPT], [held, SamplingParams(ignore_eos=True, repetition_penalty=1.3, **greedy)])
    assert mixed[0].token_ids == out.token_ids
    assert mixed[1].token_ids == llm.generate([PROMPT], SamplingParams(ignore_eos=True, repetition_penalty=1.3,
                                                                      **greedy))[0].token_ids


def test_controls_over_http(tiny_model, tmp_path):
    """The OpenAI fields as clients send them: logit_bias keyed by token-id strings, vLLM's min_tokens and
    repetition_penalty, streamed and not."""
    import httpx

    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--dtype", "float32"],
                          str(tmp_path / "s.log"))
    try:
        eos = srv.engine.tokenizer.eos_token_id
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": {str(eos): 100},
                "min_tokens": 5}
        r = httpx.post(srv.url + "/v1/completions", json=body).json()
        assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "stop"
        streamed = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
        assert '"completion_tokens":6' in streamed.text.replace(" ", "")
    finally:
        assert srv.stop() == 0
