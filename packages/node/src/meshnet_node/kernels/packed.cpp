// Linear layers on FP8 (block-scaled e4m3fn) and MXFP4 (E2M1 + E8M0) weights that stay packed
// in memory: the bytes are widened to float32 in registers.
//
// torch converts float8 to bf16 one element at a time (~38 ms for an 8192x2048 weight here),
// so a node that unpacked per call would spend more on conversion than on the product, and
// one that unpacked at load would need 2-4x the memory the checkpoint does. Few-row calls
// (decode) read the packed weight once, at a half (FP8) or a quarter (MXFP4) of bf16's
// bytes; many-row calls use the dequantize kernels here into a reused buffer and torch's
// GEMM (packed.py). Values follow the checkpoints' definition: weight = code value x scale in
// float32, products and sums in float32 (the sum order is ours, not torch's). packed.py
// checks every function against its pure-torch reference before use.
//
// Also int8 and int4 (torch's CPU int4 packing): row-tiled few-row products and the
// int4 unpacking for the many-row path (see the int8/int4 section).
//
// Built with -march=native on the machine that runs it: AVX-512 where the CPU has it, else
// AVX2 + FMA + F16C (every x86 server of the last decade).
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "omp_for.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#ifndef MESHNET_AHEAD
#define MESHNET_AHEAD 4096  // bytes of a weight stream asked for ahead of the one read
#endif
#ifndef MESHNET_INT8_ROWS
#define MESHNET_INT8_ROWS 4  // int8 bf16 tiles: 4 rows x 4 weight rows (6x4, 8x2 measured no faster)
#define MESHNET_INT8_NB 4
#endif

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "packed.cpp needs AVX2, FMA and F16C"
#endif

namespace {

// Ask for a weight stream's bytes MESHNET_AHEAD ahead of where a few-row product reads:
// the products are too short for the hardware's prefetchers to ramp up on their own (an
// int4 decode step of SmolLM2 went from 5 to 10 GB/s on one core). A hint: it changes no
// value, and an address past the weight's end is never read.
inline void ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + MESHNET_AHEAD, _MM_HINT_T0);
}

// An int4 block's scale-zero pairs for a group lie n columns apart from the group before:
// a stride no hardware prefetcher follows, one miss per group (measured: products of a
// SmolLM2 Q4_1 step 1.6x slower than the same products back to back). Asks for the `cols`
// pairs of group g + kScalesAhead while group g computes. No value changes.
constexpr int64_t kScalesAhead = 8;
template <typename S>
inline void scales_ahead(const S* sz, int64_t g, int64_t groups, int64_t n, int64_t cols) {
  const int64_t bytes = cols * 2 * static_cast<int64_t>(sizeof(S));
  if (g + kScalesAhead >= groups) return;
  const char* p = reinterpret_cast<const char*>(sz + (g + kScalesAhead) * n * 2);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

constexpr float kFp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr int64_t kGroup = 32;  // MXFP4 elements per scale (16 bytes)
constexpr float kHalfScale = 256.0f;  // fp8() yields the value / 2^8

inline float fp8_scalar(uint8_t b) {
  const uint32_t em = b & 0x7Fu;
  float mag;
  if (em >= 8) {
    const uint32_t u = (em << 20) + (120u << 23);
    std::memcpy(&mag, &u, sizeof mag);
  } else {
    mag = static_cast<float>(em) * (1.0f / 512);  // subnormal: mantissa x 2^-9
  }
  return (b & 0x80u) ? -mag : mag;
}

// 2^(e-127) for every E8M0 byte; e=0 is 2^-127, a float32 subnormal but exact.
struct Pow2Table {
  float v[256];
  Pow2Table() {
    for (int e = 0; e < 256; ++e) v[e] = std::ldexp(1.0f, e - 127);
  }
};
const Pow2Table kPow2;

inline uint16_t bf16_scalar(float f) {  // round to nearest even (no NaN in valid weights)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
constexpr int W = 16;  // float32 lanes per vector
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vi widen_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// e4m3fn -> float16 is a shift: the byte in the high half, shifted right by one (the sign
// copies into bit 14, cleared), is a half whose value is the e4m3fn value / 2^8 for every
// code, subnormals included; vcvtph2ps widens it exactly. Callers fold 2^8 into the scale
// (kHalfScale), which changes no rounding. 5 instructions, against ~12 for the exponent
// arithmetic with a subnormal blend, and no table gather.
inline vf fp8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1),
                                     _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_cvtph_ps(h);
}

// W bytes -> the W even elements (low nibbles) and the W odd ones (high nibbles): the
// 16-entry table is one register, indexed by the low 4 bits of each lane.
inline void fp4(const uint8_t* p, vf& lo, vf& hi) {
  const vf table = _mm512_loadu_ps(kFp4);
  const vi b = widen_bytes(p);
  lo = _mm512_permutexvar_ps(b, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

inline void interleave(vf lo, vf hi, float* out) {  // out[2j] = lo[j], out[2j+1] = hi[j]
  const vi first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const vi second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + W, _mm512_permutex2var_ps(lo, second, hi));
}

inline void store_bf16(uint16_t* p, vf v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const vi u = _mm512_castps_si512(v);
  const vi odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const vi r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}

// Tiles of 4 rows x 4 weight rows (16 accumulators of the 32 registers).
constexpr int kDirectRows = 4, kNB = 4;
#else
constexpr int W = 8;
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vi widen_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline vf fp8(const uint8_t* p) {  // as in the AVX-512 branch, 8 at a time
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(b, 8), 1),
                                  _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_cvtph_ps(h);
}

// Eight magnitudes fit a register (vpermps reads the low 3 bits); bit 3 is the sign.
inline void fp4(const uint8_t* p, vf& lo, vf& hi) {
  const vf table = _mm256_loadu_ps(kFp4);
  const vi signbit = _mm256_set1_epi32(INT32_MIN);
  const vi b = widen_bytes(p);
  const vi lo_sign = _mm256_and_si256(_mm256_slli_epi32(b, 28), signbit);
  const vi hi_sign = _mm256_and_si256(_mm256_slli_epi32(b, 24), signbit);
  lo = _mm256_or_ps(_mm256_permutevar8x32_ps(table, b), _mm256_castsi256_ps(lo_sign));
  hi = _mm256_or_ps(_mm256_permutevar8x32_ps(table, _mm256_srli_epi32(b, 4)),
                    _mm256_castsi256_ps(hi_sign));
}

inline void interleave(vf lo, vf hi, float* out) {
  const vf a = _mm256_unpacklo_ps(lo, hi);  // l0 h0 l1 h1 | l4 h4 l5 h5
  const vf b = _mm256_unpackhi_ps(lo, hi);  // l2 h2 l3 h3 | l6 h6 l7 h7
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(a, b, 0x20));
  _mm256_storeu_ps(out + W, _mm256_permute2f128_ps(a, b, 0x31));
}

