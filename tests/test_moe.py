"""Mixtures of experts (issue 27 item 3): qwen2moe (a shared expert with a sigmoid gate, raw top-k weights) and
qwen3moe (renormalized top-k weights, QK norm), held to transformers on tiny random GGUFs; experts sharded across
tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.model.moe import MoeWeights, moe_mlp
from hf_reference import hf_model
from paged_helpers import paged_prefill_logits
from test_model import load_model
from tiny_gguf import write_tiny_model

IDS = [(7 * i + 3) % 260 + 3 for i in range(45)]


def _tiny(tmp_path, arch: str, **kw) -> str:
    return write_tiny_model(str(tmp_path / f"{arch}.gguf"), arch, hidden=64, intermediate=32, num_experts=8,
                            experts_used=2, seed=11, **kw)


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_tiny_moe_matches_transformers(tmp_path, arch):
    """Prefill logits (chunks of 6 through 4-token blocks) within 1e-5 of the largest of transformers'
    Qwen2MoeForCausalLM /
    Qwen3MoeForCausalLM (its GGUF loader does not read the experts' widths: given as the file states them), and
    greedy text equal when decoded by the engine."""
    path = _tiny(tmp_path, arch)
    model = load_model(path)
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_used) == (8, 2) and model.layers[0].mlp.weights is not None
    assert (model.layers[0].mlp.weights.shared_gate_up is not None) == (arch == "qwen2moe")
    overrides = dict(moe_intermediate_size=32)
    if arch == "qwen2moe":
        overrides["shared_expert_intermediate_size"] = 32
    else:
        overrides["head_dim"] = cfg.head_dim
    ref_model = hf_model(path, **overrides)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    # experts' outputs are summed in another order than transformers' (grouped by expert): fp32 rounding only
    got = paged_prefill_logits(model, IDS, block_size=4, chunk=6)
    assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    want = []
    with torch.no_grad():
        for _ in range(16):
            want.append(int(ref_model(torch.tensor([IDS[:5] + want])).logits[0, -1].argmax()))
    llm = LLM(path, dtype="float32", pool_blocks=64, show_progress=False)
    assert llm.generate([IDS[:5]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids == want


def test_tokens_are_grouped_by_expert_and_weighted_as_one_token_at_a_time():
    """moe_mlp groups a batch's (token, expert) pairs by expert: the result equals each token computed alone with
    its own top-k experts (a per-token loop, the reference), and a rank holding half the experts gives its half."""
    g = torch.Generator().manual_seed(0)
    experts, hidden, ff = 6, 16, 8
    w = MoeWeights(torch.randn(experts, hidden, generator=g), torch.randn(experts, 2 * ff, hidden, generator=g),
                   torch.randn(experts, hidden, ff, generator=g), 0, 2, True)
    h = torch.randn(9, hidden, generator=g)
    act = torch.nn.functional.silu

    def one(x, keep=range(experts)):
        p = torch.softmax(w.router @ x, -1)
        top, idx = p.topk(2)
        top = top / top.sum()
        out = torch.zeros(hidden)
        for weight, e in zip(top, idx.tolist()):
            if e in keep:
                gate, up = (w.gate_up[e] @ x).chunk(2)
                out += weight * (w.down[e] @ (act(gate) * up))
        return out

    torch.testing.assert_close(moe_mlp(h, w, act), torch.stack([one(x) for x in h]), atol=1e-5, rtol=1e-5)
    half = MoeWeights(w.router, w.gate_up[3:], w.down[3:], 3, 2, True)
    torch.testing.assert_close(moe_mlp(h, half, act), torch.stack([one(x, range(3, 6)) for x in h]),
                               atol=1e-5, rtol=1e-5)


def test_moe_experts_split_across_two_ranks_give_one_ranks_text(tmp_path):
    """--tp 2: each rank reads and holds only its 4 of the 8 experts (and its heads), rank 0 adds the shared
    expert; greedy text equals one rank's."""
    from test_families import assert_tp2_gives_one_ranks_text

    def check(model, cfg):
        moe = model.layers[0].mlp.weights
        assert len(moe.gate_up) == 4 and moe.first_expert == 0 and moe.shared_gate_up is not None

    assert_tp2_gives_one_ranks_text(_tiny(tmp_path, "qwen2moe"), check)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_quantized_experts_stay_packed_one_weight_per_expert(tmp_path, qtype):
    """--dtype auto keeps each expert of a Q4_K or Q8_0 stack packed (4- or 8-bit, through the same kernel routes
    as any linear), reads only its own experts under --tp 2, holds fewer bytes than the dense stack, and stays
    within a small KL of the exact path."""
    from justapi.model.quant import Int4Weight, Int8Weight

    path = write_tiny_model(str(tmp_path / f"moe-{qtype}.gguf"), "qwen3moe", hidden=256, intermediate=256,
                            num_heads=4, num_kv_heads=2, qtype=qtype, weight_scale=0.05, num_experts=4,
                            experts_used=2, seed=2)
    opts = dict(pool_blocks=64, show_progress=False)
    exact = LLM(path, dtype="float32", **opts)
    auto = LLM(path, **opts)
    moe = auto.engine.model.layers[0].mlp.weights
    kind = Int4Weight if qtype == "Q4_K" else Int8Weight
    assert len(moe.gate_up) == 4 and all(isinstance(w, kind) for w in moe.gate_up + moe.down)
    assert moe.gate_up[0].shape == (512, 256) and moe.down[0].shape == (256, 256)
    dense_bytes = 3 * 4 * 256 * 256 * 2  # the three bf16 stacks
    packed_bytes = sum(t.numel() * t.element_size() for w in moe.gate_up + moe.down for t in w.forms().values())
    assert packed_bytes < dense_bytes
    ids = IDS[:30]
    a = torch.log_softmax(paged_prefill_logits(exact.engine.model, ids), -1)
    b = torch.log_softmax(paged_prefill_logits(auto.engine.model, ids), -1)
    assert (a.exp() * (a - b)).sum(-1).max().item() < 0.02
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    want = auto.generate([ids], params)[0].outputs[0].logprobs[0].top
    tp = LLM(path, tp=2, **opts)
    try:
        half = tp.engine.model.layers[0].mlp.weights
        assert len(half.gate_up) == 2 and all(isinstance(w, kind) for w in half.gate_up)
        got = tp.generate([ids], params)[0].outputs[0].logprobs[0].top
        assert [t for t, _ in got][:2] == [t for t, _ in want][:2]
    finally:
        tp.engine.close()
