"""Tiny random hybrid models: a transformers model (the reference) and the GGUF llama.cpp's converter would write
from it (convert_hf_to_gguf.py's layout, as the engine reads it):

- lfm2: ``attention.head_count_kv`` an array with 0 for each convolution layer, ``shortconv.l_cache``; the
  convolution's weight squeezed to [hidden, L], the final norm under the name token_embd_norm.
- qwen35: Gated DeltaNet layers and gated attention every ``full_attention_interval``-th; every norm but the
  DeltaNet's stored as 1 + w; A as -exp(A_log); the convolution squeezed; value heads reordered from transformers'
  grouped order (key head k serves value heads k*r .. k*r+r-1) to llama.cpp's tiled one (value head j*Hk + k).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from tiny_gguf import CHAT_TEMPLATE, vocab


# the tests' size; benchmarks/hybrid_bench.py passes larger ones
SIZES = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "linear_dim": 8,
         "linear_key_heads": 2, "linear_value_heads": 4, "context": 512}


def _hf_lfm2(vocab_size: int, layers: list[str], seed: int, sizes: dict):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    s = {**SIZES, **sizes}
    config = Lfm2Config(vocab_size=vocab_size, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                        num_hidden_layers=len(layers), num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv_heads"], max_position_embeddings=s["context"],
                        layer_types=layers, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _randomized(Lfm2ForCausalLM(config).eval())


def _hf_qwen35(vocab_size: int, num_layers: int, seed: int, sizes: dict, experts: int):
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    torch.manual_seed(seed)
    s = {**SIZES, **sizes}
    moe = dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=s["intermediate"],
               shared_expert_intermediate_size=s["intermediate"]) if experts else {}
    config = (Qwen3_5MoeTextConfig if experts else Qwen3_5TextConfig)(**moe,
        vocab_size=vocab_size, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=num_layers, num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], max_position_embeddings=s["context"], linear_conv_kernel_dim=4,
        linear_key_head_dim=s["linear_dim"], linear_value_head_dim=s["linear_dim"],
        linear_num_key_heads=s["linear_key_heads"], linear_num_value_heads=s["linear_value_heads"],
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [s["head_dim"] // 8, s["head_dim"] // 16, s["head_dim"] // 16]})
    return _randomized((Qwen3_5MoeForCausalLM if experts else Qwen3_5ForCausalLM)(config).eval())


def _randomized(model):
    """Every weight drawn anew at a scale where the layers matter (transformers' init is near-identity: norms 1 or
    0, small linears)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
            elif p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if "norm" in name and "linear_attn" not in name
                                                     and type(model).__name__.startswith("Qwen") else 1.0))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 0.2))
    return model


def _tokenizer(w: gguf.GGUFWriter) -> None:
    tokens, merges, types = vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_add_bos_token(False)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)


def _add(w: gguf.GGUFWriter, name: str, t: torch.Tensor, qtype: str = "F32") -> None:
    arr = t.detach().float().numpy().astype(np.float32)
    if qtype == "F32" or arr.ndim != 2:
        w.add_tensor(name, arr)
    else:
        qt = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)


def write_tiny_lfm2(path: str, layers: tuple[str, ...] = ("conv", "full_attention", "conv", "conv"), seed: int = 0,
                    qtype: str = "F32", **sizes):
    """LFM2 of ``layers`` ("conv" or "full_attention"), of SIZES unless ``sizes`` says otherwise; returns (path,
    the transformers model)."""
    hf = _hf_lfm2(len(vocab()[0]), list(layers), seed, sizes)
    cfg = hf.config
    w = gguf.GGUFWriter(path, "lfm2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in layers])
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_uint32("lfm2.shortconv.l_cache", cfg.conv_L_cache)
    _tokenizer(w)
    m = hf.model
    _add(w, "token_embd.weight", m.embed_tokens.weight)
    _add(w, "token_embd_norm.weight", m.embedding_norm.weight)
    for i, layer in enumerate(m.layers):
        p = f"blk.{i}."
        _add(w, p + "attn_norm.weight", layer.operator_norm.weight)
        _add(w, p + "ffn_norm.weight", layer.ffn_norm.weight)
        for name, lin in (("ffn_gate", layer.feed_forward.w1), ("ffn_up", layer.feed_forward.w3),
                          ("ffn_down", layer.feed_forward.w2)):
            _add(w, p + name + ".weight", lin.weight, qtype)
        if layers[i] == "conv":
            _add(w, p + "shortconv.in_proj.weight", layer.conv.in_proj.weight, qtype)
            _add(w, p + "shortconv.conv.weight", layer.conv.conv.weight.squeeze(1))
            _add(w, p + "shortconv.out_proj.weight", layer.conv.out_proj.weight, qtype)
        else:
            a = layer.self_attn
            for name, lin in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj),
                              ("attn_output", a.out_proj)):
                _add(w, p + name + ".weight", lin.weight, qtype)
            _add(w, p + "attn_q_norm.weight", a.q_layernorm.weight)
            _add(w, p + "attn_k_norm.weight", a.k_layernorm.weight)
    _close(w)
    return path, hf


