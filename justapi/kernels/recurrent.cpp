// One decode token of the gated delta rule (justapi/model/delta_rule.py) for each of B rows, in place on the rows'
// state slots. Per (row, head), with S the slot's [key_dim, value_dim] state:
//
//   S = exp(g) S;   u = beta (v - S^T k);   S += k u^T;   o = S^T q
//
// Two passes over S (read it for S^T k; then update it and read it for the output) where the torch path makes five
// full-size temporaries, and the slots are updated where they are instead of being gathered into a batch and
// scattered back: a Qwen3.5 state is 1-2 MiB a sequence and a layer, so decode is bound by these passes.
// The products are summed in another order than torch's reductions: equal within fp32 rounding, not bit-identical
// (the engine keeps --batch-invariant on the torch path).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

void delta_rule_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                     torch::Tensor states, torch::Tensor slots, torch::Tensor out) {
  for (const auto& t : {q, k, v, g, beta, states, out}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, "delta_rule_step: fp32 CPU tensors");
  }
  TORCH_CHECK(states.is_contiguous() && out.is_contiguous(), "delta_rule_step: contiguous states and output");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  g = g.contiguous();
  beta = beta.contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == dk && states.size(3) == dv,
              "delta_rule_step: states must be [slots, heads, key_dim, value_dim]");
  TORCH_CHECK(slots.numel() == rows && out.numel() == rows * heads * dv, "delta_rule_step: one slot and row each");
  TORCH_CHECK(k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == rows && v.size(1) == heads,
              "delta_rule_step: q, k [rows, heads, key_dim], v [rows, heads, value_dim]");
  TORCH_CHECK(g.numel() == rows * heads && beta.numel() == rows * heads, "delta_rule_step: g, beta [rows, heads]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < states.size(0), "delta_rule_step: slot out of range");
  }
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = states.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      float* s = sp + (slot[b] * heads + h) * dk * dv;
      const float *kk = kp + bh * dk, *qq = qp + bh * dk, *vv = vp + bh * dv;
      const float decay = std::exp(gp[bh]), scale = bp[bh];
      for (int64_t j = 0; j < dv; ++j) u[j] = 0.0f;
      for (int64_t i = 0; i < dk; ++i) {  // S^T k, before the decay (applied once to the sum)
        const float ki = kk[i];
        const float* row = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) u[j] += row[j] * ki;
      }
      for (int64_t j = 0; j < dv; ++j) u[j] = (vv[j] - decay * u[j]) * scale;
      float* o = op + bh * dv;
      for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
      for (int64_t i = 0; i < dk; ++i) {  // S = decay S + k u^T, and S^T q from the updated rows
        const float ki = kk[i], qi = qq[i];
        float* row = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          const float updated = row[j] * decay + ki * u[j];
          row[j] = updated;
          o[j] += updated * qi;
        }
      }
    }
  });
}
