// 16-lane float/int vectors (GCC vector extensions) and the two operations whose order defines a
// result: the lane-wise FMA chain and the fixed horizontal sum.
//
// Every product y[m, n] = sum_k x[m, k] * w[n, k] is computed the same way on every ISA: lane l
// (0..15) accumulates x*w over k = 16*i + l for i = 0, 1, ... with one FMA each (a single rounding),
// then hsum16 adds the 16 lanes in a fixed tree. AVX-512 does a chain in one register, AVX2 in two
// halves, the scalar fallback lane by lane with std::fma: the same bits everywhere, and for a row
// whatever other rows are in the call (batch invariance).
//
// Dequantization is plain multiplies and adds: the build passes -ffp-contract=off so that
// (d * q) + m stays two roundings, exactly as gguf.quants.dequantize computes it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace strata {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));

constexpr int kLanes = 16;

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

static inline f32x16 load16(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
static inline f32x16 zero16() { return f32x16{}; }
static inline f32x16 splat(float s) { return f32x16{} + s; }

// 16 bytes -> 16 int32 lanes (zero- or sign-extended).
static inline i32x16 u8_lanes(const uint8_t* p) {
  u8x16 b; std::memcpy(&b, p, 16); return __builtin_convertvector(b, i32x16);
}
static inline i32x16 i8_lanes(const uint8_t* p) {
  i8x16 b; std::memcpy(&b, p, 16); return __builtin_convertvector(b, i32x16);
}
static inline f32x16 to_f32(i32x16 v) { return __builtin_convertvector(v, f32x16); }

static inline const i32x16& lane_index() {
  static const i32x16 idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return idx;
}

// Bits first..first+15 of a little-endian uint32, one a lane, as 0 or 1.
static inline i32x16 bit_lanes(uint32_t bits, int first) {
  u32x16 v = u32x16{} + bits;
  u32x16 s = (u32x16)(lane_index() + first);
  return (i32x16)((v >> s) & 1u);
}

// a * b + c, one rounding a lane.
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0, a1, b0, b1, c0, c1;
  std::memcpy(&a0, &a, 32); std::memcpy(&a1, (const char*)&a + 32, 32);
  std::memcpy(&b0, &b, 32); std::memcpy(&b1, (const char*)&b + 32, 32);
  std::memcpy(&c0, &c, 32); std::memcpy(&c1, (const char*)&c + 32, 32);
  __m256 r0 = _mm256_fmadd_ps(a0, b0, c0), r1 = _mm256_fmadd_ps(a1, b1, c1);
  f32x16 r; std::memcpy(&r, &r0, 32); std::memcpy((char*)&r + 32, &r1, 32);
  return r;
#else
  f32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// The fixed reduction tree: lanes i and i+8, then i and i+4, then i and i+2, then 0 and 1.
static inline float hsum16(f32x16 a) {
#if defined(__AVX512F__)
  __m512 v = (__m512)a;
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#elif defined(__AVX2__)
  __m256 lo, hi;
  std::memcpy(&lo, &a, 32); std::memcpy(&hi, (const char*)&a + 32, 32);
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
#endif
}

// IEEE half -> float, exact for every value (subnormals, inf, NaN).
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0) {
    float f = float(man) * 5.9604644775390625e-08f;   // man * 2^-24: exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

static inline float f16_at(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }

// 16 halves -> 16 floats.
static inline f32x16 halves16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
  f32x16 r; std::memcpy(&r, &lo, 32); std::memcpy((char*)&r + 32, &hi, 32);
  return r;
#else
  f32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = f16_at(p + 2 * i);
  return r;
#endif
}

// A 16-entry signed-byte table indexed by 16 nibbles (IQ4's levels) -> int32 lanes.
static inline i32x16 lookup16(const int8_t* table, i32x16 idx) {
#if defined(__SSSE3__)
  __m128i t = _mm_loadu_si128((const __m128i*)table);
  u8x16 i8 = __builtin_convertvector(idx, u8x16);
  __m128i r = _mm_shuffle_epi8(t, (__m128i)i8);
  return __builtin_convertvector((i8x16)r, i32x16);
#else
  i32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = table[idx[i]];
  return r;
#endif
}

}  // namespace strata
