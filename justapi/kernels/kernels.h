// Every kernel function the Python module binds, declared once: bindings.cpp binds them, decode_step.cpp calls some
// of them directly (a decode step's layers in one native call). Each is defined in the source file named above it.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>

// paged_attention.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window);

// layer_ops.cpp
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, bool neox, int64_t num_heads,
                            int64_t num_kv_heads, int64_t dim, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slots, c10::optional<torch::Tensor> q_norm,
                            c10::optional<torch::Tensor> k_norm, double eps);

// int4_matmul.cpp
bool int4_amx_available();
torch::Tensor int4_amx_pack(torch::Tensor q, torch::Tensor scale, torch::Tensor zero);
torch::Tensor int4_amx_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features);
torch::Tensor q8_amx_pack(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> zero, int64_t group);
bool silu_mul_available(bool bf16);
torch::Tensor argmax_rows(torch::Tensor logits);
void mask_logits(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor q8_amx_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                            bool has_zero);

// units_avx512.cpp
bool units_avx512_available();
torch::Tensor int4_dpbf16_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features);
torch::Tensor q8_dpbf16_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                               bool has_zero);
torch::Tensor q8_small_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                              bool has_zero);
torch::Tensor int4_small_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features);

// prefill_attention.cpp
bool prefill_attention_available();
bool prefill_attention_fp32();
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, int64_t context_len, double scale, int64_t window);

// recurrent.cpp
void gated_delta_runs(torch::Tensor mixed, torch::Tensor b, torch::Tensor alpha, torch::Tensor z,
                      torch::Tensor conv_weight, torch::Tensor a, torch::Tensor dt_bias, torch::Tensor norm_weight,
                      double eps, torch::Tensor tails, torch::Tensor states, torch::Tensor runs, int64_t key_heads,
                      torch::Tensor out);

// sampling.cpp
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor settings);

// decode_step.cpp: the DecodeLayers class
void bind_decode_step(py::module& m);

// q_matmul.cpp
bool q_matmul_available();
torch::Tensor q_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> offset,
                       int64_t bits, int64_t out);
