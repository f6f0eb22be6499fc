// The packed units of q_units.h multiplied with AVX-512 instead of AMX tiles, for CPUs that have AVX-512 BF16 but
// no AMX (AMD Zen 4, Intel Cooper Lake), and for a few rows on every AVX-512 CPU:
//
// - dpbf16 (int4_dpbf16_matmul, q8_dpbf16_matmul): bf16 rows, any number. Each pair of blocks of 16 outputs has its
//   groups expanded to bf16 once (as for the AMX tiles: the same values) into a buffer that passes of up to 8 rows
//   read; each expanded row (16 outputs x an input pair) is one vdpbf16ps operand, multiplied with each row's input
//   pair broadcast. Products accumulate in fp32 over the input dimension in order, the result rounded to bf16 once. The
//   weight is read as stored (4 or 8 bits and its terms), where a dense bf16 copy reads 2 bytes a weight and holds
//   them in memory. The units are prefetched into L2 ahead of their expansion (kPrefetchAhead).
// - q8_small, q4_small (q8_small_matmul, int4_small_matmul): 1-4 fp32 rows times 8- or 4-bit units with fp32 FMAs,
//   the weights exact.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "q_units.h"

namespace {

constexpr int64_t kSmallRows = 4;  // the most rows q8_small and q4_small take
// rows per pass over a pair of blocks: 16 accumulators (8 rows x 2 blocks of 16 outputs); on a Zen 4, at SmolLM2's
// widths, pairs take 0.80-0.91x the time of single blocks at 16-512 rows, and passes of 6 or 12 rows within 2%
constexpr int64_t kDpRows = 8;

#ifdef JUSTAPI_UNITS_AVX512
// A few rows (single-stream decode, up to kSmallRows) times the units with AVX-512 FMAs instead of tiles or
// vdpbf16ps: a tile pass (or dpbf16's) expands each unit to bf16 for 1-4 rows, so at one row the expansion, not
// the memory, bounds it. Here each unit's 16 steps are widened to fp32 once (Unit::widen) and multiplied by each
// row's input pair; a step's lanes hold (output, input parity) pairs, summed pairwise after the group and scaled by
// the group's 16 scales, plus the group's inputs summed times its zeros. The weights stay exact (no bf16 rounding);
// products accumulate in fp32 in order of the groups.
template <int M, typename Unit, typename Out>
void small_rows(const float* x, int64_t k, const uint8_t* packed, int64_t n, Out* out) {
  constexpr int kSets = Unit::kGroupSets;
  // one row alone: its steps summed into C accumulators each, four independent chains of fused multiply-adds
  // instead of one (SmolLM2's 4-bit layers at 1 row on a Zen 4: 0.87x the time of one chain, 0.97x of two; at 2
  // rows, with four chains already, one accumulator each does as well)
  constexpr int C = M == 1 ? 4 : 1;
  const int64_t groups = k / 32, blocks = n / 16;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  // each set's inputs summed once for all blocks (what its zeros multiply), pair by pair in order
  std::vector<float> xsums(Unit::kHasZero ? M * groups * kSets : 0);
  for (size_t j = 0; j < xsums.size(); ++j) {
    const float* xs = x + (j / (groups * kSets)) * k + (j % (groups * kSets)) * (32 / kSets);
    float sum = 0.0f;
    for (int e = 0; e < 32 / kSets; e += 2) sum += xs[e] + xs[e + 1];
    xsums[j] = sum;
  }
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      __m512 total[M];
      for (int i = 0; i < M; ++i) total[i] = _mm512_setzero_ps();
      const uint8_t* units = packed + blk * groups * Unit::kBytes;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* unit = units + g * Unit::kBytes;
        for (int set = 0; set < kSets; ++set) {
          __m512 lo[M][C], hi[M][C];  // outputs 0..7 and 8..15, each lane one (output, parity); step r in [.][r % C]
          for (int i = 0; i < M; ++i)
            for (int c = 0; c < C; ++c) lo[i][c] = hi[i][c] = _mm512_setzero_ps();
          for (int r0 = set * 16 / kSets; r0 < (set + 1) * 16 / kSets; r0 += C) {
            for (int c = 0; c < C; ++c) {
              const int r = r0 + c;
              __m512 w_lo, w_hi;
              Unit::widen(unit, r, w_lo, w_hi);
              for (int i = 0; i < M; ++i) {
                double pair;  // x[2r], x[2r + 1] of this group, repeated over the 8 outputs
                std::memcpy(&pair, x + i * k + g * 32 + 2 * r, 8);
                const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
                lo[i][c] = _mm512_fmadd_ps(w_lo, xp, lo[i][c]);
                hi[i][c] = _mm512_fmadd_ps(w_hi, xp, hi[i][c]);
              }
            }
          }
          const __m512 scales = Unit::scales(unit, set);
          for (int i = 0; i < M; ++i) {
            for (int c = 1; c < C; ++c) {
              lo[i][0] = _mm512_add_ps(lo[i][0], lo[i][c]);
              hi[i][0] = _mm512_add_ps(hi[i][0], hi[i][c]);
            }
            const __m512 sums = _mm512_add_ps(_mm512_permutex2var_ps(lo[i][0], even, hi[i][0]),
                                              _mm512_permutex2var_ps(lo[i][0], odd, hi[i][0]));
            total[i] = _mm512_fmadd_ps(sums, scales, total[i]);
            if (Unit::kHasZero)
              total[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsums[(i * groups + g) * kSets + set]), Unit::zeros(unit, set),
                                         total[i]);
          }
        }
      }
      for (int i = 0; i < M; ++i) {
        if constexpr (std::is_same_v<Out, float>)
          _mm512_storeu_ps(out + i * n + blk * 16, total[i]);
        else  // rounded to bf16 to nearest even, as torch's conversion rounds
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * n + blk * 16),
                              (__m256i)_mm512_cvtneps_pbh(total[i]));
      }
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

