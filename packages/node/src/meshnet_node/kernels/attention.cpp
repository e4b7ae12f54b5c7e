// Causal attention of rows against their sessions' caches, computed in one fixed order
// (the native engine, ADR-0044).
//
// torch's scaled_dot_product_attention on a CPU spends ~30 us a call on a one-token row of a
// small model (buffers, a parallel region, GEMM set-up for a 1 x n product), 30 calls a
// token for SmolLM2, and its result for a row may depend on how many rows the call has.
// `attend` computes each row's attention alone, in float32, in an order the code fixes:
//
//   s_j = dot(q, k_j) * scaling   (16 lanes over the head dimension, then a fixed tree)
//   p_j = exp(s_j - max s)        (exp_fixed: range reduction and one polynomial)
//   out = sum_j p_j v_j / sum_j p_j   (j in order; the division last), rounded once
//
// with no contraction into FMAs (-ffp-contract=off) and no reassociation, so a row's output
// is the same bits whatever the other rows, the row count, the thread that computes it or
// the vector width the compiler picks (each lane's arithmetic is written out). Row r sees
// the first visible[r] keys and values of its cache: its own position and those before.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fixed_order.h"
#include "omp_for.h"

namespace py = pybind11;

namespace {

using torch::Tensor;
using c10::BFloat16;
using namespace meshnet::fixed;

constexpr int kHeads = 4;  // query heads of one kv head that share each load of a key

// Lane j of out[h]: the dot product of query h (of `heads` <= kHeads, each d floats) with
// key j of 16 (fewer at the end: the rest are zeros, dropped). Each is summed over 16 lanes
// (lane l takes d = l, l + 16, ...) whose sums then meet in one fixed tree: lane l + w added
// to lane l for w = 8, 4, 2, 1. Every key gets that same order whichever block, lane or
// group of heads it falls in.
template <int heads, typename T>
inline void dots(const float* q, const T* k, int64_t stride, int64_t count, int64_t d,
                 Lanes* out) {
  Lanes acc[heads][kLanes];
  for (int h = 0; h < heads; ++h) {
    for (int j = 0; j < kLanes; ++j) acc[h][j] = Lanes{};
  }
  // four keys at a time: twelve independent sums in flight rather than three (each sum
  // still takes the chunks of d in order)
  int j = 0;
  for (; j + 4 <= count; j += 4) {
    Lanes sum[4][heads] = {};
    for (int64_t i = 0; i < d; i += kLanes) {
      Lanes key[4];
      for (int u = 0; u < 4; ++u) key[u] = load(k + (j + u) * stride + i);
      for (int h = 0; h < heads; ++h) {
        const Lanes query = load(q + h * d + i);
        for (int u = 0; u < 4; ++u) sum[u][h] += query * key[u];
      }
    }
    for (int u = 0; u < 4; ++u) {
      for (int h = 0; h < heads; ++h) acc[h][j + u] = sum[u][h];
    }
  }
  for (; j < count; ++j) {
    Lanes sum[heads] = {};
    for (int64_t i = 0; i < d; i += kLanes) {
      const Lanes key = load(k + j * stride + i);
      for (int h = 0; h < heads; ++h) sum[h] += load(q + h * d + i) * key;
    }
    for (int h = 0; h < heads; ++h) acc[h][j] = sum[h];
  }
  for (int h = 0; h < heads; ++h) {
    Lanes half[8], quarter[4], eighth[2];
    for (int j = 0; j < 8; ++j) half[j] = fold<8>(acc[h][2 * j], acc[h][2 * j + 1]);
    for (int j = 0; j < 4; ++j) quarter[j] = fold<4>(half[2 * j], half[2 * j + 1]);
    for (int j = 0; j < 2; ++j) eighth[j] = fold<2>(quarter[2 * j], quarter[2 * j + 1]);
    out[h] = fold<1>(eighth[0], eighth[1]);  // lane j: key j
  }
}

struct Rows {
  const Tensor& q;  // (N, heads, 1, D) contiguous
  const std::vector<Tensor>& keys;  // each (1, kv_heads, n, D), last dimension contiguous
  const std::vector<Tensor>& values;
  const std::vector<int64_t>& visible;
  double scaling;
};

// Query heads [h, h + heads) of row r, all of kv head g: one softmax each (`heads` known
// when compiled: the sums stay in registers).
template <int heads, typename T>
void attend_heads(const Rows& rows, int64_t r, int64_t h, int64_t g, int64_t d, T* out,
                  std::vector<float>& buffer) {
  const auto& keys = rows.keys[r];
  const auto& values = rows.values[r];
  const int64_t n = rows.visible[r], blocks = (n + kLanes - 1) / kLanes;
  const int64_t all_heads = rows.q.size(1);
  buffer.resize(static_cast<size_t>(heads * (2 * d + blocks * kLanes)));
  float* qf = buffer.data();  // heads x d: the queries, widened (exactly)
  float* acc = qf + heads * d;  // heads x d: sum_j p_j v_j
  float* scores = acc + heads * d;  // heads x blocks * 16
  const T* qp = rows.q.data_ptr<T>() + (r * all_heads + h) * d;
  for (int64_t i = 0; i < heads * d; ++i) qf[i] = static_cast<float>(qp[i]);
  std::fill(acc, acc + heads * d, 0.0f);
  const T* kp = keys.data_ptr<T>() + g * keys.stride(1);
  const T* vp = values.data_ptr<T>() + g * values.stride(1);
  const int64_t ks = keys.stride(2), vs = values.stride(2), row = blocks * kLanes;
  const float scale = static_cast<float>(rows.scaling);
  float top[heads], total[heads];
  for (int i = 0; i < heads; ++i) top[i] = -INFINITY, total[i] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t count = std::min<int64_t>(kLanes, n - b * kLanes);
    Lanes block[heads];
    dots<heads>(qf, kp + b * kLanes * ks, ks, count, d, block);
    for (int i = 0; i < heads; ++i) {
      store(scores + i * row + b * kLanes, block[i] * scale);
      for (int64_t j = 0; j < count; ++j) top[i] = std::max(top[i], scores[i * row + b * kLanes + j]);
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    float p[heads][kLanes];
    for (int i = 0; i < heads; ++i) store(p[i], exp_fixed(load(scores + i * row + b * kLanes) - top[i]));
    const int64_t count = std::min<int64_t>(kLanes, n - b * kLanes);
    const T* v = vp + b * kLanes * vs;
    // up to four chunks of d at a time: their sums in registers, each over the keys in order
    for (int64_t c0 = 0; c0 < d; c0 += 4 * kLanes) {
      const int chunks = static_cast<int>(std::min<int64_t>(4, (d - c0) / kLanes));
      Lanes sum[4][heads];
      for (int c = 0; c < chunks; ++c) {
        for (int i = 0; i < heads; ++i) sum[c][i] = load(acc + i * d + c0 + c * kLanes);
      }
      for (int64_t j = 0; j < count; ++j) {
        for (int c = 0; c < chunks; ++c) {
          const Lanes value = load(v + j * vs + c0 + c * kLanes);
          for (int i = 0; i < heads; ++i) sum[c][i] += p[i][j] * value;
        }
      }
      for (int c = 0; c < chunks; ++c) {
        for (int i = 0; i < heads; ++i) store(acc + i * d + c0 + c * kLanes, sum[c][i]);
      }
    }
    for (int i = 0; i < heads; ++i) {
      for (int64_t j = 0; j < count; ++j) total[i] += p[i][j];
    }
  }
  T* o = out + (r * all_heads + h) * d;
  for (int i = 0; i < heads; ++i) {
    for (int64_t c = 0; c < d; ++c) o[i * d + c] = static_cast<T>(acc[i * d + c] / total[i]);
  }
}

// Items: each row's kv heads' query heads, kHeads at a time; each item one thread's whole.
template <typename T>
void attend_all(const Rows& rows, int64_t heads, int64_t d, T* out) {
  const int64_t kv_heads = rows.keys[0].size(1), group = heads / kv_heads;
  const int64_t parts = (group + kHeads - 1) / kHeads, per_row = kv_heads * parts;
  const int64_t items = rows.q.size(0) * per_row;
  int64_t work = 0;
  for (const auto n : rows.visible) work += n * heads * d;
  // a parallel region costs more than a small step's attention: one thread below ~64k
  // products (threads never change a value)
  const int64_t grain = work < 65536 ? items : 1;
  meshnet::parallel_for(0, items, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> buffer;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t r = item / per_row, g = (item % per_row) / parts, part = item % parts;
      const int64_t first = part * kHeads, count = std::min<int64_t>(kHeads, group - first);
      const int64_t h = g * group + first;
      switch (count) {
        case 1: attend_heads<1, T>(rows, r, h, g, d, out, buffer); break;
        case 2: attend_heads<2, T>(rows, r, h, g, d, out, buffer); break;
        case 3: attend_heads<3, T>(rows, r, h, g, d, out, buffer); break;
        default: attend_heads<4, T>(rows, r, h, g, d, out, buffer); break;
      }
    }
  });
}

