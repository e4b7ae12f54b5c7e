// The rows of a batched decode step attending each to its own session's cache through
// torch's own scaled_dot_product_attention, called for each row exactly as transformers'
// sdpa_attention_forward calls it for a one-token step (docs/adr/0051).
//
// Called from Python, once per row, that costs ~27 us a row and layer on this kind of CPU
// (the wrapper, the dispatcher, a parallel region of the whole team for a 1 x n product):
// 160 calls a pass for 16 sessions of SmolLM2's 10-layer stage, ~40% of the pass. Here the
// rows are spread over the calling thread's OpenMP team, one thread per row at a time. Each
// call inside runs on that one thread: at::parallel_for runs inline within a parallel
// region, and torch's CPU flash attention computes every (batch, head, query block) item
// alone, in order over the key blocks, so the thread count never changes its bits. The
// Python side checks that on probes before it uses this (row_attention.py), as it checks
// every kernel.
#include <torch/extension.h>

#include <ATen/ThreadLocalState.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "omp_for.h"

namespace py = pybind11;

namespace {

using torch::Tensor;

// How transformers hands a one-token row's grouped heads to SDPA (sdpa_attention_forward).
constexpr int64_t kPlain = 0;  // one query head per key head
constexpr int64_t kGqa = 1;    // enable_gqa=True
constexpr int64_t kPacked = 2;  // pack_gqa: queries (1, kv_heads, groups, D), no enable_gqa

Tensor one_row(const Tensor& q, const Tensor& k, const Tensor& v,
               const std::optional<Tensor>& mask, std::optional<double> scale, int64_t mode,
               int64_t groups) {
  Tensor query = q;
  if (mode == kPacked) query = q.reshape({q.size(0), q.size(1) / groups, groups, q.size(3)});
  Tensor out = at::scaled_dot_product_attention(query, k, v, mask, 0.0, false, scale,
                                                mode == kGqa);
  out = out.reshape({out.size(0), -1, 1, v.size(3)});
  return out.transpose(1, 2).contiguous();
}

// q (B, heads, 1, D); keys[b], values[b] (1, kv_heads, L_b, D); masks[b] None or a mask
// for row b as the one-token step builds it. Returns (B, 1, heads, D): each row's
// attention, as transformers' sdpa_attention_forward returns it for that row alone.
Tensor rows_sdpa(const Tensor& q, const std::vector<Tensor>& keys,
                 const std::vector<Tensor>& values, const std::vector<std::optional<Tensor>>& masks,
                 std::optional<double> scale, int64_t mode, int64_t groups) {
  const int64_t rows = q.size(0);
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "rows_sdpa: one-token rows (B, heads, 1, D)");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows &&
                  static_cast<int64_t>(values.size()) == rows &&
                  static_cast<int64_t>(masks.size()) == rows,
              "rows_sdpa: one cache and mask per row");
  TORCH_CHECK(mode >= kPlain && mode <= kPacked && groups >= 1, "rows_sdpa: mode");
  std::vector<Tensor> outs(rows);
  std::vector<std::exception_ptr> failed(rows);
  const at::ThreadLocalState state;  // grad and inference mode, as on the calling thread
  meshnet::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t b = r0; b < r1; ++b) {
      try {
        outs[b] = one_row(q.narrow(0, b, 1), keys[b], values[b], masks[b], scale, mode, groups);
      } catch (...) {
        failed[b] = std::current_exception();
      }
    }
  });
  for (const auto& error : failed)
    if (error) std::rethrow_exception(error);
  return at::cat(outs, 0);
}

// fresh (1, heads, 1, D) into position `at` of buffer (1, heads, L, D), contiguous: a
// byte copy per head where the dtypes match and fresh's rows are contiguous (the
// dispatcher's copy_ costs more than the copy of a few hundred bytes), else copy_.
void write_at(const Tensor& buffer, int64_t at, const Tensor& fresh) {
  if (buffer.is_contiguous() && fresh.scalar_type() == buffer.scalar_type() &&
      fresh.stride(3) == 1 && fresh.device().is_cpu() && buffer.size(1) == fresh.size(1) &&
      buffer.size(3) == fresh.size(3) && buffer.size(0) == 1 && fresh.size(0) == 1) {
    const int64_t heads = buffer.size(1), d = buffer.size(3), size = buffer.element_size();
    auto* out = static_cast<char*>(buffer.data_ptr()) + at * d * size;
    const auto* in = static_cast<const char*>(fresh.data_ptr());
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(out + h * buffer.stride(1) * size, in + h * fresh.stride(1) * size, d * size);
    return;
  }
  buffer.narrow(-2, at, 1).copy_(fresh);
}

