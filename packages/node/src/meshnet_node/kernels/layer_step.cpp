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
// Products are `Product`s: the int4 or Q8 kernel of this module called as
// intpack.int4_linear / intpack.q8_linear call it (reshape, contiguous rows, float32 product
// cast back), or any Python callable (the stage's own module forward) where the weight is
// another kind.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "fixed_order.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace meshnet {
torch::Tensor attend_rows(const torch::Tensor& q, std::vector<torch::Tensor> keys,
                          std::vector<torch::Tensor> values, const std::vector<int64_t>& visible,
                          double scaling);  // attention.cpp
void attend_rows_into(const torch::Tensor& q, std::vector<torch::Tensor> keys,
                      std::vector<torch::Tensor> values, const std::vector<int64_t>& visible,
                      double scaling, torch::Tensor& out);
}  // namespace meshnet

void packed_int4_into(const torch::Tensor& x, const torch::Tensor& packed,
                      const torch::Tensor& sz, int64_t group, int64_t block_n, float* y);
void packed_q8_into(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                    const torch::Tensor& z, float* y);  // packed.cpp

namespace {

using torch::Tensor;

using c10::BFloat16;

// ATen's elementwise ops on bf16 compute in float32 and round each result to bf16 (to
// nearest even): `round` does the same, so a loop of these equals the ops' chain bit for bit.
template <typename T>
inline T round(float v) {
  return static_cast<T>(v);  // BFloat16(float) rounds to nearest even; float: itself
}

bool fused_dtype(const Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32;
}

// x @ W.T as the stage's module computes it.
struct Product {
  py::object call;  // a Python forward, or None for the int4 / Q8 kernel below
  Tensor packed, sz, bias;  // int4: torch's CPU packing, contiguous scale_zero, bias or undefined
  Tensor q8, q8_scales, q8_zeros;  // Q8 (lowbit.shipped.Q8Weight): codes, scales, zeros or undefined
  int64_t group = 0, block_n = 0, in_features = 0, out_features = 0;
  // int4: calls of more rows than wide_rows go to the module's forward (`wide`), which may
  // dequantize for a GEMM in a prompt's pass (lowbit.packed.WIDE_ROWS); none where unset
  py::object wide;
  int64_t wide_rows = 0;

  bool goes_wide(const Tensor& x) const {
    return wide_rows > 0 && x.numel() / std::max<int64_t>(1, x.size(-1)) > wide_rows;
  }

  Tensor forward_of(const py::object& forward, const Tensor& x) const {
    py::gil_scoped_acquire gil;  // a stack of native layers runs without it
    return forward(x).cast<Tensor>();
  }

  bool native() const { return call.is_none(); }

  // The float32 products of x's rows into a buffer of this thread (int4 or Q8 only).
  const float* rows_into(const Tensor& x, int64_t& rows) const {
    // rows as they are where they already are the kernel's (no reshape, no cast to call)
    const bool ready = x.dim() == 2 && x.size(1) == in_features && x.is_contiguous() && fused_dtype(x);
    const auto flat = ready ? x : x.reshape({-1, in_features});
    const auto xin = ready || flat.scalar_type() == torch::kBFloat16
                         ? flat.contiguous()
                         : flat.to(torch::kFloat32).contiguous();
    rows = xin.size(0);
    thread_local std::vector<float> y;
    y.resize(static_cast<size_t>(rows * out_features));
    if (q8.defined()) {
      packed_q8_into(xin, q8, q8_scales, q8_zeros, y.data());
    } else {
      packed_int4_into(xin, packed, sz, group, block_n, y.data());
    }
    return y.data();
  }

  // Columns [a, b) of the product as intpack.int4_linear and PackedLinear.forward give
  // them: cast to x's dtype, then the bias added in that dtype; shape (*x.shape[:-1], b - a).
  template <typename T>
  void emit(const float* y, int64_t rows, int64_t a, int64_t b, T* o) const {
    const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
    const int64_t w = b - a;
    namespace fx = meshnet::fixed;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t j = a;
      for (; j + fx::kLanes <= b; j += fx::kLanes) {  // 16 at a time: the same roundings
        fx::Lanes v = fx::rounded(fx::load(y + r * out_features + j), o);
        if (bp != nullptr) v = fx::rounded(v + fx::load(bp + j), o);
        fx::store(o + r * w + (j - a), v);
      }
      for (; j < b; ++j) {
        T v = round<T>(y[r * out_features + j]);
        if (bp != nullptr) v = round<T>(static_cast<float>(v) + static_cast<float>(bp[j]));
        o[r * w + (j - a)] = v;
      }
    }
  }

  // Whether `emit` serves `rows` rows of `dtype` (as `emits` for such an x).
  bool emits_rows(c10::ScalarType dtype, int64_t rows) const {
    return native() && !(wide_rows > 0 && rows > wide_rows) &&
           (dtype == torch::kBFloat16 || dtype == torch::kFloat32) &&
           (!bias.defined() || bias.scalar_type() == dtype);
  }

