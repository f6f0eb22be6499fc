// fp32 rows times a GGUF-quantized weight (4-bit Q4_0/Q4_1 or 8-bit Q8_0 groups of 32) with integer multiply-adds,
// on AVX2: the decode-sized products of a model computing in fp32 on a CPU without a bf16 matmul (AMD Zen 3...).
//
// Each row is first rounded to 16-bit integers per group of 32:
//
//   xq = round(x * 32767 / amax)   (|xq| <= 32767),   dx = amax / 32767,   xs = sum of the group's fp32 values
//
// so that one vpmaddwd multiplies 16 weights by 16 activations and sums them in pairs into int32. Then
//
//   y[r][o] = sum_g  scale[o][g] * dx[r][g] * (sum_k w[o][g*32+k] * xq[r][g*32+k])  +  offset[o][g] * xs[r][g]
//
// with w the stored integers (0..15 for 4-bit, -128..127 for 8-bit) and offset the 4-bit groups' additive term
// (none for Q8_0). The integer sums are exact (at most 32 * 128 * 32767 < 2^31); the result is the product of the
// dequantized weight with the 16-bit rows, within fp32 rounding (tests/test_kernels.py), and the rows' rounding
// is about 2^-16 of each group's largest value: far below bf16's 2^-9 of each value. (8-bit rows, as llama.cpp
// rounds them, run faster with vpmaddubsw but moved SmolLM2's logits by up to 0.27 nats: docs/benchmarks.md.)
//
// Layout (quant.pack_for_q_matmul): 8 outputs side by side, so that the 8 lanes of an int32 vector are 8 outputs
// and scales apply as vectors (a last, partial block padded with zero weights). For each block of 8 outputs and
// each group of 32 inputs, step t (t = 0..15) holds inputs 2t, 2t+1 of the 8 outputs (output j at positions 2j,
// 2j+1); a 4-bit block stores steps 2c and 2c+1 in the low and high nibbles of the same 16 bytes, an 8-bit block
// each step in 16 bytes. One step is then one vpmaddwd against the row's 2 inputs broadcast to all lanes.
//
// Blocks of outputs are split over torch's intra-op threads (at::parallel_for, OpenMP); within a block, rows go 6
// at a time while the block's weights stay in L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define JUSTAPI_Q_MATMUL 1
#include <immintrin.h>

#include "avx2_reduce.h"
#endif

namespace {

constexpr int64_t kGroup = 32;   // weights per GGUF group
constexpr int64_t kOut = 8;      // outputs side by side in the packed layout
constexpr int64_t kRowBlock = 6; // rows whose sums are held in registers at once (0.86-0.92x the time of 4 at 6-28
                                 // rows, SmolLM2's shapes; more would not fit the 16 vector registers)

#if defined(JUSTAPI_Q_MATMUL)
// n groups of 32 fp32 values -> xq (int16), dx, xs as in the header
void quantize_groups(const float* x, int64_t n, int16_t* xq, float* dx, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; ++i) {
    __m256 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm256_loadu_ps(x + i * kGroup + 8 * k);
    const float amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3]))));
    xs[i] = hadd8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    dx[i] = amax / 32767.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int k = 0; k < 4; k += 2) {  // to nearest, ties to even; the packs interleave 128-bit lanes, undone
      const __m256i n16 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a[k], inv)),
                                             _mm256_cvtps_epi32(_mm256_mul_ps(a[k + 1], inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup + 8 * k), _mm256_permute4x64_epi64(n16, 0xD8));
    }
  }
}

inline __m256i broadcast2(const int16_t* p) {  // 2 activations in every lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// one block of kOut outputs (the first `valid` of them real) times R rows over all groups; w, scale, offset: the
// block's packed weight and terms
template <int Bits, int R>
inline void block(const uint8_t* w, const float* scale, const float* offset, const int16_t* xq, const float* dx,
                  const float* xs, int64_t in, int64_t groups, float* y, int64_t out, int64_t valid) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int16_t* xg = xq + g * kGroup;
    __m256i sum[R];  // the group's integer sums, a lane per output
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    if constexpr (Bits == 4) {
      const uint8_t* wg = w + g * 16 * 8;
      for (int c = 0; c < 8; ++c) {  // steps 2c (low nibbles) and 2c + 1 (high), widened to int16
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16 * c));
        const __m256i even = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
        const __m256i odd = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
        for (int r = 0; r < R; ++r) {
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(even, broadcast2(xg + r * in + 4 * c)));
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(odd, broadcast2(xg + r * in + 4 * c + 2)));
        }
      }
    } else {
      const uint8_t* wg = w + g * 16 * 16;
      for (int t = 0; t < 16; ++t) {
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16 * t)));
        for (int r = 0; r < R; ++r)
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(b, broadcast2(xg + r * in + 2 * t)));
      }
    }
    const __m256 s = _mm256_loadu_ps(scale + g * kOut);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * groups + g)),
                               acc[r]);
    if constexpr (Bits == 4) {
      const __m256 o = _mm256_loadu_ps(offset + g * kOut);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(xs + r * groups + g), acc[r]);
    }
  }
  if (valid == kOut) {
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out, acc[r]);
  } else {  // the last block of a weight whose outputs are not a multiple of 8 (padded with zeros)
    alignas(32) float lanes[kOut];
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(lanes, acc[r]);
      std::memcpy(y + r * out, lanes, valid * sizeof(float));
    }
  }
}