// Row b's keys (or values) after its step: new (1, kv_heads, 1, D) written into its
// buffer when the buffer holds exactly what the layer holds and has room, else a new
// buffer with the held positions, the new one and room for as many more, at most `grow`
// (a short cache at most doubles what it holds; a long one gets `grow` positions, as
// growing_cache._grown gives). Returns the view of the positions held and the buffer.
std::pair<Tensor, Tensor> grown(const Tensor& held, const std::optional<Tensor>& buffer,
                                const Tensor& fresh, int64_t grow) {
  const int64_t length = held.size(-2);
  if (buffer.has_value() && buffer->data_ptr() == held.data_ptr() &&
      length + 1 <= buffer->size(-2)) {
    write_at(*buffer, length, fresh);
    return {buffer->narrow(-2, 0, length + 1), *buffer};
  }
  auto shape = fresh.sizes().vec();
  shape[shape.size() - 2] = length + 1 + std::min(grow, length + 1);
  Tensor made = at::empty(shape, fresh.options());
  made.narrow(-2, 0, length).copy_(held);
  write_at(made, length, fresh);
  return {made.narrow(-2, 0, length + 1), made};
}

using Grown = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                         std::vector<Tensor>>;

// One-token rows' keys and values k, v (B, kv_heads, 1, D) appended to each row's own
// layer cache (keys[b], values[b]: (1, kv_heads, L_b, D), views of key_buffers[b] and
// value_buffers[b] where those are given): the GrowingLayer update of every row at once.
// Returns each row's (keys, values, key buffer, value buffer).
Grown rows_grow(const Tensor& k, const Tensor& v, const std::vector<Tensor>& keys,
                const std::vector<Tensor>& values,
                const std::vector<std::optional<Tensor>>& key_buffers,
                const std::vector<std::optional<Tensor>>& value_buffers, int64_t grow) {
  const int64_t rows = k.size(0);
  TORCH_CHECK(k.dim() == 4 && k.size(2) == 1 && v.dim() == 4 && v.size(0) == rows &&
                  v.size(2) == 1,
              "rows_grow: one-token rows (B, kv_heads, 1, D)");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows &&
                  static_cast<int64_t>(values.size()) == rows &&
                  static_cast<int64_t>(key_buffers.size()) == rows &&
                  static_cast<int64_t>(value_buffers.size()) == rows && grow >= 0,
              "rows_grow: one cache per row");
  Grown out;
  auto& [held_k, held_v, buf_k, buf_v] = out;
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(keys[b].dim() == 4 && values[b].dim() == 4 &&
                    keys[b].size(-2) == values[b].size(-2),
                "rows_grow: a row's cache is (1, kv_heads, L, D)");
  for (auto* list : {&held_k, &held_v, &buf_k, &buf_v}) list->resize(rows);
  std::vector<std::exception_ptr> failed(rows);
  const at::ThreadLocalState state;
  meshnet::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t b = r0; b < r1; ++b) {
      try {
        std::tie(held_k[b], buf_k[b]) = grown(keys[b], key_buffers[b], k.narrow(0, b, 1), grow);
        std::tie(held_v[b], buf_v[b]) =
            grown(values[b], value_buffers[b], v.narrow(0, b, 1), grow);
      } catch (...) {
        failed[b] = std::current_exception();
      }
    }
  });
  for (const auto& error : failed)
    if (error) std::rethrow_exception(error);
  return out;
}

}  // namespace

void register_rows_sdpa(py::module& m) {
  m.def("rows_sdpa", &rows_sdpa, py::arg("q"), py::arg("keys"), py::arg("values"),
        py::arg("masks"), py::arg("scale"), py::arg("mode"), py::arg("groups"),
        "one-token rows, each through torch's SDPA against its own cache, as transformers "
        "calls it, the rows over the thread's team -> (B, 1, heads, D)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rows_grow", &rows_grow, py::arg("k"), py::arg("v"), py::arg("keys"),
        py::arg("values"), py::arg("key_buffers"), py::arg("value_buffers"), py::arg("grow"),
        "one-token rows' keys and values appended to each row's growing cache -> (keys, "
        "values, key buffers, value buffers) per row",
        py::call_guard<py::gil_scoped_release>());
}