  // Whether `emit` serves x: the kernel's dtypes, and a bias already in x's dtype.
  bool emits(const Tensor& x) const {
    return native() && !goes_wide(x) && fused_dtype(x) &&
           (!bias.defined() || bias.scalar_type() == x.scalar_type());
  }

  std::vector<Tensor> parts(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& bounds) const {
    int64_t rows = 0;
    const float* y = rows_into(x, rows);
    auto shape = x.sizes().vec();
    std::vector<Tensor> out;
    for (const auto& [a, b] : bounds) {
      shape.back() = b - a;
      auto part = torch::empty(shape, x.options());
      if (x.scalar_type() == torch::kBFloat16) {
        emit<BFloat16>(y, rows, a, b, part.data_ptr<BFloat16>());
      } else {
        emit<float>(y, rows, a, b, part.data_ptr<float>());
      }
      out.push_back(part);
    }
    return out;
  }

  Tensor operator()(const Tensor& x) const {
    if (!native()) return forward_of(call, x);
    if (goes_wide(x)) return forward_of(wide, x);
    if (emits(x)) return parts(x, {{0, out_features}})[0];
    // PackedLinear.forward -> Int4Weight / Q8Weight.matmul -> intpack's product, call for call
    auto shape = x.sizes().vec();
    const auto rows = x.reshape({-1, shape.back()});
    int64_t n = 0;
    const float* y = rows_into(rows, n);
    auto out = torch::from_blob(const_cast<float*>(y), {n, out_features}, torch::kFloat32)
                   .to(rows.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
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
                     int64_t in_features, int64_t out_features, std::optional<Tensor> bias,
                     py::object wide, int64_t wide_rows) {
  TORCH_CHECK(sz.is_contiguous(), "scale_zero must be contiguous");
  Product p;
  p.call = py::none();
  p.wide = std::move(wide);
  p.wide_rows = p.wide.is_none() ? 0 : wide_rows;
  p.packed = std::move(packed);
  p.sz = std::move(sz);
  p.group = group;
  p.block_n = block_n;
  p.in_features = in_features;
  p.out_features = out_features;
  if (bias) p.bias = *bias;
  return p;
}

Product q8_product(Tensor q, Tensor d, std::optional<Tensor> bias, std::optional<Tensor> z) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous() &&
                  q.size(1) % 32 == 0,
              "q must be int8 [N, K], K a multiple of 32, contiguous");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == q.size(0) &&
                  (d.size(1) * 32 == q.size(1) || d.size(1) * 16 == q.size(1)),
              "d must be float32 [N, K / 32] or [N, K / 16], contiguous");
  Product p;
  p.call = py::none();
  p.wide = py::none();
  p.q8 = std::move(q);
  p.q8_scales = std::move(d);
  if (z) {
    TORCH_CHECK(z->scalar_type() == torch::kFloat32 && z->is_contiguous() &&
                    z->sizes() == p.q8_scales.sizes(),
                "z must be float32, contiguous, of d's shape");
    p.q8_zeros = *z;
  }
  p.in_features = p.q8.size(1);
  p.out_features = p.q8.size(0);
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
      if (members[0].emits(x)) return members[0].parts(x, bounds);  // no whole product
      const auto product = members[0](x);
      for (const auto& [a, b] : bounds) out.push_back(product.slice(-1, a, b).contiguous());
      return out;
    }
    for (const auto& member : members) out.push_back(member(x));
    return out;
  }
};

// transformers' LlamaRMSNorm.forward (and the copies other families keep of it):
//   x = hidden.to(float32); variance = x.pow(2).mean(-1, keepdim=True)
//   x = x * torch.rsqrt(variance + eps); return weight * x.to(hidden.dtype)
// The mean stays ATen's (a reduction: its order is ATen's); the rest are elementwise ops
// done in a loop with their roundings: squaring is x * x in ATen, rsqrt is 1 / sqrt (both
// IEEE-exact), `variance + eps` adds eps as float32.
struct Norm {
  Tensor weight;
  double eps;

  Tensor aten(const Tensor& hidden) const {
    const auto dtype = hidden.scalar_type();
    auto x = hidden.to(torch::kFloat32);
    const auto variance = x.pow(2).mean({-1}, /*keepdim=*/true);
    x = x * torch::rsqrt(variance + eps);
    return weight * x.to(dtype);
  }

