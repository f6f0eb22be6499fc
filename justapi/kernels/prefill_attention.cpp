// Prefill attention on AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake and later; an AVX2 build in fp32 below, for Zen
// 2/3): one sequence's new tokens (a prompt chunk) over its bf16 or int8 cache (int8 values times their group's
// scale as a tile is packed: no widened copy of the cache), read through the block table, causal, with an optional
// sliding window. torch's CPU flash kernel, which served these chunks, ran at 16-90 GFLOP/s on a Zen 4
// counted over the keys each query sees (`benchmarks/kernels_bench.py prefill`; the packed products reach ~310),
// computed every key tile of the padded
// context for every query (an additive mask hides the causal half, it does not skip it; `is_causal` took the same
// time), and needed the sequence's keys and values gathered and padded first.
//
//   pack:   each tile of 16 keys of each KV head, once:   K as [head_dim/2][16 keys] bf16 pairs (a vdpbf16ps
//           operand: 16 keys' scores from one pair of dimensions), V as [8 key pairs][head_dim] bf16 pairs
//   attend: work item = (KV head, 16 query tokens): its rows are each token's `group` query heads; items are dealt
//           to the threads heaviest first (a causal chunk's later tokens see more keys)
//           for each span of 4 key tiles (64 keys) the item's last token can see (and, with a window, its first):
//             s = scale * q . k (fp32 sums of bf16 products, 8 rows by 2 tiles at a time), hidden keys -inf
//             online softmax (fp32): m' = max(m, max s), acc *= exp(m - m'), p = exp(s - m'), l = l * .. + sum p
//             acc += p (rounded to bf16) . v (2 rows at a time up to head size 128)
//           out = acc / l
//
// The rounding points are the flash kernel's: queries rounded to bf16, scores and the softmax in fp32, the weights
// rounded to bf16 for the products with V, accumulation in fp32; only the order of the sums differs (and exp: a
// polynomial here, vec_exp.h's). The result stays fp32 (the next product rounds it to bf16). Keys after a
// query's position are never read for it: a fresh prompt's chunk costs half the products of the full rectangle.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define JUSTAPI_PREFILL_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define JUSTAPI_PREFILL_FP32 1
#endif
#if defined(JUSTAPI_PREFILL_BF16) || defined(JUSTAPI_PREFILL_FP32)
#define JUSTAPI_PREFILL_ATTENTION 1
#include <immintrin.h>

#include "avx2_reduce.h"
#include "vec_exp.h"
#endif

namespace {

#ifdef JUSTAPI_PREFILL_ATTENTION
// an int8 cache row: `dim` values, then one fp32 scale per group of 32 (model/attention.py's quantize_rows)
constexpr int64_t kInt8Group = 32;
inline int64_t int8_row_width(int64_t dim) { return dim + dim / kInt8Group * 4; }
inline float int8_value(const int8_t* row, int64_t dim, int64_t d) {
  float s;
  std::memcpy(&s, row + dim + d / kInt8Group * 4, sizeof(float));
  return row[d] * s;
}

struct Shape {
  int64_t num_new, ctx, num_heads, group, window;
  float scale;

  // where row r of the item (KV head h, tokens from t0) lies in q and out: token t0 + r / group, its query head
  // h * group + r % group (a head size apart)
  int64_t row(int64_t h, int64_t t0, int64_t r) const { return (t0 + r / group) * num_heads + h * group + r % group; }
};

// The tiles (of `keys` keys) an item of query tokens [t0, t0 + tokens) reads. Spans of `span` tiles start at
// multiples of `span` whatever the item's first query, so that each query's keys are taken in the same groups
// whichever chunk and item it comes in (a span's keys past a query add exact zeros to it).
struct TileRange {
  int64_t first_pos, first, last;  // the item's first query's position, its first and last tile
  TileRange(const Shape& s, int64_t t0, int64_t tokens, int64_t keys, int64_t span)
      : first_pos(s.ctx - s.num_new + t0),
        first(s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) / keys / span * span : 0),
        last((first_pos + tokens - 1) / keys) {}
};
#endif

