// Horizontal reductions of an 8-lane fp32 vector, shared by the AVX2 paths of paged_attention.cpp, q_matmul.cpp and
// prefill_attention.cpp.
// (Included, not compiled on its own; the build hashes the .cpp sources, so a change here wants one of them touched.)
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hadd8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
#endif
