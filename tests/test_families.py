"""Dense families beyond Llama and Gemma 3 (issue 27 item 4), each a small declarative difference (model_config.ARCHS,
and what the file states), held to transformers on tiny random GGUFs: phi3 (fused Q/K/V and gate/up tensors),
gemma2 (soft-capped attention and logits, a window on every other layer) and a Mistral-style window on llama."""

from __future__ import annotations

import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import ModelLoadError
from hf_reference import hf_model
from paged_helpers import paged_prefill_logits
from test_model import load_model
from tiny_gguf import write_tiny_model

IDS = [(7 * i + 3) % 260 + 3 for i in range(45)]  # 45 tokens: many 4-token blocks, several 6-token chunks


def _greedy_by_whole_passes(ref_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each token from a whole forward pass (its own cache plays no part)."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(ref_model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def _engine_greedy(path: str, prompt: list[int], n: int, **options) -> list[int]:
    llm = LLM(path, pool_blocks=64, block_size=4, show_progress=False, **options)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_phi3_matches_transformers(tmp_path, tied):
    """Phi-3's attn_qkv and ffn_up (gate then up, twice the rows) are read as stored: prefill logits within 1e-4 of
    transformers' Phi3ForCausalLM, and greedy text equal on the default (packed-weight, C++ kernel) engine too."""
    path = write_tiny_model(str(tmp_path / "phi3.gguf"), "phi3", tied=tied, seed=5)
    model = load_model(path)
    assert model.config.arch == "phi3" and model.layers[0].mlp.gate_up.shape[0] == 2 * model.config.intermediate_size
    ref_model = hf_model(path, pad_token_id=0)  # Phi3Config's default pad id (32000) is past the tiny vocabulary
    assert type(ref_model).__name__ == "Phi3ForCausalLM"
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4
    assert _engine_greedy(path, IDS[:5], 16, dtype="float32") == _greedy_by_whole_passes(ref_model, IDS[:5], 16)


def test_tiny_gemma2_matches_transformers_with_soft_caps(tmp_path):
    """Gemma 2: soft-capped attention scores (50) and logits (30), a window of 8 on layers 0, 2, 4 and global
    attention on 1, 3, 5, Gemma's norms and scaling, against transformers' Gemma2ForCausalLM (eager attention, the
    one that caps), prefilled in chunks and decoded past the window; without the caps the logits differ."""
    path = write_tiny_model(str(tmp_path / "gemma2.gguf"), "gemma2", tokenizer="llama", num_layers=6, seed=3,
                            weight_scale=0.6)
    model = load_model(path)
    assert [layer.attn.window for layer in model.layers] == [8, None] * 3
    assert (model.config.attn_softcap, model.config.final_softcap) == (50.0, 30.0)
    ref_model = hf_model(path, query_pre_attn_scalar=model.config.head_dim, attn_implementation="eager")
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    got = paged_prefill_logits(model, IDS, block_size=4, chunk=6)
    assert (got - ref).abs().max().item() < 1e-4
    uncapped = load_model(path)
    uncapped.config = type(model.config)(**{**vars(model.config), "attn_softcap": None, "final_softcap": None})
    assert (paged_prefill_logits(uncapped, IDS, block_size=4, chunk=6) - ref).abs().max().item() > 1e-2
    prompt = IDS[:5]
    assert _engine_greedy(path, prompt, 24) == _greedy_by_whole_passes(ref_model, prompt, 24)


def test_a_llama_file_with_a_sliding_window_attends_like_mistral(tmp_path):
    """A llama file carrying llama.attention.sliding_window (Mistral 7B v0.1's kind) attends through that window
    on every layer, in every attention path: logits against transformers' MistralForCausalLM holding the same
    weights with the same window (transformers reads llama files as LlamaForCausalLM, without one), and greedy
    text past the window with the C++ decode kernel."""
    from transformers import MistralConfig, MistralForCausalLM

    path = write_tiny_model(str(tmp_path / "mistral.gguf"), "llama", llama_window=8, seed=7)
    model = load_model(path)
    assert [layer.attn.window for layer in model.layers] == [8, 8]
    llama = hf_model(path)
    fields = {k: v for k, v in llama.config.to_dict().items() if k not in ("architectures", "model_type")}
    ref_model = MistralForCausalLM(MistralConfig(**{**fields, "sliding_window": 8})).eval()
    ref_model.load_state_dict(llama.state_dict())
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
        plain = llama(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4
    assert (plain - ref).abs().max().item() > 1e-2  # the window matters at this length
    prompt = IDS[:5]
    assert _engine_greedy(path, prompt, 24, dtype="float32") == _greedy_by_whole_passes(ref_model, prompt, 24)


def assert_tp2_gives_one_ranks_text(path: str, check_shard) -> None:
    """Greedy text of two prompts (fp32) under --tp 2 equals one rank's; ``check_shard(model, config)`` first looks
    at what rank 0 holds."""
    opts = dict(pool_blocks=64, dtype="float32", show_progress=False)
    prompts = [IDS[:7], IDS[10:30]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [r.token_ids for r in LLM(path, **opts).generate(prompts, params)]
    llm = LLM(path, tp=2, **opts)
    try:
        check_shard(llm.engine.model, llm.engine.model_config)
        assert [r.token_ids for r in llm.generate(prompts, params)] == want
    finally:
        llm.engine.close()


def test_phi3_under_tensor_parallelism_gives_one_ranks_text(tmp_path):
    """--tp 2 cuts Phi-3's fused attn_qkv (each rank's Q, K and V rows) and ffn_up (its gate and up rows) out of
    the stored tensors: greedy text equals one rank's."""
    def check(model, cfg):
        layer = model.layers[0]
        assert layer.attn.qkv.shape[0] == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // 2
        assert layer.mlp.gate_up.shape[0] == cfg.intermediate_size

    assert_tp2_gives_one_ranks_text(write_tiny_model(str(tmp_path / "phi3.gguf"), "phi3", seed=5), check)


def test_a_file_with_rope_factors_fails_in_one_line(tmp_path):
    """Per-frequency RoPE factors (Phi-3 128k's rope_factors_long) are refused at start-up, naming the tensor."""
    import numpy as np

    from justapi.model.gguf_loader import open_gguf, read_model_config
    from test_cli_and_inputs import rewrite_gguf

    path = write_tiny_model(str(tmp_path / "phi3.gguf"), "phi3")
    bad = rewrite_gguf(path, str(tmp_path / "factors.gguf"),
                       extra_tensors={"rope_factors_long.weight": np.ones(4, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="rope_factors_long"):
        read_model_config(open_gguf(bad), bad)


ROPES = {  # transformers' rope_parameters; the tiny model was trained (so to speak) at 16 tokens, its prompt is 45
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_scaled_rope_matches_transformers(tmp_path, kind):
    """RoPE as the file says (issue 54 item 1): Llama 3's per-frequency divisors (a rope_freqs tensor), linear and
    YaRN scaling (its attention factor included), written as llama.cpp's converter writes them: prefill logits
    over a prompt past the original context within 1e-4 of transformers' with the same rope_parameters, chunked and
    paged, and greedy text equal on the default engine; against plain RoPE the logits differ."""
    rope = ROPES[kind]
    path = write_tiny_model(str(tmp_path / f"{kind}.gguf"), "llama", context_length=64, seed=7, rope=rope)
    model = load_model(path)
    ref_model = hf_model(path, rope_parameters=dict(rope, rope_theta=10000.0), max_position_embeddings=64)
    plain_model = hf_model(path)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
        plain = plain_model(torch.tensor([IDS])).logits[0]
    ours = paged_prefill_logits(model, IDS, block_size=4, chunk=6)
    assert (ours - ref).abs().max().item() < 1e-4
    assert (ours - plain).abs().max().item() > 1e-3  # the scaling matters on this prompt
    assert _engine_greedy(path, IDS[:20], 16, dtype="float32") == _greedy_by_whole_passes(ref_model, IDS[:20], 16)