def _tiled(t: torch.Tensor, key_heads: int, value_heads: int, dim: int) -> torch.Tensor:
    """Rows (dim 0) of value-head blocks of ``dim`` rows each, from transformers' grouped order to llama.cpp's
    tiled one: tiled head j*Hk + k holds grouped head k*r + j."""
    r = value_heads // key_heads
    order = [k * r + j for j in range(r) for k in range(key_heads)]
    return t.view(value_heads, dim, *t.shape[1:])[order].reshape(t.shape)


def write_tiny_qwen35(path: str, num_layers: int = 4, seed: int = 0, qtype: str = "F32", experts: int = 0,
                      fused_experts: bool = False, **sizes):
    """Qwen3.5 of ``num_layers`` layers, every fourth gated attention, dense or (``experts``) its mixture of experts
    (qwen35moe: two a token and a shared expert; ``fused_experts``: each expert's gate and up as one
    ffn_gate_up_exps), of SIZES unless ``sizes`` says otherwise; returns (path, the transformers model)."""
    hf = _hf_qwen35(len(vocab()[0]), num_layers, seed, sizes, experts)
    cfg = hf.config
    w = gguf.GGUFWriter(path, "qwen35moe" if experts else "qwen35")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_block_count(num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.head_dim // 2)
    w.add_rope_dimension_sections([cfg.head_dim // 8, cfg.head_dim // 16, cfg.head_dim // 16, 0])
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(4)
    _tokenizer(w)
    m = hf.model
    _add(w, "token_embd.weight", m.embed_tokens.weight)
    _add(w, "output_norm.weight", 1 + m.norm.weight)
    _add(w, "output.weight", hf.lm_head.weight)
    for i, layer in enumerate(m.layers):
        p = f"blk.{i}."
        _add(w, p + "attn_norm.weight", 1 + layer.input_layernorm.weight)
        _add(w, p + "post_attention_norm.weight", 1 + layer.post_attention_layernorm.weight)
        if experts:
            _experts(w, p, layer.mlp, qtype, fused_experts)
        else:
            for name, lin in (("ffn_gate", layer.mlp.gate_proj), ("ffn_up", layer.mlp.up_proj),
                              ("ffn_down", layer.mlp.down_proj)):
                _add(w, p + name + ".weight", lin.weight, qtype)
        if layer.block_type == "linear_attention":
            _delta_net(w, p, layer.linear_attn, cfg, qtype)
        else:
            a = layer.self_attn
            for name, lin in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj),
                              ("attn_output", a.o_proj)):
                _add(w, p + name + ".weight", lin.weight, qtype)
            _add(w, p + "attn_q_norm.weight", 1 + a.q_norm.weight)
            _add(w, p + "attn_k_norm.weight", 1 + a.k_norm.weight)
    _close(w)
    return path, hf


def _experts(w: gguf.GGUFWriter, p: str, moe, qtype: str, fused: bool) -> None:
    """A Qwen3.5 mixture of experts as the converter writes it: the router, each expert's gate, up and down stacked
    (gate and up as one tensor, gate rows first, where ``fused``, as llama.cpp's ffn_gate_up_exps holds them), the
    shared expert and its gate."""
    ff = moe.experts.gate_up_proj.shape[1] // 2
    _add(w, p + "ffn_gate_inp.weight", moe.gate.weight)
    if fused:
        _add(w, p + "ffn_gate_up_exps.weight", moe.experts.gate_up_proj)
    else:
        _add(w, p + "ffn_gate_exps.weight", moe.experts.gate_up_proj[:, :ff])
        _add(w, p + "ffn_up_exps.weight", moe.experts.gate_up_proj[:, ff:])
    _add(w, p + "ffn_down_exps.weight", moe.experts.down_proj)
    _add(w, p + "ffn_gate_inp_shexp.weight", moe.shared_expert_gate.weight.flatten())
    for name, lin in (("ffn_gate_shexp", moe.shared_expert.gate_proj), ("ffn_up_shexp", moe.shared_expert.up_proj),
                      ("ffn_down_shexp", moe.shared_expert.down_proj)):
        _add(w, p + name + ".weight", lin.weight, qtype)


def _delta_net(w: gguf.GGUFWriter, p: str, g, cfg, qtype: str) -> None:
    hk, hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim = hk * cfg.linear_key_head_dim
    qkv = g.in_proj_qkv.weight
    conv = g.conv1d.weight.squeeze(1)
    tile = lambda t, d: _tiled(t, hk, hv, d)  # noqa: E731
    _add(w, p + "attn_qkv.weight", torch.cat([qkv[: 2 * key_dim], tile(qkv[2 * key_dim :], dv)]), qtype)
    _add(w, p + "attn_gate.weight", tile(g.in_proj_z.weight, dv), qtype)
    _add(w, p + "ssm_beta.weight", tile(g.in_proj_b.weight, 1), qtype)
    _add(w, p + "ssm_alpha.weight", tile(g.in_proj_a.weight, 1), qtype)
    _add(w, p + "ssm_conv1d.weight", torch.cat([conv[: 2 * key_dim], tile(conv[2 * key_dim :], dv)]))
    _add(w, p + "ssm_a", tile(-g.A_log.float().exp(), 1))
    _add(w, p + "ssm_dt.bias", tile(g.dt_bias, 1))
    _add(w, p + "ssm_norm.weight", g.norm.weight)
    _add(w, p + "ssm_out.weight", tile(g.out_proj.weight.t(), dv).t().contiguous(), qtype)


def _close(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