inline void store_bf16(uint16_t* p, vf v) {
  const vi u = _mm256_castps_si256(v);
  const vi odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const vi r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const vi packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// 16 registers: tiles of 2 rows x 4 weight rows.
constexpr int kDirectRows = 2, kNB = 4;
#endif

// Each thread takes a contiguous range of output rows: the weight streams once per call.
constexpr int64_t kGrain = 16;

// A tile is R rows of x against NB weight rows: R x NB accumulators in registers, each
// loaded x vector serving NB weights and each weight vector R rows.
template <int MaxR, template <int, int> class Tile, int NB, typename... A>
void by_rows(int64_t rows, A... a) {
  if constexpr (MaxR >= 1) {
    if (rows == MaxR) return Tile<MaxR, NB>::run(a...);
    by_rows<MaxR - 1, Tile, NB>(rows, a...);
  }
}

// ---- decoding one weight row ----------------------------------------------------------

// Dequantized FP8 weight row (float32 or bf16 out): code value x its tile's scale.
template <typename Out>
void fp8_row(const uint8_t* w, const float* scale, int64_t k, int64_t bk, Out* out) {
  for (int64_t k0 = 0, kb = 0; k0 < k; k0 += bk, ++kb) {
    const int64_t k1 = std::min(k, k0 + bk);
    const vf s = vset(scale[kb] * kHalfScale);
    int64_t i = k0;
    for (; i + W <= k1; i += W) {
      const vf v = vmul(fp8(w + i), s);
      if constexpr (std::is_same_v<Out, float>) {
        vstore(out + i, v);
      } else {
        store_bf16(out + i, v);
      }
    }
    for (; i < k1; ++i) {
      const float v = fp8_scalar(w[i]) * scale[kb];
      if constexpr (std::is_same_v<Out, float>) {
        out[i] = v;
      } else {
        out[i] = bf16_scalar(v);
      }
    }
  }
}

// Dequantized MXFP4 weight row: a unit is W bytes, 2W elements under one scale.
template <typename Out>
void fp4_row(const uint8_t* b, const uint8_t* e, int64_t k, Out* out) {
  constexpr int64_t per_group = kGroup / (2 * W);
  alignas(64) float tmp[2 * W];
  for (int64_t u = 0; u < k / (2 * W); ++u) {
    vf lo, hi;
    fp4(b + u * W, lo, hi);
    const vf s = vset(kPow2.v[e[u / per_group]]);
    if constexpr (std::is_same_v<Out, float>) {
      interleave(vmul(lo, s), vmul(hi, s), out + u * 2 * W);
    } else {
      interleave(vmul(lo, s), vmul(hi, s), tmp);
      store_bf16(out + u * 2 * W, vload(tmp));
      store_bf16(out + u * 2 * W + W, vload(tmp + W));
    }
  }
}

// ---- tiles ----------------------------------------------------------------------------

// The packed bytes are decoded in registers once per tile of rows: decoding is cheap next
// to the FMAs of 4 rows (a float32 buffer decoded once measured no faster, up to 48 rows).
template <int R, int NB>
struct Fp8Direct {
  static void run(const float* x, float* y, int64_t ystride, int64_t k, const uint8_t* w,
                  const float* const* scale, int64_t bk) {
    vf acc[R][NB];
    float tail[R][NB] = {};
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
    for (int64_t k0 = 0, kb = 0; k0 < k; k0 += bk, ++kb) {
      const int64_t k1 = std::min(k, k0 + bk);
      int64_t i = k0;
      for (; i + W <= k1; i += W) {
        vf wv[NB];
        for (int j = 0; j < NB; ++j) {
          ahead(w + j * k + i);
          wv[j] = vmul(fp8(w + j * k + i), vset(scale[j][kb] * kHalfScale));
        }
        for (int r = 0; r < R; ++r) {
          const vf xv = vload(x + r * k + i);
          for (int j = 0; j < NB; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
        }
      }
      for (; i < k1; ++i) {  // a width that is not a multiple of the vector
        for (int j = 0; j < NB; ++j) {
          const float wv = fp8_scalar(w[j * k + i]) * scale[j][kb];
          for (int r = 0; r < R; ++r) tail[r][j] += wv * x[r * k + i];
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]) + tail[r][j];
  }
};

// x split per unit into its W even and W odd elements, so that the low and the high
// nibbles multiply it without shuffles.
template <int R, int NB>
struct Fp4Direct {
  static void run(const float* xs, float* y, int64_t ystride, int64_t k, const uint8_t* b,
                  const uint8_t* e) {
    constexpr int64_t per_group = kGroup / (2 * W);
    const int64_t row_bytes = k / 2, groups = k / kGroup;
    vf acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
    for (int64_t u = 0; u < k / (2 * W); ++u) {
      vf lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        ahead(b + j * row_bytes + u * W);
        fp4(b + j * row_bytes + u * W, lo[j], hi[j]);
        const vf s = vset(kPow2.v[e[j * groups + u / per_group]]);
        lo[j] = vmul(lo[j], s), hi[j] = vmul(hi[j], s);
      }
      for (int r = 0; r < R; ++r) {
        const vf xe = vload(xs + r * k + u * 2 * W), xo = vload(xs + r * k + u * 2 * W + W);
        for (int j = 0; j < NB; ++j) acc[r][j] = vfma(hi[j], xo, vfma(lo[j], xe, acc[r][j]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]);
  }
};

// Output rows [n0, n1), kNB at a time, then one by one. Every output is summed in the same
// order whatever the rows and columns around it: a row's result does not depend on which
// other rows share the call (a session alone, batched or replayed gets the same numbers).
template <typename Direct>
void product_range(int64_t n0, int64_t n1, Direct&& direct) {
  int64_t j = n0;
  for (; j + kNB <= n1; j += kNB) direct(j, std::integral_constant<int, kNB>{});
  for (; j < n1; ++j) direct(j, std::integral_constant<int, 1>{});
}

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == n,
                "bias must be float32, contiguous, of the output width");
  }
}

void add_bias(torch::Tensor& y, const c10::optional<torch::Tensor>& bias) {
  if (bias) y.add_(*bias);  // after the sums, in float32: one rounding to x's dtype later
}

// ---- FP8 ------------------------------------------------------------------------------

void check_fp8(const torch::Tensor& w, const torch::Tensor& scale, int64_t bn, int64_t bk) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "weight must be uint8 [N, K], contiguous");
  TORCH_CHECK(bn > 0 && bk > 0 && scale.dim() == 2 && scale.scalar_type() == torch::kFloat32 &&
                  scale.is_contiguous() && scale.size(0) * bn >= w.size(0) &&
                  scale.size(1) * bk >= w.size(1),
              "scale grid does not cover the weight");
}

torch::Tensor fp8_linear(const torch::Tensor& x, const torch::Tensor& w,
                         const torch::Tensor& scale, int64_t bn, int64_t bk,
                         const c10::optional<torch::Tensor>& bias) {
  check_fp8(w, scale, bn, bk);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0), kblocks = scale.size(1);
  TORCH_CHECK(w.size(1) == k, "weight width differs from x's");
  check_bias(bias, n);
  auto y = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    auto direct = [&](int64_t j, auto nb) {
      constexpr int NB = decltype(nb)::value;
      const float* srows[NB];
      for (int jj = 0; jj < NB; ++jj) srows[jj] = sp + ((j + jj) / bn) * kblocks;
      for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
        by_rows<kDirectRows, Fp8Direct, NB>(std::min<int64_t>(kDirectRows, rows - r0),
                                            xp + r0 * k, yp + r0 * n + j, n, k, wp + j * k,
                                            static_cast<const float* const*>(srows), bk);
      }
    };
    product_range(n0, n1, direct);
  });
  add_bias(y, bias);
  return y;
}

void fp8_dequantize(const torch::Tensor& w, const torch::Tensor& scale, int64_t bn, int64_t bk,
                    torch::Tensor& out) {
  check_fp8(w, scale, bn, bk);
  const int64_t n = w.size(0), k = w.size(1), kblocks = scale.size(1);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "out must be [N, K], contiguous");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || out.scalar_type() == torch::kFloat32, "out must be bf16 or float32");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  void* op = out.data_ptr();
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      const float* sr = sp + (j / bn) * kblocks;
      if (bf16) {
        fp8_row(wp + j * k, sr, k, bk, static_cast<uint16_t*>(op) + j * k);
      } else {
        fp8_row(wp + j * k, sr, k, bk, static_cast<float*>(op) + j * k);
      }
    }
  });
}

// ---- MXFP4 ----------------------------------------------------------------------------

torch::Tensor split_even_odd(const torch::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1);
  auto xs = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = xs.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t u = 0; u < k; u += 2 * W) {
      const float* s = src + r * k + u;
      float* d = dst + r * k + u;
      for (int j = 0; j < W; ++j) d[j] = s[2 * j], d[W + j] = s[2 * j + 1];
    }
  }
  return xs;
}

void check_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == kGroup / 2 &&
                  blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
              "blocks must be uint8 [N, K/32, 16], contiguous");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == blocks.size(0) &&
                  scales.size(1) == blocks.size(1) && scales.scalar_type() == torch::kUInt8 &&
                  scales.is_contiguous(),
              "scales must be uint8 [N, K/32], contiguous");
}

torch::Tensor mxfp4_linear(const torch::Tensor& x, const torch::Tensor& blocks,
                           const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias) {
  check_mxfp4(blocks, scales);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0), groups = blocks.size(1);
  TORCH_CHECK(k == groups * kGroup, "x width differs from the weight's");
  check_bias(bias, n);
  const auto xs = split_even_odd(x);
  auto y = torch::empty({rows, n}, x.options());
  const float* xp = xs.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* ep = scales.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    auto direct = [&](int64_t j, auto nb) {
      constexpr int NB = decltype(nb)::value;
      for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
        by_rows<kDirectRows, Fp4Direct, NB>(std::min<int64_t>(kDirectRows, rows - r0),
                                            xp + r0 * k, yp + r0 * n + j, n, k,
                                            bp + j * (k / 2), ep + j * groups);
      }
    };
    product_range(n0, n1, direct);
  });
  add_bias(y, bias);
  return y;
}

void mxfp4_dequantize(const torch::Tensor& blocks, const torch::Tensor& scales,
                      torch::Tensor& out) {
  check_mxfp4(blocks, scales);
  const int64_t n = blocks.size(0), groups = blocks.size(1), k = groups * kGroup;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "out must be [N, K], contiguous");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || out.scalar_type() == torch::kFloat32, "out must be bf16 or float32");
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* ep = scales.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      if (bf16) {
        fp4_row(bp + j * (k / 2), ep + j * groups, k, static_cast<uint16_t*>(op) + j * k);
      } else {
        fp4_row(bp + j * (k / 2), ep + j * groups, k, static_cast<float*>(op) + j * k);
      }
    }
  });
}

// ---- int8 and int4 (torch's CPU int4 packing) -----------------------------------------
//
// Few-row products that replace torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu
// (one GEMV per row): tiles of R rows of x share each decoded weight vector, so a batch of
// 16 rows decodes each byte 4 times, not 16. Sums in float32, each output's in a fixed
// order (k ascending within a vector lane / a group, groups ascending) that neither the
// number of rows nor of threads changes: a row computes the same bits alone or batched.
// Threads split output columns only.