  template <typename T>
  Tensor fused(const Tensor& hidden) const {
    const int64_t h = hidden.size(-1), rows = hidden.numel() / h;
    const T* in = hidden.data_ptr<T>();
    auto squares = torch::empty(hidden.sizes(), hidden.options().dtype(torch::kFloat32));
    float* sq = squares.data_ptr<float>();
    for (int64_t i = 0; i < rows * h; ++i) {
      const float v = static_cast<float>(in[i]);
      sq[i] = v * v;
    }
    const auto variance = squares.mean({-1}, /*keepdim=*/true);
    const float* var = variance.data_ptr<float>();
    const T* w = weight.data_ptr<T>();
    auto out = torch::empty(hidden.sizes(), hidden.options());
    T* o = out.data_ptr<T>();
    const float e = static_cast<float>(eps);
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / std::sqrt(var[r] + e);
      for (int64_t j = 0; j < h; ++j) {
        const T normed = round<T>(static_cast<float>(in[r * h + j]) * inv);
        o[r * h + j] = round<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
    return out;
  }

  // The native engine's norm (fixed_norm): hidden's dtype is the weight's, H whole lanes.
  Tensor fixed(const Tensor& hidden_in) const;

  Tensor operator()(const Tensor& hidden) const {
    const bool same = hidden.scalar_type() == weight.scalar_type() && fused_dtype(hidden) &&
                      hidden.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
                      weight.size(0) == hidden.size(-1);
    if (!same) return aten(hidden);
    return hidden.scalar_type() == torch::kBFloat16 ? fused<BFloat16>(hidden) : fused<float>(hidden);
  }
};

// defined below fixed_norm
template <typename T>
Tensor fixed_norm(const Tensor& hidden, const Tensor& weight, double eps);

Tensor Norm::fixed(const Tensor& hidden_in) const {
  const auto hidden = hidden_in.contiguous();
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type() && fused_dtype(hidden) &&
                  weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == hidden.size(-1) &&
                  hidden.size(-1) % meshnet::fixed::kLanes == 0,
              "native layer: a norm of the hidden states' dtype over whole 16-lane blocks");
  return hidden.scalar_type() == torch::kBFloat16 ? fixed_norm<BFloat16>(hidden, weight, eps)
                                                  : fixed_norm<float>(hidden, weight, eps);
}

// apply_rotary_pos_emb on one product part: `part` (B, 1, heads * D) contiguous, cos and sin
// (B or 1, 1, D) -> (part.view(B, 1, heads, D).transpose(1, 2) * cos.unsqueeze(1)) +
// (rotate_half(...) * sin.unsqueeze(1)), (B, heads, 1, D): the products and the sum each
// rounded to the dtype as ATen's three ops round them (rotate_half's negation is exact).
Tensor rotary_aten(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const auto half = x.size(-1) / 2;
  const auto rotated = torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * c) + (rotated * s);
}

// x: batch rows of heads x d values; cp, sp: rope_rows (1 or batch) rows of d -> o, alike.
template <typename T>
void rotary_rows(const T* x, const T* cp, const T* sp, int64_t rope_rows, int64_t batch,
                 int64_t heads, int64_t d, T* o) {
  const int64_t half = d / 2;
  for (int64_t b = 0; b < batch; ++b) {
    const T* c = cp + (rope_rows == 1 ? 0 : b) * d;
    const T* s = sp + (rope_rows == 1 ? 0 : b) * d;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xi = x + (b * heads + h) * d;
      T* oi = o + (b * heads + h) * d;
      int64_t j = 0;
      if (half % meshnet::fixed::kLanes == 0) {  // 16 lanes at a time, the same operations
        namespace fx = meshnet::fixed;
        for (; j < d; j += fx::kLanes) {
          const fx::Lanes rot = j < half ? -fx::load(xi + j + half) : fx::load(xi + j - half);
          const fx::Lanes a = fx::rounded(fx::load(xi + j) * fx::load(c + j), xi);
          const fx::Lanes r = fx::rounded(rot * fx::load(s + j), xi);
          fx::store(oi + j, a + r);
        }
      }
      for (; j < d; ++j) {
        const float rot = j < half ? -static_cast<float>(xi[j + half]) : static_cast<float>(xi[j - half]);
        const T a = round<T>(static_cast<float>(xi[j]) * static_cast<float>(c[j]));
        const T r = round<T>(rot * static_cast<float>(s[j]));
        oi[j] = round<T>(static_cast<float>(a) + static_cast<float>(r));
      }
    }
  }
}

template <typename T>
Tensor rotary_fused(const Tensor& part, int64_t heads, int64_t d, const Tensor& cos,
                    const Tensor& sin) {
  const int64_t batch = part.size(0);
  auto out = torch::empty({batch, heads, 1, d}, part.options());
  rotary_rows<T>(part.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), cos.size(0), batch,
                 heads, d, out.data_ptr<T>());
  return out;
}

// Whether cos and sin (rows or 1, 1, d) of dtype T serve rotary_rows for `rows` rows.
bool rope_fits(const Tensor& cos, const Tensor& sin, c10::ScalarType dtype, int64_t d, int64_t rows) {
  return cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() &&
         sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(1) == 1 &&
         cos.size(2) == d && d % 2 == 0 && (cos.size(0) == 1 || cos.size(0) == rows);
}

