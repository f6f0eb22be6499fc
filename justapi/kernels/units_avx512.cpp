// The packed units of q_units.h multiplied with AVX-512 instead of AMX tiles, for CPUs that have AVX-512 BF16 but
// no AMX (AMD Zen 4, Intel Cooper Lake), and for a few rows on every AVX-512 CPU:
//
// - dpbf16 (int4_dpbf16_matmul, q8_dpbf16_matmul): bf16 rows, any number. Each pair of blocks of 16 outputs has its
//   groups expanded to bf16 once (as for the AMX tiles: the same values) into a buffer that passes of up to 8 rows
//   read; each expanded row (16 outputs x an input pair) is one vdpbf16ps operand, multiplied with each row's input
//   pair broadcast. Products accumulate in fp32 over the input dimension in order, the result rounded to bf16 once. The
//   weight is read as stored (4 or 8 bits and its terms), where a dense bf16 copy reads 2 bytes a weight and holds
//   them in memory. The units are prefetched into L2 ahead of their expansion (kPrefetchAhead).
// - q8_small (q8_small_matmul): 1-4 fp32 rows times 8-bit units with fp32 FMAs, the weights exact.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "q_units.h"

namespace {

constexpr int64_t kQ8SmallRows = 4;
// rows per pass over a pair of blocks: 16 accumulators (8 rows x 2 blocks of 16 outputs); on a Zen 4, at SmolLM2's
// widths, pairs take 0.80-0.91x the time of single blocks at 16-512 rows, and passes of 6 or 12 rows within 2%
constexpr int64_t kDpRows = 8;

#ifdef JUSTAPI_UNITS_AVX512
// A few rows (single-stream decode, up to kQ8SmallRows) times Q8 units with AVX-512 FMAs instead of tiles: a tile
// pass expands each unit to bf16 for a 16-row tile that holds 1-4 rows, so at one row the expansion, not the memory,
// bounds it. Here each unit's 16 steps are widened to fp32 once and multiplied by each row's input pair; a step's
// lanes hold (output, input parity) pairs, summed pairwise after the group and scaled by the group's 16 scales.
// The weights stay exact (no bf16 rounding); products accumulate in fp32 in order of the groups.
template <int M, int kSets, bool kZero>
void q8_small_rows(const float* x, int64_t k, const uint8_t* packed, int64_t n, float* out) {
  using Unit = justapi::Q8Unit<kSets, kZero>;
  const int64_t groups = k / 32, blocks = n / 16;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      __m512 total[M];
      for (int i = 0; i < M; ++i) total[i] = _mm512_setzero_ps();
      const uint8_t* units = packed + blk * groups * Unit::kBytes;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* unit = units + g * Unit::kBytes;
        const float* terms = reinterpret_cast<const float*>(unit + 512);
        for (int set = 0; set < kSets; ++set) {
          __m512 lo[M], hi[M];  // outputs 0..7 and 8..15, each lane one (output, parity)
          float xsum[M];  // the set's inputs summed: what its zeros multiply
          for (int i = 0; i < M; ++i) lo[i] = hi[i] = _mm512_setzero_ps(), xsum[i] = 0.0f;
          for (int r = set * 16 / kSets; r < (set + 1) * 16 / kSets; ++r) {
            const int8_t* row = reinterpret_cast<const int8_t*>(unit + 32 * r);
            const __m512 w_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
            const __m512 w_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
            for (int i = 0; i < M; ++i) {
              const float* xr = x + i * k + g * 32 + 2 * r;
              double pair;  // x[2r], x[2r + 1] of this group, repeated over the 8 outputs
              std::memcpy(&pair, xr, 8);
              const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
              lo[i] = _mm512_fmadd_ps(w_lo, xp, lo[i]);
              hi[i] = _mm512_fmadd_ps(w_hi, xp, hi[i]);
              if (kZero) xsum[i] += xr[0] + xr[1];
            }
          }
          const __m512 scales = _mm512_loadu_ps(terms + 16 * set);
          for (int i = 0; i < M; ++i) {
            const __m512 sums = _mm512_add_ps(_mm512_permutex2var_ps(lo[i], even, hi[i]),
                                              _mm512_permutex2var_ps(lo[i], odd, hi[i]));
            total[i] = _mm512_fmadd_ps(sums, scales, total[i]);
            if (kZero)
              total[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i]), _mm512_loadu_ps(terms + 16 * (kSets + set)), total[i]);
          }
        }
      }
      for (int i = 0; i < M; ++i) _mm512_storeu_ps(out + i * n + blk * 16, total[i]);
    }
  });
}

