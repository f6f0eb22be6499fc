// Two fused steps of a decoder layer, each one call instead of a dozen small torch ops (at one decode row, every
// torch op costs microseconds of dispatch for nanoseconds of work):
//
//   add_rms_norm   x += residual (optional), h = rms_norm(x) * weight
//   rope_write_kv  rotate the Q and K heads of the fused QKV output (each normed first where the model has QK
//                  norms), store K and V at their cache slots, return Q
//   silu_mul       silu(gate) * up from the fused gate/up output, in one pass over it (AVX-512 builds; fp32
//                  only on AVX2)
//   argmax_rows    the greedy pick: each row's first maximum (torch's max(dim=-1) runs on one thread, 1.6 ms
//                  for 28 rows of SmolLM2's 49152 logits)
//   mask_logits    -inf where a grammar's token bitmask has a 0 bit (xgrammar's CPU apply_token_bitmask_inplace
//                  took 4.4-7.8 ms for 32 rows of 49152 logits, most of a constrained step's extra cost)
//
// Built into the same module as paged_attention.cpp (see justapi/kernels/__init__.py). Compiled with
// -ffp-contract=off: rope_write_kv's products and sums are then rounded exactly as torch's elementwise ops round
// them, so its result is bit-identical to the torch path (tested).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <vector>
#include <tuple>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define JUSTAPI_SILU 1
#include <immintrin.h>
// torch's own vectorised exp (Sleef, exported by libtorch_cpu): the one its CPU silu kernel calls on AVX-512
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__) && defined(__FMA__)
#define JUSTAPI_SILU_AVX2 1  // fp32 only: the models that run on CPUs without a bf16 matmul compute in fp32
#include <immintrin.h>
// ... and the one it calls on AVX2
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T narrow(float x) { return static_cast<T>(x); }  // c10::BFloat16(float) rounds to nearest even, as torch

template <typename T>
void add_rms_norm_rows(T* x, const T* residual, const float* weight, T* h, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* hr = h + r * dim;
      if (residual != nullptr) {
        const T* rr = residual + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) xr[d] = narrow<T>(widen(xr[d]) + widen(rr[d]));
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)  // vector lanes of partial sums: fp32 rounding of another order than torch's
      for (int64_t d = 0; d < dim; ++d) {
        const float v = widen(xr[d]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) hr[d] = narrow<T>(widen(xr[d]) * inv * weight[d]);
    }
  });
}

// One head's rotary: y[a] = x[a] c - x[b] s, y[b] = x[b] c + x[a] s over its pairs (a, b): "norm" style the
// adjacent pairs (2i, 2i+1), "neox" the halves (i, i + dim/2). The products and sums of RotaryEmbedding.rotate in
// its order, each rounded as there (no contraction into FMAs in this file). The style is a template parameter so
// that the loop has no branch and vectorises: with a run-time choice per pair it stayed scalar, 222 us against 45
// for a 373-row chunk of SmolLM2 on a Zen 4 (in isolation; 6.3 against 2.7 ms a mixed step's 30 layers).
template <bool Neox, typename T, typename O>
inline void rotate_head(const T* x, const float* c, const float* s, O* y, int64_t half) {
  if constexpr (Neox) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = widen(x[i]), x2 = widen(x[i + half]);
      y[i] = narrow<O>(x1 * c[i] - x2 * s[i]);
      y[i + half] = narrow<O>(x2 * c[i] + x1 * s[i]);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = widen(x[2 * i]), x2 = widen(x[2 * i + 1]);
      y[2 * i] = narrow<O>(x1 * c[i] - x2 * s[i]);
      y[2 * i + 1] = narrow<O>(x2 * c[i] + x1 * s[i]);
    }
  }
}

// An int8 cache row (model/attention.py's quantize_rows, bit for bit): each group of 32 values divided by its
// scale, max |x| / 127 over the group, and rounded half to even; then the groups' scales (fp32)
constexpr int64_t kInt8Group = 32;
inline void quantize_row(const float* x, int64_t dim, int8_t* out) {
  for (int64_t g = 0; g < dim / kInt8Group; ++g) {
    const float* xg = x + g * kInt8Group;
    float amax = 0.f;
    for (int64_t d = 0; d < kInt8Group; ++d) amax = std::max(amax, std::fabs(xg[d]));
    const float scale = amax / 127.f;
    for (int64_t d = 0; d < kInt8Group; ++d)
      out[g * kInt8Group + d] = static_cast<int8_t>(scale > 0.f ? std::nearbyint(xg[d] / scale) : 0.f);
    std::memcpy(out + dim + g * 4, &scale, sizeof(float));
  }
}