// bf16 or float32 scales, read as float32
inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float as_float(c10::Half v) { return static_cast<float>(v); }  // exact

// int8: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]; R rows x NB weight rows a tile.
template <int R, int NB>
struct Int8Tile {
  static void run(const float* x, float* y, int64_t ystride, int64_t k, const int8_t* q) {
    vf acc[R][NB];
    float tail[R][NB] = {};
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
    int64_t i = 0;
    for (; i + W <= k; i += W) {
      vf wv[NB];
      for (int j = 0; j < NB; ++j) {
        ahead(q + j * k + i);
        wv[j] = int8s(q + j * k + i);
      }
      for (int r = 0; r < R; ++r) {
        const vf xv = vload(x + r * k + i);
        for (int j = 0; j < NB; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
      }
    }
    for (; i < k; ++i) {
      for (int j = 0; j < NB; ++j) {
        const float wv = static_cast<float>(q[j * k + i]);
        for (int r = 0; r < R; ++r) tail[r][j] += wv * x[r * k + i];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]) + tail[r][j];
  }
#if defined(__AVX512F__)
  static vf int8s(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
#else
  static vf int8s(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};

#if defined(__AVX512BF16__)
#define MESHNET_INT8_BF16 1
// 32 int8 weights as 32 bf16 (exact: |q| <= 127 has 7 significant bits), in the order
// vdpbf16ps pairs them with 32 inputs.
inline __m512bh int8s_bf16(const int8_t* p) {
  const vf lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const vf hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
// bf16 rows of x: 32 int8 weights become 32 bf16 (exact: |q| <= 127 has 7 significant
// bits) and vdpbf16ps multiplies them with 32 inputs in pairs, summing in float32 lanes.
constexpr int kInt8Bf16Rows = MESHNET_INT8_ROWS, kInt8Bf16NB = MESHNET_INT8_NB;
template <int R, int NB>
struct Int8Bf16Tile {
  static void run(const uint16_t* x, float* y, int64_t ystride, int64_t k, const int8_t* q) {
    vf acc[R][NB];
    float tail[R][NB] = {};
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
    int64_t i = 0;
    for (; i + 2 * W <= k; i += 2 * W) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j) {
        const int8_t* p = q + j * k + i;
        ahead(p);
        wv[j] = int8s_bf16(p);
      }
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
      }
    }
    for (; i < k; ++i) {
      for (int j = 0; j < NB; ++j) {
        const float wv = static_cast<float>(q[j * k + i]);
        for (int r = 0; r < R; ++r) {
          const uint32_t u = static_cast<uint32_t>(x[r * k + i]) << 16;
          float xf;
          std::memcpy(&xf, &u, sizeof xf);
          tail[r][j] += wv * xf;
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]) + tail[r][j];
  }
};
#endif

template <typename S>
torch::Tensor int8_linear_t(const torch::Tensor& x, const torch::Tensor& q,
                            const torch::Tensor& scale) {
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0);
  auto y = torch::empty({rows, n}, x.options().dtype(torch::kFloat32));
  const int8_t* qp = q.data_ptr<int8_t>();
  const S* sp = scale.data_ptr<S>();
  float* yp = y.data_ptr<float>();
#if defined(MESHNET_INT8_BF16)
  if (x.scalar_type() == torch::kBFloat16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    constexpr int NB = kInt8Bf16NB;
    meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
      auto direct = [&](int64_t j, auto nb) {
        constexpr int C = decltype(nb)::value;
        for (int64_t r0 = 0; r0 < rows; r0 += kInt8Bf16Rows) {
          by_rows<kInt8Bf16Rows, Int8Bf16Tile, C>(std::min<int64_t>(kInt8Bf16Rows, rows - r0),
                                                  xb + r0 * k, yp + r0 * n + j, n, k,
                                                  qp + j * k);
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int jj = 0; jj < C; ++jj) yp[r * n + j + jj] *= as_float(sp[j + jj]);
      };
      int64_t j = n0;
      for (; j + NB <= n1; j += NB) direct(j, std::integral_constant<int, NB>{});
      for (; j < n1; ++j) direct(j, std::integral_constant<int, 1>{});
    });
    return y;
  }
#endif
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bf16");
  const auto xf = x.to(torch::kFloat32);  // bf16 without AVX-512 BF16: float32 products
  const float* xp = xf.data_ptr<float>();
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    auto direct = [&](int64_t j, auto nb) {
      constexpr int NB = decltype(nb)::value;
      for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
        by_rows<kDirectRows, Int8Tile, NB>(std::min<int64_t>(kDirectRows, rows - r0),
                                           xp + r0 * k, yp + r0 * n + j, n, k, qp + j * k);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int jj = 0; jj < NB; ++jj) yp[r * n + j + jj] *= as_float(sp[j + jj]);
    };
    product_range(n0, n1, direct);
  });
  return y;
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(),
              "q must be int8 [N, K], contiguous");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == q.size(1),
              "x must be [M, K], contiguous");
  TORCH_CHECK(scale.dim() == 1 && scale.numel() == q.size(0) && scale.is_contiguous(),
              "scale must be [N], contiguous");
  if (scale.scalar_type() == torch::kBFloat16) return int8_linear_t<c10::BFloat16>(x, q, scale);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "scale must be bf16 or float32");
  return int8_linear_t<float>(x, q, scale);
}

// Int8 codes with a float32 scale per block of B weights of a row, W = d * q: llama.cpp's
// Q8_0 as shipped (B = 32, d its f16 scale) and Q6_K (B = 16, d = the super-block's f16
// times the sub-block's int8 scale, q = code - 32; both exact in float32). Per block, in =
// sum x * q over its B inputs (exact products, float32 sums), then acc += d * in; the lanes
// are summed at the end. A row's order is fixed whatever the rows around it.
constexpr int64_t kQ8Block = 32;

template <int64_t B>
struct Q8 {
  static_assert(B == 16 || B == 32, "blocks of 16 or 32 weights");

  template <int R, int NB>
  struct Tile {
    static void run(const float* x, float* y, int64_t ystride, int64_t k, const int8_t* q,
                    const float* d, const float* z) {
      const int64_t blocks = k / B;
      vf acc[R][NB];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
      for (int64_t b = 0; b < blocks; ++b) {
        vf in[R][NB], xs[R];
        for (int r = 0; r < R; ++r) {
          xs[r] = vzero();
          for (int j = 0; j < NB; ++j) in[r][j] = vzero();
        }
        for (int64_t i = b * B; i < (b + 1) * B; i += W) {
          vf wv[NB];
          for (int j = 0; j < NB; ++j) {
            ahead(q + j * k + i);
            wv[j] = Int8Tile<1, 1>::int8s(q + j * k + i);
          }
          for (int r = 0; r < R; ++r) {
            const vf xv = vload(x + r * k + i);
            if (z != nullptr) xs[r] = vadd(xs[r], xv);
            for (int j = 0; j < NB; ++j) in[r][j] = vfma(wv[j], xv, in[r][j]);
          }
        }
        for (int j = 0; j < NB; ++j) {
          const vf dv = vset(d[j * blocks + b]);
          for (int r = 0; r < R; ++r) acc[r][j] = vfma(dv, in[r][j], acc[r][j]);
          if (z != nullptr) {  // W = q * d + z: the block's inputs summed, times its zero
            const vf zv = vset(z[j * blocks + b]);
            for (int r = 0; r < R; ++r) acc[r][j] = vfma(zv, xs[r], acc[r][j]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]);
    }
  };

#if defined(MESHNET_INT8_BF16)
  // bf16 rows: 32 int8 weights become 32 bf16 (exact) and one vdpbf16ps multiplies them
  // with 32 inputs in pairs: lane l holds inputs 2l and 2l + 1, so at B = 16 lanes 0-7 are
  // one block and 8-15 the next, each scaled by its own d.
  template <int R, int NB>
  struct Bf16Tile {
    static void run(const uint16_t* x, float* y, int64_t ystride, int64_t k, const int8_t* q,
                    const float* d, const float* z) {
      static_assert(2 * W == kQ8Block, "one vdpbf16ps per 32 inputs");
      const int64_t chunks = k / kQ8Block, blocks = k / B;
      const vi halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0: exact sums
      vf acc[R][NB];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = c * kQ8Block;
        __m512bh wv[NB];
        vf dv[NB], zv[NB];
        for (int j = 0; j < NB; ++j) {
          const int8_t* p = q + j * k + i;
          ahead(p);
          wv[j] = int8s_bf16(p);
          dv[j] = per_lane(d + j * blocks, c, halves);
          if (z != nullptr) zv[j] = per_lane(z + j * blocks, c, halves);
        }
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);
          const vf xs = z != nullptr ? _mm512_dpbf16_ps(vzero(), ones, xv) : vzero();
          for (int j = 0; j < NB; ++j) {
            const vf in = _mm512_dpbf16_ps(vzero(), wv[j], xv);
            acc[r][j] = vfma(dv[j], in, acc[r][j]);
            if (z != nullptr) acc[r][j] = vfma(zv[j], xs, acc[r][j]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]);
    }

    // A row's per-block values (scales or zeros) for the 32 inputs of chunk c, lane by lane:
    // one value at B = 32, two (lanes 0-7, 8-15) at B = 16.
    static vf per_lane(const float* v, int64_t c, const vi& halves) {
      if constexpr (B == kQ8Block) {
        return vset(v[c]);
      } else {
        double pair;
        std::memcpy(&pair, v + 2 * c, sizeof pair);
        return _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(pair)));
      }
    }
  };