#ifdef JUSTAPI_PREFILL_BF16
using Word = uint32_t;           // a packed tile's element: a pair of bf16 dimensions (K) or keys (V)
constexpr int64_t kValuesPerWord = 2;
constexpr int64_t kKeys = 16;    // keys a tile: one vector of scores per query row
constexpr int64_t kTokens = 16;  // query tokens a work item
constexpr int64_t kRowBlock = 8; // query rows sharing each loaded key pair in the score loop
constexpr int64_t kSpan = 4;     // tiles a softmax update covers

// The K and V tiles of one KV head: tile t holds keys [16t, 16t + 16), zeros past the context.
void pack_tiles(const uint16_t* k_head, const uint16_t* v_head, const int64_t* table, int64_t block_stride,
                int64_t block_size, int64_t ctx, int64_t dim, int64_t tile, uint32_t* kp, uint32_t* vp) {
  const int64_t pairs = dim / 2;
  std::memset(kp, 0, pairs * kKeys * sizeof(uint32_t));
  std::memset(vp, 0, (kKeys / 2) * dim * sizeof(uint32_t));
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t key = tile * kKeys + j;
    if (key >= ctx) break;
    const int64_t offset = table[key / block_size] * block_stride + (key % block_size) * dim;
    const uint32_t* k = reinterpret_cast<const uint32_t*>(k_head + offset);
    for (int64_t p = 0; p < pairs; ++p) kp[p * kKeys + j] = k[p];
    const uint16_t* v = v_head + offset;
    uint16_t* vpair = reinterpret_cast<uint16_t*>(vp + (j / 2) * dim);
    for (int64_t d = 0; d < dim; ++d) vpair[2 * d + (j & 1)] = v[d];
  }
}

// An int8 cache's tiles: each value times its group's scale, rounded to bf16 as packed
void pack_tiles(const int8_t* k_head, const int8_t* v_head, const int64_t* table, int64_t block_stride,
                int64_t block_size, int64_t ctx, int64_t dim, int64_t tile, uint32_t* kp, uint32_t* vp) {
  std::memset(kp, 0, (dim / 2) * kKeys * sizeof(uint32_t));
  std::memset(vp, 0, (kKeys / 2) * dim * sizeof(uint32_t));
  uint16_t* kpair = reinterpret_cast<uint16_t*>(kp);
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t key = tile * kKeys + j;
    if (key >= ctx) break;
    const int64_t offset = table[key / block_size] * block_stride + (key % block_size) * int8_row_width(dim);
    uint16_t* vpair = reinterpret_cast<uint16_t*>(vp + (j / 2) * dim);
    for (int64_t d = 0; d < dim; ++d) {
      kpair[((d / 2) * kKeys + j) * 2 + (d & 1)] = c10::BFloat16(int8_value(k_head + offset, dim, d)).x;
      vpair[2 * d + (j & 1)] = c10::BFloat16(int8_value(v_head + offset, dim, d)).x;
    }
  }
}

inline __m512bh bcast_pair(const uint32_t* p) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(*p)); }

// scores[r][t * 16 ..] = q[r] . k for kRowBlock rows and Tiles (1 or 2) packed tiles: each key vector loaded is
// used by 8 rows, each broadcast query pair by both tiles
template <int64_t Dim, int64_t Tiles>
inline void tile_scores(const uint32_t* q, const uint32_t* kp, float* scores, int64_t row_stride) {
  constexpr int64_t pairs = Dim / 2;
  __m512 s[Tiles][kRowBlock];
  for (int64_t t = 0; t < Tiles; ++t)
    for (int64_t r = 0; r < kRowBlock; ++r) s[t][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[Tiles];
    for (int64_t t = 0; t < Tiles; ++t) k[t] = (__m512bh)_mm512_loadu_si512(kp + (t * pairs + p) * kKeys);
    for (int64_t r = 0; r < kRowBlock; ++r) {
      const __m512bh qp = bcast_pair(q + r * pairs + p);
      for (int64_t t = 0; t < Tiles; ++t) s[t][r] = _mm512_dpbf16_ps(s[t][r], qp, k[t]);
    }
  }
  for (int64_t t = 0; t < Tiles; ++t)
    for (int64_t r = 0; r < kRowBlock; ++r) _mm512_storeu_ps(scores + r * row_stride + t * kKeys, s[t][r]);
}