// A per-head QK norm before the rotary (Qwen3, Gemma 3): each Q and K head of a row normed by add_rms_norm_rows
// itself, the function the torch path's norms call (nested in this parallel region it runs on the calling thread),
// so the normed heads, rounded to T, are the torch path's bit for bit
struct QkNorm {
  const float* q = nullptr;  // [dim] fp32 weights; null: no QK norm
  const float* k = nullptr;
  float eps = 0.f;
};

// cos/sin: [rows, dim/2] fp32; an int8 cache's rows are dim + dim / 8 wide, each K and V row rotated or widened to
// fp32 first and then quantized
template <bool Neox, typename T, typename C>
void rope_write_rows(const T* qkv, int64_t row_stride, const float* cos, const float* sin, int64_t rows,
                     int64_t num_heads, int64_t num_kv_heads, int64_t dim, C* k_cache, C* v_cache,
                     int64_t cache_head_stride, const int64_t* slots, float* q_out, QkNorm norm) {
  const int64_t half = dim / 2;
  constexpr bool int8 = std::is_same_v<C, int8_t>;
  const int64_t width = int8 ? dim + dim / kInt8Group * 4 : dim;
  const int64_t qk = (num_heads + num_kv_heads) * dim;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row_f32(int8 ? dim : 0);
    std::vector<T> normed(norm.q ? qk : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = qkv + r * row_stride;
      if (norm.q) {  // the row's Q and K heads normed into `normed`; its V is read from qkv as it is. Without a
        // residual add_rms_norm_rows only reads x, so the row goes in as it is
        T* heads_in = const_cast<T*>(row);
        add_rms_norm_rows<T>(heads_in, nullptr, norm.q, normed.data(), num_heads, dim, norm.eps);
        add_rms_norm_rows<T>(heads_in + num_heads * dim, nullptr, norm.k, normed.data() + num_heads * dim,
                             num_kv_heads, dim, norm.eps);
      }
      const T* heads = norm.q ? normed.data() : row;
      const float* c = cos + r * half;
      const float* s = sin + r * half;
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_head<Neox>(heads + h * dim, c, s, q_out + (r * num_heads + h) * dim, half);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        C* ko = k_cache + h * cache_head_stride + slots[r] * width;
        if constexpr (int8) {
          rotate_head<Neox>(heads + (num_heads + h) * dim, c, s, row_f32.data(), half);
          quantize_row(row_f32.data(), dim, ko);
        } else {
          rotate_head<Neox>(heads + (num_heads + h) * dim, c, s, ko, half);
        }
      }
      const T* v = row + (num_heads + num_kv_heads) * dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        C* vo = v_cache + h * cache_head_stride + slots[r] * width;
        if constexpr (int8) {
          for (int64_t d = 0; d < dim; ++d) row_f32[d] = widen(v[h * dim + d]);
          quantize_row(row_f32.data(), dim, vo);
        } else {
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) vo[d] = narrow<C>(widen(v[h * dim + d]));
        }
      }
    }
  });
}

template <typename T, typename C>
void rope_write_dispatch_style(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, bool neox,
                               int64_t num_heads, int64_t num_kv_heads, int64_t dim, torch::Tensor& k_cache,
                               torch::Tensor& v_cache, const torch::Tensor& slots, torch::Tensor& q, QkNorm norm) {
  const int64_t head_stride = k_cache.size(1) * k_cache.size(2) * k_cache.size(3);  // one KV head's blocks
  auto run = [&](auto neox_style) {
    rope_write_rows<decltype(neox_style)::value>(qkv.data_ptr<T>(), qkv.stride(0), cos.data_ptr<float>(),
                                                 sin.data_ptr<float>(), qkv.size(0), num_heads, num_kv_heads, dim,
                                                 k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), head_stride,
                                                 slots.data_ptr<int64_t>(), q.data_ptr<float>(), norm);
  };
  if (neox) run(std::true_type{});
  else run(std::false_type{});
}

template <typename T>
void rope_write_dispatch_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, bool neox,
                               int64_t num_heads, int64_t num_kv_heads, int64_t dim, torch::Tensor& k_cache,
                               torch::Tensor& v_cache, const torch::Tensor& slots, torch::Tensor& q, QkNorm norm) {
  if (k_cache.scalar_type() == torch::kFloat32)
    rope_write_dispatch_style<T, float>(qkv, cos, sin, neox, num_heads, num_kv_heads, dim, k_cache, v_cache, slots, q,
                                        norm);
  else if (k_cache.scalar_type() == torch::kChar)
    rope_write_dispatch_style<T, int8_t>(qkv, cos, sin, neox, num_heads, num_kv_heads, dim, k_cache, v_cache, slots,
                                         q, norm);
  else
    rope_write_dispatch_style<T, c10::BFloat16>(qkv, cos, sin, neox, num_heads, num_kv_heads, dim, k_cache, v_cache,
                                                slots, q, norm);
}

