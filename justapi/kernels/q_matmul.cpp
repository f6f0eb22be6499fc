// fp32 rows times a GGUF-quantized weight (4-bit Q4_0/Q4_1 or 8-bit Q8_0 groups of 32) with integer multiply-adds,
// on AVX2: the decode-sized products of a model computing in fp32 on a CPU without a bf16 matmul (AMD Zen 3...).
//
// Each row is first rounded to integers per group of 32:
//
//   xq = round(x * 32258 / amax)   (|xq| <= 32258),   dx = amax / 32258,   xs = sum of the group's fp32 values
//
// and the weights' integers multiply xq exactly:
//
//   y[r][o] = sum_g  scale[o][g] * dx[r][g] * (sum_k w[o][g*32+k] * xq[r][g*32+k])  +  offset[o][g] * xs[r][g]
//
// with w the stored integers (0..15 for 4-bit, -128..127 for 8-bit) and offset the 4-bit groups' additive term
// (none for Q8_0). 8-bit weights meet xq as int16 in vpmaddwd (16 products a vector, summed in pairs into int32).
// 4-bit weights meet it as two bytes, xq = 254 * hi + lo with hi = round(xq / 254) and lo in [-127, 127]
// (32258 = 254 * 127), in vpmaddubsw (32 products of unsigned by signed bytes a vector, summed in pairs into
// int16): the same instructions per product as vpmaddwd, and a 4-bit weight widens to bytes without crossing
// 128-bit lanes. The integer sums are exact (at most 32 * 128 * 32258 < 2^31; in int16 see block4); the result is
// the product of the dequantized weight with the rounded rows, within fp32 rounding (tests/test_kernels.py), and
// the rows' rounding is about 2^-16 of each group's largest value: far below bf16's 2^-9 of each value. (8-bit
// rows alone, as llama.cpp rounds them, run faster but moved SmolLM2's logits by up to 0.27 nats:
// docs/benchmarks-archive.md.)
//
// Layout (quant.pack_for_q_matmul): 8 outputs side by side, so that the 8 lanes of an int32 vector are 8 outputs
// and scales apply as vectors (a last, partial block padded with zero weights). For each block of 8 outputs and
// each group of 32 inputs, an 8-bit block holds 16 steps of 16 bytes, step t inputs 2t, 2t+1 of the 8 outputs
// (output j at bytes 2j, 2j+1): one vpmaddwd against the row's 2 inputs broadcast to all lanes. A 4-bit block
// holds 4 chunks of 32 bytes, chunk c inputs 8c..8c+3 of the 8 outputs in the low nibbles and 8c+4..8c+7 in the
// high ones (output j at bytes 4j..4j+3): two vpmaddubsw (low, high) for each of hi and lo against the row's 4
// bytes broadcast.
//
// Blocks of outputs are split over torch's intra-op threads (at::parallel_for, OpenMP); within a block, rows go a
// few at a time while the block's weights stay in L1.
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

constexpr int64_t kGroup = 32;  // weights per GGUF group
constexpr int64_t kOut = 8;     // outputs side by side in the packed layout
constexpr float kSteps = 32258.f;  // 254 * 127: xq = 254 * hi + lo with hi, lo in [-127, 127] (see the header)
// Rows whose sums are held in registers at once. 4-bit: a row's hi and lo sums and its fp32 result fill the 16
// vector registers at 4 rows; 3 and 5 measured slower than 4, and 6 with the results in memory no faster
// (a probe in docs/benchmarks-archive.md). 8-bit: 6 took 0.86-0.92x the time of 4 at 6-28 rows, measured
// when this int16 path served the 4-bit layers too.
constexpr int64_t kRowBlock4 = 4;
constexpr int64_t kRowBlock8 = 6;