// acc[0..Dim) = acc * alpha + p . v over key_pairs key pairs (p: bf16 weights in pairs), in order of the keys
template <int64_t Dim>
inline void tile_values(const uint32_t* p, const uint32_t* vp, int64_t key_pairs, float alpha, float* acc) {
  constexpr int64_t chunks = Dim / 16;
  __m512 a[chunks];
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t c = 0; c < chunks; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), scale);
  for (int64_t j = 0; j < key_pairs; ++j) {
    const __m512bh w = bcast_pair(p + j);
    for (int64_t c = 0; c < chunks; ++c)
      a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)_mm512_loadu_si512(vp + j * Dim + c * 16), w);
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
}

// tile_values for two rows, each V vector loaded once for both (head size 64 or 128: 8 or 16 accumulators; a
// dpbf16 waits 6 cycles for the one before it on the same accumulator on a Zen 4, so one row's 4 accumulators at
// head size 64 would leave the units idle). Each row's sums are tile_values' sums, in the same order, so a row's
// result does not depend on whether it was paired.
template <int64_t Dim>
inline void tile_values2(const uint32_t* p0, const uint32_t* p1, const uint32_t* vp, int64_t key_pairs, float alpha0,
                         float alpha1, float* acc0, float* acc1) {
  constexpr int64_t chunks = Dim / 16;
  __m512 a0[chunks], a1[chunks];
  const __m512 s0 = _mm512_set1_ps(alpha0), s1 = _mm512_set1_ps(alpha1);
  for (int64_t c = 0; c < chunks; ++c) {
    a0[c] = _mm512_mul_ps(_mm512_loadu_ps(acc0 + c * 16), s0);
    a1[c] = _mm512_mul_ps(_mm512_loadu_ps(acc1 + c * 16), s1);
  }
  for (int64_t j = 0; j < key_pairs; ++j) {
    const __m512bh w0 = bcast_pair(p0 + j), w1 = bcast_pair(p1 + j);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + j * Dim + c * 16);
      a0[c] = _mm512_dpbf16_ps(a0[c], v, w0);
      a1[c] = _mm512_dpbf16_ps(a1[c], v, w1);
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    _mm512_storeu_ps(acc0 + c * 16, a0[c]);
    _mm512_storeu_ps(acc1 + c * 16, a1[c]);
  }
}

// One work item: KV head h, query tokens [t0, t0 + tokens). q: [num_new, num_heads, Dim] fp32; out likewise.
template <int64_t Dim>
void attend_item(const float* q, const uint32_t* kp_head, const uint32_t* vp_head, const Shape& s, int64_t h,
                 int64_t t0, int64_t tokens, float* out) {
  constexpr int64_t pairs = Dim / 2;
  const int64_t rows = tokens * s.group;
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<uint32_t> qb(padded_rows * pairs, 0);  // rows as bf16 pairs, row r = (token r / group, head r % group)
  std::vector<float> acc(rows * Dim, 0.0f), scores(padded_rows * kSpan * kKeys);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.0f);
  std::vector<uint32_t> p(rows * kSpan * kKeys / 2);
  std::vector<float> alphas(rows);
  std::vector<char> active(rows);  // whether a row sees any key of the current span
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + s.row(h, t0, r) * Dim;
    for (int64_t c = 0; c < Dim / 16; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb.data() + r * pairs + c * 8),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c * 16)));
  }
  const TileRange tiles(s, t0, tokens, kKeys, kSpan);
  const int64_t first_pos = tiles.first_pos, first_tile = tiles.first, last_tile = tiles.last;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t span0 = first_tile; span0 <= last_tile; span0 += kSpan) {
    const int64_t span = std::min(kSpan, last_tile + 1 - span0);
    for (int64_t t = 0; t < span; t += 2) {
      const uint32_t* kp = kp_head + (span0 + t) * pairs * kKeys;
      for (int64_t r = 0; r < padded_rows; r += kRowBlock) {
        float* dst = scores.data() + r * kSpan * kKeys + t * kKeys;
        if (t + 1 < span)
          tile_scores<Dim, 2>(qb.data() + r * pairs, kp, dst, kSpan * kKeys);
        else
          tile_scores<Dim, 1>(qb.data() + r * pairs, kp, dst, kSpan * kKeys);
      }
    }
    std::fill(active.begin(), active.end(), 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / s.group;
      __mmask16 visible[kSpan];
      __m512 sc[kSpan];
      __m512 vmax = neg_inf;
      bool any = false;
      for (int64_t t = 0; t < span; ++t) {
        const __m512i keys = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>((span0 + t) * kKeys)));
        visible[t] = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(pos)));
        if (s.window > 0)
          visible[t] &= _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(pos - s.window)));
        any |= visible[t] != 0;
        sc[t] = _mm512_mask_mov_ps(neg_inf, visible[t],
                                   _mm512_mul_ps(_mm512_loadu_ps(scores.data() + (r * kSpan + t) * kKeys), scale));
        vmax = _mm512_max_ps(vmax, sc[t]);
      }
      if (!any) continue;  // nothing of these keys for this row: its state is unchanged
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
      const float alpha = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[r] - m_new);
      const __m512 shift = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      uint32_t* pr = p.data() + r * kSpan * kKeys / 2;
      for (int64_t t = 0; t < span; ++t) {
        // hidden keys (-inf) weigh exactly 0, not exp512's floor of ~1.6e-38
        const __m512 e = _mm512_maskz_mov_ps(visible[t], exp512(_mm512_sub_ps(sc[t], shift)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t * kKeys / 2), (__m256i)_mm512_cvtneps_pbh(e));
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      alphas[r] = alpha;
      active[r] = 1;
    }
    const uint32_t* vp = vp_head + span0 * (kKeys / 2) * Dim;
    const int64_t key_pairs = span * kKeys / 2;
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      uint32_t* pr = p.data() + r * kSpan * kKeys / 2;
      if constexpr (Dim <= 128) {
        if (r + 1 < rows && active[r + 1]) {
          tile_values2<Dim>(pr, pr + kSpan * kKeys / 2, vp, key_pairs, alphas[r], alphas[r + 1], acc.data() + r * Dim,
                            acc.data() + (r + 1) * Dim);
          ++r;
          continue;
        }
      }
      tile_values<Dim>(pr, vp, key_pairs, alphas[r], acc.data() + r * Dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + s.row(h, t0, r) * Dim;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t c = 0; c < Dim / 16; ++c)
      _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * Dim + c * 16), inv));
  }
}

