// A few fp32 rows times a GGUF-quantized weight (4-bit Q4_0/Q4_1 or 8-bit Q8_0 groups of 32), on AVX2 + FMA.
//
// For CPUs without a bf16 matmul (AVX2 only, as AMD Zen 3), where the model computes in fp32: torch's int4 and int8
// CPU kernels take bf16 rows only (fp32 rows are 8-25x slower), so each of their calls rounded the rows to bf16 and
// widened the products back, and on AVX2 they read the 4-bit weights at a fifth of the memory bandwidth. Here each
// group of 32 weights is widened to fp32 in registers once and multiplied into every row (up to kMaxRows):
//
//   y[r][o] = sum_g  scale[o][g] * (sum_k w[o][g*32+k] * x[r][g*32+k])  +  offset[o][g] * xsum[r][g]
//
// with w the stored integers (0..15 for 4-bit, -128..127 for 8-bit), xsum[r][g] the sum of row r's 32 values in
// group g, and offset the 4-bit groups' additive term (none for Q8_0). Sums are fp32, in another order than a
// dense product of the dequantized weight: equal to it within fp32 rounding (tests/test_kernels.py).
//
// Output rows are split over torch's intra-op threads (at::parallel_for, OpenMP).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define JUSTAPI_Q_GEMV 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;

#if defined(JUSTAPI_Q_GEMV)
inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// a 4-bit group (16 bytes; byte j holds weight j in its low nibble and weight j + 16 in its high one, as GGUF
// stores Q4_0/Q4_1) as 32 fp32 values in w[0..3]
struct Q4Group {
  static constexpr int64_t kBytes = 16;
  static inline void expand(const uint8_t* p, __m256* w) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
};

// an 8-bit group (32 signed bytes in order) as 32 fp32 values
struct Q8Group {
  static constexpr int64_t kBytes = 32;
  static inline void expand(const uint8_t* p, __m256* w) {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
};

template <typename Unit, int R>
void gemv(const float* x, int64_t in, const uint8_t* wq, const float* scale, const float* offset, const float* xsum,
          int64_t out, float* y) {
  const int64_t groups = in / kGroup, row_bytes = groups * Unit::kBytes;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* wo = wq + o * row_bytes;
      const float* so = scale + o * groups;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m256 w[4];
        Unit::expand(wo + g * Unit::kBytes, w);
        const __m256 s = _mm256_set1_ps(so[g]);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * in + g * kGroup;
          __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
          p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), p);
          p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), p);
          p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), p);
          acc[r] = _mm256_fmadd_ps(p, s, acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        float c = 0.f;
        if (offset != nullptr) {
          const float* fo = offset + o * groups;
          const float* xs = xsum + r * groups;
          for (int64_t g = 0; g < groups; ++g) c += fo[g] * xs[g];
        }
        y[r * out + o] = hsum(acc[r]) + c;
      }
    }
  });
}

template <typename Unit>
void gemv_rows(int64_t rows, const float* x, int64_t in, const uint8_t* wq, const float* scale, const float* offset,
               const float* xsum, int64_t out, float* y) {
  switch (rows) {  // the rows' accumulators in registers: one instance per row count
    case 1: return gemv<Unit, 1>(x, in, wq, scale, offset, xsum, out, y);
    case 2: return gemv<Unit, 2>(x, in, wq, scale, offset, xsum, out, y);
    case 3: return gemv<Unit, 3>(x, in, wq, scale, offset, xsum, out, y);
    case 4: return gemv<Unit, 4>(x, in, wq, scale, offset, xsum, out, y);
    case 5: return gemv<Unit, 5>(x, in, wq, scale, offset, xsum, out, y);
    case 6: return gemv<Unit, 6>(x, in, wq, scale, offset, xsum, out, y);
    case 7: return gemv<Unit, 7>(x, in, wq, scale, offset, xsum, out, y);
    default: return gemv<Unit, 8>(x, in, wq, scale, offset, xsum, out, y);
  }
}
#endif  // JUSTAPI_Q_GEMV

}  // namespace

bool q_gemv_available() {
#if defined(JUSTAPI_Q_GEMV)
  return true;
#else
  return false;
#endif
}

// x [rows <= 8, in] fp32; wq [out, in / 32 * group bytes] uint8 (bits 4 or 8); scale, offset [out, in / 32] fp32
// (offset: 4-bit only) -> [rows, out] fp32
torch::Tensor q_gemv(torch::Tensor x, torch::Tensor wq, torch::Tensor scale, c10::optional<torch::Tensor> offset,
                     int64_t bits) {
  TORCH_CHECK(q_gemv_available(), "q_gemv: built without AVX2 and FMA");
  TORCH_CHECK(bits == 4 || bits == 8, "q_gemv: 4 or 8 bits");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "q_gemv: 1 to 8 fp32 rows expected");
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup, out = wq.size(0);
  const int64_t group_bytes = bits == 4 ? 16 : 32;
  TORCH_CHECK(in % kGroup == 0 && wq.dim() == 2 && wq.scalar_type() == torch::kUInt8 &&
                  wq.size(1) == groups * group_bytes,
              "q_gemv: weight bytes do not match the rows' width");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.sizes() == torch::IntArrayRef({out, groups}),
              "q_gemv: [out, in / 32] fp32 scales expected");
  TORCH_CHECK((bits == 4) == offset.has_value(), "q_gemv: an offset for 4-bit weights, none for 8-bit");
  x = x.contiguous();
  wq = wq.contiguous();
  scale = scale.contiguous();
  torch::Tensor off;
  std::vector<float> xsum;  // each row's sum over each group, for the 4-bit offsets
  if (offset.has_value()) {
    off = offset->contiguous();
    TORCH_CHECK(off.scalar_type() == torch::kFloat32 && off.sizes() == scale.sizes(), "q_gemv: offset like scale");
    const float* xp = x.data_ptr<float>();
    xsum.assign(rows * groups, 0.f);
    for (int64_t i = 0; i < rows * groups; ++i)
      for (int64_t k = 0; k < kGroup; ++k) xsum[i] += xp[i * kGroup + k];
  }
  auto y = torch::empty({rows, out}, x.options());
#if defined(JUSTAPI_Q_GEMV)
  const float* op = offset.has_value() ? off.data_ptr<float>() : nullptr;
  const float* xs = offset.has_value() ? xsum.data() : nullptr;
  if (bits == 4)
    gemv_rows<Q4Group>(rows, x.data_ptr<float>(), in, wq.data_ptr<uint8_t>(), scale.data_ptr<float>(), op, xs, out,
                       y.data_ptr<float>());
  else
    gemv_rows<Q8Group>(rows, x.data_ptr<float>(), in, wq.data_ptr<uint8_t>(), scale.data_ptr<float>(), op, xs, out,
                       y.data_ptr<float>());
#endif
  return y;
}