#if defined(JUSTAPI_Q_MATMUL)
// n groups of 32 fp32 values -> xq (int16; the 8-bit weights' rows) or its bytes hi, lo (the 4-bit weights'), dx,
// xs as in the header
void quantize_groups(const float* x, int64_t n, int16_t* xq, int8_t* hi, int8_t* lo, float* dx, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f), k254 = _mm256_set1_ps(254.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving of lanes
  for (int64_t i = 0; i < n; ++i) {
    __m256 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm256_loadu_ps(x + i * kGroup + 8 * k);
    const float amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3]))));
    xs[i] = hadd8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    dx[i] = amax / kSteps;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kSteps / amax : 0.f);
    __m256i q[4];  // to nearest, ties to even
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(a[k], inv));
    if (xq != nullptr) {
      for (int k = 0; k < 4; k += 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup + 8 * k),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[k], q[k + 1]), 0xD8));
    } else {
      __m256i h[4], l[4];
      for (int k = 0; k < 4; ++k) {  // hi = round(xq / 254) (|xq| <= 32258 is exact in fp32), lo = xq - 254 hi
        const __m256 f = _mm256_cvtepi32_ps(q[k]);
        const __m256 hf = _mm256_round_ps(_mm256_div_ps(f, k254), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        h[k] = _mm256_cvtps_epi32(hf);
        l[k] = _mm256_cvtps_epi32(_mm256_sub_ps(f, _mm256_mul_ps(hf, k254)));  // exact: integers below 2^24
      }
      const __m256i hb = _mm256_packs_epi16(_mm256_packs_epi32(h[0], h[1]), _mm256_packs_epi32(h[2], h[3]));
      const __m256i lb = _mm256_packs_epi16(_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i * kGroup), _mm256_permutevar8x32_epi32(hb, order));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i * kGroup), _mm256_permutevar8x32_epi32(lb, order));
    }
  }
}

template <typename T>
inline __m256i broadcast4(const T* p) {  // 4 bytes (2 int16 or 4 int8 activations) in every lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// y[r] = acc[r] for the first `valid` of the block's outputs
template <int R>
inline void store(const __m256* acc, float* y, int64_t out, int64_t valid) {
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

// One block of kOut outputs of a 4-bit weight times R rows over all groups; w, scale, offset: the block's packed
// weight and terms. Per group, each row's hi and lo bytes meet the weights in vpmaddubsw (unsigned weights times
// signed bytes, pairs summed to int16); 8 of them sum to at most 8 * 2 * 15 * 127 = 30480 in each int16 lane, so
// the group's sums stay in int16 until one vpmaddwd each widens them, hi's times 254.
template <int R>
inline void block4(const uint8_t* w, const float* scale, const float* offset, const int8_t* hi, const int8_t* lo,
                   const float* dx, const float* xs, int64_t in, int64_t groups, float* y, int64_t out,
                   int64_t valid) {
  const __m256i low = _mm256_set1_epi8(0x0F), k254 = _mm256_set1_epi16(254), one = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t x0 = g * kGroup;
    const uint8_t* wg = w + g * 128;
    __m256i sh[R], sl[R];
    for (int r = 0; r < R; ++r) sh[r] = sl[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // steps 2c (low nibbles: inputs 8c..8c+3) and 2c + 1 (high: 8c+4..8c+7)
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
      const __m256i even = _mm256_and_si256(b, low), odd = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * in + x0 + 8 * c;
        sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(even, broadcast4(hi + at)));
        sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(odd, broadcast4(hi + at + 4)));
        sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(even, broadcast4(lo + at)));
        sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(odd, broadcast4(lo + at + 4)));
      }
    }
    const __m256 s = _mm256_loadu_ps(scale + g * kOut), o = _mm256_loadu_ps(offset + g * kOut);
    for (int r = 0; r < R; ++r) {
      const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(sh[r], k254), _mm256_madd_epi16(sl[r], one));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * groups + g)),
                               acc[r]);
      acc[r] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(xs + r * groups + g), acc[r]);
    }
  }
  store<R>(acc, y, out, valid);
}

