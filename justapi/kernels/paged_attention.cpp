// Decode attention straight from the paged KV cache: one query token per sequence, keys and values read in place
// through the block table, so no [sequences, context, head_dim] copy of the cache is ever made.
//
// Cache layout (see justapi/model/attention.py): [num_kv_heads, num_blocks, block_size, head_dim], fp32.
// Work item = (sequence, kv head): its `group` query heads share every key/value row it reads.
//   pass 1: s[h][t] = scale * q[h] . k[t]        for t < context_len
//   pass 2: p = softmax(s[h])                     (max-subtracted, fp32)
//   pass 3: out[h] = sum_t p[h][t] * v[t]
// Each work item is computed alone, so a sequence's result never depends on the rest of the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 && v_cache.dtype() == torch::kFloat32,
              "decode_attention: fp32 query and cache expected");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64,
              "decode_attention: int64 block tables and context lengths expected");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "decode_attention: shape mismatch");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t ctx = lens[b];
      TORCH_CHECK(ctx >= 1 && ctx <= max_blocks * block_size, "decode_attention: bad context length");
      const int64_t* table = tables + b * max_blocks;
      scores.assign(group * ctx, 0.f);
      const float* qh = qp + (b * num_heads + kvh * group) * head_dim;  // this kv head's `group` query heads
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t block = table[t / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention: block id out of range");
        const float* kr = kp + ((kvh * num_blocks + block) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kr[d];
          scores[g * ctx + t] = s * fscale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t block = table[t / block_size];
        const float* vr = vp + ((kvh * num_blocks + block) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vr[d];
        }
      }
      float* oh = op + (b * num_heads + kvh * group) * head_dim;
      std::copy(acc.begin(), acc.end(), oh);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over the paged KV cache (fp32, CPU)");
}