// R rows of x (row stride k) times B blocks of 16 outputs whose `groups` groups are expanded in `e` (block b at
// e + b * groups * 512), into o (row stride n), rounded to bf16. Each x pair broadcast feeds B products and each
// expanded row R.
template <int R, int B>
inline void dp_pass(const uint16_t* x, int64_t k, int64_t groups, const uint16_t* e, uint16_t* o, int64_t n) {
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < R; ++i) acc[b][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* xg = x + g * 32;
    for (int r = 0; r < 16; ++r) {
      __m512bh w[B];
      for (int b = 0; b < B; ++b) w[b] = (__m512bh)_mm512_load_si512(e + (b * groups + g) * 16 * 32 + 32 * r);
      for (int i = 0; i < R; ++i) {
        int32_t pair;  // x[2r], x[2r + 1] of this group, for each of the 16 outputs
        std::memcpy(&pair, xg + i * k + 2 * r, 4);
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < B; ++b) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], xp, w[b]);
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < R; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i * n + 16 * b), (__m256i)_mm512_cvtneps_pbh(acc[b][i]));
}

template <int B>
void dp_rows(int64_t rows, const uint16_t* x, int64_t k, int64_t groups, const uint16_t* e, uint16_t* o, int64_t n) {
  switch (rows) {
    case 1: dp_pass<1, B>(x, k, groups, e, o, n); break;
    case 2: dp_pass<2, B>(x, k, groups, e, o, n); break;
    case 3: dp_pass<3, B>(x, k, groups, e, o, n); break;
    case 4: dp_pass<4, B>(x, k, groups, e, o, n); break;
    case 5: dp_pass<5, B>(x, k, groups, e, o, n); break;
    case 6: dp_pass<6, B>(x, k, groups, e, o, n); break;
    case 7: dp_pass<7, B>(x, k, groups, e, o, n); break;
    default: dp_pass<kDpRows, B>(x, k, groups, e, o, n); break;
  }
}

// The units are read once a call, in order, but expanded in bursts between passes that touch no memory, so the
// hardware prefetcher, which follows a stream only while it is read, starts each burst cold: expanding SmolLM2's
// units from memory took twice their time in cache (Zen 4). So each unit's lines are prefetched into L2 10 KB
// ahead (into the next pair's units near a pair's end: the passes over this pair give them time to arrive). Zen 4,
// SmolLM2's layers at 8 / 28 rows: 0.84x / 0.93x the time, its 8-bit head 0.70x / 0.79x; 5 and 20 KB within noise
// of it, chunk-sized batches unchanged (docs/benchmarks.md).
constexpr int64_t kPrefetchAhead = 10240;

template <typename Unit>
inline void prefetch_unit(const uint8_t* unit) {
  for (int64_t c = 0; c < Unit::kBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(unit) + c, _MM_HINT_T1);
}