#ifdef JUSTAPI_SILU
// torch computes silu(x) as x / (1 + exp(-x)) in fp32 (a bf16 x widened, the result rounded to bf16), then the
// product with up as a separate op (in fp32, rounded to the dtype): the same operations in the same order here, so
// the result is bit-identical to F.silu(gate) * up (tested)
inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
inline __m512 round_bf16(__m512 v) { return bf16_to_f32((__m256i)_mm512_cvtneps_pbh(v)); }

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * width;
      const T* u = g + width;
      T* o = out + r * width;
      for (int64_t d = 0; d < width; d += 16) {
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(o + d, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + d)), _mm512_loadu_ps(u + d)));
        } else {
          const __m512 sg = round_bf16(silu16(bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + d)))));
          const __m512 uf = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + d)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sg, uf)));
        }
      }
    }
  });
}
#endif

#ifdef JUSTAPI_SILU_AVX2
// the AVX-512 path's operations with 8 lanes, fp32 only
void silu_mul_rows_avx2(const float* gate_up, float* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up + r * 2 * width;
      const float* u = g + width;
      float* o = out + r * width;
      for (int64_t d = 0; d < width; d += 8) {
        const __m256 x = _mm256_loadu_ps(g + d);
        const __m256 silu =
            _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(o + d, _mm256_mul_ps(silu, _mm256_loadu_ps(u + d)));
      }
    }
  });
}
#endif

// the index of the first maximum of row[0..n), or of the first NaN if there is one (as torch's max(dim) gives)
int64_t argmax_row(const float* row, int64_t n) {
  int64_t d = 0, best = 0;
  float best_v = row[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(row);
    __m512i vidx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (d = 16; d + 16 <= n && !nan; d += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(row + d);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strictly greater: a lane keeps its first
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    if (nan) {  // the first NaN decides; find it in order
      for (int64_t t = 0; t < n; ++t)
        if (std::isnan(row[t])) return t;
    }
    best_v = _mm512_reduce_max_ps(vmax);
    const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best_v), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at_max, vidx);  // among lanes holding the maximum, the first index
  }
#endif
  for (; d < n; ++d) {  // the tail (or the whole row without AVX-512)
    if (std::isnan(row[d])) {
      for (int64_t t = 0; t <= d; ++t)
        if (std::isnan(row[t])) return t;
    }
    if (row[d] > best_v) best_v = row[d], best = d;
  }
  return best;
}

}  // namespace

// logits [rows, vocab] fp32 -> [rows] int64: torch's logits.max(dim=-1).indices, rows on all intra-op threads
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31),
              "argmax_rows: [rows, vocab] fp32 logits expected");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(lp + r * n, n);
  });
  return out;
}

// logits [n, vocab] fp32, bitmask [rows, ceil(vocab / 32)] int32 (bit j of word w: token 32w + j allowed):
// logits[rows[i]] = -inf wherever bitmask[i] has a 0 bit, in place; all-ones words (free text) cost one compare
void mask_logits(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "mask_logits: contiguous [rows, vocab] fp32 logits expected");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "mask_logits: [rows, ceil(vocab / 32)] int32 bitmask expected");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0) &&
                  rows.is_contiguous(),
              "mask_logits: one int64 logits row per bitmask row expected");
  TORCH_CHECK(logits.is_cpu() && bitmask.is_cpu() && rows.is_cpu(), "mask_logits: CPU tensors expected");
  const int64_t n = logits.size(1), words = bitmask.size(1), num_logits = logits.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < num_logits, "mask_logits: row out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * n;
      const uint32_t* bits = bp + i * words;
      for (int64_t w = 0; w * 32 < n; ++w) {
        const uint32_t word = bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, count = std::min<int64_t>(32, n - base);
        if (word == 0) {  // most words of a narrow grammar (digits, a choice): the whole run goes
          std::fill(row + base, row + base + count, neg_inf);
          continue;
        }
        for (int64_t j = 0; j < count; ++j)
          if (!((word >> j) & 1u)) row[base + j] = neg_inf;
      }
    }
  });
}

bool silu_mul_available(bool bf16) {
#if defined(JUSTAPI_SILU)
  return true;
#elif defined(JUSTAPI_SILU_AVX2)
  return !bf16;
#else
  return false;
#endif
}