#endif  // JUSTAPI_PREFILL_BF16

#ifdef JUSTAPI_PREFILL_FP32
// The AVX2 build (AMD Zen 2/3), for a model computing in fp32 over its bf16 cache: the same tiles, spans and
// online softmax in 8 lanes, every product in fp32. K and V are widened to fp32 as they are packed (exact), the
// queries and softmax weights stay fp32, so this computes what torch's fp32 flash kernel computes over the widened
// cache (the path it replaces) in another order of the sums.
//
//   pack:   K as [head_dim][8 keys] fp32 (8 keys' scores from one dimension), V as [8 keys][head_dim] fp32
//   scores: 6 rows by 2 tiles at a time (12 accumulators of the 16 registers), each key vector used by 6 rows
//   values: acc += p . v, 8 vectors of a row's accumulators at a time (head size 64: one pass per key)
using Word = float;
constexpr int64_t kValuesPerWord = 1;
constexpr int64_t kKeys = 8;     // keys a tile: one vector of scores per query row
constexpr int64_t kTokens = 16;  // query tokens a work item
constexpr int64_t kRowBlock = 6; // query rows sharing each loaded key vector in the score loop
constexpr int64_t kSpan = 8;     // tiles a softmax update covers (64 keys, as the AVX-512 build's 4 x 16)

inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

// a cache value as fp32: a bf16 one widened (exact), an int8 one times its group's scale
inline float cache_value(const uint16_t* row, int64_t, int64_t d) { return widen(row[d]); }
inline float cache_value(const int8_t* row, int64_t dim, int64_t d) { return int8_value(row, dim, d); }
inline int64_t row_width(const uint16_t*, int64_t dim) { return dim; }
inline int64_t row_width(const int8_t*, int64_t dim) { return int8_row_width(dim); }