// q (N, heads, 1, D); keys[r], values[r] (1, kv_heads, n_r, D) of row r's cache, of which
// it sees the first visible[r] -> out (N, 1, heads * D) in q's dtype, contiguous.
void attend_into(const Tensor& query, std::vector<Tensor> keys, std::vector<Tensor> values,
                 const std::vector<int64_t>& visible, double scaling, Tensor& out) {
  const auto q = query.contiguous();
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat32, "attend: bf16 or float32");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "attend: q (N, heads, 1, D)");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(3);
  TORCH_CHECK(d % kLanes == 0, "attend: a head dimension that is a multiple of 16");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows && values.size() == keys.size() &&
                  static_cast<int64_t>(visible.size()) == rows,
              "attend: one cache per row");
  for (int64_t r = 0; r < rows; ++r) {
    for (auto* t : {&keys[r], &values[r]}) {
      if (t->stride(3) != 1) *t = t->contiguous();
      TORCH_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(3) == d && t->scalar_type() == dtype,
                  "attend: a cache is (1, kv_heads, n, D) in q's dtype");
    }
    const int64_t kv_heads = keys[r].size(1);
    TORCH_CHECK(values[r].size(1) == kv_heads && heads % kv_heads == 0 && kv_heads == keys[0].size(1),
                "attend: the same kv heads for every row, heads a multiple of them");
    TORCH_CHECK(visible[r] >= 1 && visible[r] <= keys[r].size(2) && visible[r] <= values[r].size(2),
                "attend: a row sees 1..n of its cache");
  }
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.numel() == rows * heads * d,
              "attend: out (N, 1, heads * D) in q's dtype, contiguous");
  const Rows all{q, keys, values, visible, scaling};
  if (dtype == torch::kBFloat16) {
    attend_all<BFloat16>(all, heads, d, out.data_ptr<BFloat16>());
  } else {
    attend_all<float>(all, heads, d, out.data_ptr<float>());
  }
}