Tensor rotary(const Tensor& part, int64_t d, const Tensor& cos, const Tensor& sin) {
  auto shape = part.sizes().vec();
  shape.back() = -1;
  shape.push_back(d);
  const auto dtype = part.scalar_type();
  const bool fusable = fused_dtype(part) && cos.scalar_type() == dtype &&
                       sin.scalar_type() == dtype && part.dim() == 3 && part.size(1) == 1 &&
                       part.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                       cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(1) == 1 &&
                       cos.size(2) == d && d % 2 == 0 &&
                       (cos.size(0) == 1 || cos.size(0) == part.size(0));
  if (!fusable) return rotary_aten(part.view(shape).transpose(1, 2), cos, sin);
  const int64_t heads = part.size(2) / d;
  return dtype == torch::kBFloat16 ? rotary_fused<BFloat16>(part, heads, d, cos, sin)
                                   : rotary_fused<float>(part, heads, d, cos, sin);
}

// -- the native engine's elementwise parts (ADR-0044): fixed-order sums, own exp --------

namespace fixed = meshnet::fixed;

// 16 lanes of `p` (fewer at the end: zeros) as float32
template <typename T>
inline fixed::Lanes load_some(const T* p, int64_t count) {
  if (count >= fixed::kLanes) return fixed::load(p);
  T part[fixed::kLanes] = {};
  for (int64_t i = 0; i < count; ++i) part[i] = p[i];
  return fixed::load(part);
}

// the first `count` lanes rounded to T (to nearest even for bf16)
template <typename T>
inline void store_some(T* p, fixed::Lanes v, int64_t count) {
  if (count >= fixed::kLanes) return fixed::store(p, v);
  float lanes[fixed::kLanes];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int64_t i = 0; i < std::min<int64_t>(count, fixed::kLanes); ++i) p[i] = round<T>(lanes[i]);
}

// po[i] = f(pa[i], pb[i]) rounded to T, 16 lanes at a time (po may be pa: each lane is
// read before it is written).
template <typename T, typename F>
void lanes_run(const T* pa, const T* pb, T* po, int64_t n, F f) {
  for (int64_t i = 0; i < n; i += fixed::kLanes) {
    store_some(po + i, f(load_some(pa + i, n - i), load_some(pb + i, n - i)), n - i);
  }
}

struct Plus {
  fixed::Lanes operator()(fixed::Lanes a, fixed::Lanes b) const { return a + b; }
};

// act_fn(gate) * up: the activation rounded to the dtype before the product
template <typename T>
struct SiluTimes {
  fixed::Lanes operator()(fixed::Lanes g, fixed::Lanes u) const {
    return fixed::rounded(fixed::silu(g), static_cast<const T*>(nullptr)) * u;
  }
};

// out[i] = f(a[i], b[i]) rounded to the dtype, 16 lanes at a time; a and b alike.
template <typename F>
Tensor lanes_map(const Tensor& a_in, const Tensor& b_in, F f) {
  const auto a = a_in.contiguous(), b = b_in.contiguous();
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && fused_dtype(a),
              "native layer: two like bf16 or float32 tensors");
  auto out = torch::empty(a.sizes(), a.options());
  const int64_t n = a.numel();
  if (a.scalar_type() == torch::kBFloat16) {
    lanes_run(a.data_ptr<BFloat16>(), b.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), n, f);
  } else {
    lanes_run(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n, f);
  }
  return out;
}

// transformers' RMS norm with its roundings, the mean of squares summed in the fixed order:
// x * rsqrt(sum(x^2) / H + eps) rounded to the dtype, then the weight's product rounded.
template <typename T>
void fixed_norm_rows(const T* in, const T* w, double eps, int64_t rows, int64_t h, T* o) {
  for (int64_t r = 0; r < rows; ++r) {
    const float variance = fixed::squares(in + r * h, h) / static_cast<float>(h);
    const float inv = 1.0f / std::sqrt(variance + static_cast<float>(eps));
    for (int64_t j = 0; j < h; j += fixed::kLanes) {  // h: whole lanes (Norm::fixed)
      const fixed::Lanes normed = fixed::rounded(fixed::load(in + r * h + j) * inv, in);
      fixed::store(o + r * h + j, fixed::load(w + j) * normed);
    }
  }
}

template <typename T>
Tensor fixed_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  const int64_t h = hidden.size(-1), rows = hidden.numel() / h;
  auto out = torch::empty(hidden.sizes(), hidden.options());
  fixed_norm_rows<T>(hidden.data_ptr<T>(), weight.data_ptr<T>(), eps, rows, h, out.data_ptr<T>());
  return out;
}

struct LayerStep {
  Norm input_norm, post_norm;
  int64_t head_dim;
  Siblings qkv, gate_up;
  Product o, down;

