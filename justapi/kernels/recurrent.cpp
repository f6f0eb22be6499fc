// Gated DeltaNet's recurrence (justapi/model/recurrent.py, delta_rule.py) for a flat batch's runs: each run is one
// sequence's consecutive rows (a decode row, or a prompt chunk) continued from its state slot, or from zeros where
// the run starts its sequence, and the slot is left holding the state after its last row. Per run, in three phases:
//
//   1. the causal depthwise convolution of q, k, v's channels, continued from the slot's tail, then SiLU;
//   2. q and k L2-normalized per key head, q scaled by key_dim^-1/2;
//   3. per value head h (key head h % key_heads, llama.cpp's tiled order), token after token, with S the slot's
//      [key_dim, value_dim] state, beta = sigmoid(b) and g = a softplus(alpha + dt_bias):
//        S = exp(g) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T q
//      and the output RMS-normalized over the head (weight norm) and gated by SiLU(z).
//
// A prompt is scanned token by token here, not in the chunked (WY) form of the torch path: on a CPU the state of a
// head (16-64 KiB) stays in L1/L2 and a token costs two passes over it, about as many multiply-adds as the
// chunked form's matmuls, with none of its temporaries; and each token's arithmetic is the same whether it came in a
// prompt chunk of any size or as a decode row, so chunked prefill and decode agree exactly with each other. Sums run
// in another order than torch's reductions: equal to the torch path within fp32 rounding, not bit-identical.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
// torch's own vectorised exp (Sleef, exported by libtorch_cpu), as layer_ops.cpp's silu uses it
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

struct Run {
  int64_t first, rows, slot, fresh;
};

// x / (1 + exp(-x)) over n floats in place
void silu(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(x + i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                           Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                           Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
  }
#endif
  for (; i < n; ++i) x[i] = x[i] / (1.0f + std::exp(-x[i]));
}

// The convolution's inputs before a run, oldest first [taps-1, channels]: the slot's tail, zeros where the run
// starts its sequence
std::vector<float> inputs_before(const Run& run, const float* tail, int64_t channels, int64_t taps) {
  std::vector<float> before((taps - 1) * channels, 0.0f);
  if (!run.fresh) {
    for (int64_t c = 0; c < channels; ++c) {
      for (int64_t j = 0; j + 1 < taps; ++j) before[j * channels + c] = tail[c * (taps - 1) + j];
    }
  }
  return before;
}

// The input tap j of a run's row t sees (row t - (taps-1) + j): a row of x, or one of the inputs before the run
inline const float* tap_input(const Run& run, const float* x, const std::vector<float>& before, int64_t channels,
                              int64_t taps, int64_t t, int64_t j) {
  const int64_t back = t - (taps - 1) + j;
  return back >= 0 ? x + (run.first + back) * channels : before.data() + (back + taps - 1) * channels;
}

// Row t of a run through the convolution, all channels at once (so the loops vectorize): the taps' products
// summed oldest first, then SiLU. ``weight`` is [taps, channels].
void conv_row(const Run& run, const float* x, const std::vector<float>& before, const float* weight,
              int64_t channels, int64_t taps, int64_t t, float* out) {
  const float* first = tap_input(run, x, before, channels, taps, t, 0);
  for (int64_t c = 0; c < channels; ++c) out[c] = first[c] * weight[c];
  for (int64_t j = 1; j < taps; ++j) {
    const float *in = tap_input(run, x, before, channels, taps, t, j), *w = weight + j * channels;
    for (int64_t c = 0; c < channels; ++c) out[c] = out[c] + in[c] * w[c];
  }
  silu(out, channels);
}

void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float factor = scale / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

// The rule's two passes over one head's state for the value columns [j0, j0 + W) of W-lane vectors (AVX-512: 16,
// AVX2: 8), the accumulators in registers: u = beta (v - decay S^T k), then S = decay S + k u^T and o = S^T q.
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#define VEC __m512
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSUB _mm512_sub_ps
#define VZERO _mm512_setzero_ps
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
#define VEC __m256
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSUB _mm256_sub_ps
#define VZERO _mm256_setzero_ps
#else
constexpr int64_t LANES = 0;
#endif

