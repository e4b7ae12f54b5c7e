// Float32 arithmetic in an order the code fixes (the native engine, ADR-0044): 16 lanes as
// GCC's vector extension (AVX-512 registers where the CPU has them, two AVX2 halves where
// not), each lane's operations written out, built with -ffp-contract=off. So a result is the
// same bits on any x86 CPU, vector width, thread or row count.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace meshnet::fixed {

using c10::BFloat16;

constexpr int kLanes = 16;

// 16 float32 lanes as GCC's vector extension: AVX-512 registers where the CPU has them, two
// AVX2 halves where not; each lane's arithmetic is the same either way.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Bits __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// 16 elements from p as float32 lanes (exact widening); bf16 through its bits
inline Lanes load(const float* p) {
  Lanes out;
  std::memcpy(&out, p, sizeof out);
  return out;
}
inline Lanes load(const BFloat16* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Bits bits = __builtin_convertvector(h, Bits) << 16;
  Lanes out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

// Lanes rounded to bf16 to nearest even, as c10::BFloat16(float) rounds (NaN: 0x7FC0).
inline Halves to_bf16(Lanes v) {
  Bits bits;
  std::memcpy(&bits, &v, sizeof bits);
  Bits rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  rounded = v != v ? Bits{} + 0x7FC0u : rounded;
  return __builtin_convertvector(rounded, Halves);
}
inline void store(BFloat16* p, Lanes v) {
  const Halves h = to_bf16(v);
  std::memcpy(p, &h, sizeof h);
}

// Lanes through the dtype T: bf16's rounding, or float32's nothing.
inline Lanes rounded(Lanes v, const float*) { return v; }
inline Lanes rounded(Lanes v, const BFloat16*) {
  const Bits bits = __builtin_convertvector(to_bf16(v), Bits) << 16;
  Lanes out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// e^x lane by lane for x <= 0 (below -87: 0): x = n ln2 + r with n rounded to nearest even
// (adding and taking away 1.5 * 2^23), a degree-6 Taylor polynomial of e^r (|r| <= ln2 / 2,
// error < 2 ulp), scaled by 2^n through the exponent bits (n >= -126: a normal number).
inline Lanes exp_fixed(Lanes x) {
  const Lanes shift = Lanes{} + 12582912.0f;
  const Lanes n = (x * 1.44269504088896341f + shift) - shift;
  const Lanes r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  Lanes p = Lanes{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  Ints bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += __builtin_convertvector(n, Ints) << 23;
  Lanes out;
  std::memcpy(&out, &bits, sizeof out);
  return x < -87.0f ? Lanes{} : out;
}

// Pairs of vectors folded once: lanes [0, w) of each block of 2w lanes added to lanes
// [w, 2w) of it, the results of a then b side by side (the tree step of width w for every
// key both vectors hold).
template <int W>
inline Lanes fold(Lanes a, Lanes b);
template <>
inline Lanes fold<8>(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
template <>
inline Lanes fold<4>(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
template <>
inline Lanes fold<2>(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
template <>
inline Lanes fold<1>(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The sum of a 16-lane vector: lane l + w added to lane l for w = 8, 4, 2, 1.
inline float total(Lanes v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// x * x summed over n elements (a multiple of 16): lane l takes l, l + 16, ..., then `total`.
template <typename T>
inline float squares(const T* x, int64_t n) {
  Lanes acc = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    const Lanes v = load(x + i);
    acc += v * v;
  }
  return total(acc);
}

// silu(x) = x / (1 + e^-x) lane by lane through exp_fixed of -|x| (e^-x for x >= 0; for
// x < 0, x e^x / (1 + e^x)).
inline Lanes silu(Lanes x) {
  const Lanes e = exp_fixed(x < 0.0f ? x : -x);
  const Lanes one = Lanes{} + 1.0f;
  return x < 0.0f ? x * e / (one + e) : x / (one + e);
}

}  // namespace meshnet::fixed