// The K and V tiles of one KV head: tile t holds keys [8t, 8t + 8), zeros past the context.
template <typename C>
void pack_tiles(const C* k_head, const C* v_head, const int64_t* table, int64_t block_stride, int64_t block_size,
                int64_t ctx, int64_t dim, int64_t tile, float* kp, float* vp) {
  std::memset(kp, 0, dim * kKeys * sizeof(float));
  std::memset(vp, 0, kKeys * dim * sizeof(float));
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t key = tile * kKeys + j;
    if (key >= ctx) break;
    const int64_t offset = table[key / block_size] * block_stride + (key % block_size) * row_width(k_head, dim);
    for (int64_t d = 0; d < dim; ++d) {
      kp[d * kKeys + j] = cache_value(k_head + offset, dim, d);
      vp[j * dim + d] = cache_value(v_head + offset, dim, d);
    }
  }
}

// scores[r][t * 8 ..] = q[r] . k for kRowBlock rows and Tiles (1 or 2) packed tiles
template <int64_t Dim, int64_t Tiles>
inline void tile_scores(const float* q, const float* kp, float* scores, int64_t row_stride) {
  __m256 s[Tiles][kRowBlock];
  for (int64_t t = 0; t < Tiles; ++t)
    for (int64_t r = 0; r < kRowBlock; ++r) s[t][r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dim; ++d) {
    __m256 k[Tiles];
    for (int64_t t = 0; t < Tiles; ++t) k[t] = _mm256_loadu_ps(kp + (t * Dim + d) * kKeys);
    for (int64_t r = 0; r < kRowBlock; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q + r * Dim + d);
      for (int64_t t = 0; t < Tiles; ++t) s[t][r] = _mm256_fmadd_ps(qd, k[t], s[t][r]);
    }
  }
  for (int64_t t = 0; t < Tiles; ++t)
    for (int64_t r = 0; r < kRowBlock; ++r) _mm256_storeu_ps(scores + r * row_stride + t * kKeys, s[t][r]);
}

// acc[0..Dim) = acc * alpha + p . v over `keys` keys, in order of the keys, 8 vectors of acc at a time
template <int64_t Dim>
inline void tile_values(const float* p, const float* vp, int64_t keys, float alpha, float* acc) {
  constexpr int64_t chunk = std::min<int64_t>(8, Dim / 8);
  const __m256 scale = _mm256_set1_ps(alpha);
  for (int64_t c0 = 0; c0 < Dim / 8; c0 += chunk) {
    __m256 a[chunk];
    for (int64_t c = 0; c < chunk; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (c0 + c) * 8), scale);
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 w = _mm256_broadcast_ss(p + j);
      for (int64_t c = 0; c < chunk; ++c)
        a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + j * Dim + (c0 + c) * 8), a[c]);
    }
    for (int64_t c = 0; c < chunk; ++c) _mm256_storeu_ps(acc + (c0 + c) * 8, a[c]);
  }
}

// tile_values for two rows, 4 vectors of each row's accumulators at a time, each V vector loaded once for both:
// 6 loads for 8 FMAs instead of 9 (the loads, not the FMAs, bounded one row's pass). Each row's sums are
// tile_values' sums in the same order, so a row's result does not depend on whether it was paired.
template <int64_t Dim>
inline void tile_values2(const float* p0, const float* p1, const float* vp, int64_t keys, float alpha0, float alpha1,
                         float* acc0, float* acc1) {
  constexpr int64_t chunk = 4;
  const __m256 s0 = _mm256_set1_ps(alpha0), s1 = _mm256_set1_ps(alpha1);
  for (int64_t c0 = 0; c0 < Dim / 8; c0 += chunk) {
    __m256 a0[chunk], a1[chunk];
    for (int64_t c = 0; c < chunk; ++c) {
      a0[c] = _mm256_mul_ps(_mm256_loadu_ps(acc0 + (c0 + c) * 8), s0);
      a1[c] = _mm256_mul_ps(_mm256_loadu_ps(acc1 + (c0 + c) * 8), s1);
    }
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j);
      for (int64_t c = 0; c < chunk; ++c) {
        const __m256 v = _mm256_loadu_ps(vp + j * Dim + (c0 + c) * 8);
        a0[c] = _mm256_fmadd_ps(w0, v, a0[c]);
        a1[c] = _mm256_fmadd_ps(w1, v, a1[c]);
      }
    }
    for (int64_t c = 0; c < chunk; ++c) {
      _mm256_storeu_ps(acc0 + (c0 + c) * 8, a0[c]);
      _mm256_storeu_ps(acc1 + (c0 + c) * 8, a1[c]);
    }
  }
}