// One token of the rule on one head's state s [dk, dv], its output into o [dv]; u is scratch [dv]. Vector blocks
// of the value dimension first, the columns left over one by one.
void delta_token(float* s, const float* q, const float* k, const float* v, float g, float beta, int64_t dk,
                 int64_t dv, float* u, float* o) {
  const float decay = std::exp(g);
  int64_t vectors = 0;
#ifdef VEC
  vectors = dv / LANES * LANES;
  for (int64_t j0 = 0; j0 < vectors; j0 += LANES) {
    VEC acc = VZERO();
    for (int64_t i = 0; i < dk; ++i) acc = VFMA(VLOAD(s + i * dv + j0), VSET1(k[i]), acc);
    VSTORE(u + j0, VMUL(VSUB(VLOAD(v + j0), VMUL(VSET1(decay), acc)), VSET1(beta)));
  }
  for (int64_t j0 = 0; j0 < vectors; j0 += LANES) {
    const VEC uj = VLOAD(u + j0), d = VSET1(decay);
    VEC acc = VZERO();
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv + j0;
      const VEC updated = VFMA(VSET1(k[i]), uj, VMUL(VLOAD(row), d));
      VSTORE(row, updated);
      acc = VFMA(updated, VSET1(q[i]), acc);
    }
    VSTORE(o + j0, acc);
  }
#endif
  for (int64_t j = vectors; j < dv; ++j) {
    float acc = 0.0f;
    for (int64_t i = 0; i < dk; ++i) acc += s[i * dv + j] * k[i];
    u[j] = (v[j] - decay * acc) * beta;
    acc = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      const float updated = s[i * dv + j] * decay + k[i] * u[j];
      s[i * dv + j] = updated;
      acc += updated * q[i];
    }
    o[j] = acc;
  }
}

// torch's softplus (beta 1, threshold 20): log1p(exp(x)), x itself above the threshold
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// o [n] RMS-normalized (weight w) and multiplied by SiLU(z), as F.rms_norm then o * F.silu(z)
void gated_norm(float* o, const float* z, const float* w, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += o[j] * o[j];
  const float factor = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) o[j] = o[j] * factor * w[j] * (z[j] / (1.0f + std::exp(-z[j])));
}

}  // namespace