  // DecodeProgram._projected of the normed input x; rotary as apply_rotary_pos_emb.
  std::vector<Tensor> projected(const Tensor& x, const Tensor& cos, const Tensor& sin) const {
    const auto parts = qkv(x);
    auto shape = x.sizes().vec();
    shape.back() = -1;
    shape.push_back(head_dim);
    return {rotary(parts[0], head_dim, cos, sin), rotary(parts[1], head_dim, cos, sin),
            parts[2].view(shape).transpose(1, 2)};
  }

  // DecodeProgram._projected after the layer's input norm.
  std::vector<Tensor> before(const Tensor& hidden, const Tensor& cos, const Tensor& sin) const {
    return projected(input_norm(hidden), cos, sin);
  }

  // The native engine's parts around its attention: `before` and `after` with the norms'
  // sums, the residuals and the activation in the fixed order (fixed_order.h); products
  // and rotary as above.
  std::vector<Tensor> native_before(const Tensor& hidden, const Tensor& cos, const Tensor& sin) const {
    return projected(input_norm.fixed(hidden), cos, sin);
  }

  Tensor native_after(const Tensor& residual, const Tensor& attended) const {
    auto shape = residual.sizes().vec();
    shape.back() = -1;
    const auto hidden = lanes_map(residual, o(attended.reshape(shape).contiguous()), Plus{});
    const auto gate_up_parts = gate_up(post_norm.fixed(hidden));
    const auto act = hidden.scalar_type() == torch::kBFloat16
                         ? lanes_map(gate_up_parts[0], gate_up_parts[1], SiluTimes<BFloat16>{})
                         : lanes_map(gate_up_parts[0], gate_up_parts[1], SiluTimes<float>{});
    return lanes_map(hidden, down(act), Plus{});
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

// The native engine's stack (ADR-0044): rows through layers in one call, the interpreter
// out of the loop and the GIL released while they compute.

// Rows (count, kv, 1, D) into positions [n, n + count) of a contiguous (1, kv, cap, D)
// buffer of their dtype: a memcpy per row and head where each head's D values lie together.
void copy_rows(const Tensor& rows, Tensor& buffer, int64_t n) {
  const int64_t count = rows.size(0), kv = rows.size(1), d = rows.size(3), cap = buffer.size(2);
  if (rows.stride(3) != 1 || rows.scalar_type() != buffer.scalar_type()) {
    buffer.slice(2, n, n + count).copy_(rows.transpose(0, 2));
    return;
  }
  const auto size = rows.element_size();
  const auto* src = static_cast<const char*>(rows.data_ptr());
  auto* dst = static_cast<char*>(buffer.data_ptr());
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t g = 0; g < kv; ++g) {
      std::memcpy(dst + ((g * cap + n + b) * d) * size,
                  src + (b * rows.stride(0) + g * rows.stride(1)) * size, static_cast<size_t>(d * size));
    }
  }
}

// A layer's cache in the native engine: its keys and values in a buffer with room for `grow`
// more positions, kept in the transformers DynamicLayer's dict; the layer's keys and values
// are views of the buffer's first positions, so a step copies its own rows instead of
// torch.cat-ing the whole cache. A layer whose tensors are not views of its buffer (new,
// filled from a prefix, grown past it) moves into a new one; a crop leaves a shorter view and
// the next rows overwrite what it dropped.
//
// A pass touches Python twice per layer and session: `read` before the layers run (with the
// GIL), `publish` after all of them ran (with the GIL); in between, `append` copies the
// rows into the buffer without it. A pass that fails in between changes no layer.
struct CacheSlot {
  py::object layer;
  bool initialized = false;
  Tensor keys, values, kbuf, vbuf;  // keys/values: the layer's (n > 0); buffers: its, or new
  int64_t n = 0;  // positions the layer holds before the pass
  bool moved = false;

  static CacheSlot read(py::object layer) {
    CacheSlot slot;
    slot.layer = std::move(layer);
    slot.initialized = slot.layer.attr("is_initialized").cast<bool>();
    if (!slot.initialized) return slot;
    slot.keys = slot.layer.attr("keys").cast<Tensor>();
    slot.values = slot.layer.attr("values").cast<Tensor>();
    slot.n = slot.keys.dim() == 4 ? slot.keys.size(2) : 0;
    py::dict state = slot.layer.attr("__dict__");
    if (state.contains("_meshnet_buffers")) {
      auto pair = state["_meshnet_buffers"].cast<std::pair<Tensor, Tensor>>();
      slot.kbuf = std::move(pair.first), slot.vbuf = std::move(pair.second);
    }
    return slot;
  }

