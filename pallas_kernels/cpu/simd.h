// 16-lane float/int vectors and the two operations whose order defines a result: the lane-wise FMA
// chain and the fixed horizontal sum.
//
// Every product y[m, n] = sum_k x[m, k] * w[n, k] is computed the same way on every ISA: lane l
// (0..15) accumulates x*w over k = 16*i + l for i = 0, 1, ... with one FMA each (a single rounding),
// then hsum16 adds the 16 lanes in a fixed tree. AVX-512 does a chain in one register, AVX2 in two
// halves, the scalar fallback lane by lane with std::fma: the same bits everywhere, and for a row
// whatever other rows are in the call (batch invariance).
//
// Dequantization is plain multiplies and adds: the build passes -ffp-contract=off so that
// (d * q) + m stays two roundings, exactly as gguf.quants.dequantize computes it, unless an FMA is
// written out where it is exact (blocks.h says why).
//
// Types: with AVX-512, GCC vector extensions (one zmm register a vector). With AVX2, a pair of ymm
// registers in a struct with the few operators the dequantizers use: GCC keeps a 64-byte vector
// extension type in memory when the machine has no 64-byte registers, which makes every operation
// a store and a load. The scalar fallback uses the vector extensions with loops.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Forced: a 16-lane vector passed to a function that is not inlined goes through the stack.
#define SIMD_INLINE static inline __attribute__((always_inline))

namespace strata {

constexpr int kLanes = 16;

#if defined(__AVX512F__)
#define STRATA_X86_SIMD 1
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_X86_SIMD 1
#define STRATA_AVX2 1
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

// ---- the types and their element-wise operators -------------------------------------------------

#if defined(STRATA_AVX2)

struct f32x16 { __m256 lo, hi; };
struct i32x16 { __m256i lo, hi; };

SIMD_INLINE f32x16 operator*(f32x16 a, f32x16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
SIMD_INLINE f32x16 operator*(f32x16 a, float s) { __m256 v = _mm256_set1_ps(s); return {_mm256_mul_ps(a.lo, v), _mm256_mul_ps(a.hi, v)}; }
SIMD_INLINE f32x16 operator*(float s, f32x16 a) { __m256 v = _mm256_set1_ps(s); return {_mm256_mul_ps(v, a.lo), _mm256_mul_ps(v, a.hi)}; }
SIMD_INLINE f32x16 operator+(f32x16 a, float s) { __m256 v = _mm256_set1_ps(s); return {_mm256_add_ps(a.lo, v), _mm256_add_ps(a.hi, v)}; }
SIMD_INLINE f32x16 operator-(f32x16 a, float s) { __m256 v = _mm256_set1_ps(s); return {_mm256_sub_ps(a.lo, v), _mm256_sub_ps(a.hi, v)}; }
SIMD_INLINE i32x16 operator&(i32x16 a, int k) { __m256i v = _mm256_set1_epi32(k); return {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)}; }
SIMD_INLINE i32x16 operator|(i32x16 a, i32x16 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
SIMD_INLINE i32x16 operator-(i32x16 a, int k) { __m256i v = _mm256_set1_epi32(k); return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)}; }
SIMD_INLINE i32x16 operator>>(i32x16 a, int n) { __m128i c = _mm_cvtsi32_si128(n); return {_mm256_sra_epi32(a.lo, c), _mm256_sra_epi32(a.hi, c)}; }
SIMD_INLINE i32x16 operator<<(i32x16 a, int n) { __m128i c = _mm_cvtsi32_si128(n); return {_mm256_sll_epi32(a.lo, c), _mm256_sll_epi32(a.hi, c)}; }

SIMD_INLINE f32x16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
SIMD_INLINE void store16(float* p, f32x16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
SIMD_INLINE f32x16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SIMD_INLINE f32x16 splat(float s) { __m256 v = _mm256_set1_ps(s); return {v, v}; }
SIMD_INLINE f32x16 to_f32(i32x16 v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }

#else

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

SIMD_INLINE f32x16 load16(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof v); return v; }
SIMD_INLINE void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
SIMD_INLINE f32x16 zero16() { return f32x16{}; }
// A broadcast (not 0 + s, which costs an add and turns -0 into +0).
SIMD_INLINE f32x16 splat(float s) { return f32x16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
SIMD_INLINE f32x16 to_f32(i32x16 v) { return __builtin_convertvector(v, f32x16); }

#endif

// Constants as loads from constant arrays (a function-local static vector would cost a guard check
// a use).
SIMD_INLINE f32x16 iota16() {
  alignas(64) static constexpr float v[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return load16(v);
}

// ---- loading quant bytes as int32 lanes ---------------------------------------------------------
// Intrinsics: GCC turns a __builtin_convertvector of bytes into a byte-by-byte loop.

#if defined(__AVX512F__)
SIMD_INLINE i32x16 widen_u8(__m128i b) { return (i32x16)_mm512_cvtepu8_epi32(b); }
SIMD_INLINE i32x16 widen_i8(__m128i b) { return (i32x16)_mm512_cvtepi8_epi32(b); }
#elif defined(STRATA_AVX2)
SIMD_INLINE i32x16 widen_u8(__m128i b) { return {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))}; }
SIMD_INLINE i32x16 widen_i8(__m128i b) { return {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))}; }
#endif