#endif
};

// Q8 blocks against bf16 or float32 rows as two int8 digits (AVX-512 VNNI; defined
// below): false where it does not apply (no VNNI, K not whole 64s), y untouched.
template <int64_t B>
bool q8_vnni_into(const torch::Tensor& x, const int8_t* q, const float* d, const float* z,
                  int64_t n, int64_t k, float* y);

template <int64_t B>
void q8_linear_into(const torch::Tensor& x, const int8_t* qp, const float* dp, const float* zp,
                    int64_t n, int64_t k, float* yp) {
  const int64_t rows = x.size(0), blocks = k / B;
  if (q8_vnni_into<B>(x, qp, dp, zp, n, k, yp)) return;
#if defined(MESHNET_INT8_BF16)
  if (x.scalar_type() == torch::kBFloat16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
      auto direct = [&](int64_t j, auto nb) {
        constexpr int C = decltype(nb)::value;
        for (int64_t r0 = 0; r0 < rows; r0 += kInt8Bf16Rows) {
          by_rows<kInt8Bf16Rows, Q8<B>::template Bf16Tile, C>(
              std::min<int64_t>(kInt8Bf16Rows, rows - r0), xb + r0 * k, yp + r0 * n + j, n, k,
              qp + j * k, dp + j * blocks, zp == nullptr ? nullptr : zp + j * blocks);
        }
      };
      product_range(n0, n1, direct);
    });
    return;
  }
#endif
  const auto xf = x.to(torch::kFloat32);  // bf16 without AVX-512 BF16: float32 products
  const float* xp = xf.data_ptr<float>();
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    auto direct = [&](int64_t j, auto nb) {
      constexpr int NB = decltype(nb)::value;
      for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
        by_rows<kDirectRows, Q8<B>::template Tile, NB>(
            std::min<int64_t>(kDirectRows, rows - r0), xp + r0 * k, yp + r0 * n + j, n, k,
            qp + j * k, dp + j * blocks, zp == nullptr ? nullptr : zp + j * blocks);
      }
    };
    product_range(n0, n1, direct);
  });
}

// z, where given: float32 zeros [N, K / B], W = q * d + z per block (Q5_1, Q5_K).
const float* q8_zeros(const std::optional<torch::Tensor>& z, const torch::Tensor& d) {
  if (!z || !z->defined()) return nullptr;
  TORCH_CHECK(z->scalar_type() == torch::kFloat32 && z->is_contiguous() && z->sizes() == d.sizes(),
              "z must be float32, contiguous, of d's shape");
  return z->data_ptr<float>();
}

// y = x @ W.T, float32, for int8 codes q [N, K] and float32 scales d [N, K / B] (and zeros
// z of d's shape, W = q * d + z): the block size B (16 or 32) is K over d's columns.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                        const std::optional<torch::Tensor>& z) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous() &&
                  q.size(1) % kQ8Block == 0,
              "q must be int8 [N, K], K a multiple of 32, contiguous");
  const int64_t n = q.size(0), k = q.size(1), rows = x.size(0);
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == n && (d.size(1) == k / 32 || d.size(1) == k / 16),
              "d must be float32 [N, K / 32] or [N, K / 16], contiguous");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be float32 or bf16 [M, K], contiguous");
  auto y = torch::empty({rows, n}, x.options().dtype(torch::kFloat32));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* zp = q8_zeros(z, d);
  if (d.size(1) == k / 16) {
    q8_linear_into<16>(x, qp, dp, zp, n, k, yp);
  } else {
    q8_linear_into<32>(x, qp, dp, zp, n, k, yp);
  }
  return y;
}

// int4 in torch's CPU packing: bytes [N/B, K, B/2] (B = block_n); byte j of (block, k)
// holds row j of the block in its low nibble, row B/2 + j in its high one. W[n, k] =
// (code - 8) * scale[g, n] + zero[g, n], scale_zero [K/group, N, 2].
//
// Products: per group, in = sum_k x * (code - 8) (exact code values), then
// acc += scale * in + zero * sum_k x. Columns are the vector lanes: one byte vector per k
// serves B columns and R rows.

#if defined(__AVX512F__)
constexpr float kCodes[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
// W bytes -> (low nibble - 8), (high nibble - 8) as float32: vpermps reads 4 index bits.
inline void int4s(const uint8_t* p, vf table, vf& lo, vf& hi) {
  const vi b = widen_bytes(p);
  lo = _mm512_permutexvar_ps(b, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
inline vf codes_table() { return _mm512_loadu_ps(kCodes); }
// W (scale, zero) pairs -> W scales, W zeros
inline void pairs_apart(vf a, vf b, vf& s, vf& z) {  // a: pairs 0..W/2-1, b: the rest
  const vi even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const vi odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  s = _mm512_permutex2var_ps(a, even, b);
  z = _mm512_permutex2var_ps(a, odd, b);
}
inline void scale_zero(const float* p, vf& s, vf& z) {
  pairs_apart(_mm512_loadu_ps(p), _mm512_loadu_ps(p + W), s, z);
}
inline void scale_zero(const c10::Half* p, vf& s, vf& z) {  // f16 widened exactly
  const vi v = _mm512_loadu_si512(p);
  pairs_apart(_mm512_cvtph_ps(_mm512_castsi512_si256(v)),
              _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)), s, z);
}
inline void scale_zero(const c10::BFloat16* p, vf& s, vf& z) {
  const vi v = _mm512_loadu_si512(p);  // lane i: scale_i | zero_i << 16
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
inline void int4s(const uint8_t* p, vf, vf& lo, vf& hi) {
  const vi b = widen_bytes(p);
  const vi m = _mm256_set1_epi32(15);
  const vf eight = _mm256_set1_ps(8.0f);
  lo = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, m)), eight);
  hi = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), eight);
}
inline vf codes_table() { return vzero(); }
template <typename S>
inline void scale_zero(const S* p, vf& s, vf& z) {
  alignas(32) float a[W], b[W];
  for (int i = 0; i < W; ++i) a[i] = as_float(p[2 * i]), b[i] = as_float(p[2 * i + 1]);
  s = vload(a), z = vload(b);
}
#endif

// A group finished in a 64-column int4 tile (bf16 or VNNI) of V of a block's four column
// vectors (col[v]) and R rows: acc += scale * in + zero * (the group's inputs summed).
template <int R, int V, typename S>
inline void add_group(float (&acc)[R][V * W], const vf (&in)[R][V], const S* sz, int64_t g,
                      int64_t n, const int (&col)[4], const float* xsum, int64_t groups) {
  for (int v = 0; v < V; ++v) {
    vf s, z;
    scale_zero(sz + (g * n + col[v] * W) * 2, s, z);
    for (int r = 0; r < R; ++r) {
      float* a = acc[r] + v * W;
      vstore(a, vfma(z, vset(xsum[r * groups + g]), vfma(s, in[r][v], vload(a))));
    }
  }
}

// The tile's sums into y: column vector col[v] of each row.
template <int R, int V>
inline void store_tile(const float (&acc)[R][V * W], float* y, int64_t ystride,
                       const int (&col)[4]) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      std::memcpy(y + r * ystride + col[v] * W, acc[r] + v * W, sizeof(float) * W);
    }
  }
}

