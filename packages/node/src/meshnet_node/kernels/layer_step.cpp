// A Llama-style decoder layer's one-token step around its attention, in C++ (ADR-0043).
//
// A decode step through transformers' Python spends most of a small model's token on the
// interpreter: ~86 torch calls a layer for SmolLM2 (norm casts, views, rotary halves, the
// products' wrappers), each parsed and dispatched from Python, against ~150 us of products.
// `LayerStep` makes the same ATen calls, with the same arguments, in the same order as the
// Python program (programs/decode.py) and the modules it mirrors: so its results are theirs
// bit for bit by construction (the same kernels compute them), and tests compare them too.
// Only the interpreter between the calls is gone. The attention itself (the cache's update
// and the attention function transformers picks) stays in Python, between `before` and
// `after`: it is where families and caches differ.
//
// Products are `Product`s: the int4 kernel of this module called as intpack.int4_linear
// calls it (reshape, contiguous rows, float32 product cast back), or any Python callable
// (the stage's own module forward) where the weight is another kind.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;

torch::Tensor packed_int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                 const torch::Tensor& sz, int64_t group, int64_t block_n);

namespace {

using torch::Tensor;

// x @ W.T as the stage's module computes it.
struct Product {
  py::object call;  // a Python forward, or None for the int4 kernel below
  Tensor packed, sz, bias;  // int4: torch's CPU packing, contiguous scale_zero, bias or undefined
  int64_t group = 0, block_n = 0, in_features = 0, out_features = 0;

  Tensor operator()(const Tensor& x) const {
    if (!call.is_none()) return call(x).cast<Tensor>();
    // PackedLinear.forward -> Int4Weight.matmul -> intpack.int4_linear, call for call
    auto shape = x.sizes().vec();
    const auto rows = x.reshape({-1, shape.back()});
    const auto flat = rows.reshape({-1, in_features});
    const auto xin = flat.scalar_type() == torch::kBFloat16 ? flat.contiguous()
                                                              : flat.to(torch::kFloat32).contiguous();
    auto out = packed_int4_linear(xin, packed, sz, group, block_n).to(rows.scalar_type());
    out = out.view({rows.size(0), out_features});
    if (bias.defined()) out = out + bias.to(out.scalar_type());
    shape.back() = out_features;
    return out.view(shape);
  }
};

Product python_product(py::object call) {
  Product p;
  p.call = std::move(call);
  return p;
}

Product int4_product(Tensor packed, Tensor sz, int64_t group, int64_t block_n,
                     int64_t in_features, int64_t out_features, std::optional<Tensor> bias) {
  TORCH_CHECK(sz.is_contiguous(), "scale_zero must be contiguous");
  Product p;
  p.call = py::none();
  p.packed = std::move(packed);
  p.sz = std::move(sz);
  p.group = group;
  p.block_n = block_n;
  p.in_features = in_features;
  p.out_features = out_features;
  if (bias) p.bias = *bias;
  return p;
}

// Sibling projections of one input: a fused group's one product cut into contiguous
// slices (FusedGroup.part), or each member's own product.
struct Siblings {
  std::vector<Product> members;
  std::vector<std::pair<int64_t, int64_t>> bounds;  // non-empty: members[0] is the group's

  std::vector<Tensor> operator()(const Tensor& x) const {
    std::vector<Tensor> out;
    if (!bounds.empty()) {
      const auto product = members[0](x);
      for (const auto& [a, b] : bounds) out.push_back(product.slice(-1, a, b).contiguous());
      return out;
    }
    for (const auto& member : members) out.push_back(member(x));
    return out;
  }
};

// transformers' LlamaRMSNorm.forward (and the copies other families keep of it).
struct Norm {
  Tensor weight;
  double eps;

  Tensor operator()(const Tensor& hidden) const {
    const auto dtype = hidden.scalar_type();
    auto x = hidden.to(torch::kFloat32);
    const auto variance = x.pow(2).mean({-1}, /*keepdim=*/true);
    x = x * torch::rsqrt(variance + eps);
    return weight * x.to(dtype);
  }
};

Tensor rotate_half(const Tensor& x) {
  const auto half = x.size(-1) / 2;
  return torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

struct LayerStep {
  Norm input_norm, post_norm;
  int64_t head_dim;
  Siblings qkv, gate_up;
  Product o, down;

  // DecodeProgram._projected after the layer's input norm; rotary as apply_rotary_pos_emb.
  std::vector<Tensor> before(const Tensor& hidden, const Tensor& cos, const Tensor& sin) const {
    const auto x = input_norm(hidden);
    const auto parts = qkv(x);
    auto shape = x.sizes().vec();
    shape.back() = -1;
    shape.push_back(head_dim);
    const auto q = parts[0].view(shape).transpose(1, 2);
    const auto k = parts[1].view(shape).transpose(1, 2);
    const auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    auto q_embed = (q * c) + (rotate_half(q) * s);
    auto k_embed = (k * c) + (rotate_half(k) * s);
    return {q_embed, k_embed, parts[2].view(shape).transpose(1, 2)};
  }

  // DecodeProgram._finish for pre-norm layers: output projection, residuals, the MLP.
  Tensor after(const Tensor& residual, const Tensor& attended) const {
    auto shape = residual.sizes().vec();
    shape.back() = -1;
    const auto out = o(attended.reshape(shape).contiguous());
    const auto hidden = residual + out;
    const auto gate_up_parts = gate_up(post_norm(hidden));
    return hidden + down(torch::silu(gate_up_parts[0]) * gate_up_parts[1]);
  }
};

}  // namespace

void register_layer_step(py::module& m) {
  py::class_<Product>(m, "Product")
      .def_static("python", &python_product, "a product by a Python forward")
      .def_static("int4", &int4_product, py::arg("packed"), py::arg("scale_zero"),
                  py::arg("group"), py::arg("block_n"), py::arg("in_features"),
                  py::arg("out_features"), py::arg("bias") = std::nullopt,
                  "the int4 kernel, called as intpack.int4_linear calls it")
      .def("__call__", &Product::operator());
  py::class_<Siblings>(m, "Siblings")
      .def(py::init([](std::vector<Product> members) { return Siblings{std::move(members), {}}; }))
      .def(py::init([](Product fused, std::vector<std::pair<int64_t, int64_t>> bounds) {
        return Siblings{{std::move(fused)}, std::move(bounds)};
      }))
      .def("__call__", &Siblings::operator());
  py::class_<LayerStep>(m, "LayerStep")
      .def(py::init([](Tensor w1, double eps1, Tensor w2, double eps2, int64_t head_dim,
                       Siblings qkv, Product o, Siblings gate_up, Product down) {
             return LayerStep{{std::move(w1), eps1}, {std::move(w2), eps2}, head_dim,
                              std::move(qkv), std::move(gate_up), std::move(o), std::move(down)};
           }),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("head_dim"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"))
      .def("before", &LayerStep::before, "(hidden, cos, sin) -> [q, k, v] rotated, (B, h, 1, D)")
      .def("after", &LayerStep::after, "(residual, attended) -> the layer's output");
}
