// sample_rows: one token drawn from each row of logits under its temperature, top-k, top-p and min-p, by the
// inverse of its distribution's cumulative sum at a uniform the caller draws (model/sampler.py `draw`, the same
// steps in torch ops, which this kernel matches token for token). What torch's path paid on a large vocabulary (a
// softmax, a full sort for top-p, multinomial; 5-22 ms a row of Gemma 3's 262,144 logits) is here a few passes:
//
//   1. w = exp((l - max) / T) by torch's own ops, as draw computes it (torch's exp is MKL's in this build: no
//      hand-written exp rounds as it does); a NaN weight (an infinite temperature over a -inf logit) is 0. A row
//      with a NaN or no finite logit has no token: -1
//   2. top-k: the k-th largest logit, from a min-heap of k (most logits fail one compare); ties with it kept
//   3. top-p: the tokens by w descending (ties by index) kept while the mass before them is under top_p * Z (Z their
//      sum in index order, double). Only tokens with w >= eps are sorted, eps lowered until their mass reaches
//      top_p * Z: the kept prefix then lies within them, as in a full sort
//   4. min-p: w below min_p dropped (the top token's w is exp(0) = 1, the maximum)
//   5. the first token whose running sum (index order, double, kept once) passes u times the total
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <vector>

namespace {

struct Settings {  // a row's filters and uniform (its temperature is in its weights)
  int64_t top_k;
  double top_p;
  float min_p;
  double u;
};

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

// top-p over w (step 3): zeroes what it drops
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

// one row: its logits l, its weights w (step 1's, zeroed in place by the filters), its running sums in run
int64_t sample_row(const float* l, float* w, int64_t n, const Settings& s, std::vector<double>& run) {
  if (s.top_k > 0 && s.top_k < n) {
    const float kth = kth_largest(l, n, s.top_k);
    for (int64_t i = 0; i < n; ++i)
      if (l[i] < kth) w[i] = 0.0f;
  }
  if (s.top_p < 1.0) {
    double z = 0.0;
    for (int64_t i = 0; i < n; ++i) z += w[i];
    keep_top_p(w, n, s.top_p, z);
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
  auto out = torch::full({rows}, -1, logits.options().dtype(torch::kInt64));
  const double* sp = settings.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(sp[5 * r] > 0.0 && sp[5 * r + 4] >= 0.0 && sp[5 * r + 4] < 1.0,
                "sample_rows: a positive temperature and u in [0, 1) expected");
  std::vector<torch::Tensor> weights(rows);  // step 1, row by row as draw computes it (each op on all threads)
  for (int64_t r = 0; r < rows; ++r) {
    const torch::Tensor row = logits[r], top = row.max();
    if (std::isfinite(top.item<float>()))
      weights[r] = at::nan_to_num(at::exp((row - top) / c10::Scalar(sp[5 * r])), 0.0).contiguous();
  }
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> run;
    for (int64_t r = begin; r < end; ++r) {
      if (!weights[r].defined()) continue;  // -1: nothing to draw
      const double* s = sp + 5 * r;
      const Settings row{static_cast<int64_t>(s[1]), s[2], static_cast<float>(s[3]), s[4]};
      op[r] = sample_row(lp + r * n, weights[r].data_ptr<float>(), n, row, run);
    }
  });
  return out;
}