// 16 bytes -> 16 int32 lanes, zero- (u8) or sign-extended (i8).
SIMD_INLINE i32x16 u8_lanes(const uint8_t* p) {
#if defined(STRATA_X86_SIMD)
  return widen_u8(_mm_loadu_si128((const __m128i*)p));
#else
  i32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = p[i];
  return r;
#endif
}

SIMD_INLINE i32x16 i8_lanes(const uint8_t* p) {
#if defined(STRATA_X86_SIMD)
  return widen_i8(_mm_loadu_si128((const __m128i*)p));
#else
  i32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = int8_t(p[i]);
  return r;
#endif
}

// The 16 bytes of lo (bytes 0..7) and hi (8..15), zero-extended: built in registers (a vector load of
// bytes just stored one by one would stall on store forwarding).
SIMD_INLINE i32x16 u8_lanes_of(uint64_t lo, uint64_t hi) {
#if defined(STRATA_X86_SIMD)
  return widen_u8(_mm_set_epi64x((long long)hi, (long long)lo));
#else
  i32x16 r;
  for (int i = 0; i < 8; i++) r[i] = (lo >> (8 * i)) & 0xFF, r[8 + i] = (hi >> (8 * i)) & 0xFF;
  return r;
#endif
}

// ---- the arithmetic whose order is the definition ------------------------------------------------

// a * b + c, one rounding a lane.
SIMD_INLINE f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(STRATA_AVX2)
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#else
  f32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// The fixed reduction tree: lanes i and i+8, then i and i+4, then i and i+2, then 0 and 1.
SIMD_INLINE float hsum16(f32x16 a) {
#if defined(STRATA_X86_SIMD)
#if defined(__AVX512F__)
  __m512 v = (__m512)a;
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
#else
  __m256 s8 = _mm256_add_ps(a.lo, a.hi);
#endif
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

// e^x a lane, the same bits on every ISA (a fixed sequence of FMAs, multiplies and integer adds, not
// the C library's expf, whose code differs by ISA): Cephes' expf, x = n ln 2 + r with n = round(x /
// ln 2) (ln 2 in two parts), e^r by a degree-7 polynomial, 2^n added to the exponent; relative error
// ~1e-7. x is clamped to [-87.34, 88.38] (e^x below ~1e-38 is not 0 but ~1e-38); NaN stays NaN.
namespace exp_detail {
constexpr float kLo = -87.33654f, kHi = 88.37626f, kLog2e = 1.44269504088896341f, kMagic = 12582912.0f;
constexpr float kC1 = -0.693359375f, kC2 = 2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                         1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_detail

#if defined(STRATA_X86_SIMD)
SIMD_INLINE __m256 exp8(__m256 x) {
  using namespace exp_detail;
  __m256 c = _mm256_min_ps(_mm256_set1_ps(kHi), _mm256_max_ps(_mm256_set1_ps(kLo), x));
  __m256 t = _mm256_fmadd_ps(c, _mm256_set1_ps(kLog2e), _mm256_set1_ps(kMagic));
  __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(kMagic));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kC1), c);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kC2), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  __m256i k = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(_mm256_set1_ps(kMagic))), 23);
  __m256 e = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), k));
  return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

SIMD_INLINE float exp1(float x) {
  using namespace exp_detail;
  float c = x < kLo ? kLo : x;
  c = c > kHi ? kHi : c;
  float t = std::fma(c, kLog2e, kMagic), n = t - kMagic;
  float r = std::fma(n, kC1, c);
  r = std::fma(n, kC2, r);
  float p = kP[0];
  for (int i = 1; i < 6; i++) p = std::fma(p, r, kP[i]);
  p = std::fma(p, r * r, r);
  p = p + 1.0f;
  uint32_t tb, pb, mb;
  float m = kMagic;
  std::memcpy(&tb, &t, 4), std::memcpy(&pb, &p, 4), std::memcpy(&mb, &m, 4);
  uint32_t eb = pb + ((tb - mb) << 23);
  float e;
  std::memcpy(&e, &eb, 4);
  return x != x ? x : e;
}