// One block of B = 2 * NV * W columns against R rows of x.
template <int R, int NV>
struct Int4Tile {
  template <typename S>
  static void run(const float* x, const float* xsum, float* y, int64_t ystride, int64_t k,
                  int64_t group, const uint8_t* blk, const S* sz, int64_t n) {
    constexpr int V = 2 * NV;
    constexpr int64_t half = NV * W;
    const int64_t groups = k / group;
    const vf table = codes_table();
    alignas(64) float acc[R][V * W] = {};
    for (int64_t g = 0; g < groups; ++g) {
      scales_ahead(sz, g, groups, n, V * W);
      vf in[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) in[r][v] = vzero();
      const uint8_t* p = blk + g * group * half;
      const float* xg = x + g * group;
      for (int64_t kk = 0; kk < group; ++kk, p += half) {
        ahead(p);
        vf w[V];
        for (int v = 0; v < NV; ++v) int4s(p + v * W, table, w[v], w[NV + v]);
        for (int r = 0; r < R; ++r) {
          const vf xb = vset(xg[r * k + kk]);
          for (int v = 0; v < V; ++v) in[r][v] = vfma(w[v], xb, in[r][v]);
        }
      }
      for (int v = 0; v < V; ++v) {
        vf s, z;
        scale_zero(sz + (g * n + v * W) * 2, s, z);
        for (int r = 0; r < R; ++r) {
          float* a = acc[r] + v * W;
          vstore(a, vfma(z, vset(xsum[r * groups + g]), vfma(s, in[r][v], vload(a))));
        }
      }
    }
    for (int r = 0; r < R; ++r) std::memcpy(y + r * ystride, acc[r], sizeof acc[r]);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define MESHNET_INT4_BF16 1
// bf16 rows of x against 64-row blocks (AVX-512 BF16 + VBMI): vdpbf16ps multiplies pairs
// (k, k+1) of bf16 values exactly and adds them to float32 lanes (32 products an
// instruction, twice vfmadd's). Codes become bf16 (code - 8) by a byte table: each
// column's dword gets the bytes of k and k+1 twice (vpermb), a nibble of each indexes the
// table's low bytes (positions 0-15) or high bytes (16-31).
struct Bf16Codes {
  vi table, dup[2], off, low4;
  Bf16Codes() {
    alignas(64) uint8_t t[64] = {};
    for (int c = 0; c < 16; ++c) {
      const uint16_t b = bf16_scalar(static_cast<float>(c - 8));
      t[c] = static_cast<uint8_t>(b & 0xFF), t[16 + c] = static_cast<uint8_t>(b >> 8);
    }
    table = _mm512_load_si512(t);
    for (int q = 0; q < 2; ++q) {
      alignas(64) uint8_t d[64];
      for (int i = 0; i < 16; ++i) {
        const int j = 16 * q + i;
        d[4 * i] = d[4 * i + 1] = static_cast<uint8_t>(j);
        d[4 * i + 2] = d[4 * i + 3] = static_cast<uint8_t>(32 + j);
      }
      dup[q] = _mm512_load_si512(d);
    }
    off = _mm512_set1_epi32(0x10001000);
    low4 = _mm512_set1_epi8(0x0F);
  }
  // 64 bytes: k's 32 then k+1's -> columns 0-15, 16-31 (low nibbles), 32-47, 48-63 (high).
  // Half q of a block (columns 16q..16q+15 and 32+16q..32+16q+15) comes from one vpermb of
  // the bytes: w[0] the low nibbles' columns, w[1] the high ones'.
  void decode_half(const vi& src, int q, __m512bh* w) const {
    const vi d = _mm512_permutexvar_epi8(dup[q], src);
    const vi lo = _mm512_or_si512(_mm512_and_si512(d, low4), off);
    const vi hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(d, 4), low4), off);
    w[0] = (__m512bh)_mm512_permutexvar_epi8(lo, table);
    w[1] = (__m512bh)_mm512_permutexvar_epi8(hi, table);
  }
};

// Halves [Q0, Q0 + QS) of one 64-column block (both: the whole block) against R rows of x.
// Each column's sum is the same operations in the same order whichever columns share the
// call, so a block computed as two halves (on two threads) gives the whole block's bits.
template <int R, int QS, int Q0>
struct Int4Bf16Tile {
  template <typename S>
  static void run(const uint16_t* x, const float* xsum, float* y, int64_t ystride, int64_t k,
                  int64_t group, const uint8_t* blk, const S* sz, int64_t n,
                  const Bf16Codes& codes) {
    constexpr int V = 2 * QS;  // vector s: column vector col(s) of the block's four
    constexpr int col[4] = {Q0, 2 + Q0, Q0 + 1, 3 + Q0};
    const int64_t groups = k / group;
    alignas(64) float acc[R][V * W] = {};
    for (int64_t g = 0; g < groups; ++g) {
      scales_ahead(sz, g, groups, n, 4 * W);
      vf in[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) in[r][v] = vzero();
      const uint8_t* p = blk + g * group * 32;
      const uint16_t* xg = x + g * group;
      for (int64_t kk = 0; kk < group; kk += 2, p += 64) {
        ahead(p);
        const vi src = _mm512_loadu_si512(p);
        __m512bh w[V];
        for (int q = 0; q < QS; ++q) codes.decode_half(src, Q0 + q, w + 2 * q);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xg + r * k + kk, sizeof pair);
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
          for (int v = 0; v < V; ++v) in[r][v] = _mm512_dpbf16_ps(in[r][v], w[v], xb);
        }
      }
      add_group<R, V>(acc, in, sz, g, n, col, xsum, groups);
    }
    store_tile<R, V>(acc, y, ystride, col);
  }
};

constexpr int kBf16Rows = 4;

// Block b's halves [Q0, Q0 + QS) for every row, kBf16Rows rows a tile.
template <int QS, int Q0, typename S>
void int4_bf16_block(const uint16_t* xp, const float* xsum, float* yp, int64_t rows, int64_t k,
                     int64_t n, int64_t group, const uint8_t* pp, const S* sp, int64_t b,
                     const Bf16Codes& codes) {
  constexpr int64_t B = 64;
  const int64_t groups = k / group;
  for (int64_t r0 = 0; r0 < rows; r0 += kBf16Rows) {
    const int64_t tile = std::min<int64_t>(kBf16Rows, rows - r0);
    auto call = [&](auto rr) {
      constexpr int R = decltype(rr)::value;
      Int4Bf16Tile<R, QS, Q0>::run(xp + r0 * k, xsum + r0 * groups, yp + r0 * n + b * B, n, k,
                                   group, pp + b * B * (k / 2), sp + b * B * 2, n, codes);
    };
    switch (tile) {
      case 1: call(std::integral_constant<int, 1>{}); break;
      case 2: call(std::integral_constant<int, 2>{}); break;
      case 3: call(std::integral_constant<int, 3>{}); break;
      case 4: call(std::integral_constant<int, 4>{}); break;
    }
  }
}

// The blocks split in halves among the threads (half-block units, ceil(units / threads) a
// thread): 9 blocks on two threads are 4.5 each, not 5 and 4. A thread's units that make a
// whole block run as one; a half at either end of its range runs alone.
template <typename S>
void int4_bf16_blocks(const uint16_t* xp, const float* xsum, float* yp, int64_t rows,
                      int64_t k, int64_t n, int64_t group, const uint8_t* pp, const S* sp) {
  const int64_t units = 2 * (n / 64);
  const Bf16Codes codes;
  meshnet::parallel_for(0, units, 1, [&](int64_t u, int64_t end) {
    if (u % 2 == 1 && u < end) {
      int4_bf16_block<1, 1>(xp, xsum, yp, rows, k, n, group, pp, sp, u / 2, codes);
      ++u;
    }
    for (; u + 2 <= end; u += 2) {
      int4_bf16_block<2, 0>(xp, xsum, yp, rows, k, n, group, pp, sp, u / 2, codes);
    }
    if (u < end) int4_bf16_block<1, 0>(xp, xsum, yp, rows, k, n, group, pp, sp, u / 2, codes);
  });
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define MESHNET_INT4_VNNI 1
// bf16 or float32 rows as int8 against 64-column blocks (AVX-512 VNNI + VBMI, ADR-0045,
// 0046), as llama.cpp computes a Q4 block against Q8 inputs but with two digits: each row's
// inputs per 32 as q * d + q2 * d / 254 (quantize_rows), and vpdpbusd adds four products of
// codes (0-15, unsigned) and a digit (signed) into int32 lanes: exact integers, in any
// order. Per 32 inputs the two sums become float once, (sum - 8 * sum q) * d then (sum2 - 8
// * sum q2) * d / 254, and per group acc += scale * that + zero * (the group's inputs summed
// as float32, as the other tiles do). Sixteen instructions for 256 weights, against forty
// in the bf16 tile.
//
// Four k of a 64-column block are 128 bytes of torch's packing (byte j of k: column j's
// code in its low nibble, column 32 + j's in its high one). One vpermt2b gathers, for 16
// columns, each column's four bytes into its dword; the low nibbles are columns j0..j0+15,
// the high ones 32+j0..: half q of the block (j0 = 16q), as in the bf16 tile.
constexpr int64_t kQ8Inputs = 32;  // inputs per scale of the quantized rows
constexpr int kVnniRows = 2;  // two int32 sums a row and vector: 2 x 4 x 2 registers
constexpr int kQ8VnniRows = 2;

struct VnniGather {
  vi idx[2], low4;
  VnniGather() {
    for (int q = 0; q < 2; ++q) {
      alignas(64) uint8_t d[64];
      for (int i = 0; i < 16; ++i) {
        const int j = 16 * q + i;
        d[4 * i] = static_cast<uint8_t>(j);
        d[4 * i + 1] = static_cast<uint8_t>(32 + j);
        d[4 * i + 2] = static_cast<uint8_t>(64 + j);
        d[4 * i + 3] = static_cast<uint8_t>(96 + j);
      }
      idx[q] = _mm512_load_si512(d);
    }
    low4 = _mm512_set1_epi8(0x0F);
  }
  // half q of four k (a: k, k + 1; b: k + 2, k + 3) -> w[0] columns 16q.., w[1] 32+16q..
  void codes(const vi& a, const vi& b, int q, vi* w) const {
    const vi p = _mm512_permutex2var_epi8(a, idx[q], b);
    w[0] = _mm512_and_si512(p, low4);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
  }
};

// A row's inputs as two int8 digits (x ~ q * d + q2 * d / 254): q, q2 (k each), per 32
// inputs d and 8 * sum q, 8 * sum q2.
struct QuantRows {
  const int8_t* q;
  const int8_t* q2;
  const float* d;
  const int32_t* sum8;
  const int32_t* sum8_2;
};

template <int R, int QS, int Q0>
struct Int4VnniTile {
  template <typename S>
  static void run(const QuantRows& x, const float* xsum, float* y, int64_t ystride, int64_t k,
                  int64_t group, const uint8_t* blk, const S* sz, int64_t n,
                  const VnniGather& gather) {
    constexpr int V = 2 * QS;
    constexpr int col[4] = {Q0, 2 + Q0, Q0 + 1, 3 + Q0};
    const int64_t groups = k / group, per = group / kQ8Inputs, blocks = k / kQ8Inputs;
    alignas(64) float acc[R][V * W] = {};
    for (int64_t g = 0; g < groups; ++g) {
      scales_ahead(sz, g, groups, n, 4 * W);
      vf in[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) in[r][v] = vzero();
      for (int64_t b = g * per; b < (g + 1) * per; ++b) {
        vi sum[R][V], sum2[R][V];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) sum[r][v] = sum2[r][v] = _mm512_setzero_si512();
        const uint8_t* p = blk + b * kQ8Inputs * 32;
        for (int64_t kk = 0; kk < kQ8Inputs; kk += 4, p += 128) {
          ahead(p);
          ahead(p + 64);
          const vi a = _mm512_loadu_si512(p), c = _mm512_loadu_si512(p + 64);
          vi w[V];
          for (int q = 0; q < QS; ++q) gather.codes(a, c, Q0 + q, w + 2 * q);
          for (int r = 0; r < R; ++r) {
            int32_t quad, quad2;
            std::memcpy(&quad, x.q + r * k + b * kQ8Inputs + kk, sizeof quad);
            std::memcpy(&quad2, x.q2 + r * k + b * kQ8Inputs + kk, sizeof quad2);
            const vi xq = _mm512_set1_epi32(quad), xq2 = _mm512_set1_epi32(quad2);
            for (int v = 0; v < V; ++v) {
              sum[r][v] = _mm512_dpbusd_epi32(sum[r][v], w[v], xq);
              sum2[r][v] = _mm512_dpbusd_epi32(sum2[r][v], w[v], xq2);
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          const vi eight = _mm512_set1_epi32(x.sum8[r * blocks + b]);
          const vi eight2 = _mm512_set1_epi32(x.sum8_2[r * blocks + b]);
          const float scale = x.d[r * blocks + b];
          const vf d = vset(scale), d2 = vset(scale / 254.0f);
          for (int v = 0; v < V; ++v) {
            in[r][v] = vfma(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r][v], eight)), d, in[r][v]);
            in[r][v] = vfma(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum2[r][v], eight2)), d2, in[r][v]);
          }
        }
      }
      add_group<R, V>(acc, in, sz, g, n, col, xsum, groups);
    }
    store_tile<R, V>(acc, y, ystride, col);
  }
};

