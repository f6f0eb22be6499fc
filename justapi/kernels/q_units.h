// The packed weight units that int4_matmul.cpp's AMX tiles and units_avx512.cpp's AVX-512 kernels read: one unit per
// (block of 16 outputs, group of 32 inputs), the units of a block contiguous, and their expansion into 16 rows of
// 32 bf16 (an AMX B tile, or 16 vdpbf16ps operands). The formats are plain bytes, packed on any CPU (the packers in
// int4_matmul.cpp); the expansions need AVX-512 with BF16 (JUSTAPI_UNITS_AVX512).
//
// 4-bit unit (GGUF Q4_0/Q4_1/Q4_K, w = (q - 8) * scale + zero), 320 bytes:
//
//   bytes   0..255  16 rows r (pairs of inputs 2r, 2r+1) x 16 bytes: byte b holds, low nibble, q of output b/2 at
//                   input 2r + b%2 and, high nibble, q of output 8 + b/2 at the same input
//   bytes 256..287  16 scales (bf16), outputs 0..15
//   bytes 288..319  16 zeros (bf16)
//
// 8-bit unit (Q8_0 and Q5_0, widened exactly; Q5_1, Q5_K and Q6_K with their zeros or 16-wide groups): w = q * s
// (+ z), q int8, s (and z) fp32 per output and group of 32 inputs, or of 16 (kSets = 2: rows 0..7 of a unit, inputs
// 0..15, read set 0; rows 8..15 set 1): 16 rows r x 32 bytes (byte b: q of output b/2 at input 2r + b%2, an int8),
// then the scales, then the zeros (q8_unit_bytes).
//
// Expanded, row r is [out0: in 2r, 2r+1 | out1: ... | out15: ...] (bf16 pairs, "VNNI" order).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define JUSTAPI_UNITS_AVX512 1
#include <immintrin.h>
#endif

namespace justapi {

constexpr int64_t kUnitBytes = 320;  // a 4-bit unit
// an 8-bit unit: 512 bytes of integers, then S sets of 16 fp32 scales (S = 32 / group size), then, with zeros, S
// sets of 16 fp32 zeros
constexpr int64_t q8_unit_bytes(int64_t sets, bool zero) { return 512 + 64 * sets * (zero ? 2 : 1); }

inline uint16_t bf16_bits(float f) {  // f is bf16-exact (scales, zeros)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// A unit format: its bytes and its expansion into 16 rows of 32 bf16 (the layout above)
struct Q4Unit {
  static constexpr int64_t kBytes = kUnitBytes;
  static constexpr int kGroupSets = 1;
  static constexpr bool kHasZero = true;
  static void expand(const uint8_t* unit, uint16_t* b);
#ifdef JUSTAPI_UNITS_AVX512
  // row r exact in fp32 lanes (q - 8): lane j of `lo` is output j/2 at input 2r + j%2, of `hi` output 8 + j/2
  static void widen(const uint8_t* unit, int r, __m512& lo, __m512& hi);
  static __m512 scales(const uint8_t* unit, int set);  // the 16 outputs' scales (fp32)
  static __m512 zeros(const uint8_t* unit, int set);
#endif
};

template <int kSets, bool kZero>
struct Q8Unit {
  static constexpr int kGroupSets = kSets;  // groups of 32 / kSets inputs
  static constexpr bool kHasZero = kZero;
  static constexpr int64_t kBytes = q8_unit_bytes(kSets, kZero);
  static void expand(const uint8_t* unit, uint16_t* b);
#ifdef JUSTAPI_UNITS_AVX512
  static void widen(const uint8_t* unit, int r, __m512& lo, __m512& hi);  // as Q4Unit's
  static __m512 scales(const uint8_t* unit, int set) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(unit + 512) + 16 * set);
  }
  static __m512 zeros(const uint8_t* unit, int set) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(unit + 512) + 16 * (kSets + set));
  }
#endif
};

// f(Q8Unit<...>{}) for the unit format of an 8-bit weight with groups of `group` inputs (32 or 16) and zeros or not
template <typename F>
auto with_q8_unit(int64_t group, bool has_zero, F f) {
  if (group == 32 && !has_zero) return f(Q8Unit<1, false>{});
  if (group == 32) return f(Q8Unit<1, true>{});
  if (!has_zero) return f(Q8Unit<2, false>{});
  return f(Q8Unit<2, true>{});
}