template <typename Unit>
void matmul_dpbf16(const uint16_t* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, uint16_t* out) {
  const int64_t groups = k / 32, blocks = n / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const uint8_t* end = packed + b1 * groups * Unit::kBytes;  // this thread's units end here
    std::vector<uint16_t> buffer(2 * groups * 16 * 32 + 32);  // 2 * k * 32 bytes: two blocks' groups expanded
    uint16_t* expanded = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) / 2 % 32);  // 64-byte aligned
    for (int64_t blk = b0; blk < b1; blk += 2) {
      const bool pair = blk + 1 < b1;  // else the range's last block, alone
      const uint8_t* units = packed + blk * groups * Unit::kBytes;
      for (int64_t g = 0; g < groups * (pair ? 2 : 1); ++g) {
        const uint8_t* unit = units + g * Unit::kBytes;
        if (end - unit > kPrefetchAhead) prefetch_unit<Unit>(unit + kPrefetchAhead);  // within the range
        Unit::expand(unit, expanded + g * 16 * 32);
      }
      for (int64_t m0 = 0; m0 < m; m0 += kDpRows) {
        const int64_t rows = std::min(kDpRows, m - m0);
        if (pair) dp_rows<2>(rows, x + m0 * k, k, groups, expanded, out + m0 * n + blk * 16, n);
        else dp_rows<1>(rows, x + m0 * k, k, groups, expanded, out + m0 * n + blk * 16, n);
      }
    }
  });
}

template <int kSets, bool kZero>
void q8_small_dispatch(int64_t m, const float* x, int64_t k, const uint8_t* packed, int64_t n, float* out) {
  switch (m) {
    case 1: q8_small_rows<1, kSets, kZero>(x, k, packed, n, out); break;
    case 2: q8_small_rows<2, kSets, kZero>(x, k, packed, n, out); break;
    case 3: q8_small_rows<3, kSets, kZero>(x, k, packed, n, out); break;
    case 4: q8_small_rows<4, kSets, kZero>(x, k, packed, n, out); break;
    default: break;
  }
}
#endif

// x [rows, in] bf16 times a weight packed in units of the format `Unit`, out_features -> [rows, out] bf16
template <typename Unit>
torch::Tensor dpbf16_matmul(const char* name, torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  x = justapi::checked_rows(name, x, packed, out_features, Unit::kBytes, torch::kBFloat16);
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  auto out = torch::empty({m, n}, x.options());
#ifdef JUSTAPI_UNITS_AVX512
  if (m > 0)
    matmul_dpbf16<Unit>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k,
                        packed.data_ptr<uint8_t>(), n, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#else
  TORCH_CHECK(false, name, ": built without AVX-512 BF16");
#endif
  return out;
}

}  // namespace

bool units_avx512_available() {
#ifdef JUSTAPI_UNITS_AVX512
  return true;
#else
  return false;
#endif
}

// x [rows, in] bf16, packed from int4_amx_pack, out_features -> [rows, out] bf16
torch::Tensor int4_dpbf16_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  return dpbf16_matmul<justapi::Q4Unit>("int4_dpbf16_matmul", x, packed, out_features);
}

// x [rows, in] bf16, packed from q8_amx_pack (with this group and zeros or not), out_features -> [rows, out] bf16
torch::Tensor q8_dpbf16_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                               bool has_zero) {
  TORCH_CHECK(group == 32 || group == 16, "q8_dpbf16_matmul: groups of 32 or 16 inputs expected");
  return justapi::with_q8_unit(group, has_zero, [&](auto unit) {
    return dpbf16_matmul<decltype(unit)>("q8_dpbf16_matmul", x, packed, out_features);
  });
}

// x [rows <= 4, in] fp32, packed from q8_amx_pack (this group, zeros or not), out_features -> [rows, out] fp32
torch::Tensor q8_small_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                              bool has_zero) {
  TORCH_CHECK(group == 32 || group == 16, "q8_small_matmul: groups of 32 or 16 inputs expected");
  x = justapi::checked_rows("q8_small_matmul", x, packed, out_features, justapi::q8_unit_bytes(32 / group, has_zero),
                            torch::kFloat32);
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(m <= kQ8SmallRows, "q8_small_matmul: at most 4 rows");
  auto out = torch::empty({m, n}, x.options());
#ifdef JUSTAPI_UNITS_AVX512
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  justapi::with_q8_unit(group, has_zero, [&](auto unit) {
    q8_small_dispatch<decltype(unit)::kGroupSets, decltype(unit)::kHasZero>(m, xp, k, pp, n, op);
  });
#else
  TORCH_CHECK(false, "q8_small_matmul: built without AVX-512 BF16");
#endif
  return out;
}