  // Rows k, v (count, kv, 1, D) after the layer's n positions, as DynamicLayer.update
  // would append them; returns the keys and values the rows attend to. No GIL needed.
  std::pair<Tensor, Tensor> append(const Tensor& k_rows, const Tensor& v_rows, int64_t grow) {
    const int64_t count = k_rows.size(0);
    moved = !kbuf.defined() || kbuf.size(2) < n + count ||
            (n > 0 && (keys.data_ptr() != kbuf.data_ptr() || values.data_ptr() != vbuf.data_ptr()));
    if (moved) {
      const std::vector<int64_t> shape{1, k_rows.size(1), n + count + grow, k_rows.size(3)};
      kbuf = torch::empty(shape, k_rows.options());
      vbuf = torch::empty(shape, v_rows.options());
      if (n > 0) {
        kbuf.slice(2, 0, n).copy_(keys);
        vbuf.slice(2, 0, n).copy_(values);
      }
    }
    copy_rows(k_rows, kbuf, n);
    copy_rows(v_rows, vbuf, n);
    keys = kbuf.slice(2, 0, n + count), values = vbuf.slice(2, 0, n + count);
    return {keys, values};
  }

  // The layer's keys and values become the views `append` made (GIL held).
  void publish() {
    if (!initialized) layer.attr("lazy_initialization")(keys, values);
    if (moved) layer.attr("__dict__")["_meshnet_buffers"] = py::make_tuple(kbuf, vbuf);
    layer.attr("keys") = keys;
    layer.attr("values") = values;
  }
};

// A session's `count` rows (a prompt chunk of more than wide_rows) attended as the module
// path attends them: torch's SDPA over its cache, each row masked to the positions up to
// its own (q: (count, heads, 1, D) -> (count, 1, heads * D)).
Tensor sdpa_rows(const Tensor& q, const Tensor& keys, const Tensor& values, double scaling) {
  const int64_t count = q.size(0), n = keys.size(2);
  const auto rows = torch::arange(count, torch::kLong).unsqueeze(1) + (n - count);
  const auto mask = torch::arange(n, torch::kLong).unsqueeze(0) <= rows;  // (count, n)
  const auto out = at::scaled_dot_product_attention(q.permute({2, 1, 0, 3}), keys, values, mask, 0.0,
                                                    false, scaling, /*enable_gqa=*/true);
  return out.permute({2, 0, 1, 3}).reshape({count, 1, -1});  // (1, heads, count, D) -> rows
}

// -- one session's rows through the stack, on buffers of the call ---------------------------
//
// native_stack's layers for the rows of one session (a decode step, a verification pass's
// drafts, a short prompt chunk): the same functions on the same values in the same order as
// LayerStep::native_before / native_after and the attention, each part writing into a
// buffer the call made once instead of a tensor it makes per layer. A decode step of
// SmolLM2 made ~1,300 ATen calls (allocations, views, no-op casts), each slow after the
// layers' weights had gone through the caches: ~0.5 ms of a 6.5 ms step.

// The products of x (rows x K, contiguous) into dst[j] (rows x part j's width), as
// Siblings gives them.
template <typename T>
void siblings_into(const Siblings& s, const Tensor& x, const std::vector<T*>& dst) {
  int64_t rows = 0;
  if (!s.bounds.empty()) {
    const float* y = s.members[0].rows_into(x, rows);
    for (size_t j = 0; j < s.bounds.size(); ++j) {
      s.members[0].template emit<T>(y, rows, s.bounds[j].first, s.bounds[j].second, dst[j]);
    }
    return;
  }
  for (size_t j = 0; j < s.members.size(); ++j) {
    const float* y = s.members[j].rows_into(x, rows);
    s.members[j].template emit<T>(y, rows, 0, s.members[j].out_features, dst[j]);
  }
}

// The widths of Siblings' parts where `emit` serves all of them for rows of dtype; else {}.
std::vector<int64_t> emitted_widths(const Siblings& s, c10::ScalarType dtype, int64_t rows) {
  std::vector<int64_t> widths;
  if (!s.bounds.empty()) {
    if (!s.members[0].emits_rows(dtype, rows)) return {};
    for (const auto& [a, b] : s.bounds) widths.push_back(b - a);
    return widths;
  }
  for (const auto& m : s.members) {
    if (!m.emits_rows(dtype, rows)) return {};
    widths.push_back(m.out_features);
  }
  return widths;
}

bool norm_fits(const Norm& norm, c10::ScalarType dtype, int64_t h) {
  return norm.weight.scalar_type() == dtype && norm.weight.is_contiguous() && norm.weight.dim() == 1 &&
         norm.weight.size(0) == h && h % fixed::kLanes == 0;
}

// The parts' widths of every layer, where all of them fit: {q, k, v, gate, up}; else {}.
std::vector<int64_t> session_widths(const std::vector<LayerStep*>& steps, c10::ScalarType dtype,
                                    int64_t rows, int64_t h) {
  std::vector<int64_t> first;
  for (const auto* step : steps) {
    const auto qkv = emitted_widths(step->qkv, dtype, rows);
    const auto gate_up = emitted_widths(step->gate_up, dtype, rows);
    if (qkv.size() != 3 || gate_up.size() != 2 || gate_up[0] != gate_up[1] ||
        !step->o.emits_rows(dtype, rows) || !step->down.emits_rows(dtype, rows) ||
        step->o.in_features != qkv[0] || step->o.out_features != h || step->down.out_features != h ||
        step->down.in_features != gate_up[0] || !norm_fits(step->input_norm, dtype, h) ||
        !norm_fits(step->post_norm, dtype, h) || qkv[0] % step->head_dim != 0 ||
        qkv[1] % step->head_dim != 0 || qkv[1] != qkv[2]) {
      return {};
    }
    std::vector<int64_t> widths{qkv[0], qkv[1], qkv[2], gate_up[0], gate_up[1]};
    if (first.empty()) first = widths;
    if (widths != first || step->head_dim != steps[0]->head_dim) return {};
  }
  return first;
}

