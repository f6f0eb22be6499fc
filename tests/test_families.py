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


def _longrope(dim: int) -> dict:
    """Phi-3's rope_parameters for ``dim`` rotated dimensions, trained at 16 tokens: short and long factors apart."""
    return {"rope_type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(dim // 2)],
            "long_factor": [1.0 + 2.0 * i for i in range(dim // 2)]}


@pytest.mark.parametrize("rope_dim", [None, 8], ids=["phi3.5", "phi4-mini-partial"])
def test_longrope_matches_transformers_on_either_side_of_the_original_context(tmp_path, rope_dim):
    """LongRoPE as llama.cpp's converter writes it (rope_factors_short/_long, attn_factor, and for Phi-4-mini a
    rope.dimension_count below the head size: partial rotary). Served past the original context (64 > 16) the long
    factors rotate every position: prefill logits of a 45-token prompt within 1e-4 of transformers' (which switches
    to them for a sequence past 16), greedy text equal. Served within it (--max-model-len 16) the short ones do, as
    transformers' for a sequence within it; the two tables differ."""
    dim = rope_dim or 16
    rope = _longrope(dim)
    path = write_tiny_model(str(tmp_path / "phi.gguf"), "phi3", context_length=64, seed=5, rope=rope, rope_dim=rope_dim)
    model = load_model(path)
    assert model.config.rope_scaling.kind == "longrope" and model.rope.rot_dim == dim
    ref_model = hf_model(path, rope_parameters=dict(rope, rope_theta=10000.0, partial_rotary_factor=dim / 16),
                         original_max_position_embeddings=16, max_position_embeddings=64, pad_token_id=0)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4
    assert _engine_greedy(path, IDS[:20], 12, dtype="float32") == _greedy_by_whole_passes(ref_model, IDS[:20], 12)
    short = _engine_greedy(path, IDS[:6], 10, dtype="float32", max_model_len=16)
    assert short == _greedy_by_whole_passes(ref_model, IDS[:6], 10)
    assert short != _engine_greedy(path, IDS[:6], 10, dtype="float32")  # the long table, on the same short prompt


def _same_weights_as_llama(tmp_path, arch: str, **options):
    """(the ``arch`` file, transformers' LlamaForCausalLM of a llama file with the same weights): llama.cpp's
    converter permutes Q/K rows for these rotary layouts, which transformers' llama reader undoes."""
    path = write_tiny_model(str(tmp_path / f"{arch}.gguf"), arch, **options)
    return path, hf_model(write_tiny_model(str(tmp_path / "as-llama.gguf"), "llama", **options))


def _reference(cls, config_cls, llama, **fields):
    base = {k: v for k, v in llama.config.to_dict().items() if k not in ("architectures", "model_type")}
    model = cls(config_cls(**{**base, **fields})).eval()
    model.load_state_dict(llama.state_dict())
    return model


def test_smollm3_leaves_every_fourth_layer_without_rope(tmp_path):
    """SmolLM3: Llama's tensors, no RoPE on layers 3 and 7 (every fourth, which the file does not state), against
    transformers' SmolLM3ForCausalLM holding the same weights; greedy text equal on the default engine."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    path, llama = _same_weights_as_llama(tmp_path, "smollm3", num_layers=8, seed=11)
    model = load_model(path)
    assert [layer.attn.rope is None for layer in model.layers] == [False, False, False, True] * 2
    ref_model = _reference(SmolLM3ForCausalLM, SmolLM3Config, llama, no_rope_layer_interval=4, no_rope_layers=None)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
        plain = llama(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4
    assert (plain - ref).abs().max().item() > 1e-3  # the NoPE layers matter
    assert _engine_greedy(path, IDS[:5], 16) == _greedy_by_whole_passes(ref_model, IDS[:5], 16)


def test_granite_applies_its_four_multipliers(tmp_path):
    """Granite 3.x (dense): embeddings times embedding_scale, each sublayer's output times residual_scale,
    attention.scale in place of head_dim ** -0.5, logits divided by logit_scale: all four from the file, against
    transformers' GraniteForCausalLM with the same weights and multipliers; greedy text equal."""
    from transformers import GraniteConfig, GraniteForCausalLM
    from tiny_gguf import GRANITE_SCALES as s

    path, llama = _same_weights_as_llama(tmp_path, "granite", seed=12, tied=False)
    model = load_model(path)
    cfg = model.config
    assert (cfg.embedding_scale, cfg.residual_scale, cfg.logit_scale) == pytest.approx(
        (s["embedding"], s["residual"], s["logits"]))
    ref_model = _reference(GraniteForCausalLM, GraniteConfig, llama, embedding_multiplier=s["embedding"],
                           residual_multiplier=s["residual"], attention_multiplier=s["attention"],
                           logits_scaling=s["logits"])
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4
    assert _engine_greedy(path, IDS[:5], 16) == _greedy_by_whole_passes(ref_model, IDS[:5], 16)


def test_gemma3_4b_geometry_scales_only_its_global_layers(tmp_path):
    """Gemma 3 4B and larger: linear RoPE scaling (x8 there; x4 on this 16-token-trained model) on the global layers
    only, the sliding ones at base 10,000 unscaled, a head of 256 wider than hidden / heads: prefill logits past
    the original context against transformers' Gemma3ForCausalLM with the same per-layer-type rope_parameters."""
    path = write_tiny_model(str(tmp_path / "gemma3.gguf"), "gemma3", tokenizer="llama", num_layers=6, seed=3,
                            head_dim=256, num_heads=2, num_kv_heads=1, context_length=64,
                            rope={"rope_type": "linear", "factor": 4.0})
    model = load_model(path)
    assert model.config.rope_scaling.kind == "linear" and model.local_rope is not None
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    ref_model = hf_model(path, query_pre_attn_scalar=256, rope_parameters=rope, max_position_embeddings=64)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4
    assert _engine_greedy(path, IDS[:20], 12) == _greedy_by_whole_passes(ref_model, IDS[:20], 12)


def test_qwen2_with_yarn_matches_transformers(tmp_path):
    """Qwen2.5 served past 32k: YaRN (factor, original context, its attention factor) on a qwen2 file (QKV biases,
    neox rotary), against transformers' Qwen2ForCausalLM with the same rope_parameters over a prompt past the
    original context."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    path = write_tiny_model(str(tmp_path / "qwen2.gguf"), "qwen2", context_length=64, seed=8, rope=rope)
    model = load_model(path)
    ref_model = hf_model(path, rope_parameters=dict(rope, rope_theta=10000.0), max_position_embeddings=64)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=6) - ref).abs().max().item() < 1e-4


def test_what_is_out_of_reach_is_refused_in_one_line_naming_what_is_served(tmp_path):
    """Item 6: a LongRoPE file with one factor set, a RoPE scaling kind not served, a partial rotary size that is
    not a head's, and an unknown architecture each fail at start-up with a ModelLoadError naming the problem and,
    where there is one, the list of what is supported; Gemma 3 27B (62 layers) takes its query scale."""
    import numpy as np

    from justapi.model.gguf_loader import open_gguf, read_model_config
    from test_cli_and_inputs import rewrite_gguf

    def refused(path: str) -> str:
        with pytest.raises(ModelLoadError) as e:
            read_model_config(open_gguf(path), path)
        assert "\n" not in str(e.value)
        return str(e.value)

    phi = write_tiny_model(str(tmp_path / "phi3.gguf"), "phi3")
    half = rewrite_gguf(phi, str(tmp_path / "half.gguf"),
                        extra_tensors={"rope_factors_long.weight": np.ones(8, dtype=np.float32)},
                        replace_keys={"phi3.rope.scaling.original_context_length": 16})
    assert "rope_factors_short" in refused(half)
    llama = write_tiny_model(str(tmp_path / "llama.gguf"))
    dynamic = rewrite_gguf(llama, str(tmp_path / "dynamic.gguf"),
                           replace_keys={"llama.rope.scaling.type": "dynamic"})
    assert "'dynamic' is not supported; supported: none, linear, yarn, longrope" in refused(dynamic)
    odd = rewrite_gguf(llama, str(tmp_path / "odd.gguf"), replace_keys={"llama.rope.dimension_count": 7})
    assert "rope.dimension_count is 7" in refused(odd)
    other = rewrite_gguf(llama, str(tmp_path / "mamba.gguf"), replace_keys={"general.architecture": "mamba"})
    assert "unsupported architecture 'mamba'; supported architectures: llama" in refused(other)
    big = write_tiny_model(str(tmp_path / "gemma3-27b.gguf"), "gemma3", tokenizer="llama", num_layers=62, hidden=64,
                           num_heads=4, head_dim=32)
    cfg = read_model_config(open_gguf(big), big)
    assert cfg.attention_scale == pytest.approx(16 ** -0.5)  # hidden / heads, not the head size 32
    big2 = write_tiny_model(str(tmp_path / "gemma2-27b.gguf"), "gemma2", tokenizer="llama", num_layers=46, hidden=64,
                            num_heads=4, head_dim=32)
    assert read_model_config(open_gguf(big2), big2).attention_scale == pytest.approx(16 ** -0.5)


FEATURE_FAMILIES = {  # issue 54's new families, each a tiny file with two KV heads (--tp 2 splits them)
    "llama3-rope-freqs": dict(arch="llama", rope=ROPES["llama3"], context_length=64),
    "phi3-longrope-partial": dict(arch="phi3", rope=_longrope(8), rope_dim=8, context_length=64),
    "smollm3": dict(arch="smollm3", num_layers=4),
    "granite": dict(arch="granite"),
    "gemma3-4b-linear": dict(arch="gemma3", tokenizer="llama", num_layers=6, head_dim=256, num_heads=2,
                             context_length=64, rope={"rope_type": "linear", "factor": 4.0}),
    "qwen2-yarn": dict(arch="qwen2", context_length=64, rope=ROPES["yarn"]),
}


@pytest.mark.parametrize("family", sorted(FEATURE_FAMILIES))
def test_every_engine_feature_gives_the_same_tokens_on_each_new_family(tmp_path, family):
    """Item 5: the prefix cache, preemption, chunked prefill, draft trees and prompt lookup, --tp 2,
    disaggregation and structured output each give every request its tokens alone (feature_matrix)."""
    from feature_matrix import assert_every_engine_feature_gives_the_same_tokens

    options = dict(FEATURE_FAMILIES[family])
    path = write_tiny_model(str(tmp_path / f"{family}.gguf"), options.pop("arch"), seed=5, **options)
    assert_every_engine_feature_gives_the_same_tokens(path, vocab=265, grammar_in_workers=False)