template <typename Unit, typename Out>
void small_dispatch(int64_t m, const float* x, int64_t k, const uint8_t* packed, int64_t n, Out* out) {
  switch (m) {
    case 1: small_rows<1, Unit>(x, k, packed, n, out); break;
    case 2: small_rows<2, Unit>(x, k, packed, n, out); break;
    case 3: small_rows<3, Unit>(x, k, packed, n, out); break;
    case 4: small_rows<4, Unit>(x, k, packed, n, out); break;
    default: break;
  }
}
#endif

// x [rows <= kSmallRows, in] fp32 or bf16 times a weight packed in units of the format `Unit` -> [rows, out] in x's
// dtype. bf16 rows are widened here (exactly) and the result rounded once: the same values as converting around
// an fp32 call, without two more torch calls a product (single-stream decode makes 120 such products a step).
template <typename Unit>
torch::Tensor small_matmul(const char* name, torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  x = justapi::checked_rows(name, x, packed, out_features, Unit::kBytes, bf16 ? torch::kBFloat16 : torch::kFloat32);
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(m <= kSmallRows, name, ": at most ", kSmallRows, " rows");
  auto out = torch::empty({m, n}, x.options());
#ifdef JUSTAPI_UNITS_AVX512
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  if (bf16) {
    std::vector<float> wide(m * k);
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t j = 0; j < m * k; ++j) {
      const uint32_t bits = static_cast<uint32_t>(xb[j]) << 16;
      std::memcpy(&wide[j], &bits, 4);
    }
    small_dispatch<Unit>(m, wide.data(), k, pp, n, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  } else {
    small_dispatch<Unit>(m, x.data_ptr<float>(), k, pp, n, out.data_ptr<float>());
  }
#else
  TORCH_CHECK(false, name, ": built without AVX-512 BF16");
#endif
  return out;
}

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

// x [rows <= 4, in] fp32 or bf16, packed from q8_amx_pack (this group, zeros or not), out_features -> [rows, out]
torch::Tensor q8_small_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                              bool has_zero) {
  TORCH_CHECK(group == 32 || group == 16, "q8_small_matmul: groups of 32 or 16 inputs expected");
  return justapi::with_q8_unit(group, has_zero, [&](auto unit) {
    return small_matmul<decltype(unit)>("q8_small_matmul", x, packed, out_features);
  });
}

// x [rows <= 4, in] fp32 or bf16, packed from int4_amx_pack, out_features -> [rows, out] in x's dtype
torch::Tensor int4_small_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  return small_matmul<justapi::Q4Unit>("int4_small_matmul", x, packed, out_features);
}
