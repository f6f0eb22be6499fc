// DecodeLayers: the decoder layers of a decode step (every row a sequence's next token) in one native call. The
// Python loop (model/blocks.py) pays its dispatch on every op of every layer: 0.7 ms of SmolLM2's 6.0 ms one-row
// forward on a Xeon, 12-20% of a step (docs/benchmarks.md). Here the same kernels are called with the same
// tensors in the same order, each weight's route picked by the batch's rows from the table the weight was built
// with (model/quant.py), so the result is the Python loop's bit for bit (tested): a layer is
//
//   x, h = add_rms_norm(x, residual, attn_norm)
//   qkv = qkv_weight(h) (+ bias); q = rope_write_kv(qkv, QK norms, cos, sin -> K/V cache)
//   o = o_weight(decode_attention(q).to(h.dtype))             [post_attn_norm, residual_scale]
//   x, h = add_rms_norm(x, o, ffn_norm)
//   residual = down(silu_mul(gate_up(h)) or act(gate) * up)  [post_ffn_norm, residual_scale]
//
// model/decode_plan.py builds it at load where every part is one of these (else the Python loop serves).
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"  // the kernels it calls

namespace {

using torch::Tensor;
using Opt = c10::optional<Tensor>;

// model/quant.py's _run_<kernel>, named once when the plan is built (a step compares no strings)
enum class Kernel { TorchInt4, Amx, Dpbf16, Small, QMatmul, Dense };

Kernel kernel_of(const std::string& name) {
  if (name == "torch_int4") return Kernel::TorchInt4;
  if (name == "amx") return Kernel::Amx;
  if (name == "dpbf16") return Kernel::Dpbf16;
  if (name == "q4_small" || name == "q8_small") return Kernel::Small;
  if (name == "q_matmul") return Kernel::QMatmul;
  TORCH_CHECK(name == "dense", "DecodeLayers: no route ", name);
  return Kernel::Dense;
}

// One route of a weight: batches of up to max_rows rows go to `kernel`
struct Route {
  int64_t max_rows;
  Kernel kernel;
  std::vector<Tensor> t;  // the forms it reads, in quant.py's order
  int64_t out, group, bits;
  bool int8, has_zero;
};

struct Linear {
  std::vector<Route> routes;  // empty: a plain tensor weight (t0 of `plain`), multiplied by at::linear
  Tensor plain;
  at::ScalarType dtype;  // the products' (the weight's self.dtype)
  int64_t out_features;  // the weight's outputs: a unit kernel computes them padded to whole units (quant.py)

  Tensor run(const Route& r, const Tensor& x) const {
    const auto in = [&](at::ScalarType d) { return x.scalar_type() == d ? x : x.to(d); };
    const auto as_dtype = [&](const Tensor& y) { return y.scalar_type() == dtype ? y : y.to(dtype); };
    switch (r.kernel) {
      case Kernel::TorchInt4:
        return as_dtype(at::_weight_int4pack_mm_for_cpu(in(at::kBFloat16), r.t[0], 32, r.t[1]));
      case Kernel::Amx:
        return r.int8 ? q8_amx_matmul(in(dtype), r.t[0], r.out, r.group, r.has_zero)
                      : int4_amx_matmul(in(dtype), r.t[0], r.out);
      case Kernel::Dpbf16:
        return r.int8 ? q8_dpbf16_matmul(in(dtype), r.t[0], r.out, r.group, r.has_zero)
                      : int4_dpbf16_matmul(in(dtype), r.t[0], r.out);
      case Kernel::Small: {
        const bool fits = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
        const Tensor xs = fits ? x : x.to(dtype);
        return as_dtype(r.int8 ? q8_small_matmul(xs, r.t[0], r.out, r.group, r.has_zero)
                               : int4_small_matmul(xs, r.t[0], r.out));
      }
      case Kernel::QMatmul:
        return q_matmul(in(at::kFloat), r.t[0], r.t[1], r.t.size() > 2 ? Opt(r.t[2]) : Opt(), r.bits, r.out);
      case Kernel::Dense:
        break;
    }
    return r.t[0].is_mkldnn() ? prepacked_linear(in(dtype), r.t[0]) : at::linear(in(dtype), r.t[0]);
  }

  // quant.packed_linear's product with a weight in oneDNN's prepacked layout: torch's own op, through the dispatcher
  static Tensor prepacked_linear(const Tensor& x, const Tensor& w) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                               .typed<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&,
                                             c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                                             c10::optional<c10::string_view>)>();
    return op.call(x, w, c10::nullopt, "none", c10::List<c10::optional<c10::Scalar>>(), c10::string_view(""));
  }

  // layers.linear: the product, in x's dtype, plus the bias
  Tensor operator()(const Tensor& x, const Opt& bias) const {
    if (routes.empty()) return at::linear(x, plain, bias);
    const int64_t rows = x.size(0);
    for (const Route& r : routes) {
      if (rows > r.max_rows) continue;
      Tensor y = run(r, x);
      if (y.size(1) != out_features) y = y.narrow(1, 0, out_features).contiguous();
      y = y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
      return bias.has_value() ? y + *bias : y;
    }
    TORCH_CHECK(false, "DecodeLayers: the last route covers every batch size");
  }
};

