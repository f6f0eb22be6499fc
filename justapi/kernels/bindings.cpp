// The Python module of every kernel: each source's functions (declared in kernels.h) bound once, so that a kernel's
// own file changes only with its kernel. Built from build_spec.SOURCES (setup.py at install; the loader on first use).

#include <torch/extension.h>

#include <cstdint>
#include <tuple>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over the paged KV cache (fp32 or bf16 cache, CPU); "
        "window > 0: only each sequence's last `window` tokens", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0);
  m.def("add_rms_norm", &add_rms_norm, "x += residual; rms_norm(x) * weight (fp32 accumulation), in place on x");
  m.def("rope_write_kv", &rope_write_kv, "rotary embedding of fused QKV rows (each Q and K head RMS-normed first "
        "with q_norm / k_norm), K/V stored at their slots; returns Q", py::arg("qkv"), py::arg("cos"), py::arg("sin"),
        py::arg("neox"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("dim"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
        py::arg("eps") = 0.0);
  m.def("int4_amx_available", &int4_amx_available, "whether int4_amx_matmul can run here (built with AMX, allowed)");
  m.def("int4_amx_pack", &int4_amx_pack, "4-bit weight (q, scale, zero) -> the layout int4_amx_matmul reads");
  m.def("int4_amx_matmul", &int4_amx_matmul, "x @ w.T, bf16 rows x a packed 4-bit weight, on AMX tiles");
  m.def("mask_logits", &mask_logits, "-inf in logits[rows[i]] wherever bitmask[i] has a 0 bit (a grammar's token mask)");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum (or first NaN), as logits.max(dim=-1).indices");
  m.def("silu_mul_available", &silu_mul_available, "whether silu_mul runs here on bf16 (True) or fp32 rows (AVX-512; AVX2: fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from fused [rows, 2 * width] gate/up rows, as torch rounds it");
  m.def("q8_amx_pack", &q8_amx_pack, "8-bit weight (q, scale[, zero], group 32 or 16) -> the layout q8_amx_matmul reads",
        py::arg("q"), py::arg("scale"), py::arg("zero") = py::none(), py::arg("group") = 32);
  m.def("q8_amx_matmul", &q8_amx_matmul, "x @ w.T, bf16 rows x a packed 8-bit weight, on AMX tiles", py::arg("x"),
        py::arg("packed"), py::arg("out_features"), py::arg("group") = 32, py::arg("has_zero") = false);
  m.def("q8_small_matmul", &q8_small_matmul, "x @ w.T, 1-4 fp32 rows x q8_amx_pack's units, AVX-512 FMAs (fp32 out)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("group") = 32, py::arg("has_zero") = false);
  m.def("int4_small_matmul", &int4_small_matmul,
        "x @ w.T, 1-4 fp32 rows x int4_amx_pack's units, AVX-512 FMAs (fp32 out)");
  m.def("units_avx512_available", &units_avx512_available,
        "whether the AVX-512 BF16 kernels of the packed units run here (dpbf16, q8_small, q4_small)");
  m.def("int4_dpbf16_matmul", &int4_dpbf16_matmul, "x @ w.T, bf16 rows x int4_amx_pack's units, AVX-512 BF16");
  m.def("q8_dpbf16_matmul", &q8_dpbf16_matmul, "x @ w.T, bf16 rows x q8_amx_pack's units, AVX-512 BF16",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("group") = 32, py::arg("has_zero") = false);
  m.def("prefill_attention_available", &prefill_attention_available,
        "whether prefill_attention runs here (an AVX-512 BF16 or an AVX2 build)");
  m.def("prefill_attention_fp32", &prefill_attention_fp32,
        "whether prefill_attention computes in fp32 (the AVX2 build) rather than with bf16 products (AVX-512 BF16)");
  m.def("prefill_attention", &prefill_attention,
        "a prompt chunk's causal attention over its bf16 cache: bf16 products on AVX-512 BF16, fp32 on AVX2");
  m.def("gated_delta_runs", &gated_delta_runs,
        "Gated DeltaNet's convolution and delta rule over runs of rows (decode rows, prompt chunks), in place on "
        "their state slots (fp32)");
  m.def("sample_rows", &sample_rows,
        "a token from each logits row under its (temperature, top_k, top_p, min_p, u): the inverse of its cumulative "
        "distribution at u, as model/sampler.py's draw; -1 where none can be drawn");
  m.def("q_matmul_available", &q_matmul_available, "whether q_matmul can run here (an AVX2 + FMA build)");
  bind_decode_step(m);
  m.def("q_matmul", &q_matmul, "x @ w.T, fp32 rows (rounded to 16-bit integers) x a packed 4-bit or Q8_0 weight, on AVX2");
}
