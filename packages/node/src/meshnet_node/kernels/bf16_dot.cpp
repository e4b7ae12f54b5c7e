// bfloat16 linear layers on x86 CPUs with AVX2 but no bfloat16 arithmetic, bit for bit equal
// to torch's own product there, and several times faster for calls of more than one row.
//
// Where oneDNN has no bf16 kernels (no AVX-512), torch multiplies a bf16 matrix as one dot
// product per output (ReducedPrecisionFloatGemvFastPathKernel / cpublas, AVX2 build): both
// operands widened to float32, eight 8-lane float32 accumulators over each 64-element block,
// the eight summed as a pairwise tree (0+4, 1+5, 2+6, 3+7, then 0+2, 1+3, then 0+1), the
// lanes summed in-register (halves, then pairs, then neighbours), the bias added, and the
// float rounded to bf16 to nearest even. Each output is a separate dot product, so the cost
// is linear in the rows and the weight streams through the cache once per row.
//
// This kernel sums every output in that same order with the same fused multiply-adds, but
// computes a tile of 4 rows x 3 weight rows at once: each widened weight vector serves 4
// rows and each row vector 3 weights, from registers. The Python side (bf16_dot.py) checks
// its results against torch's on adversarial inputs before using it (docs/adr/0030).
#include <torch/extension.h>

#include "omp_for.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 64;  // elements per iteration of torch's loop: 8 registers x 8 lanes
constexpr int kRegisters = 8;
constexpr int kRows = 4;      // rows of x per tile
constexpr int kWeights = 3;   // weight rows per tile (4 x 3 accumulators + 3 weights + 1 x)

inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float lanes_sum(__m256 v) {
  __m256 t = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
  t = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0x4E));
  t = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0xB1));
  return _mm256_cvtss_f32(t);
}

inline float registers_sum(const __m256 (&r)[kRegisters]) {
  const __m256 s0 = _mm256_add_ps(_mm256_add_ps(r[0], r[4]), _mm256_add_ps(r[2], r[6]));
  const __m256 s1 = _mm256_add_ps(_mm256_add_ps(r[1], r[5]), _mm256_add_ps(r[3], r[7]));
  return lanes_sum(_mm256_add_ps(s0, s1));
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Problem {
  const float* x;      // (rows, k) float32, widened from bf16
  const uint16_t* w;   // (n, k) bf16
  const uint16_t* b;   // (n,) bf16 or null
  uint16_t* y;         // (rows, n) bf16
  int64_t rows, k, n;
};

// Rows r0.. (R of them) against weight rows n0.. (NB of them). Register j of a dot product
// takes elements j*8 .. j*8+7 of every 64-element block; the registers are built one after
// another so that R x NB accumulators fit in the 16 AVX2 registers.
template <int R, int NB>
inline void tile(const Problem& p, int64_t r0, int64_t n0) {
  const int64_t blocks = p.k / kBlock;
  __m256 acc[NB][R][kRegisters];
  for (int j = 0; j < kRegisters; ++j) {
    __m256 a[NB][R];
    for (int b = 0; b < NB; ++b)
      for (int i = 0; i < R; ++i) a[b][i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t off = blk * kBlock + j * 8;
      __m256 wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = widen8(p.w + (n0 + b) * p.k + off);
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_loadu_ps(p.x + (r0 + i) * p.k + off);
        for (int b = 0; b < NB; ++b) a[b][i] = _mm256_fmadd_ps(xv, wv[b], a[b][i]);
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int i = 0; i < R; ++i) acc[b][i][j] = a[b][i];
  }
  for (int b = 0; b < NB; ++b) {
    const float bias = p.b ? from_bf16(p.b[n0 + b]) : 0.0f;
    for (int i = 0; i < R; ++i) {
      float dot = registers_sum(acc[b][i]);
      if (p.b) dot = bias + dot;
      p.y[(r0 + i) * p.n + n0 + b] = to_bf16(dot);
    }
  }
}

template <int NB>
inline void all_rows(const Problem& p, int64_t n0) {
  int64_t r0 = 0;
  for (; r0 + kRows <= p.rows; r0 += kRows) tile<kRows, NB>(p, r0, n0);
  switch (p.rows - r0) {
    case 3: tile<3, NB>(p, r0, n0); break;
    case 2: tile<2, NB>(p, r0, n0); break;
    case 1: tile<1, NB>(p, r0, n0); break;
    default: break;
  }
}

}  // namespace

// y = x @ w.T (+ bias), all bf16: x (rows, k), w (n, k) contiguous, k a multiple of 64.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % kBlock == 0, "contiguous w, k % 64 == 0");
  const auto xf = x.to(at::kFloat).contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == w.size(0), "bias");
  }
  const Problem p{
      xf.data_ptr<float>(),
      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
      b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr,
      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
      x.size(0), x.size(1), w.size(0)};
  const int64_t tiles = (p.n + kWeights - 1) / kWeights;
  meshnet::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kWeights;
      switch (std::min<int64_t>(kWeights, p.n - n0)) {
        case 3: all_rows<3>(p, n0); break;
        case 2: all_rows<2>(p, n0); break;
        default: all_rows<1>(p, n0); break;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "bf16 linear summed as torch's AVX2 kernel sums it",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
