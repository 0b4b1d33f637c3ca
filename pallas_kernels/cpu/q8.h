// The int8 path's activations and the arithmetic that defines its results (--cpu-math int8).
//
// Each row of x is quantized per block to 8 bits, as llama.cpp's vec_dot_type does for the weight type:
// blocks of 32 values for the 32-value weight types (llama.cpp's Q8_0 / Q8_1), of 256 for the K and
// IQ4_XS super-blocks (Q8_K). A block: d = amax / 127, q = round_to_nearest_even(x * (1 / d)) in
// [-127, 127] (d = 0: all zeros). Unlike llama.cpp, d is kept as a float32 (not a float16): a little
// more accurate, and free. Per block we also keep the integer sums of q that the weights' offsets and
// minima need (per 32 values, and for the 16-value sub-blocks of Q2_K, Q3_K, Q6_K per 16).
//
// A product y[m][n] = x row m . weight row n is then, per weight unit u (a block of 32 values or a
// super-block of 256, in order), at most two integer sums int1, int2 (exact: int32, no overflow for any
// unit: int8_blocks.h) and one float accumulator, from 0:
//     acc = fma(w1 * dx, float(int1), acc)
//     acc = fma(w2 * dx, float(int2), acc)          (the types with a min or an m)
// with w1, w2 the weight unit's float scales, dx the x block's d (each product one rounding). That is
// the definition on every ISA and for every M: integer sums are exact whatever their order, and each
// (m, n) has its own sequence of float operations, so AVX-512, AVX2 and the scalar build give the same
// bits, and a row's result depends only on that row (batch invariance). The vector code puts 8 weight
// rows in the 8 float lanes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define Q8_INLINE static inline __attribute__((always_inline))

namespace strata {

#if defined(__AVX2__)
#define STRATA_Q8_AVX2 1
#endif

// One quantized x row, for one activation format (units of 32 or 256 values: k / unit of them).
struct Q8Row {
  const int8_t* q;        // [units * unit_values]
  const float* d;         // [units]: the block scale
  const int32_t* s32;     // [units * unit_values / 32]: sum of q over each 32 values
  const int32_t* s16;     // 256-value units only: [units * 16]: sum over each 16 values, in kSub16Order
};

// The 16-value sub-block sums of a super-block are kept in the order the AVX2 reduction produces them
// (halves8 below): sub-blocks 0, 2, 4, 6, 1, 3, 5, 7, then 8, 10, ..., 15.
constexpr int kSub16Order[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

// Quantized rows of one call, for one unit size (32 or 256 values). Owns the storage.
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s32, s16;
  std::vector<Q8Row> rows;
};

// Quantizes rows x[0..m) of k values (k a multiple of `unit`) into out.
void quantize_rows(const float* const* x, int64_t m, int64_t k, int unit, Q8Rows& out);

// ---- the float part: 8 lanes (8 weight rows), fma per lane ----------------------------------------------

#if defined(STRATA_Q8_AVX2)
struct f32x8 { __m256 v; };
Q8_INLINE f32x8 zero8() { return {_mm256_setzero_ps()}; }
Q8_INLINE f32x8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
Q8_INLINE f32x8 mul8(f32x8 a, f32x8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
Q8_INLINE f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
Q8_INLINE f32x8 cvt8(const int32_t* p) { return {_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)p))}; }
Q8_INLINE f32x8 cvt8(__m256i v) { return {_mm256_cvtepi32_ps(v)}; }
Q8_INLINE f32x8 splat8(float s) { return {_mm256_set1_ps(s)}; }
Q8_INLINE void store8(float* p, f32x8 a) { _mm256_storeu_ps(p, a.v); }
#else
struct f32x8 { float v[8]; };
Q8_INLINE f32x8 zero8() { return f32x8{}; }
Q8_INLINE f32x8 load8(const float* p) { f32x8 r; std::memcpy(r.v, p, 32); return r; }
Q8_INLINE f32x8 mul8(f32x8 a, f32x8 b) { for (int i = 0; i < 8; i++) a.v[i] *= b.v[i]; return a; }
Q8_INLINE f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
  for (int i = 0; i < 8; i++) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
Q8_INLINE f32x8 cvt8(const int32_t* p) { f32x8 r; for (int i = 0; i < 8; i++) r.v[i] = (float)p[i]; return r; }
Q8_INLINE f32x8 splat8(float s) { f32x8 r; for (int i = 0; i < 8; i++) r.v[i] = s; return r; }
Q8_INLINE void store8(float* p, f32x8 a) { std::memcpy(p, a.v, 32); }
#endif

// ---- integer dot products of 32 bytes (x86: AVX2, AVX-VNNI, AVX-512 VNNI) --------------------------

#if defined(STRATA_Q8_AVX2)
// Lane j (0..7) = sum over t < 4 of a[4j + t] * b[4j + t]: a unsigned, b signed. Without VNNI the
// pairs go through int16 (maddubs saturates): every caller keeps |a| * 127 * 2 < 32768, i.e. a <= 128.
Q8_INLINE __m256i dot_u8i8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

// acc + dot_u8i8(a, b): one instruction with VNNI.
Q8_INLINE __m256i dot_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, dot_u8i8(a, b));
#endif
}

// Both signed: |a| times b with a's sign (|-128| = 128 as an unsigned byte: still within maddubs' range).
Q8_INLINE __m256i dot_i8i8(__m256i a, __m256i b) {
  return dot_u8i8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
// With VNNI the products of unsigned bytes up to 255 add in int32 without saturating, so a signed
// weight w times a quantized x (|x| <= 127) can go as (x + 128) * w, and 128 * sum(w) be taken off
// once a block: the same exact integer sums as dot_i8i8, without its two sign operations a product
// (int8.cc: the kernels of several x rows, where sum(w) is shared by every row).
#define STRATA_Q8_OFFSET_X 1
// x's bytes plus 128, as unsigned bytes (x in [-127, 127]: 1..255)
Q8_INLINE __m256i offset_x(__m256i xq) { return _mm256_xor_si256(xq, _mm256_set1_epi8((char)0x80)); }
#endif

// [sum(p[0]), ..., sum(p[7])]: the 8 lanes of each vector added (exact integers: any order).
Q8_INLINE __m256i sums8(const __m256i* p) {
  __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  // a = [p0 lo, p1 lo, p2 lo, p3 lo | p0 hi, p1 hi, p2 hi, p3 hi] (lo: lanes 0..3), b likewise for p4..p7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// [lo(p0), lo(p1), lo(p2), lo(p3), hi(p0), hi(p1), hi(p2), hi(p3)]: lo = lanes 0..3 (bytes 0..15 of the
// 32 the dot read), hi = lanes 4..7 (bytes 16..31): the sums of 16-value sub-blocks, in kSub16Order.
Q8_INLINE __m256i halves8(const __m256i* p) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

Q8_INLINE int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

Q8_INLINE __m256i load32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
#endif

}  // namespace strata