// One work item: KV head h, query tokens [t0, t0 + tokens). q: [num_new, num_heads, Dim] fp32; out likewise.
template <int64_t Dim>
void attend_item(const float* q, const float* kp_head, const float* vp_head, const Shape& s, int64_t h, int64_t t0,
                 int64_t tokens, float* out) {
  const int64_t rows = tokens * s.group;
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<float> qr(padded_rows * Dim, 0.0f);  // row r = (token r / group, head r % group)
  std::vector<float> acc(rows * Dim, 0.0f), scores(padded_rows * kSpan * kKeys), p(rows * kSpan * kKeys);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.0f), alphas(rows);
  std::vector<char> active(rows);  // whether a row sees any key of the current span
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(qr.data() + r * Dim, q + s.row(h, t0, r) * Dim, Dim * sizeof(float));
  const TileRange tiles(s, t0, tokens, kKeys, kSpan);
  const int64_t first_pos = tiles.first_pos, first_tile = tiles.first, last_tile = tiles.last;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 scale = _mm256_set1_ps(s.scale);
  for (int64_t span0 = first_tile; span0 <= last_tile; span0 += kSpan) {
    const int64_t span = std::min(kSpan, last_tile + 1 - span0);
    for (int64_t t = 0; t < span; t += 2) {
      const float* kp = kp_head + (span0 + t) * Dim * kKeys;
      for (int64_t r = 0; r < padded_rows; r += kRowBlock) {
        float* dst = scores.data() + r * kSpan * kKeys + t * kKeys;
        if (t + 1 < span)
          tile_scores<Dim, 2>(qr.data() + r * Dim, kp, dst, kSpan * kKeys);
        else
          tile_scores<Dim, 1>(qr.data() + r * Dim, kp, dst, kSpan * kKeys);
      }
    }
    std::fill(active.begin(), active.end(), 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / s.group;
      __m256 visible[kSpan], sc[kSpan];  // visible: all ones in a lane whose key the row sees
      __m256 vmax = neg_inf;
      bool any = false;
      for (int64_t t = 0; t < span; ++t) {
        const __m256i keys = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>((span0 + t) * kKeys)));
        __m256i seen = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(pos + 1)), keys);  // key <= pos
        if (s.window > 0)
          seen = _mm256_and_si256(seen, _mm256_cmpgt_epi32(keys, _mm256_set1_epi32(static_cast<int>(pos - s.window))));
        visible[t] = _mm256_castsi256_ps(seen);
        any |= !_mm256_testz_si256(seen, seen);
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(scores.data() + (r * kSpan + t) * kKeys), scale);
        sc[t] = _mm256_blendv_ps(neg_inf, scaled, visible[t]);
        vmax = _mm256_max_ps(vmax, sc[t]);
      }
      if (!any) continue;  // nothing of these keys for this row: its state is unchanged
      const float m_new = std::max(m[r], hmax8(vmax));
      const float alpha = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[r] - m_new);
      const __m256 shift = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      float* pr = p.data() + r * kSpan * kKeys;
      for (int64_t t = 0; t < span; ++t) {
        // hidden keys (-inf) weigh exactly 0, not exp256's floor
        const __m256 e = _mm256_and_ps(visible[t], exp256(_mm256_sub_ps(sc[t], shift)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(pr + t * kKeys, e);
      }
      l[r] = l[r] * alpha + hadd8(sum);
      m[r] = m_new;
      alphas[r] = alpha;
      active[r] = 1;
    }
    const float* vp = vp_head + span0 * kKeys * Dim;
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      float* pr = p.data() + r * kSpan * kKeys;
      if (r + 1 < rows && active[r + 1]) {
        tile_values2<Dim>(pr, pr + kSpan * kKeys, vp, span * kKeys, alphas[r], alphas[r + 1], acc.data() + r * Dim,
                          acc.data() + (r + 1) * Dim);
        ++r;
        continue;
      }
      tile_values<Dim>(pr, vp, span * kKeys, alphas[r], acc.data() + r * Dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + s.row(h, t0, r) * Dim;
    const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
    for (int64_t c = 0; c < Dim / 8; ++c)
      _mm256_storeu_ps(dst + c * 8, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * Dim + c * 8), inv));
  }
}
#endif  // JUSTAPI_PREFILL_FP32