// gate_up [rows, 2 * width] (gate then up; rows may be strided), fp32 or bf16, width a multiple of 16
// -> silu(gate) * up [rows, width], like gate_up
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 32 == 0 &&
                  gate_up.stride(0) == gate_up.size(1),
              "silu_mul: contiguous [rows, 2 * width] input with width a multiple of 16 expected");
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16,
              "silu_mul: fp32 or bf16");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  TORCH_CHECK(silu_mul_available(gate_up.scalar_type() == torch::kBFloat16), "silu_mul: built without AVX-512",
              gate_up.scalar_type() == torch::kFloat32 ? " or AVX2" : "");
#if defined(JUSTAPI_SILU)
  if (gate_up.scalar_type() == torch::kFloat32)
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  else
    silu_mul_rows<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, width);
#elif defined(JUSTAPI_SILU_AVX2)
  silu_mul_rows_avx2(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
#endif
  return out;
}

// x [rows, dim] fp32 or bf16 (updated in place when residual is given), weight [dim] fp32; returns h like x
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "add_rms_norm: contiguous [rows, dim] input expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "add_rms_norm: fp32 or bf16");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.numel() == x.size(1), "add_rms_norm: fp32 weight [dim]");
  weight = weight.contiguous();
  torch::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "add_rms_norm: residual like x");
  }
  auto h = torch::empty_like(x);
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32)
    add_rms_norm_rows<float>(x.data_ptr<float>(), res.defined() ? res.data_ptr<float>() : nullptr,
                             weight.data_ptr<float>(), h.data_ptr<float>(), x.size(0), x.size(1), feps);
  else
    add_rms_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(),
                                     res.defined() ? res.data_ptr<c10::BFloat16>() : nullptr, weight.data_ptr<float>(),
                                     h.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), feps);
  return {x, h};
}

// qkv [rows, (num_heads + 2 * num_kv_heads) * dim] (rows may be strided), cos/sin [rows, dim/2] fp32, caches
// [num_kv_heads, num_blocks, block_size, dim] fp32 or bf16 (int8: dim + dim / 8), slots [rows] int64; returns rotated Q
// [rows, heads, dim]; with q_norm and k_norm ([dim] fp32) each Q and K head is RMS-normed (eps) before its rotary
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, bool neox, int64_t num_heads,
                            int64_t num_kv_heads, int64_t dim, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slots, c10::optional<torch::Tensor> q_norm,
                            c10::optional<torch::Tensor> k_norm, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "rope_write_kv: qkv [rows, (heads + 2 kv_heads) * dim] with unit column stride expected");
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 || qkv.scalar_type() == torch::kBFloat16, "rope_write_kv: fp32 or bf16");
  TORCH_CHECK(dim % 2 == 0, "rope_write_kv: even head_dim expected");
  cos = cos.reshape({qkv.size(0), dim / 2}).contiguous();
  sin = sin.reshape({qkv.size(0), dim / 2}).contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "rope_write_kv: fp32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.size(0) == num_kv_heads &&
                  k_cache.size(3) == (k_cache.scalar_type() == torch::kChar ? dim + dim / kInt8Group * 4 : dim),
              "rope_write_kv: contiguous K/V caches [kv_heads, blocks, block_size, dim (int8: + dim / 8)] of one "
              "dtype expected");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16 ||
                  k_cache.scalar_type() == torch::kChar,
              "rope_write_kv: fp32, bf16 or int8 cache");
  slots = slots.contiguous();
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == qkv.size(0), "rope_write_kv: int64 slot per row");
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < slots.numel(); ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "rope_write_kv: slot out of range");
  QkNorm norm;
  torch::Tensor qn, kn;  // held while the kernel reads them
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rope_write_kv: both QK norms or neither");
  if (q_norm.has_value()) {
    qn = q_norm->contiguous();
    kn = k_norm->contiguous();
    TORCH_CHECK(qn.scalar_type() == torch::kFloat32 && kn.scalar_type() == torch::kFloat32 && qn.numel() == dim &&
                    kn.numel() == dim, "rope_write_kv: [dim] fp32 QK norm weights expected");
    norm = QkNorm{qn.data_ptr<float>(), kn.data_ptr<float>(), static_cast<float>(eps)};
  }
  auto q = torch::empty({qkv.size(0), num_heads, dim}, qkv.options().dtype(torch::kFloat32));
  if (qkv.scalar_type() == torch::kFloat32)
    rope_write_dispatch_cache<float>(qkv, cos, sin, neox, num_heads, num_kv_heads, dim, k_cache, v_cache, slots, q,
                                     norm);
  else
    rope_write_dispatch_cache<c10::BFloat16>(qkv, cos, sin, neox, num_heads, num_kv_heads, dim, k_cache, v_cache,
                                             slots, q, norm);
  return q;
}
