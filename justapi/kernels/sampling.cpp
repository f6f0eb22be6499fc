// sample_rows: one token drawn from each row of logits under its temperature, top-k, top-p and min-p, by the
// inverse of its distribution's cumulative sum at a uniform the caller draws (model/sampler.py `draw`, the same
// steps in torch ops, which this kernel matches token for token). What torch's path pays on a large vocabulary (a
// softmax, a full sort for top-p, multinomial; 6-25 ms a row of Gemma 3's 262,144 logits) is here a few passes:
//
//   1. m = the row's maximum (a NaN or no finite logit: no token, -1)
//   2. top-k: the k-th largest logit, from a min-heap of k (most logits fail one compare); ties with it kept
//   3. w = exp((l - m) / T), 0 where top-k dropped it, in torch's rounding (its own vectorised exp, the division in
//      fp32, no fused multiply-adds: -ffp-contract=off); Z = their sum in index order (double)
//   4. top-p: the tokens by w descending (ties by index) kept while the mass before them is under top_p * Z. Only
//      tokens with w >= eps are sorted, eps lowered until their mass reaches top_p * Z: the kept prefix then lies
//      within them, as in a full sort
//   5. min-p: w below min_p dropped (the top token's w is exp(0) = 1, the maximum)
//   6. the first token whose running sum (index order, double, kept once) passes u times the total
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's own vectorised exp (libtorch_cpu), as torch.exp computes
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

struct Settings {
  float temperature;
  int64_t top_k;
  double top_p;
  float min_p;
  double u;
};

// w[i] = exp((l[i] - m) / t), all lanes as torch's elementwise exp of that tensor rounds them
void exp_shifted(const float* l, float m, float t, float* w, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(t);
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 x = _mm512_div_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + i), vm), vt);
    _mm512_mask_storeu_ps(w + i, k, Sleef_expf16_u10(x));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(t);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(w + i, Sleef_expf8_u10(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), vm), vt)));
  if (i < n) {  // the tail through one padded vector, as torch's loops take it
    float in[8] = {0}, out[8];
    for (int64_t j = i; j < n; ++j) in[j - i] = l[j];
    _mm256_storeu_ps(out, Sleef_expf8_u10(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(in), vm), vt)));
    for (int64_t j = i; j < n; ++j) w[j] = out[j - i];
  }
#else
  for (; i < n; ++i) w[i] = std::exp((l[i] - m) / t);
#endif
}

// the k-th largest of l[0..n), counting repeats (torch.topk(l, k).values[-1])
float kth_largest(const float* l, int64_t n, int64_t k) {
  std::priority_queue<float, std::vector<float>, std::greater<float>> heap;  // the k largest so far, least on top
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push(l[i]);
    } else if (l[i] > heap.top()) {
      heap.pop();
      heap.push(l[i]);
    }
  }
  return heap.top();
}

// top-p over w (step 4): zeroes what it drops
void keep_top_p(float* w, int64_t n, double top_p, double z) {
  const double target = top_p * z;
  std::vector<int32_t> cand;
  for (float eps = 1.0f / 16; ; eps = eps > 1e-30f ? eps / 256 : 0.0f) {
    cand.clear();
    for (int64_t i = 0; i < n; ++i)
      if (w[i] > 0.0f && w[i] >= eps) cand.push_back(static_cast<int32_t>(i));
    std::sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
    double mass = 0.0;
    size_t kept = 0;
    for (; kept < cand.size() && (kept == 0 || mass < target); ++kept) mass += w[cand[kept]];
    if (kept < cand.size() || mass >= target || eps == 0.0f) {  // the kept prefix ends within the candidates
      std::vector<char> keep(n, 0);
      for (size_t j = 0; j < kept; ++j) keep[cand[j]] = 1;
      for (int64_t i = 0; i < n; ++i)
        if (!keep[i]) w[i] = 0.0f;
      return;
    }
  }
}

int64_t sample_row(const float* l, int64_t n, const Settings& s, std::vector<float>& w, std::vector<double>& run) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, l[i]);
    nan |= l[i] != l[i];
  }
  if (nan || !std::isfinite(m)) return -1;
  w.resize(n);
  exp_shifted(l, m, s.temperature, w.data(), n);
  if (s.top_k > 0 && s.top_k < n) {
    const float kth = kth_largest(l, n, s.top_k);
    for (int64_t i = 0; i < n; ++i)
      if (l[i] < kth) w[i] = 0.0f;
  }
  if (s.top_p < 1.0) {
    double z = 0.0;
    for (int64_t i = 0; i < n; ++i) z += w[i];
    keep_top_p(w.data(), n, s.top_p, z);
  }
  // the running sums once (torch.cumsum's sequence), then the first past u times their total
  run.resize(n);
  double total = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (s.min_p > 0.0f && w[i] < s.min_p) w[i] = 0.0f;
    total += w[i];
    run[i] = total;
    if (w[i] > 0.0f) last = i;
  }
  const auto past = std::upper_bound(run.begin(), run.end(), s.u * total);
  return past == run.end() ? last : past - run.begin();  // the end: u * total rounded past the sum
}

}  // namespace

// logits [rows, vocab] fp32, settings [rows, 5] fp64 (temperature, top_k, top_p, min_p, u) -> [rows] int64 tokens,
// -1 where a row has no token to draw (a NaN, or every logit -inf); rows on all intra-op threads
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor settings) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_cpu() && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31),
              "sample_rows: [rows, vocab] fp32 CPU logits expected");
  TORCH_CHECK(settings.dim() == 2 && settings.size(0) == logits.size(0) && settings.size(1) == 5 &&
                  settings.scalar_type() == torch::kFloat64 && settings.is_cpu(),
              "sample_rows: [rows, 5] fp64 settings expected");
  logits = logits.contiguous();
  settings = settings.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  const double* sp = settings.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(sp[5 * r] > 0.0 && sp[5 * r + 4] >= 0.0 && sp[5 * r + 4] < 1.0,
                "sample_rows: a positive temperature and u in [0, 1) expected");
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    std::vector<double> run;
    for (int64_t r = begin; r < end; ++r) {
      const double* s = sp + 5 * r;
      const Settings row{static_cast<float>(s[0]), static_cast<int64_t>(s[1]), s[2], static_cast<float>(s[3]), s[4]};
      op[r] = sample_row(lp + r * n, n, row, w, run);
    }
  });
  return out;
}