template <typename T>
Tensor session_stack(const std::vector<LayerStep*>& steps, const std::vector<double>& scalings,
                     const Tensor& hidden, const Tensor& cos, const Tensor& sin,
                     std::vector<std::vector<CacheSlot>>& slots, int64_t grow,
                     const std::vector<int64_t>& widths) {
  const int64_t rows = hidden.size(0), h = hidden.size(-1), d = steps[0]->head_dim;
  const int64_t heads = widths[0] / d, kv = widths[1] / d, inner = widths[3];
  const auto opts = hidden.options();
  auto state = hidden.contiguous().clone();  // (rows, 1, H): the layers' running hidden states
  auto xn = torch::empty({rows, h}, opts);
  auto q = torch::empty({rows, widths[0]}, opts), k = torch::empty({rows, widths[1]}, opts);
  auto v = torch::empty({rows, 1, widths[2]}, opts);
  auto q_rot = torch::empty({rows, heads, 1, d}, opts), k_rot = torch::empty({rows, kv, 1, d}, opts);
  const auto v_rows = v.view({rows, 1, kv, d}).transpose(1, 2);  // (rows, kv, 1, D)
  auto attended = torch::empty({rows, widths[0]}, opts), projected = torch::empty({rows, h}, opts);
  auto gate = torch::empty({rows, inner}, opts), up = torch::empty({rows, inner}, opts);
  auto act = torch::empty({rows, inner}, opts);
  T* hp = state.data_ptr<T>();
  T* xp = xn.data_ptr<T>();
  T* pp = projected.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  for (size_t i = 0; i < steps.size(); ++i) {
    const LayerStep& step = *steps[i];
    fixed_norm_rows<T>(hp, step.input_norm.weight.data_ptr<T>(), step.input_norm.eps, rows, h, xp);
    siblings_into<T>(step.qkv, xn, {q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>()});
    rotary_rows<T>(q.data_ptr<T>(), cp, sp, cos.size(0), rows, heads, d, q_rot.data_ptr<T>());
    rotary_rows<T>(k.data_ptr<T>(), cp, sp, cos.size(0), rows, kv, d, k_rot.data_ptr<T>());
    auto [kk, vv] = slots[i][0].append(k_rot, v_rows, grow);
    const int64_t n = kk.size(2);
    std::vector<int64_t> visible(rows);
    for (int64_t t = 0; t < rows; ++t) visible[t] = n - rows + 1 + t;
    meshnet::attend_rows_into(q_rot, std::vector<Tensor>(rows, kk), std::vector<Tensor>(rows, vv),
                              visible, scalings[i], attended);
    int64_t count = 0;
    step.o.template emit<T>(step.o.rows_into(attended, count), rows, 0, h, pp);
    lanes_run(hp, static_cast<const T*>(pp), hp, rows * h, Plus{});
    fixed_norm_rows<T>(hp, step.post_norm.weight.data_ptr<T>(), step.post_norm.eps, rows, h, xp);
    siblings_into<T>(step.gate_up, xn, {gate.data_ptr<T>(), up.data_ptr<T>()});
    lanes_run(static_cast<const T*>(gate.data_ptr<T>()), static_cast<const T*>(up.data_ptr<T>()),
              act.data_ptr<T>(), rows * inner, SiluTimes<T>{});
    step.down.template emit<T>(step.down.rows_into(act, count), rows, 0, h, pp);
    lanes_run(hp, static_cast<const T*>(pp), hp, rows * h, Plus{});
  }
  return state;
}

