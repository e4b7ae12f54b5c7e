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
// Built with -march=native on the machine that runs it: AVX-512 where the CPU has it, else
// AVX2 + FMA + F16C (every x86 server of the last decade).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "packed.cpp needs AVX2, FMA and F16C"
#endif

namespace {

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
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
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
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
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
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
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
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      if (bf16) {
        fp4_row(bp + j * (k / 2), ep + j * groups, k, static_cast<uint16_t*>(op) + j * k);
      } else {
        fp4_row(bp + j * (k / 2), ep + j * groups, k, static_cast<float*>(op) + j * k);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("lanes") = W;
  m.attr("tile_rows") = kDirectRows;
  m.def("fp8_linear", &fp8_linear, "y = x @ dequant(w).T + bias, float32 (few rows)");
  m.def("fp8_dequantize", &fp8_dequantize, "dequantized FP8 weight into out (bf16 or f32)");
  m.def("mxfp4_linear", &mxfp4_linear, "y = x @ dequant(w).T + bias, float32 (few rows)");
  m.def("mxfp4_dequantize", &mxfp4_dequantize, "dequantized MXFP4 weight into out");
}
