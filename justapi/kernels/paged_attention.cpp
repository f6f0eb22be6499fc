// Decode attention straight from the paged KV cache: one query token per sequence, keys and values read in place
// through the block table, so no [sequences, context, head_dim] copy of the cache is ever made.
//
// Cache layout (see justapi/model/attention.py): [num_kv_heads, num_blocks, block_size, head_dim], fp32 or bf16
// (a bf16 value is the top half of an fp32: widened as it is read; all arithmetic is fp32), or int8 rows of
// head_dim + head_dim / 8 bytes: the values, each group of 32 rounded to multiples of its own scale, then the groups'
// scales (fp32). An int8 block is widened and scaled into an L1 buffer once, for all of a KV head's query heads,
// then read as an fp32 block is (widen_block).
// Work item = (sequence, kv head): its `group` query heads share every key/value row it reads.
//   pass 1: s[h][t] = scale * q[h] . k[t]        for t < context_len
//   pass 2: p = softmax(s[h])                     (max-subtracted, fp32)
//   pass 3: out[h] = sum_t p[h][t] * v[t]
// Each work item is computed alone, so a sequence's result never depends on the rest of the batch. Work items run
// on torch's intra-op threads (at::parallel_for: OpenMP, so the extension is built with -fopenmp), in one
// contiguous run of items per thread holding about equal context (split_by_context).
//
// A sliding window (Gemma 3's local layers) reads only each sequence's last `window` tokens.
// Three implementations of the same passes: AVX-512 for head_dim 64, 128 and 256 (query and accumulator rows held in
// registers, blocks prefetched, exp vectorised), AVX2 for the same head sizes on CPUs without AVX-512 (AMD Zen 2/3,
// older Intel: eight lanes, sixteen registers), and a portable one for everything else.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define JUSTAPI_SIMD_ATTENTION 1
#include <immintrin.h>

#include "avx2_reduce.h"
#include "vec_exp.h"
#endif

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head

// A sliding window starts mid-block: the first `skip` rows of the first block read are before it. Their scores
// become -inf before the softmax (exp gives 0, or under 2e-38 where the vector exp clamps at -87).
inline void hide_before_window(float* scores, int64_t group, int64_t ctx, int64_t skip) {
  for (int64_t g = 0; g < group; ++g)
    std::fill(scores + g * ctx, scores + g * ctx + skip, -std::numeric_limits<float>::infinity());
}

// an int8 cache row: head_dim values, then one fp32 scale per group of 32 (model/attention.py's quantize_rows)
constexpr int64_t kGroup = 32;
template <typename T>
constexpr bool kInt8 = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int64_t row_width(int64_t head_dim) { return kInt8<T> ? head_dim + head_dim / kGroup * 4 : head_dim; }
inline float group_scale(const int8_t* row, int64_t head_dim, int64_t group) {
  float s;
  std::memcpy(&s, row + head_dim + group * 4, sizeof(float));
  return s;
}

// --- portable ----------------------------------------------------------------------------------------------------

// a cache row as fp32: fp32 rows are used in place, bf16 rows widened and int8 rows scaled into `buf`
inline const float* row_f32(const float* src, float*, int64_t) { return src; }
inline const float* row_f32(const uint16_t* src, float* buf, int64_t n) {
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
    std::memcpy(buf + d, &bits, sizeof(float));
  }
  return buf;
}
inline const float* row_f32(const int8_t* src, float* buf, int64_t n) {
  for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(src[d]) * group_scale(src, n, d / kGroup);
  return buf;
}

template <typename T>
void attend(const float* qh, const T* kp, const T* vp, const int64_t* table, int64_t ctx, int64_t skip,
            int64_t kvh, int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t group, float scale, float* oh,
            std::vector<float>& scores) {
  scores.resize(group * ctx + head_dim * (1 + group));
  float* row = scores.data() + group * ctx;
  float* acc = row + head_dim;
  const int64_t nblk = (ctx + block_size - 1) / block_size;
  const int64_t width = row_width<T>(head_dim);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    const T* kb = kp + (kvh * num_blocks + table[ib]) * block_size * width;
    const int64_t n = std::min(block_size, ctx - ib * block_size);
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = row_f32(kb + j * width, row, head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qh + g * head_dim;
        float s = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kr[d];
        scores[g * ctx + ib * block_size + j] = s * scale;
      }
    }
  }
  hide_before_window(scores.data(), group, ctx, skip);
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    const T* vb = vp + (kvh * num_blocks + table[ib]) * block_size * width;
    const int64_t n = std::min(block_size, ctx - ib * block_size);
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = row_f32(vb + j * width, row, head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * ctx + ib * block_size + j];
        float* ag = acc + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vr[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) oh[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
}