// Rows (N, 1, H) through `steps` (layer indices `indices` of the caches, attention scalings
// `scalings`); `caches`: consecutive rows of one session as (DynamicCache, count), in
// position order; row i of a group of `count` whose cache then holds n sees its first
// n - count + 1 + i positions. A group of more than `wide_rows` rows (a long prompt chunk)
// attends through torch's SDPA, as its products go through a GEMM: such a pass's rows are
// not computed alone.
Tensor native_stack(const std::vector<LayerStep*>& steps, const std::vector<int64_t>& indices,
                    const std::vector<double>& scalings, Tensor hidden, const Tensor& cos,
                    const Tensor& sin, const std::vector<std::pair<py::object, int64_t>>& caches,
                    int64_t grow, int64_t wide_rows) {
  bool wide = false;
  std::vector<std::vector<CacheSlot>> slots(steps.size());  // [layer][group]
  for (size_t g = 0; g < caches.size(); ++g) {
    const auto& group = caches[g];
    for (size_t h = 0; h < g; ++h) {
      TORCH_CHECK(!caches[h].first.is(group.first), "native_stack: a session's rows are one group");
    }
    const py::object layers = group.first.attr("layers");
    for (size_t i = 0; i < steps.size(); ++i) slots[i].push_back(CacheSlot::read(layers[py::int_(indices[i])]));
    wide = wide || group.second > wide_rows;
  }
  const auto dtype = hidden.scalar_type();
  const int64_t rows = hidden.size(0), h = hidden.size(-1);
  const auto widths = caches.size() == 1 && caches[0].second == rows && !wide && hidden.dim() == 3 &&
                              hidden.size(1) == 1 && !steps.empty() &&
                              fused_dtype(hidden) && rope_fits(cos, sin, dtype, steps[0]->head_dim, rows)
                          ? session_widths(steps, dtype, rows, h)
                          : std::vector<int64_t>{};
  if (!widths.empty()) {
    {
      py::gil_scoped_release free;
      hidden = dtype == torch::kBFloat16
                   ? session_stack<BFloat16>(steps, scalings, hidden, cos, sin, slots, grow, widths)
                   : session_stack<float>(steps, scalings, hidden, cos, sin, slots, grow, widths);
    }
    for (auto& layer : slots) layer[0].publish();
    return hidden;
  }
  {
    py::gil_scoped_release free;  // the whole stack: products that need Python take it back
    for (size_t i = 0; i < steps.size(); ++i) {
      const auto qkv = steps[i]->native_before(hidden, cos, sin);
      std::vector<Tensor> keys, values, parts;
      std::vector<int64_t> visible;
      int64_t start = 0;
      for (size_t g = 0; g < caches.size(); ++g) {
        const int64_t count = caches[g].second;
        auto [kk, vv] = slots[i][g].append(qkv[1].slice(0, start, start + count),
                                           qkv[2].slice(0, start, start + count), grow);
        const int64_t n = kk.size(2);
        if (wide) {  // each group on its own: a long one through SDPA
          const auto q = qkv[0].slice(0, start, start + count);
          std::vector<int64_t> seen(count);
          for (int64_t t = 0; t < count; ++t) seen[t] = n - count + 1 + t;
          parts.push_back(count > wide_rows ? sdpa_rows(q, kk, vv, scalings[i])
                                            : meshnet::attend_rows(q, std::vector<Tensor>(count, kk),
                                                                   std::vector<Tensor>(count, vv), seen,
                                                                   scalings[i]));
        } else {
          for (int64_t t = 0; t < count; ++t) {
            keys.push_back(kk);
            values.push_back(vv);
            visible.push_back(n - count + 1 + t);
          }
        }
        start += count;
      }
      const auto attended = wide ? torch::cat(parts)
                                 : meshnet::attend_rows(qkv[0], std::move(keys), std::move(values), visible, scalings[i]);
      hidden = steps[i]->native_after(hidden, attended);
    }
  }
  for (auto& layer : slots) {
    for (auto& slot : layer) slot.publish();
  }
  return hidden;
}

}  // namespace

void register_layer_step(py::module& m) {
  py::class_<Product>(m, "Product")
      .def_static("python", &python_product, "a product by a Python forward")
      .def_static("int4", &int4_product, py::arg("packed"), py::arg("scale_zero"),
                  py::arg("group"), py::arg("block_n"), py::arg("in_features"),
                  py::arg("out_features"), py::arg("bias") = std::nullopt,
                  py::arg("wide") = py::none(), py::arg("wide_rows") = 0,
                  "the int4 kernel, called as intpack.int4_linear calls it")
      .def_static("q8", &q8_product, py::arg("q"), py::arg("d"), py::arg("bias") = std::nullopt,
                  py::arg("z") = std::nullopt,
                  "the Q8 kernel (a GGUF's kept blocks), called as intpack.q8_linear calls it")
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
      .def("after", &LayerStep::after, "(residual, attended) -> the layer's output")
      .def("native_before", &LayerStep::native_before,
           "the native engine's before: norm summed in the fixed order (ADR-0044)")
      .def("native_after", &LayerStep::native_after,
           "the native engine's after: norm, residuals and SiLU in the fixed order");
  m.def("rms_norm", [](const Tensor& hidden, Tensor weight, double eps) { return Norm{std::move(weight), eps}(hidden); },
        py::arg("hidden"), py::arg("weight"), py::arg("eps"),
        "transformers' LlamaRMSNorm.forward, its calls made from C++ (the same bits)");
  m.def("native_stack", &native_stack, py::arg("steps"), py::arg("indices"), py::arg("scalings"),
        py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("caches"), py::arg("grow"),
        py::arg("wide_rows"),
        "rows through native layer steps, their caches appended and attended (ADR-0044)");
}