// 16 inputs as float32: bf16 widened (exact), float32 as they are.
inline vf load_inputs(const uint16_t* x) {
  const vi wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vf load_inputs(const float* x) { return _mm512_loadu_ps(x); }

// Each row's inputs (bf16 or float32) as two int8 digits per 32: d = max |x| / 127, q =
// x * (1 / d) rounded to nearest even (vcvtps2dq under the default rounding; d = 0: all
// zeros), then the rest x - q * d the same way in steps of d / 254 (|rest| <= d / 2: q2
// within 127), and 8 * sum q, 8 * sum q2. An input is then within d / 508 of x (max |x| /
// 64516), where one digit is within d / 2. The same float32 operations on every lane: the
// bits do not depend on the thread or the rows.
template <typename In>
void quantize_rows(const In* x, int64_t rows, int64_t k, std::vector<int8_t>& q,
                   std::vector<int8_t>& q2, std::vector<float>& d, std::vector<int32_t>& sum8,
                   std::vector<int32_t>& sum8_2) {
  static_assert(kQ8Inputs == 2 * W, "two vectors of inputs a scale");
  const int64_t blocks = k / kQ8Inputs;
  q.resize(static_cast<size_t>(rows * k));
  q2.resize(static_cast<size_t>(rows * k));
  d.resize(static_cast<size_t>(rows * blocks));
  sum8.resize(static_cast<size_t>(rows * blocks));
  sum8_2.resize(static_cast<size_t>(rows * blocks));
  const vf sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const vi low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * k + b * kQ8Inputs;
      vf v[2];
      for (int h = 0; h < 2; ++h) v[h] = load_inputs(x + at + h * W);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], sign), _mm512_and_ps(v[1], sign)));
      const float scale = top / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      const float step = scale / 254.0f, inverse2 = step > 0.0f ? 1.0f / step : 0.0f;
      vi total = _mm512_setzero_si512(), total2 = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        vi c = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], vset(inverse)));
        c = _mm512_min_epi32(_mm512_max_epi32(c, low), high);
        const vf rest = _mm512_sub_ps(v[h], _mm512_mul_ps(_mm512_cvtepi32_ps(c), vset(scale)));
        vi c2 = _mm512_cvtps_epi32(_mm512_mul_ps(rest, vset(inverse2)));
        c2 = _mm512_min_epi32(_mm512_max_epi32(c2, low), high);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + at + h * W), _mm512_cvtepi32_epi8(c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2.data() + at + h * W), _mm512_cvtepi32_epi8(c2));
        total = _mm512_add_epi32(total, c);
        total2 = _mm512_add_epi32(total2, c2);
      }
      d[r * blocks + b] = scale;
      sum8[r * blocks + b] = 8 * _mm512_reduce_add_epi32(total);
      sum8_2[r * blocks + b] = 8 * _mm512_reduce_add_epi32(total2);
    }
  }
}

template <int QS, int Q0, typename S>
void int4_vnni_block(const QuantRows& x, const float* xsum, float* yp, int64_t rows, int64_t k,
                     int64_t n, int64_t group, const uint8_t* pp, const S* sp, int64_t b,
                     const VnniGather& gather) {
  constexpr int64_t B = 64;
  const int64_t groups = k / group, blocks = k / kQ8Inputs;
  for (int64_t r0 = 0; r0 < rows; r0 += kVnniRows) {
    const int64_t tile = std::min<int64_t>(kVnniRows, rows - r0);
    const QuantRows part{x.q + r0 * k, x.q2 + r0 * k, x.d + r0 * blocks, x.sum8 + r0 * blocks,
                         x.sum8_2 + r0 * blocks};
    auto call = [&](auto rr) {
      constexpr int R = decltype(rr)::value;
      Int4VnniTile<R, QS, Q0>::run(part, xsum + r0 * groups, yp + r0 * n + b * B, n, k, group,
                                   pp + b * B * (k / 2), sp + b * B * 2, n, gather);
    };
    switch (tile) {
      case 1: call(std::integral_constant<int, 1>{}); break;
      case 2: call(std::integral_constant<int, 2>{}); break;
    }
  }
}

// As int4_bf16_blocks: half-block units shared among the threads.
template <typename In, typename S>
void int4_vnni_blocks(const In* xp, const float* xsum, float* yp, int64_t rows,
                      int64_t k, int64_t n, int64_t group, const uint8_t* pp, const S* sp) {
  thread_local std::vector<int8_t> q, q2;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> sum8, sum8_2;
  quantize_rows(xp, rows, k, q, q2, d, sum8, sum8_2);
  const QuantRows x{q.data(), q2.data(), d.data(), sum8.data(), sum8_2.data()};
  const int64_t units = 2 * (n / 64);
  const VnniGather gather;
  meshnet::parallel_for(0, units, 1, [&](int64_t u, int64_t end) {
    if (u % 2 == 1 && u < end) {
      int4_vnni_block<1, 1>(x, xsum, yp, rows, k, n, group, pp, sp, u / 2, gather);
      ++u;
    }
    for (; u + 2 <= end; u += 2) {
      int4_vnni_block<2, 0>(x, xsum, yp, rows, k, n, group, pp, sp, u / 2, gather);
    }
    if (u < end) int4_vnni_block<1, 0>(x, xsum, yp, rows, k, n, group, pp, sp, u / 2, gather);
  });
}

// Q8 weights (int8 codes, a float scale per block of B = 32 or 16 of a row) against rows as
// two int8 digits (per 32 inputs).
// 64 codes of one output row meet the 64 digits of the same k: vpdpbusd adds, in each of 16
// lanes, four products of (code + 128) (the codes' sign bit flipped: unsigned) and the
// digit, starting from -128 times the four digits' sum, so the lane holds the exact sum of
// code * digit. Lanes 0-7 are one block of 32 inputs, 8-15 the next (and at B = 16 lanes
// 0-3, 4-7, ... each one block of weights): each lane is made float and scaled by its
// block's input and weight scales, and summed into a float32 lane; a row's 16
// lanes meet at the end in _mm512_reduce_add_ps's fixed order.
struct Q8Lanes {  // one row's inputs: digits, and per 64 k the lanes' start and scales
  const int8_t* q;
  const int8_t* q2;
  const int32_t* start;  // chunks x 16: -128 * (four digits summed)
  const int32_t* start2;
  const float* d;  // chunks x 16: the input scale of the lane's block
  const float* d2;
  const float* sum;  // chunks x 16: the lane's four inputs summed, as digits (zeros only)
};