#if defined(JUSTAPI_SIMD_ATTENTION)
// prefetch the `bytes` of a cache block into L2 (the blocks of a sequence are scattered, so the hardware
// prefetcher, which follows streams within a page, does not see them coming). Into L2, not L1: two bf16 blocks
// ahead are 64 lines, more misses than L1 tracks at once, and prefetches into L1 left the kernel waiting on
// memory: 2.1x the time of L2 prefetches on a W1-sized batch out of cache (Zen 4, docs/benchmarks.md)
inline void prefetch_block(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(static_cast<const char*>(p) + c, _MM_HINT_T1);
}
constexpr int64_t kAhead = 2;  // blocks prefetched ahead of the one being read (into L2, Zen 4: 2 > 1, 4)
#endif

// --- AVX-512 -----------------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
// 32 cache values as two vectors of fp32 lanes. fp32: in order. bf16: one load; the even-numbered values are the
// low halves of its 32-bit lanes (shifted up), the odd-numbered ones the high halves (masked), so no value crosses
// a lane. Widening 16 values in order (vpmovzxwd, a cross-lane shuffle, then a shift) took 1.08x the time of a
// W1-sized batch out of cache and 1.27x in cache on a Zen 4 (docs/benchmarks.md). The queries are put in that
// order once per work item and the weighted sums of values back in order at the end (to_load_order, to_row_order).
inline void load32(const float* p, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(p);
  b = _mm512_loadu_ps(p + 16);
}
inline void load32(const uint16_t* p, __m512& a, __m512& b) {
  const __m512i x = _mm512_loadu_si512(p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// int8: in order, sign-extended to 32 bits and converted (the row's scale applied by the caller)
inline void load32(const int8_t* p, __m512& a, __m512& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(x)));
  b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(x, 1)));
}
// (a, b) <- the lanes `first` and `second` pick out of the 32 lanes of a (0-15) and b (16-31)
inline void permute_pair(__m512& a, __m512& b, __m512i first, __m512i second) {
  const __m512 x = _mm512_permutex2var_ps(a, first, b), y = _mm512_permutex2var_ps(a, second, b);
  a = x;
  b = y;
}
// 32 values in order (a: 0-15, b: 16-31) -> load32's order of a bf16 cache (a: even, b: odd), and back
template <typename T>
inline void to_load_order(__m512& a, __m512& b) {
  if constexpr (std::is_same_v<T, uint16_t>)
    permute_pair(a, b, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                 _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}
template <typename T>
inline void to_row_order(__m512& a, __m512& b) {
  if constexpr (std::is_same_v<T, uint16_t>)
    permute_pair(a, b, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                 _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}

// s[0..n) = exp(s - max(s)), unnormalised; *inv_sum = 1 / their sum
inline void softmax_avx512(float* s, int64_t n, float* inv_sum) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  *inv_sum = 1.f / _mm512_reduce_add_ps(sum);
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once (a transposing tree: 45 shuffles and adds instead of
// 16 separate horizontal sums of 9 each)
inline __m512 hsum16(const __m512* v) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0 e0+e2, v1 e0+e2, v0 e1+e3, v1 e1+e3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's partial sums of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 u[2];
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: x[2i] lanes 0+1, 2+3, then x[2i+1]'s
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc[h] += sum_j p[h][j] * v[j] for H heads (p[h] = p + h * p_stride, acc[h] = acc + h * 16 * V) over a block's
// n value rows: each row is loaded and widened once for all H heads (H * V accumulators in registers). Each
// accumulator sums its rows in order, so a head's result does not depend on how many share the pass.
template <typename T, int V, int H>
inline void weigh_values(const T* vb, int64_t n, const float* p, int64_t p_stride, float* acc_rows) {
  constexpr int64_t D = 16 * V, W = row_width<T>(D);
  __m512 acc[H][V];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < V; ++i) acc[h][i] = _mm512_loadu_ps(acc_rows + h * D + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    __m512 w[H];
    for (int h = 0; h < H; ++h) w[h] = _mm512_set1_ps(p[h * p_stride + j]);
    for (int i = 0; i < V; i += 2) {
      __m512 va, vb2;
      load32(vb + j * W + 16 * i, va, vb2);
      for (int h = 0; h < H; ++h) {
        acc[h][i] = _mm512_fmadd_ps(w[h], va, acc[h][i]);
        acc[h][i + 1] = _mm512_fmadd_ps(w[h], vb2, acc[h][i + 1]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc_rows + h * D + 16 * i, acc[h][i]);
}

// an int8 block's n rows widened and scaled into `wide` [n, D] fp32, once for all of a KV head's query heads (each
// head read them from L1 after: converting a row per query head cost Gemma 3, four heads a KV head, 15% of decode)
template <int V>
inline void widen_block(const int8_t* block, int64_t n, float* wide) {
  constexpr int64_t D = 16 * V, W = row_width<int8_t>(D);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < D; c += 32) {
      __m512 a, b;
      load32(block + j * W + c, a, b);
      const __m512 s = _mm512_set1_ps(group_scale(block + j * W, D, c / kGroup));
      _mm512_storeu_ps(wide + j * D + c, _mm512_mul_ps(a, s));
      _mm512_storeu_ps(wide + j * D + c + 16, _mm512_mul_ps(b, s));
    }
}

// scores[g * ctx + j] = q[g] . k[j] for a block's n key rows (R: fp32, or bf16 in load32's order), every query head
template <typename R, int V>
inline void block_scores(const R* kb, int64_t n, const float* qs, int64_t group, float* scores, int64_t ctx) {
  constexpr int64_t D = 16 * V;
  for (int64_t g = 0; g < group; ++g) {
    __m512 q[V];
    for (int i = 0; i < V; ++i) q[i] = _mm512_loadu_ps(qs + g * D + 16 * i);
    float* sg = scores + g * ctx;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {  // 16 rows' dot products, reduced together
      const int64_t m = std::min<int64_t>(16, n - j0);
      __m512 s[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j < m) {
          const R* kr = kb + (j0 + j) * D;
          __m512 ka, kb2;
          load32(kr, ka, kb2);
          s[j] = _mm512_fmadd_ps(q[1], kb2, _mm512_mul_ps(q[0], ka));
          for (int i = 2; i < V; i += 2) {
            load32(kr + 16 * i, ka, kb2);
            s[j] = _mm512_fmadd_ps(q[i], ka, s[j]);
            s[j] = _mm512_fmadd_ps(q[i + 1], kb2, s[j]);
          }
        } else {
          s[j] = _mm512_setzero_ps();
        }
      }
      _mm512_mask_storeu_ps(sg + j0, static_cast<__mmask16>((1u << m) - 1), hsum16(s));
    }
  }
}

// acc[g] += sum_j p[g][j] * v[j] over a block's n value rows, every query head (p[g] = p + g * ctx)
template <typename R, int V>
inline void block_values(const R* vb, int64_t n, const float* p, int64_t group, int64_t ctx, float* acc_all) {
  constexpr int64_t D = 16 * V;
  for (int64_t g = 0; g < group;) {  // the heads in sets whose accumulators fit 16 registers
    const int64_t heads = std::min<int64_t>(16 / V, group - g);
    const float* pg = p + g * ctx;
    if constexpr (V == 4)
      if (heads >= 3) {
        if (heads == 4) weigh_values<R, V, 4>(vb, n, pg, ctx, acc_all + g * D);
        else weigh_values<R, V, 3>(vb, n, pg, ctx, acc_all + g * D);
        g += heads;
        continue;
      }
    if constexpr (V <= 8)
      if (heads == 2) {
        weigh_values<R, V, 2>(vb, n, pg, ctx, acc_all + g * D);
        g += heads;
        continue;
      }
    weigh_values<R, V, 1>(vb, n, pg, ctx, acc_all + g * D);
    g += 1;
  }
}

// head_dim = 16 * V; blocks outermost so each is read from memory once, query/accumulator rows in registers
template <typename T, int V>
void attend_avx512(const float* qh, const T* kp, const T* vp, const int64_t* table, int64_t ctx, int64_t skip,
                   int64_t kvh,
                   int64_t num_blocks, int64_t block_size, int64_t group, float scale, float* oh,
                   std::vector<float>& scores) {
  constexpr int64_t D = 16 * V;
  scores.resize(group * ctx + 2 * group * D + (kInt8<T> ? block_size * D : 0));
  float* qs = scores.data() + group * ctx;  // the scaled queries, in load32's order
  float* acc_all = qs + group * D;
  float* wide = acc_all + group * D;  // an int8 block widened (widen_block)
  for (int64_t i = 0; i < group * D; i += 32) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh + i), _mm512_set1_ps(scale));
    __m512 b = _mm512_mul_ps(_mm512_loadu_ps(qh + i + 16), _mm512_set1_ps(scale));
    to_load_order<T>(a, b);
    _mm512_storeu_ps(qs + i, a);
    _mm512_storeu_ps(qs + i + 16, b);
  }
  const int64_t nblk = (ctx + block_size - 1) / block_size;
  constexpr int64_t W = row_width<T>(D);
  const int64_t block_elems = block_size * W, block_bytes = block_elems * sizeof(T);
  auto kblock = [&](int64_t ib) { return kp + (kvh * num_blocks + table[ib]) * block_elems; };
  auto vblock = [&](int64_t ib) { return vp + (kvh * num_blocks + table[ib]) * block_elems; };
  for (int64_t ib = 0; ib < std::min(kAhead, nblk); ++ib) prefetch_block(kblock(ib), block_bytes);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    if (ib + kAhead < nblk) prefetch_block(kblock(ib + kAhead), block_bytes);
    else if (ib + kAhead - nblk < nblk) prefetch_block(vblock(ib + kAhead - nblk), block_bytes);
    const int64_t n = std::min(block_size, ctx - ib * block_size);
    float* sb = scores.data() + ib * block_size;
    if constexpr (kInt8<T>) {
      widen_block<V>(kblock(ib), n, wide);
      block_scores<float, V>(wide, n, qs, group, sb, ctx);
    } else {
      block_scores<T, V>(kblock(ib), n, qs, group, sb, ctx);
    }
  }
  hide_before_window(scores.data(), group, ctx, skip);
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) softmax_avx512(scores.data() + g * ctx, ctx, inv_sum + g);
  std::fill(acc_all, acc_all + group * D, 0.f);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    if (ib + kAhead < nblk) prefetch_block(vblock(ib + kAhead), block_bytes);
    const int64_t n = std::min(block_size, ctx - ib * block_size);
    const float* pb = scores.data() + ib * block_size;
    if constexpr (kInt8<T>) {
      widen_block<V>(vblock(ib), n, wide);
      block_values<float, V>(wide, n, pb, group, ctx, acc_all);
    } else {
      block_values<T, V>(vblock(ib), n, pb, group, ctx, acc_all);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int i = 0; i < V; i += 2) {  // back in order
      __m512 a = _mm512_loadu_ps(acc_all + g * D + 16 * i), b = _mm512_loadu_ps(acc_all + g * D + 16 * i + 16);
      to_row_order<T>(a, b);
      _mm512_storeu_ps(oh + g * D + 16 * i, _mm512_mul_ps(a, inv));
      _mm512_storeu_ps(oh + g * D + 16 * i + 16, _mm512_mul_ps(b, inv));
    }
  }
}
#elif defined(JUSTAPI_SIMD_ATTENTION)