Tensor attend(const Tensor& query, std::vector<Tensor> keys, std::vector<Tensor> values,
              const std::vector<int64_t>& visible, double scaling) {
  auto out = query.dim() == 4 ? torch::empty({query.size(0), 1, query.size(1) * query.size(3)}, query.options())
                              : torch::empty({0}, query.options());  // attend_into says why not
  attend_into(query, std::move(keys), std::move(values), visible, scaling, out);
  return out;
}

}  // namespace

namespace meshnet {
Tensor attend_rows(const Tensor& q, std::vector<Tensor> keys, std::vector<Tensor> values,
                   const std::vector<int64_t>& visible, double scaling) {
  return attend(q, std::move(keys), std::move(values), visible, scaling);
}

void attend_rows_into(const Tensor& q, std::vector<Tensor> keys, std::vector<Tensor> values,
                      const std::vector<int64_t>& visible, double scaling, Tensor& out) {
  attend_into(q, std::move(keys), std::move(values), visible, scaling, out);
}
}  // namespace meshnet

void register_attention(py::module& m) {
  m.def("attend", &attend, py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("visible"),
        py::arg("scaling"),
        "causal attention of rows (N, heads, 1, D) against their caches, each row alone in a "
        "fixed order -> (N, 1, heads * D)");
}