template <int64_t B>
struct Q8Vnni {
  template <int R, int NB>
  struct Tile {
    static void run(const Q8Lanes* x, float* y, int64_t ystride, int64_t k, const int8_t* q,
                    const float* d, const float* z) {
      const int64_t chunks = k / 64, blocks = k / B;
      const vi flip = _mm512_set1_epi8(static_cast<char>(0x80));
      const vi halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const vi quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      vf acc[R][NB];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = vzero();
      for (int64_t c = 0; c < chunks; ++c) {
        vi w[NB];
        vf dw[NB], zw[NB];
        for (int j = 0; j < NB; ++j) {
          const int8_t* p = q + j * k + c * 64;
          ahead(p);
          w[j] = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
          dw[j] = per_lane(d + j * blocks, c, halves, quarters);
          if (z != nullptr) zw[j] = per_lane(z + j * blocks, c, halves, quarters);
        }
        for (int r = 0; r < R; ++r) {
          const Q8Lanes& in = x[r];
          const vi q1 = _mm512_loadu_si512(in.q + c * 64), q2 = _mm512_loadu_si512(in.q2 + c * 64);
          const vi s1 = _mm512_loadu_si512(in.start + c * W), s2 = _mm512_loadu_si512(in.start2 + c * W);
          const vf d1 = vload(in.d + c * W), d2 = vload(in.d2 + c * W);
          const vf xs = z != nullptr ? vload(in.sum + c * W) : vzero();
          for (int j = 0; j < NB; ++j) {
            const vf f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(s1, w[j], q1)), d1);
            const vf f = vfma(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(s2, w[j], q2)), d2, f1);
            acc[r][j] = vfma(f, dw[j], acc[r][j]);
            if (z != nullptr) acc[r][j] = vfma(xs, zw[j], acc[r][j]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) y[r * ystride + j] = vsum(acc[r][j]);
    }

    // A row's per-block values (scales or zeros) for chunk c's 16 lanes: two blocks of 32
    // (lanes 0-7, 8-15) or four of 16 (lanes 0-3, 4-7, 8-11, 12-15).
    static vf per_lane(const float* v, int64_t c, const vi& halves, const vi& quarters) {
      if constexpr (B == kQ8Block) {
        double pair;
        std::memcpy(&pair, v + 2 * c, sizeof pair);
        return _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(pair)));
      } else {
        return _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_loadu_ps(v + 4 * c)));
      }
    }
  };
};

template <int64_t B>
bool q8_vnni_into(const torch::Tensor& x, const int8_t* q, const float* d, const float* z,
                  int64_t n, int64_t k, float* y) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  if ((!bf16 && x.scalar_type() != torch::kFloat32) || k % 64 != 0) return false;
  const int64_t rows = x.size(0), chunks = k / 64, blocks = k / B, xblocks = k / kQ8Block;
  thread_local std::vector<int8_t> q1, q2;
  thread_local std::vector<float> scales, d1, d2, sums;
  thread_local std::vector<int32_t> sum8, sum8_2, start1, start2;
  if (bf16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    quantize_rows(xb, rows, k, q1, q2, scales, sum8, sum8_2);
  } else {
    quantize_rows(x.data_ptr<float>(), rows, k, q1, q2, scales, sum8, sum8_2);
  }
  const auto lanes = static_cast<size_t>(rows * chunks * W);
  start1.resize(lanes), start2.resize(lanes), d1.resize(lanes), d2.resize(lanes);
  sums.resize(z != nullptr ? lanes : 0);
  std::vector<Q8Lanes> inputs(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t l = 0; l < W; ++l) {
        const int64_t at = r * k + c * 64 + 4 * l, lane = (r * chunks + c) * W + l;
        int32_t a = 0, b = 0;
        for (int i = 0; i < 4; ++i) a += q1[at + i], b += q2[at + i];
        const float scale = scales[r * xblocks + 2 * c + l / 8];  // per 32 inputs
        start1[lane] = -128 * a, start2[lane] = -128 * b;
        d1[lane] = scale, d2[lane] = scale / 254.0f;
        if (z != nullptr) sums[lane] = static_cast<float>(a) * d1[lane] + static_cast<float>(b) * d2[lane];
      }
    }
    const auto off = static_cast<size_t>(r * chunks * W);
    inputs[r] = {q1.data() + r * k, q2.data() + r * k, start1.data() + off, start2.data() + off,
                 d1.data() + off, d2.data() + off, z != nullptr ? sums.data() + off : nullptr};
  }
  meshnet::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    auto direct = [&](int64_t j, auto nb) {
      constexpr int C = decltype(nb)::value;
      for (int64_t r0 = 0; r0 < rows; r0 += kQ8VnniRows) {
        by_rows<kQ8VnniRows, Q8Vnni<B>::template Tile, C>(
            std::min<int64_t>(kQ8VnniRows, rows - r0), inputs.data() + r0, y + r0 * n + j, n, k,
            q + j * k, d + j * blocks, z == nullptr ? nullptr : z + j * blocks);
      }
    };
    product_range(n0, n1, direct);
  });
  return true;
}
#else
template <int64_t B>
bool q8_vnni_into(const torch::Tensor&, const int8_t*, const float*, const float*, int64_t,
                  int64_t, float*) {
  return false;
}
#endif

template <int NV, typename S>
void int4_linear_blocks(const float* xp, const float* xsum, float* yp, int64_t rows, int64_t k,
                        int64_t n, int64_t group, const uint8_t* pp, const S* sp) {
  constexpr int64_t B = 2 * NV * W;
  const int64_t groups = k / group;
  meshnet::parallel_for(0, n / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < rows; r0 += kDirectRows) {
        const int64_t tile = std::min<int64_t>(kDirectRows, rows - r0);
        auto call = [&](auto rr) {
          constexpr int R = decltype(rr)::value;
          Int4Tile<R, NV>::run(xp + r0 * k, xsum + r0 * groups, yp + r0 * n + b * B, n, k,
                               group, pp + b * B * (k / 2), sp + b * B * 2, n);
        };
        switch (tile) {
          case 1: call(std::integral_constant<int, 1>{}); break;
          case 2: call(std::integral_constant<int, 2>{}); break;
#if defined(__AVX512F__)
          case 3: call(std::integral_constant<int, 3>{}); break;
          case 4: call(std::integral_constant<int, 4>{}); break;
#endif
        }
      }
    }
  });
}

void check_int4(const torch::Tensor& packed, const torch::Tensor& sz, int64_t group,
                int64_t block_n, int64_t& n, int64_t& k) {
  TORCH_CHECK(sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous() &&
                  (sz.scalar_type() == torch::kBFloat16 || sz.scalar_type() == torch::kFloat32 ||
                   sz.scalar_type() == torch::kHalf),
              "scale_zero must be [K/group, N, 2], bf16, float32 or float16, contiguous");
  n = sz.size(1), k = sz.size(0) * group;
  TORCH_CHECK(group > 0 && block_n > 0 && block_n % 2 == 0 && n % block_n == 0,
              "block_n must divide N");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.numel() == n * k / 2,
              "packed must be uint8 holding N * K / 2 bytes, contiguous");
}

// x @ W.T into yp [rows, N] float32 (x float32 or bf16 [rows, K], contiguous). The sum of
// each row's inputs per group (the zero's weight) is taken in k order from x's values as
// float32 (bf16 widened exactly).
void int4_into(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
               int64_t group, int64_t block_n, float* yp) {
  int64_t n, k;
  check_int4(packed, sz, group, block_n, n, k);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == torch::kFloat32) &&
                  x.is_contiguous() && x.size(1) == k,
              "x must be float32 or bf16 [M, K], contiguous");
  const int64_t rows = x.size(0), groups = k / group;
  thread_local std::vector<float> xsum_buf;
  xsum_buf.resize(static_cast<size_t>(rows * groups));
  float* xs = xsum_buf.data();
  auto sums = [&](auto* xv) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int64_t i = 0; i < group; ++i) s += static_cast<float>(xv[r * k + g * group + i]);
        xs[r * groups + g] = s;
      }
    }
  };
  if (bf16) {
    sums(x.data_ptr<c10::BFloat16>());
  } else {
    sums(x.data_ptr<float>());
  }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  auto dispatch = [&](auto* sp) {
#if defined(MESHNET_INT4_VNNI)
    if (block_n == 64 && group % kQ8Inputs == 0) {  // bf16 or float32 rows
      if (bf16) {
        const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
        int4_vnni_blocks(xb, xs, yp, rows, k, n, group, pp, sp);
      } else {
        int4_vnni_blocks(x.data_ptr<float>(), xs, yp, rows, k, n, group, pp, sp);
      }
      return;
    }
#endif
#if defined(MESHNET_INT4_BF16)
    if (bf16 && block_n == 64 && group % 2 == 0) {
      const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
      int4_bf16_blocks(xb, xs, yp, rows, k, n, group, pp, sp);
      return;
    }
#endif
    const auto xf = bf16 ? x.to(torch::kFloat32) : x;  // bf16 without the bf16 tiles
    const float* xp = xf.data_ptr<float>();
    if (block_n == 4 * W) {
      int4_linear_blocks<2>(xp, xs, yp, rows, k, n, group, pp, sp);
    } else if (block_n == 2 * W) {
      int4_linear_blocks<1>(xp, xs, yp, rows, k, n, group, pp, sp);
#if !defined(__AVX512F__)
    } else if (block_n == 8 * W) {
      int4_linear_blocks<4>(xp, xs, yp, rows, k, n, group, pp, sp);
#endif
    } else {
      TORCH_CHECK(false, "block_n ", block_n, " is not supported");
    }
  };
  if (sz.scalar_type() == torch::kBFloat16) {
    dispatch(sz.data_ptr<c10::BFloat16>());
  } else if (sz.scalar_type() == torch::kHalf) {
    dispatch(sz.data_ptr<c10::Half>());
  } else {
    dispatch(sz.data_ptr<float>());
  }
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& sz, int64_t group, int64_t block_n) {
  TORCH_CHECK(sz.dim() == 3, "scale_zero must be [K/group, N, 2]");
  auto y = torch::empty({x.size(0), sz.size(1)}, x.options().dtype(torch::kFloat32));
  int4_into(x, packed, sz, group, block_n, y.data_ptr<float>());
  return y;
}