// --- AVX2 --------------------------------------------------------------------------------------------------------
// The same passes with eight lanes. Sixteen registers do not hold a query row and eight dot products at once, so
// the query is read from L1 as each product needs it, and eight rows' products run side by side (eight independent
// FMA chains, as the FMA latency needs).

// 16 cache values as two vectors of fp32 lanes. fp32: in order. bf16: one load and two unpacks with zeros (each
// bf16 becomes the high half of an fp32), which leaves them in the order [0-3, 8-11] and [4-7, 12-15]; the scaled
// queries are stored in that order and the weighted sums of values put back in order at the end (swap_halves).
// Widening 8 values in order (zero-extend, then shift) takes twice the instructions.
inline void load16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
inline void load16(const uint16_t* p, __m256& a, __m256& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
}
// int8: in order, sign-extended and converted (the row's scale applied by the caller)
inline void load16(const int8_t* p, __m256& a, __m256& b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
}
// 16 lanes in order <-> load16's order of a bf16 cache (the same exchange of 128-bit halves both ways)
template <typename T>
inline void swap_halves(__m256& a, __m256& b) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
    a = lo;
    b = hi;
  }
}

// lanes [0, m) set
inline __m256i first_lanes(int64_t m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// s[0..n) = exp(s - max(s)), unnormalised; *inv_sum = 1 / their sum
inline void softmax_avx2(float* s, int64_t n, float* inv_sum) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = neg_inf;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
  const __m256i tail = first_lanes(n - t);
  if (t < n) mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(s + t, tail), _mm256_castsi256_ps(tail)));
  const __m256 m = _mm256_set1_ps(hmax8(mx));
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (t < n) {
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(s + t, tail), m)), _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(s + t, tail, e);
    sum = _mm256_add_ps(sum, e);
  }
  *inv_sum = 1.f / hadd8(sum);
}

