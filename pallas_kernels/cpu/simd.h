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
// A broadcast (not 0 + s, which costs an add and turns -0 into +0).
static inline f32x16 splat(float s) { return f32x16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

// 16 bytes (or halfwords) -> 16 int32 lanes, zero- or sign-extended. Intrinsics: GCC turns a
// __builtin_convertvector of bytes into a byte-by-byte loop.
#if defined(__AVX512F__)
static inline i32x16 u8_lanes(const uint8_t* p) {
  return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}
static inline i32x16 widen_i8(__m128i b) { return (i32x16)_mm512_cvtepi8_epi32(b); }
static inline i32x16 u16_lanes(const uint8_t* p) {
  return (i32x16)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
}
#elif defined(__AVX2__)
static inline i32x16 join(__m256i lo, __m256i hi) {
  i32x16 r; std::memcpy(&r, &lo, 32); std::memcpy((char*)&r + 32, &hi, 32); return r;
}
static inline i32x16 u8_lanes(const uint8_t* p) {
  __m128i b = _mm_loadu_si128((const __m128i*)p);
  return join(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
static inline i32x16 widen_i8(__m128i b) {
  return join(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
static inline i32x16 u16_lanes(const uint8_t* p) {
  return join(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)),
              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
}
#else
static inline i32x16 u8_lanes(const uint8_t* p) {
  i32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = p[i];
  return r;
}
static inline i32x16 u16_lanes(const uint8_t* p) {
  i32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = p[2 * i] | (p[2 * i + 1] << 8);
  return r;
}
#endif

// The 16 bytes of lo (bytes 0..7) and hi (8..15), zero-extended: built in registers (a vector load of
// bytes just stored one by one would stall on store forwarding).
static inline i32x16 u8_lanes_of(uint64_t lo, uint64_t hi) {
#if defined(__AVX512F__)
  return (i32x16)_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)hi, (long long)lo));
#elif defined(__AVX2__)
  __m128i b = _mm_set_epi64x((long long)hi, (long long)lo);
  return join(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
#else
  i32x16 r;
  for (int i = 0; i < 8; i++) r[i] = (lo >> (8 * i)) & 0xFF, r[8 + i] = (hi >> (8 * i)) & 0xFF;
  return r;
#endif
}

static inline i32x16 i8_lanes(const uint8_t* p) {
#if defined(__AVX2__)
  return widen_i8(_mm_loadu_si128((const __m128i*)p));
#else
  i32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = int8_t(p[i]);
  return r;
#endif
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

// ---- table lookups: the dequantizers compute each block's (or sub-block's) possible values once,
// with the reference's own operations, and pick a lane's value by its quant bits -------------------

static inline const f32x16& iota16() {
  static const f32x16 v = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return v;
}

// t[idx & 15] a lane.
static inline f32x16 pick16(f32x16 t, i32x16 idx) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_permutexvar_ps((__m512i)idx, (__m512)t);
#elif defined(__AVX2__)
  __m256 t0, t1; __m256i i[2];
  std::memcpy(&t0, &t, 32); std::memcpy(&t1, (const char*)&t + 32, 32);
  std::memcpy(i, &idx, 64);
  f32x16 r;
  for (int h = 0; h < 2; h++) {      // vpermps takes 3 index bits: both halves, chosen by bit 3
    __m256 lo = _mm256_permutevar8x32_ps(t0, i[h]), hi = _mm256_permutevar8x32_ps(t1, i[h]);
    __m256 v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i[h], 28)));
    std::memcpy((char*)&r + 32 * h, &v, 32);
  }
  return r;
#else
  f32x16 r;
  for (int l = 0; l < kLanes; l++) r[l] = t[idx[l] & 15];
  return r;
#endif
}

// Lane l's bit of `high` chooses between two 16-entry tables (a fifth quant bit).
static inline f32x16 pick32(f32x16 lo, f32x16 hi, i32x16 idx, uint32_t high) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_mask_permutexvar_ps((__m512)pick16(lo, idx), (__mmask16)high, (__m512i)idx, (__m512)hi);
#else
  f32x16 a = pick16(lo, idx), b = pick16(hi, idx);
  i32x16 bit = (i32x16)(((u32x16{} + high) >> (u32x16)lane_index()) & 1u);
  return bit ? b : a;
#endif
}

// Bit `bit` of each lane, as a 16-bit lane mask (for pick32).
static inline uint32_t lane_bits(i32x16 v, int bit) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)v, _mm512_set1_epi32(1 << bit));
#elif defined(__AVX2__)
  __m256i h[2]; std::memcpy(h, &v, 64);
  uint32_t m0 = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h[0], 31 - bit)));
  uint32_t m1 = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h[1], 31 - bit)));
  return m0 | (m1 << 8);
#else
  uint32_t m = 0;
  for (int l = 0; l < kLanes; l++) m |= uint32_t((v[l] >> bit) & 1) << l;
  return m;
#endif
}

}  // namespace strata