// One block of kOut outputs of an 8-bit weight times R rows: one vpmaddwd a step, the rows' int16 xq
template <int R>
inline void block8(const uint8_t* w, const float* scale, const int16_t* xq, const float* dx, int64_t in,
                   int64_t groups, float* y, int64_t out, int64_t valid) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int16_t* xg = xq + g * kGroup;
    const uint8_t* wg = w + g * 16 * 16;
    __m256i sum[R];  // the group's integer sums, a lane per output
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int t = 0; t < 16; ++t) {
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16 * t)));
      for (int r = 0; r < R; ++r)
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(b, broadcast4(xg + r * in + 2 * t)));
    }
    const __m256 s = _mm256_loadu_ps(scale + g * kOut);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * groups + g)),
                               acc[r]);
  }
  store<R>(acc, y, out, valid);
}

// n <= R rows (from the pointers' first) of one block of outputs: one instance of the block per count
template <int Bits, int R>
inline void some_rows(int64_t n, const int16_t* xq, const int8_t* hi, const int8_t* lo, const float* dx,
                      const float* xs, int64_t in, int64_t groups, const uint8_t* wb, const float* sb, const float* ob,
                      float* y, int64_t out, int64_t valid) {
  if constexpr (R > 1) {
    if (n < R) return some_rows<Bits, R - 1>(n, xq, hi, lo, dx, xs, in, groups, wb, sb, ob, y, out, valid);
  }
  if constexpr (Bits == 4)
    block4<R>(wb, sb, ob, hi, lo, dx, xs, in, groups, y, out, valid);
  else
    block8<R>(wb, sb, xq, dx, in, groups, y, out, valid);
}

template <int Bits>
void matmul(int64_t rows, const int16_t* xq, const int8_t* hi, const int8_t* lo, const float* dx, const float* xs,
            int64_t in, const uint8_t* w, const float* scale, const float* offset, int64_t out, float* y) {
  constexpr int R = Bits == 4 ? kRowBlock4 : kRowBlock8;
  const int64_t groups = in / kGroup, block_bytes = groups * Bits * 32;
  at::parallel_for(0, (out + kOut - 1) / kOut, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t valid = std::min(kOut, out - b * kOut);
      const uint8_t* wb = w + b * block_bytes;
      const float* sb = scale + b * groups * kOut;
      const float* ob = offset == nullptr ? nullptr : offset + b * groups * kOut;
      for (int64_t r0 = 0; r0 < rows; r0 += R) {  // rows R at a time while the block's weights stay in L1
        const int64_t at = r0 * in;
        some_rows<Bits, R>(std::min<int64_t>(R, rows - r0), Bits == 8 ? xq + at : nullptr, Bits == 4 ? hi + at : nullptr,
                           Bits == 4 ? lo + at : nullptr, dx + r0 * groups, xs + r0 * groups, in, groups, wb, sb, ob,
                           y + r0 * out + b * kOut, out, valid);
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
  const int64_t groups_all = rows * groups;
  std::vector<int16_t> xq(bits == 8 ? rows * in : 0);
  std::vector<int8_t> hi(bits == 4 ? rows * in : 0), lo(bits == 4 ? rows * in : 0);
  std::vector<float> dx(groups_all), xs(groups_all);
  quantize_groups(x.data_ptr<float>(), groups_all, bits == 8 ? xq.data() : nullptr, hi.data(), lo.data(), dx.data(),
                  xs.data());
  if (bits == 4)
    matmul<4>(rows, nullptr, hi.data(), lo.data(), dx.data(), xs.data(), in, w.data_ptr<uint8_t>(),
              scale.data_ptr<float>(), off.data_ptr<float>(), out, y.data_ptr<float>());
  else
    matmul<8>(rows, xq.data(), nullptr, nullptr, dx.data(), xs.data(), in, w.data_ptr<uint8_t>(),
              scale.data_ptr<float>(), nullptr, out, y.data_ptr<float>());
#endif
  return y;
}