template <int Bits>
void matmul(int64_t rows, const int16_t* xq, const float* dx, const float* xs, int64_t in, const uint8_t* w,
            const float* scale, const float* offset, int64_t out, float* y) {
  const int64_t groups = in / kGroup, block_bytes = groups * Bits * 32;
  at::parallel_for(0, (out + kOut - 1) / kOut, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t valid = std::min(kOut, out - b * kOut);
      const uint8_t* wb = w + b * block_bytes;
      const float* sb = scale + b * groups * kOut;
      const float* ob = offset == nullptr ? nullptr : offset + b * groups * kOut;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int16_t* xr = xq + r0 * in;
        const float *d = dx + r0 * groups, *s = xs + r0 * groups;
        float* yr = y + r0 * out + b * kOut;
        switch (std::min(kRowBlock, rows - r0)) {  // the rows' sums in registers: one instance per count
          case 1: block<Bits, 1>(wb, sb, ob, xr, d, s, in, groups, yr, out, valid); break;
          case 2: block<Bits, 2>(wb, sb, ob, xr, d, s, in, groups, yr, out, valid); break;
          case 3: block<Bits, 3>(wb, sb, ob, xr, d, s, in, groups, yr, out, valid); break;
          case 4: block<Bits, 4>(wb, sb, ob, xr, d, s, in, groups, yr, out, valid); break;
          case 5: block<Bits, 5>(wb, sb, ob, xr, d, s, in, groups, yr, out, valid); break;
          default: block<Bits, 6>(wb, sb, ob, xr, d, s, in, groups, yr, out, valid); break;
        }
      }
    }
  });
}
#endif  // JUSTAPI_Q_MATMUL

}  // namespace

bool q_matmul_available() {
#if defined(JUSTAPI_Q_MATMUL)
  return true;
#else
  return false;
#endif
}

// x [rows, in] fp32; w [blocks, in / 32 * bits * 32] uint8; scale, offset [blocks, in / 32, 8] fp32 (offset:
// 4-bit only), packed as in the header, blocks = ceil(out / 8) -> [rows, out] fp32
torch::Tensor q_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> offset,
                       int64_t bits, int64_t out) {
  TORCH_CHECK(q_matmul_available(), "q_matmul: built without AVX2 and FMA");
  TORCH_CHECK(bits == 4 || bits == 8, "q_matmul: 4 or 8 bits");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "q_matmul: fp32 rows expected");
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup;
  TORCH_CHECK(in % kGroup == 0 && scale.dim() == 3 && scale.size(1) == groups && scale.size(2) == kOut &&
                  scale.scalar_type() == torch::kFloat32,
              "q_matmul: [out / 8, in / 32, 8] fp32 scales expected for rows of width ", in);
  TORCH_CHECK(out > 0 && (out + kOut - 1) / kOut == scale.size(0), "q_matmul: ", out, " outputs do not match ",
              scale.size(0), " blocks of 8");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.size(0) == scale.size(0) &&
                  w.size(1) == groups * bits * 32,
              "q_matmul: weight bytes do not match the scales");
  TORCH_CHECK((bits == 4) == offset.has_value(), "q_matmul: an offset for 4-bit weights, none for 8-bit");
  TORCH_CHECK(!offset.has_value() || (offset->sizes() == scale.sizes() && offset->scalar_type() == torch::kFloat32),
              "q_matmul: offset like scale");
  x = x.contiguous();
  w = w.contiguous();
  scale = scale.contiguous();
  torch::Tensor off = offset.has_value() ? offset->contiguous() : torch::Tensor();
  auto y = torch::empty({rows, out}, x.options());
  if (rows == 0) return y;
#if defined(JUSTAPI_Q_MATMUL)
  std::vector<int16_t> xq(rows * in);
  std::vector<float> dx(rows * groups), xs(rows * groups);
  quantize_groups(x.data_ptr<float>(), rows * groups, xq.data(), dx.data(), xs.data());
  if (bits == 4)
    matmul<4>(rows, xq.data(), dx.data(), xs.data(), in, w.data_ptr<uint8_t>(), scale.data_ptr<float>(),
              off.data_ptr<float>(), out, y.data_ptr<float>());
  else
    matmul<8>(rows, xq.data(), dx.data(), xs.data(), in, w.data_ptr<uint8_t>(), scale.data_ptr<float>(), nullptr,
              out, y.data_ptr<float>());
#endif
  return y;
}