#ifdef JUSTAPI_PREFILL_ATTENTION
// Both builds: pack each KV head's tiles once, then attend, items dealt to the threads
template <int64_t Dim, typename C>
void run(const float* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t head_stride,
         int64_t block_stride, int64_t block_size, int64_t num_kv_heads, const Shape& s, float* out) {
  const int64_t tiles = (s.ctx + kKeys - 1) / kKeys;
  const int64_t tile_words = Dim * kKeys / kValuesPerWord;  // K and V tiles are the same size
  std::vector<Word> kp(num_kv_heads * tiles * tile_words), vp(kp.size());
  at::parallel_for(0, num_kv_heads * tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / tiles, t = i % tiles;
      pack_tiles(k_cache + h * head_stride, v_cache + h * head_stride, table, block_stride, block_size, s.ctx, Dim, t,
                 kp.data() + i * tile_words, vp.data() + i * tile_words);
    }
  });
  const int64_t blocks = (s.num_new + kTokens - 1) / kTokens, items = num_kv_heads * blocks;
  // later query blocks see more keys: dealt to the threads in turn, heaviest first, so that they finish together
  // (parallel_for's contiguous ranges would give one thread the whole long end of a causal chunk)
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread)
      for (int64_t i = thread; i < items; i += threads) {
        const int64_t h = i % num_kv_heads, t0 = (blocks - 1 - i / num_kv_heads) * kTokens;
        attend_item<Dim>(q, kp.data() + h * tiles * tile_words, vp.data() + h * tiles * tile_words, s, h, t0,
                         std::min(kTokens, s.num_new - t0), out);
      }
  });
}
#endif

}  // namespace

bool prefill_attention_available() {
#ifdef JUSTAPI_PREFILL_ATTENTION
  return true;
#else
  return false;
#endif
}

bool prefill_attention_fp32() {
#ifdef JUSTAPI_PREFILL_FP32
  return true;
#else
  return false;
#endif
}

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, int64_t context_len, double scale, int64_t window) {
#ifdef JUSTAPI_PREFILL_ATTENTION
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3, "prefill_attention: fp32 [tokens, heads, dim] query expected");
  const bool int8 = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK((int8 || k_cache.scalar_type() == torch::kBFloat16) && v_cache.scalar_type() == k_cache.scalar_type(),
              "prefill_attention: bf16 or int8 K and V caches expected");
  TORCH_CHECK(block_table.dtype() == torch::kInt64, "prefill_attention: int64 block table expected");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_table = block_table.contiguous();
  const int64_t num_new = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t width = int8 ? int8_row_width(dim) : dim;  // an int8 row: its values, then its groups' scales
  TORCH_CHECK(k_cache.size(3) == width && v_cache.sizes() == k_cache.sizes() && num_heads % num_kv_heads == 0,
              "prefill_attention: shape mismatch");
  TORCH_CHECK(dim == 64 || dim == 128 || dim == 256, "prefill_attention: head size 64, 128 or 256 expected");
  TORCH_CHECK(num_new >= 1 && context_len >= num_new && context_len <= block_table.size(0) * block_size,
              "prefill_attention: bad context length");
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (context_len + block_size - 1) / block_size; ++i)  // checked once: the loops index freely
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "prefill_attention: block id out of range");
  auto out = torch::empty_like(q);
  const Shape s{num_new, context_len, num_heads, num_heads / num_kv_heads, window, static_cast<float>(scale)};
  const int64_t head_stride = num_blocks * block_size * width, block_stride = block_size * width;
  auto dispatch = [&](const auto* k, const auto* v) {
    if (dim == 64)
      run<64>(q.data_ptr<float>(), k, v, table, head_stride, block_stride, block_size, num_kv_heads, s,
              out.data_ptr<float>());
    else if (dim == 128)
      run<128>(q.data_ptr<float>(), k, v, table, head_stride, block_stride, block_size, num_kv_heads, s,
               out.data_ptr<float>());
    else
      run<256>(q.data_ptr<float>(), k, v, table, head_stride, block_stride, block_size, num_kv_heads, s,
               out.data_ptr<float>());
  };
  if (int8)
    dispatch(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  else
    dispatch(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  return out;
#else
  TORCH_CHECK(false, "prefill_attention: this build has neither AVX-512 BF16 nor AVX2");
#endif
}