void gated_delta_runs(torch::Tensor mixed, torch::Tensor b, torch::Tensor alpha, torch::Tensor z,
                      torch::Tensor conv_weight, torch::Tensor a, torch::Tensor dt_bias, torch::Tensor norm_weight,
                      double eps, torch::Tensor tails, torch::Tensor states, torch::Tensor runs, int64_t key_heads,
                      torch::Tensor out) {
  for (const auto& t : {mixed, b, alpha, z, conv_weight, a, dt_bias, norm_weight, tails, states, out}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, "gated_delta_runs: fp32 CPU tensors");
  }
  TORCH_CHECK(tails.is_contiguous() && states.is_contiguous() && out.is_contiguous(),
              "gated_delta_runs: contiguous states and output");
  mixed = mixed.contiguous();
  b = b.contiguous();
  alpha = alpha.contiguous();
  z = z.contiguous();
  conv_weight = conv_weight.contiguous();
  a = a.contiguous();
  dt_bias = dt_bias.contiguous();
  norm_weight = norm_weight.contiguous();
  runs = runs.to(torch::kInt64).contiguous();
  TORCH_CHECK(states.dim() == 4 && tails.dim() == 3 && runs.dim() == 2 && runs.size(1) == 4,
              "gated_delta_runs: states [slots, value_heads, key_dim, value_dim], tails [slots, channels, K-1], "
              "runs [n, 4]");
  const int64_t total = mixed.size(0), channels = mixed.size(1), taps = conv_weight.size(1);
  const int64_t slots = states.size(0), value_heads = states.size(1), dk = states.size(2), dv = states.size(3);
  TORCH_CHECK(key_heads > 0 && value_heads % key_heads == 0 && channels == 2 * key_heads * dk + value_heads * dv,
              "gated_delta_runs: mixed must hold q, k [key_heads * key_dim] and v [value_heads * value_dim]");
  TORCH_CHECK(conv_weight.size(0) == channels && tails.size(0) == slots && tails.size(1) == channels &&
              tails.size(2) == taps - 1, "gated_delta_runs: convolution weight and tails must match mixed");
  TORCH_CHECK(b.numel() == total * value_heads && alpha.numel() == total * value_heads &&
              a.numel() == value_heads && dt_bias.numel() == value_heads && norm_weight.numel() == dv &&
              z.numel() == total * value_heads * dv && out.numel() == total * value_heads * dv,
              "gated_delta_runs: b, alpha [rows, value_heads], a, dt_bias [value_heads], norm [value_dim], z and out "
              "[rows, value_heads * value_dim]");
  const int64_t count = runs.size(0);
  std::vector<Run> run(count);
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    run[i] = {r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]};
    TORCH_CHECK(run[i].first >= 0 && run[i].rows > 0 && run[i].first + run[i].rows <= total && run[i].slot >= 0 &&
                run[i].slot < slots, "gated_delta_runs: a run outside the batch or the slots");
  }
  const float* xp = mixed.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *alp = alpha.data_ptr<float>(), *zp = z.data_ptr<float>();
  const float *ap = a.data_ptr<float>(), *dtp = dt_bias.data_ptr<float>(), *nw = norm_weight.data_ptr<float>();
  float *tp = tails.data_ptr<float>(), *sp = states.data_ptr<float>(), *op = out.data_ptr<float>();
  std::vector<float> conv(total * channels);  // the rows' q, k, v after the convolution and SiLU
  const torch::Tensor taps_first = conv_weight.t().contiguous();  // [taps, channels]
  const float* wt = taps_first.data_ptr<float>();
  std::vector<std::vector<float>> before(count);
  std::vector<int64_t> row_run(total, -1);
  for (int64_t i = 0; i < count; ++i) {
    before[i] = inputs_before(run[i], tp + run[i].slot * channels * (taps - 1), channels, taps);
    for (int64_t t = 0; t < run[i].rows; ++t) row_run[run[i].first + t] = i;
  }
  at::parallel_for(0, total, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = row_run[r];
      if (i >= 0) conv_row(run[i], xp, before[i], wt, channels, taps, r - run[i].first, conv.data() + r * channels);
    }
  });
  for (int64_t i = 0; i < count; ++i) {  // each slot's tail: its run's last taps-1 inputs
    float* tail = tp + run[i].slot * channels * (taps - 1);
    for (int64_t j = 0; j + 1 < taps; ++j) {
      const float* in = tap_input(run[i], xp, before[i], channels, taps, run[i].rows, j);
      for (int64_t c = 0; c < channels; ++c) tail[c * (taps - 1) + j] = in[c];
    }
  }
  const int64_t qk = key_heads * dk;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, total * key_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {
      float* row = conv.data() + (th / key_heads) * channels + (th % key_heads) * dk;
      l2_normalize(row, dk, q_scale);
      l2_normalize(row + qk, dk, 1.0f);
    }
  });
  at::parallel_for(0, count * value_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(dv);
    for (int64_t rh = begin; rh < end; ++rh) {
      const Run& u = run[rh / value_heads];
      const int64_t h = rh % value_heads, key = (h % key_heads) * dk;
      float* s = sp + (u.slot * value_heads + h) * dk * dv;
      if (u.fresh) std::fill(s, s + dk * dv, 0.0f);
      for (int64_t t = u.first; t < u.first + u.rows; ++t) {
        const float* row = conv.data() + t * channels;
        const int64_t th = t * value_heads + h;
        const float g = ap[h] * softplus(alp[th] + dtp[h]), beta = 1.0f / (1.0f + std::exp(-bp[th]));
        float* o = op + th * dv;
        delta_token(s, row + key, row + qk + key, row + 2 * qk + h * dv, g, beta, dk, dv, scratch.data(), o);
        gated_norm(o, zp + th * dv, nw, dv, static_cast<float>(eps));
      }
    }
  });
}