// x [rows, in] (of `dtype`) against a weight of `out_features` outputs packed in units of `unit_bytes`: checked
// (the message names the kernel), made contiguous
inline torch::Tensor checked_rows(const char* name, torch::Tensor x, const torch::Tensor& packed, int64_t out_features,
                                  int64_t unit_bytes, c10::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, name, ": x [rows, in] ", c10::toString(dtype), " expected");
  const int64_t k = x.size(1), n = out_features;
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0 && packed.numel() == n / 16 * k / 32 * unit_bytes, name,
              ": packed weight does not match the input width");
  return x.contiguous();
}

#ifdef JUSTAPI_UNITS_AVX512
// The integers of row r as fp32 lanes, exact: Q8, sign-extended; Q4, q - 8 for q = 0..15 looked up by q
// (permutexvar reads only the low 4 bits of each index, so a lane holding a whole byte looks up its low nibble, and
// the byte shifted right by 4 its high nibble)
template <int kSets, bool kZero>
inline void Q8Unit<kSets, kZero>::widen(const uint8_t* unit, int r, __m512& lo, __m512& hi) {
  const __m128i* row = reinterpret_cast<const __m128i*>(unit + 32 * r);
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1)));
}

inline void Q4Unit::widen(const uint8_t* unit, int r, __m512& lo, __m512& hi) {
  const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 16 * r)));
  lo = _mm512_permutexvar_ps(bytes, centred);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), centred);
}

inline __m512 widen_bf16(const uint8_t* p) {  // 16 bf16 -> fp32, exact
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 Q4Unit::scales(const uint8_t* unit, int) { return widen_bf16(unit + 256); }
inline __m512 Q4Unit::zeros(const uint8_t* unit, int) { return widen_bf16(unit + 288); }

// Expanded to bf16: w = q * s (+ z) per lane. Q8_0: q * d, exact in fp32 (an 8-bit integer times an 11-bit
// significand) — the values gguf's dequantize gives —, then rounded to bf16 as torch's conversion rounds them. Q4:
// (q - 8) * scale is exact in fp32 (a 4-bit integer times an 8-bit significand), so one fused multiply-add rounds
// exactly as torch's multiply then add do.
template <typename Unit>
inline void expand_unit(const uint8_t* unit, uint16_t* b) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  constexpr int kSets = Unit::kGroupSets;
  for (int set = 0; set < kSets; ++set) {
    const __m512 scales = Unit::scales(unit, set);
    const __m512 s_lo = _mm512_permutexvar_ps(lo_idx, scales), s_hi = _mm512_permutexvar_ps(hi_idx, scales);
    __m512 z_lo = _mm512_setzero_ps(), z_hi = _mm512_setzero_ps();
    if (Unit::kHasZero) {
      const __m512 zeros = Unit::zeros(unit, set);
      z_lo = _mm512_permutexvar_ps(lo_idx, zeros), z_hi = _mm512_permutexvar_ps(hi_idx, zeros);
    }
    for (int r = set * 16 / kSets; r < (set + 1) * 16 / kSets; ++r) {
      __m512 q_lo, q_hi;
      Unit::widen(unit, r, q_lo, q_hi);
      // q * s is exact in fp32 for every source format (at most 24 significant bits: Q6_K's d·sc has 18 and
      // |q| <= 32), so the fused multiply-add rounds once, where gguf's dequantization rounds its sum
      const __m512 w_lo = Unit::kHasZero ? _mm512_fmadd_ps(q_lo, s_lo, z_lo) : _mm512_mul_ps(q_lo, s_lo);
      const __m512 w_hi = Unit::kHasZero ? _mm512_fmadd_ps(q_hi, s_hi, z_hi) : _mm512_mul_ps(q_hi, s_hi);
      _mm512_store_si512(b + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    }
  }
}

template <int kSets, bool kZero>
inline void Q8Unit<kSets, kZero>::expand(const uint8_t* unit, uint16_t* b) {
  expand_unit<Q8Unit<kSets, kZero>>(unit, b);
}
inline void Q4Unit::expand(const uint8_t* unit, uint16_t* b) { expand_unit<Q4Unit>(unit, b); }
#endif

}  // namespace justapi