// r[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once
inline __m256 hsum8(const __m256* v) {
  // per 128-bit lane: [v0 e0+e1, v1 e0+e1, v0 e2+e3, v1 e2+e3], then the lane's sums of v0..v3
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // low lanes hold the sums of elements 0-3, high lanes of 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// an int8 block's n rows widened and scaled into `wide` [n, D] fp32, once for all of a KV head's query heads
template <int64_t D>
inline void widen_block(const int8_t* block, int64_t n, float* wide) {
  constexpr int64_t W = row_width<int8_t>(D);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < D; c += 16) {
      __m256 a, b;
      load16(block + j * W + c, a, b);
      const __m256 s = _mm256_set1_ps(group_scale(block + j * W, D, c / kGroup));
      _mm256_storeu_ps(wide + j * D + c, _mm256_mul_ps(a, s));
      _mm256_storeu_ps(wide + j * D + c + 8, _mm256_mul_ps(b, s));
    }
}

// scores[g * ctx + j] = q[g] . k[j] for a block's n key rows (R: fp32, or bf16 in load16's order), every query head
template <typename R, int64_t D>
inline void block_scores(const R* kb, int64_t n, const float* qs, int64_t group, float* scores, int64_t ctx) {
  constexpr int64_t V = D / 8;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qs + g * D;
    float* sg = scores + g * ctx;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {  // 8 rows' dot products, reduced together
      const int64_t m = std::min<int64_t>(8, n - j0);
      const R* kr[8];  // rows past the block's end repeat its last row; their sums are not stored
      for (int64_t j = 0; j < 8; ++j) kr[j] = kb + (j0 + std::min(j, m - 1)) * D;
      __m256 s[8];
      for (int64_t i = 0; i < V; i += 2) {
        const __m256 qa = _mm256_loadu_ps(qg + 8 * i), qb = _mm256_loadu_ps(qg + 8 * i + 8);
        for (int j = 0; j < 8; ++j) {
          __m256 k_lo, k_hi;
          load16(kr[j] + 8 * i, k_lo, k_hi);
          s[j] = i == 0 ? _mm256_mul_ps(qa, k_lo) : _mm256_fmadd_ps(qa, k_lo, s[j]);
          s[j] = _mm256_fmadd_ps(qb, k_hi, s[j]);
        }
      }
      const __m256 r = hsum8(s);
      if (m == 8) _mm256_storeu_ps(sg + j0, r);
      else _mm256_maskstore_ps(sg + j0, first_lanes(m), r);
    }
  }
}