// exp1 of the 16 floats at p, into out.
SIMD_INLINE void exp16(const float* p, float* out) {
#if defined(STRATA_X86_SIMD)
  _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(p)));
  _mm256_storeu_ps(out + 8, exp8(_mm256_loadu_ps(p + 8)));
#else
  for (int i = 0; i < kLanes; i++) out[i] = exp1(p[i]);
#endif
}

// ---- float16 and bfloat16 ------------------------------------------------------------------------

// IEEE half -> float, exact for every value (subnormals, inf, NaN).
SIMD_INLINE float half_to_float(uint16_t h) {
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

SIMD_INLINE float f16_at(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }

// 16 halves -> 16 floats.
SIMD_INLINE f32x16 halves16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(STRATA_AVX2)
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
#else
  f32x16 r;
  for (int i = 0; i < kLanes; i++) r[i] = f16_at(p + 2 * i);
  return r;
#endif
}

// 16 bfloat16 -> 16 floats (the 16 bits on top of zeros).
SIMD_INLINE f32x16 bfloat16s(const uint8_t* p) {
#if defined(__AVX512F__)
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif defined(STRATA_AVX2)
  __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
#else
  f32x16 r;
  for (int i = 0; i < kLanes; i++) {
    uint32_t bits = uint32_t(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
    std::memcpy(&r[i], &bits, 4);
  }
  return r;
#endif
}

// ---- table lookups: the dequantizers compute each block's (or sub-block's) possible values once,
// with the reference's own operations, and pick a lane's value by its quant bits -------------------

// t[idx & 15] a lane.
SIMD_INLINE f32x16 pick16(f32x16 t, i32x16 idx) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_permutexvar_ps((__m512i)idx, (__m512)t);
#elif defined(STRATA_AVX2)
  auto half = [&](__m256i i) {       // vpermps takes 3 index bits: both table halves, chosen by bit 3
    __m256 a = _mm256_permutevar8x32_ps(t.lo, i), b = _mm256_permutevar8x32_ps(t.hi, i);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  };
  return {half(idx.lo), half(idx.hi)};
#else
  f32x16 r;
  for (int l = 0; l < kLanes; l++) r[l] = t[idx[l] & 15];
  return r;
#endif
}

// Lane l's bit of `high` chooses between two 16-entry tables (a fifth quant bit).
SIMD_INLINE f32x16 pick32(f32x16 lo, f32x16 hi, i32x16 idx, uint32_t high) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_mask_permutexvar_ps((__m512)pick16(lo, idx), (__mmask16)high, (__m512i)idx, (__m512)hi);
#elif defined(STRATA_AVX2)
  f32x16 a = pick16(lo, idx), b = pick16(hi, idx);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  auto sel = [&](__m256 x, __m256 y, uint32_t bits) {
    __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), bit), bit);
    return _mm256_blendv_ps(x, y, _mm256_castsi256_ps(m));
  };
  return {sel(a.lo, b.lo, high & 0xFF), sel(a.hi, b.hi, (high >> 8) & 0xFF)};
#else
  f32x16 a = pick16(lo, idx), b = pick16(hi, idx), r;
  for (int l = 0; l < kLanes; l++) r[l] = (high >> l) & 1 ? b[l] : a[l];
  return r;
#endif
}

// Bit `bit` of each lane, as a 16-bit lane mask (for pick32).
SIMD_INLINE uint32_t lane_bits(i32x16 v, int bit) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)v, _mm512_set1_epi32(1 << bit));
#elif defined(STRATA_AVX2)
  __m128i c = _mm_cvtsi32_si128(31 - bit);
  uint32_t m0 = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_sll_epi32(v.lo, c)));
  uint32_t m1 = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_sll_epi32(v.hi, c)));
  return m0 | (m1 << 8);
#else
  uint32_t m = 0;
  for (int l = 0; l < kLanes; l++) m |= uint32_t((v[l] >> bit) & 1) << l;
  return m;
#endif
}

// Lanes 0..7 of v times a, lanes 8..15 times b.
SIMD_INLINE f32x16 times_halves(i32x16 v, float a, float b) {
#if defined(STRATA_AVX2)
  f32x16 f = to_f32(v);
  return {_mm256_mul_ps(f.lo, _mm256_set1_ps(a)), _mm256_mul_ps(f.hi, _mm256_set1_ps(b))};
#else
  f32x16 s = splat(a);
  for (int l = 8; l < kLanes; l++) s[l] = b;
  return to_f32(v) * s;
#endif
}

}  // namespace strata