struct Layer {
  Tensor attn_norm, ffn_norm;
  Opt post_attn_norm, post_ffn_norm, qkv_bias, q_norm, k_norm;
  std::optional<double> residual_scale;
  Linear qkv, o, gate_up, down;
  int64_t heads, kv_heads, dim, window, table;
  double scale;
  bool neox, gelu;
};

Linear make_linear(const py::object& w) {
  Linear lin;
  if (py::isinstance<py::tuple>(w)) {  // (bf16, outputs, [(max_rows, kernel, tensors, out, group, bits, int8, zero)])
    auto parts = w.cast<py::tuple>();
    lin.dtype = parts[0].cast<bool>() ? at::kBFloat16 : at::kFloat;
    lin.out_features = parts[1].cast<int64_t>();
    for (const auto& r : parts[2].cast<py::list>()) {
      auto f = r.cast<py::tuple>();
      lin.routes.push_back(Route{f[0].cast<int64_t>(), kernel_of(f[1].cast<std::string>()),
                                 f[2].cast<std::vector<Tensor>>(), f[3].cast<int64_t>(), f[4].cast<int64_t>(),
                                 f[5].cast<int64_t>(), f[6].cast<bool>(), f[7].cast<bool>()});
    }
  } else {
    lin.plain = w.cast<Tensor>();
    lin.dtype = lin.plain.scalar_type();
    lin.out_features = lin.plain.size(0);
  }
  return lin;
}

}  // namespace

class DecodeLayers {
 public:
  DecodeLayers(double eps, bool fused_silu) : eps_(eps), fused_silu_(fused_silu) {}

  // one layer, in order (model/decode_plan.py); a weight is a plain tensor or (bf16, routes)
  void add(Tensor attn_norm, Tensor ffn_norm, Opt post_attn_norm, Opt post_ffn_norm, std::optional<double> res_scale,
           py::object qkv, Opt qkv_bias, Opt q_norm, Opt k_norm, py::object o, int64_t heads, int64_t kv_heads,
           int64_t dim, double scale, int64_t window, int64_t table, bool neox, py::object gate_up, py::object down,
           bool gelu) {
    layers_.push_back(Layer{attn_norm, ffn_norm, post_attn_norm, post_ffn_norm, qkv_bias, q_norm, k_norm, res_scale,
                            make_linear(qkv), make_linear(o), make_linear(gate_up), make_linear(down), heads,
                            kv_heads, dim, window, table, scale, neox, gelu});
  }

  // x: the embedded rows; tables: (cos, sin) of each RoPE table at the rows' positions; caches: each layer's (K, V)
  // -> (x, the last layer's MLP output not yet added to it), as the Python loop returns them
  std::tuple<Tensor, Tensor> run(Tensor x, const std::vector<std::pair<Tensor, Tensor>>& tables,
                                 const std::vector<std::pair<Tensor, Tensor>>& caches, Tensor slots,
                                 Tensor block_tables, Tensor context_lens) const {
    TORCH_CHECK(caches.size() == layers_.size(), "DecodeLayers: one (K, V) per layer expected");
    Opt residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      Tensor h;
      std::tie(x, h) = add_rms_norm(x, residual, l.attn_norm, eps_);
      const auto& [cos, sin] = tables.at(l.table);
      const auto& [k_cache, v_cache] = caches[i];
      const int64_t n = h.size(0);
      const Tensor qkv = l.qkv(h, l.qkv_bias);
      const Tensor q = rope_write_kv(qkv, cos, sin, l.neox, l.heads, l.kv_heads, l.dim, k_cache, v_cache, slots,
                                     l.q_norm, l.k_norm, eps_);
      const Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, context_lens, l.scale, l.window)
                              .to(h.scalar_type())
                              .reshape({n, l.heads * l.dim});
      const Tensor o = output(l.o(attn, Opt()), l.post_attn_norm, l.residual_scale);
      std::tie(x, h) = add_rms_norm(x, o, l.ffn_norm, eps_);
      residual = output(mlp(l, h), l.post_ffn_norm, l.residual_scale);
    }
    return {x, *residual};
  }

  size_t size() const { return layers_.size(); }

 private:
  Tensor mlp(const Layer& l, const Tensor& h) const {
    const Tensor gate_up = l.gate_up(h, Opt());
    Tensor act;
    if (!l.gelu && fused_silu_ && gate_up.size(1) % 32 == 0) {
      act = silu_mul(gate_up);
    } else {
      const auto parts = gate_up.chunk(2, -1);
      act = (l.gelu ? at::gelu(parts[0], "tanh") : at::silu(parts[0])) * parts[1];
    }
    return l.down(act, Opt());
  }

  // a sublayer's output as the stream takes it: Gemma's post-norm, Granite's multiplier (blocks.DecoderLayer)
  Tensor output(Tensor out, const Opt& post_norm, const std::optional<double>& scale) const {
    if (post_norm.has_value())
      out = std::get<1>(add_rms_norm(out.reshape({-1, out.size(-1)}).contiguous(), Opt(), *post_norm, eps_))
                .view(out.sizes());
    return scale.has_value() ? out * *scale : out;
  }

  double eps_;
  bool fused_silu_;
  std::vector<Layer> layers_;
};

void bind_decode_step(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers", "a decode step's decoder layers in one native call (decode_step.cpp)")
      .def(py::init<double, bool>(), py::arg("eps"), py::arg("fused_silu"))
      .def("add", &DecodeLayers::add)
      .def("run", &DecodeLayers::run, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &DecodeLayers::size);
}