// acc[g] += sum_j p[g][j] * v[j] over a block's n value rows, every query head (p[g] = p + g * ctx)
template <typename R, int64_t D>
inline void block_values(const R* vb, int64_t n, const float* p, int64_t group, int64_t ctx, float* acc_all) {
  for (int64_t g = 0; g < group; ++g) {
    const float* sg = p + g * ctx;
    for (int64_t c = 0; c < D; c += 64) {  // 64 columns at a time: 8 accumulators
      float* ag = acc_all + g * D + c;
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(ag + 8 * i);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 w = _mm256_set1_ps(sg[j]);
        for (int i = 0; i < 8; i += 2) {
          __m256 v_lo, v_hi;
          load16(vb + j * D + c + 8 * i, v_lo, v_hi);
          acc[i] = _mm256_fmadd_ps(w, v_lo, acc[i]);
          acc[i + 1] = _mm256_fmadd_ps(w, v_hi, acc[i + 1]);
        }
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(ag + 8 * i, acc[i]);
    }
  }
}

// head_dim D = 64, 128 or 256; blocks outermost so each is read from memory once
template <typename T, int64_t D>
void attend_avx2(const float* qh, const T* kp, const T* vp, const int64_t* table, int64_t ctx, int64_t skip,
                 int64_t kvh,
                 int64_t num_blocks, int64_t block_size, int64_t group, float scale, float* oh,
                 std::vector<float>& scores) {
  scores.resize(group * ctx + 2 * group * D + (kInt8<T> ? block_size * D : 0));
  float* qs = scores.data() + group * ctx;  // the scaled queries
  float* acc_all = qs + group * D;
  float* wide = acc_all + group * D;  // an int8 block widened (widen_block)
  for (int64_t i = 0; i < group * D; i += 16) {  // scaled, in load16's order
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh + i), _mm256_set1_ps(scale));
    __m256 b = _mm256_mul_ps(_mm256_loadu_ps(qh + i + 8), _mm256_set1_ps(scale));
    swap_halves<T>(a, b);
    _mm256_storeu_ps(qs + i, a);
    _mm256_storeu_ps(qs + i + 8, b);
  }
  const int64_t nblk = (ctx + block_size - 1) / block_size;
  constexpr int64_t W = row_width<T>(D);
  const int64_t block_elems = block_size * W, block_bytes = block_elems * sizeof(T);
  auto kblock = [&](int64_t ib) { return kp + (kvh * num_blocks + table[ib]) * block_elems; };
  auto vblock = [&](int64_t ib) { return vp + (kvh * num_blocks + table[ib]) * block_elems; };
  for (int64_t ib = 0; ib < std::min(kAhead, nblk); ++ib) prefetch_block(kblock(ib), block_bytes);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    if (ib + kAhead < nblk) prefetch_block(kblock(ib + kAhead), block_bytes);
    else if (ib + kAhead - nblk < nblk) prefetch_block(vblock(ib + kAhead - nblk), block_bytes);
    const int64_t n = std::min(block_size, ctx - ib * block_size);
    float* sb = scores.data() + ib * block_size;
    if constexpr (kInt8<T>) {
      widen_block<D>(kblock(ib), n, wide);
      block_scores<float, D>(wide, n, qs, group, sb, ctx);
    } else {
      block_scores<T, D>(kblock(ib), n, qs, group, sb, ctx);
    }
  }
  hide_before_window(scores.data(), group, ctx, skip);
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) softmax_avx2(scores.data() + g * ctx, ctx, inv_sum + g);
  std::fill(acc_all, acc_all + group * D, 0.f);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    if (ib + kAhead < nblk) prefetch_block(vblock(ib + kAhead), block_bytes);
    const int64_t n = std::min(block_size, ctx - ib * block_size);
    const float* pb = scores.data() + ib * block_size;
    if constexpr (kInt8<T>) {
      widen_block<D>(vblock(ib), n, wide);
      block_values<float, D>(wide, n, pb, group, ctx, acc_all);
    } else {
      block_values<T, D>(vblock(ib), n, pb, group, ctx, acc_all);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m256 inv = _mm256_set1_ps(inv_sum[g]);
    for (int64_t i = 0; i < D; i += 16) {  // back in order
      __m256 a = _mm256_loadu_ps(acc_all + g * D + i), b = _mm256_loadu_ps(acc_all + g * D + i + 8);
      swap_halves<T>(a, b);
      _mm256_storeu_ps(oh + g * D + i, _mm256_mul_ps(a, inv));
      _mm256_storeu_ps(oh + g * D + i + 8, _mm256_mul_ps(b, inv));
    }
  }
}
#endif  // __AVX512F__ / AVX2