// Dequantization, bit for bit what torch computes for out.copy_(codes); out.sub_(8);
// out.mul_(scale); out.add_(zero) in out's dtype: the product (code - 8) * scale is exact in
// float32 and rounded once to out's dtype, the sum rounded to float32 and then to out's
// dtype (no fused multiply-add: the build has -ffp-contract=off).
template <typename Out>
inline Out store_value(float v);
template <>
inline float store_value<float>(float v) { return v; }
template <>
inline uint16_t store_value<uint16_t>(float v) { return bf16_scalar(v); }
inline float round_to(float v, float) { return v; }
inline float round_to(float v, uint16_t) {
  const uint32_t u = static_cast<uint32_t>(bf16_scalar(v)) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(__AVX512F__)
inline vf round_bf16(vf v) {  // to bf16 and back, round to nearest even
  const vi u = _mm512_castps_si512(v);
  const vi odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const vi r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(
      _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

template <typename Out, typename S>
void int4_dequantize_block(const uint8_t* blk, const S* sz, int64_t n, int64_t k, int64_t group,
                           int64_t block_n, Out* out) {
  // rows of this block: out[j] for j < block_n; blk: k * block_n / 2 bytes
  const int64_t half = block_n / 2;
  int64_t j0 = 0;
#if defined(__AVX512F__)
  if (half % 4 == 0 && k % W == 0 && group % W == 0) {
    // one gather: 4 adjacent bytes (4 rows' low nibbles, 4 rows' high nibbles) of W k's
    const vi index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                           12, 13, 14, 15),
                                        _mm512_set1_epi32(static_cast<int>(half)));
    const vf table = codes_table();
    for (; j0 < half; j0 += 4) {
      for (int64_t k0 = 0; k0 < k; k0 += W) {
        const vi bytes = _mm512_i32gather_epi32(index, blk + k0 * half + j0, 1);
        const int64_t g = k0 / group;
        for (int b = 0; b < 8; ++b) {  // nibble b: row j0 + b/2 (+ half for high nibbles)
          const int64_t row = (b & 1) ? half + j0 + b / 2 : j0 + b / 2;
          const vf c = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4 * b), table);
          const float s = round_to(as_float(sz[(g * n + row) * 2]), Out{});
          const float z = round_to(as_float(sz[(g * n + row) * 2 + 1]), Out{});
          Out* o = out + row * k + k0;
          if constexpr (std::is_same_v<Out, float>) {
            vstore(o, vadd(vmul(c, vset(s)), vset(z)));
          } else {
            store_bf16(o, vadd(round_bf16(vmul(c, vset(s))), vset(z)));
          }
        }
      }
    }
  }
#endif
  for (int64_t j = j0; j < half; ++j) {  // any other layout: one element at a time
    for (int64_t kk = 0; kk < k; ++kk) {
      const uint8_t byte = blk[kk * half + j];
      const int64_t g = kk / group;
      for (int hi = 0; hi < 2; ++hi) {
        const int64_t row = j + hi * half;
        const float c = static_cast<float>(hi ? (byte >> 4) : (byte & 15)) - 8.0f;
        // scale and zero in out's dtype, as torch's scale_zero.to(out.dtype)
        const float s = round_to(as_float(sz[(g * n + row) * 2]), Out{});
        const float z = round_to(as_float(sz[(g * n + row) * 2 + 1]), Out{});
        out[row * k + kk] = store_value<Out>(round_to(c * s, Out{}) + z);
      }
    }
  }
}

void int4_dequantize(const torch::Tensor& packed, const torch::Tensor& sz, int64_t group,
                     int64_t block_n, torch::Tensor& out) {
  int64_t n, k;
  check_int4(packed, sz, group, block_n, n, k);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "out must be [N, K], contiguous");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || out.scalar_type() == torch::kFloat32, "out must be bf16 or float32");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  auto run = [&](auto* sp) {
    meshnet::parallel_for(0, n / block_n, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = pp + b * block_n * (k / 2);
        const auto* s = sp + b * block_n * 2;
        if (bf16) {
          int4_dequantize_block(blk, s, n, k, group, block_n,
                                static_cast<uint16_t*>(op) + b * block_n * k);
        } else {
          int4_dequantize_block(blk, s, n, k, group, block_n,
                                static_cast<float*>(op) + b * block_n * k);
        }
      }
    });
  };
  if (sz.scalar_type() == torch::kBFloat16) {
    run(sz.data_ptr<c10::BFloat16>());
  } else if (sz.scalar_type() == torch::kHalf) {
    run(sz.data_ptr<c10::Half>());
  } else {
    run(sz.data_ptr<float>());
  }
}

}  // namespace

// For layer_step.cpp: this file's int4 product into a float32 buffer, outside its
// anonymous namespace.
void packed_int4_into(const torch::Tensor& x, const torch::Tensor& packed,
                      const torch::Tensor& sz, int64_t group, int64_t block_n, float* y) {
  int4_into(x, packed, sz, group, block_n, y);
}

// q8_linear's product into y (rows x N float32): x contiguous float32 or bf16 rows, q and d
// as q8_linear checks them (layer_step.cpp's Q8 products).
void packed_q8_into(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                    const torch::Tensor& z, float* y) {
  const int64_t n = q.size(0), k = q.size(1);
  const float* zp = z.defined() ? z.data_ptr<float>() : nullptr;
  if (d.size(1) == k / 16) {
    q8_linear_into<16>(x, q.data_ptr<int8_t>(), d.data_ptr<float>(), zp, n, k, y);
  } else {
    q8_linear_into<32>(x, q.data_ptr<int8_t>(), d.data_ptr<float>(), zp, n, k, y);
  }
}

void register_layer_step(pybind11::module& m);  // layer_step.cpp
void register_attention(pybind11::module& m);  // attention.cpp
void register_rows_sdpa(pybind11::module& m);  // row_sdpa.cpp
void register_lane_io(pybind11::module& m);    // lane_io.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_step(m);
  register_attention(m);
  register_rows_sdpa(m);
  register_lane_io(m);
  m.attr("lanes") = W;
  m.attr("tile_rows") = kDirectRows;
#if defined(__AVX512F__)
  m.attr("int4_blocks") = py::make_tuple(32, 64);  // int4_linear's block_n (any for unpacking)
#else
  m.attr("int4_blocks") = py::make_tuple(16, 32, 64);
#endif
#if defined(MESHNET_INT4_VNNI)
  m.attr("int4_vnni") = true;
#else
  m.attr("int4_vnni") = false;
#endif
#if defined(MESHNET_INT4_BF16)
  m.attr("int4_bf16") = true;
#else
  m.attr("int4_bf16") = false;
#endif
  m.def("fp8_linear", &fp8_linear, "y = x @ dequant(w).T + bias, float32 (few rows)");
  m.def("fp8_dequantize", &fp8_dequantize, "dequantized FP8 weight into out (bf16 or f32)");
  m.def("mxfp4_linear", &mxfp4_linear, "y = x @ dequant(w).T + bias, float32 (few rows)");
  m.def("mxfp4_dequantize", &mxfp4_dequantize, "dequantized MXFP4 weight into out");
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale).T, float32 (few rows)");
  m.def("q8_linear", &q8_linear, pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("d"),
        pybind11::arg("z") = std::nullopt,
        "y = x @ (q * d + z per 16 or 32).T, float32 (Q8_0, Q6_K, Q5_* blocks)");
  m.def("int4_linear", &int4_linear, "y = x @ dequant(torch int4 packing).T, float32");
  m.def("int4_dequantize", &int4_dequantize, "torch's CPU int4 packing into out (bf16/f32)");
}