// The work items (sequence-major, then KV head) cut into one contiguous part per thread, holding about equal
// context each: bounds[t] .. bounds[t + 1]. A split by item count (at::parallel_for's) left one of two threads with
// 54% of a W1-sized batch's context. Each item is still computed alone, so the split moves no result.
std::vector<int64_t> split_by_context(const int64_t* lens, int64_t num_seqs, int64_t num_kv_heads, int64_t window) {
  constexpr int64_t kItemCost = 16;  // a work item's fixed cost (queries, softmax set-up, output), in context tokens
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_seqs * num_kv_heads));
  auto cost = [&](int64_t b) { return (window > 0 ? std::min(lens[b], window) : lens[b]) + kItemCost; };
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) total += cost(b) * num_kv_heads;
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
    const int64_t c = cost(item / num_kv_heads);
    // an item goes to the part its middle falls in
    for (int64_t t = static_cast<int64_t>(bounds.size()); t < parts && 2 * done + c > 2 * total * t / parts; ++t)
      bounds.push_back(item);
    done += c;
  }
  while (static_cast<int64_t>(bounds.size()) <= parts) bounds.push_back(num_seqs * num_kv_heads);
  return bounds;
}

// the work items of one call, split over torch's threads
template <typename T>
void run(const float* qp, const T* kp, const T* vp, const int64_t* tables, const int64_t* lens, float* op,
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
         int64_t head_dim, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<int64_t> bounds = split_by_context(lens, num_seqs, num_kv_heads, window);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first_part, int64_t end_part) {
    std::vector<float> scores;
    for (int64_t item = bounds[first_part]; item < bounds[end_part]; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t off = (b * num_heads + kvh * group) * head_dim;  // this kv head's `group` query heads
      // a sliding window: only the last `window` tokens, read from the block that holds the first of them
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t first_block = first / block_size, skip = first - first_block * block_size;
      const int64_t* table = tables + b * max_blocks + first_block;
      const int64_t ctx = lens[b] - first_block * block_size;
#if defined(__AVX512F__)
      if (head_dim == 64) {
        attend_avx512<T, 4>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, group, scale, op + off,
                            scores);
        continue;
      }
      if (head_dim == 128) {
        attend_avx512<T, 8>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, group, scale, op + off,
                            scores);
        continue;
      }
      if (head_dim == 256) {  // Gemma 3
        attend_avx512<T, 16>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, group, scale,
                             op + off, scores);
        continue;
      }
#elif defined(JUSTAPI_SIMD_ATTENTION)
      if (head_dim == 64) {
        attend_avx2<T, 64>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, group, scale, op + off,
                           scores);
        continue;
      }
      if (head_dim == 128) {
        attend_avx2<T, 128>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, group, scale, op + off,
                            scores);
        continue;
      }
      if (head_dim == 256) {  // Gemma 3
        attend_avx2<T, 256>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, group, scale, op + off,
                            scores);
        continue;
      }
#endif
      attend<T>(qp + off, kp, vp, table, ctx, skip, kvh, num_blocks, block_size, head_dim, group, scale, op + off,
                scores);
    }
  });
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window) {
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == torch::kFloat32, "decode_attention: fp32 query expected");
  TORCH_CHECK((cache_dtype == torch::kFloat32 || cache_dtype == torch::kBFloat16 || cache_dtype == torch::kChar) &&
                  v_cache.scalar_type() == cache_dtype,
              "decode_attention: fp32, bf16 or int8 K and V caches of one dtype expected");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64,
              "decode_attention: int64 block tables and context lengths expected");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t width = cache_dtype == torch::kChar ? row_width<int8_t>(head_dim) : head_dim;
  TORCH_CHECK(k_cache.size(3) == width && num_heads % num_kv_heads == 0 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: shape mismatch");
  TORCH_CHECK(num_heads / num_kv_heads <= kMaxGroup, "decode_attention: more than 16 query heads per KV head");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs, "decode_attention: batch mismatch");
  const int64_t max_blocks = block_tables.size(1);
  // every table entry a sequence reads is checked here, once, so the loops index without checks
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "decode_attention: bad context length");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks,
                  "decode_attention: block id out of range");
  }
  auto out = torch::empty_like(q);
  const float fscale = static_cast<float>(scale);
  if (cache_dtype == torch::kFloat32)
    run<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, lens,
               out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, num_blocks, block_size, head_dim, max_blocks,
               fscale, window);
  else if (cache_dtype == torch::kChar)
    run<int8_t>(q.data_ptr<float>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), tables, lens,
                out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, num_blocks, block_size, head_dim, max_blocks,
                fscale, window);
  else
    run<uint16_t>(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), tables, lens,
                  out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, num_blocks, block_size, head_dim,
                  max_blocks, fscale, window);
  return out;
}
