// The weight types in their integer form, for the int8 path (q8.h defines the arithmetic).
//
// A unit is one block (32 values) or super-block (256). Its values are w = w1 * sc_j * (u - off) and,
// for the types with a minimum, + w2 * mn_j, where u is an unsigned (or, `is_signed`, signed) integer of
// at most 8 bits, sc_j / mn_j integer scales of sub-block j (16 or 32 values; 1 for the 32-value types)
// and w1, w2 the unit's float scales. So a unit's product with a quantized x block (q, scale dx) is
//     dx * (w1 * sum_j sc_j * (sum_i u_i q_i - off * sum_i q_i)  +  w2 * sum_j mn_j * sum_i q_i)
// with both sums exact integers (the bounds: Q6_K's |sum| < 16 * 128 * (16 * 63 * 127 + 32 * 2032) <
// 2^29; the others are smaller).
//
// Each type gives: scales() (w1, w2 and the integer sc_j, mn_j), chunk(b, c, out) (values 32c..32c+31
// of the unit as bytes, plain C++: the scalar build) and, on x86 with AVX2, vchunk(b, c) (the same 32
// bytes in a register). Layouts: llama.cpp's ggml-common.h; blocks.h reads the same fields for the exact path.
#pragma once

#include <cstdint>
#include <cstring>

#include "dequant.h"
#include "q8.h"
#include "simd.h"

namespace strata {
namespace i8 {

#if defined(STRATA_Q8_AVX2)
// 16 bytes of nibbles -> 32 bytes: the low nibbles (values 0..15), then the high ones (16..31).
// (The 16 bytes broadcast to both halves, the upper half shifted by 4: three instructions, no lane insert.)
Q8_INLINE __m256i nibbles16(const uint8_t* p) {
  __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}
// Bits of 32 bytes: (v >> s) & mask, per byte.
Q8_INLINE __m256i bits_of(__m256i v, int s, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8((char)mask));
}
// Byte j = 0x10 if bit j of x is set, else 0.
Q8_INLINE __m256i bit16_of_bits(uint32_t x) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}
Q8_INLINE __m256i iq4_levels(__m256i idx) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIQ4Levels));
  return _mm256_shuffle_epi8(t, idx);
}
Q8_INLINE __m256i mxfp4_levels(__m256i idx) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kMXFP4Levels));
  return _mm256_shuffle_epi8(t, idx);
}
#endif

Q8_INLINE void nibbles16_plain(const uint8_t* p, uint8_t* out) {
  for (int i = 0; i < 16; i++) out[i] = p[i] & 15, out[i + 16] = p[i] >> 4;
}

// ---- 32-value blocks: sc = mn = 1 -------------------------------------------------------------------

struct Q4_0 {
  static constexpr int values = 32, bytes = 18, sub = 32, off = 8;
  static constexpr bool is_signed = false, two = false;
  static constexpr bool nibble = true;   // unsigned values <= 15 (int8.cc's sums16)
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = f16_at(b); w2 = 0; }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) { nibbles16_plain(b + 2, out); }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return nibbles16(b + 2); }
#endif
};

struct Q4_1 {
  static constexpr int values = 32, bytes = 20, sub = 32, off = 0;
  static constexpr bool is_signed = false, two = true;
  static constexpr bool nibble = true;   // unsigned values <= 15 (int8.cc's sums16)
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = f16_at(b); w2 = f16_at(b + 2); }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) { nibbles16_plain(b + 4, out); }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return nibbles16(b + 4); }
#endif
};

// Five bits: the nibble and bit j of the 32-bit qh (at qh_at) for value j.
Q8_INLINE void five_bits_plain(const uint8_t* qh_at, const uint8_t* qs, uint8_t* out) {
  uint32_t qh; std::memcpy(&qh, qh_at, 4);
  nibbles16_plain(qs, out);
  for (int j = 0; j < 32; j++) out[j] |= ((qh >> j) & 1) << 4;
}
#if defined(STRATA_Q8_AVX2)
Q8_INLINE __m256i five_bits(const uint8_t* qh_at, const uint8_t* qs) {
  uint32_t qh; std::memcpy(&qh, qh_at, 4);
  return _mm256_or_si256(nibbles16(qs), bit16_of_bits(qh));
}
#endif

struct Q5_0 {
  static constexpr int values = 32, bytes = 22, sub = 32, off = 16;
  static constexpr bool is_signed = false, two = false;
  static constexpr bool nibble = false;   // unsigned values <= 15 (int8.cc's sums16)
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = f16_at(b); w2 = 0; }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) { five_bits_plain(b + 2, b + 6, out); }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return five_bits(b + 2, b + 6); }
#endif
};

struct Q5_1 {
  static constexpr int values = 32, bytes = 24, sub = 32, off = 0;
  static constexpr bool is_signed = false, two = true;
  static constexpr bool nibble = false;   // unsigned values <= 15 (int8.cc's sums16)
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = f16_at(b); w2 = f16_at(b + 2); }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) { five_bits_plain(b + 4, b + 8, out); }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return five_bits(b + 4, b + 8); }
#endif
};

struct Q8_0 {
  static constexpr int values = 32, bytes = 34, sub = 32, off = 0;
  static constexpr bool is_signed = true, two = false;
  static constexpr bool nibble = false;   // unsigned values <= 15 (int8.cc's sums16)
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = f16_at(b); w2 = 0; }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) { std::memcpy(out, b + 2, 32); }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return load32(b + 2); }
#endif
};

struct IQ4_NL {
  static constexpr int values = 32, bytes = 18, sub = 32, off = 0;
  static constexpr bool is_signed = true, two = false;
  static constexpr bool nibble = false;   // unsigned values <= 15 (int8.cc's sums16)
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = f16_at(b); w2 = 0; }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) {
    nibbles16_plain(b + 2, out);
    for (int j = 0; j < 32; j++) out[j] = (uint8_t)kIQ4Levels[out[j]];
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return iq4_levels(nibbles16(b + 2)); }
#endif
};

// MXFP4: the doubled e2m1 values (signed, |u| <= 12) times w1 = 2^(e - 128) (e8m0_half: a power of two,
// so w1 * dx is exact but for under- or overflow). Its scale is one E8M0 byte, not a float16: int8.cc
// reads it through kE8M0Scale, below.
struct MXFP4 {
  static constexpr int values = 32, bytes = 17, sub = 32, off = 0;
  static constexpr bool is_signed = true, two = false;
  static constexpr bool nibble = false;   // signed: the dot_i8i8 sums, not int8.cc's sums16
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2) { w1 = e8m0_half(b[0]); w2 = 0; }
  Q8_INLINE void chunk(const uint8_t* b, int, uint8_t* out) {
    nibbles16_plain(b + 1, out);
    for (int j = 0; j < 32; j++) out[j] = (uint8_t)kMXFP4Levels[out[j]];
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int) { return mxfp4_levels(nibbles16(b + 1)); }
#endif
};

// The 32-value types whose block scale is one E8M0 byte at byte 0 (not float16 fields at bytes 0, 2).
template <class B>
inline constexpr bool kE8M0Scale = false;
template <>
inline constexpr bool kE8M0Scale<MXFP4> = true;

// ---- 256-value super-blocks: 8 chunks of 32; sub-blocks of 32 (8 scales) or 16 (16 scales) ---------

// Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks (llama.cpp's unpacking).
Q8_INLINE void k_scales_int(const uint8_t* b, int32_t* sc, int32_t* mn) {
  uint32_t u[3], k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  std::memcpy(u, b + 4, 12);
  uint32_t s[2] = {u[0] & k1, (u[2] & k2) | (((u[0] >> 6) & k3) << 4)};
  uint32_t m[2] = {u[1] & k1, ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4)};
  for (int j = 0; j < 8; j++) sc[j] = (s[j / 4] >> (8 * (j % 4))) & 0xFF, mn[j] = (m[j / 4] >> (8 * (j % 4))) & 0xFF;
}

struct Q4_K {
  static constexpr int values = 256, bytes = 144, sub = 32, off = 0;
  static constexpr bool is_signed = false, two = true;
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2, int32_t* sc, int32_t* mn) {
    w1 = f16_at(b), w2 = -f16_at(b + 2);
    k_scales_int(b, sc, mn);
  }
  Q8_INLINE void chunk(const uint8_t* b, int c, uint8_t* out) {
    const uint8_t* qs = b + 16 + 32 * (c / 2);
    for (int i = 0; i < 32; i++) out[i] = c % 2 ? qs[i] >> 4 : qs[i] & 15;
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int c) { return bits_of(load32(b + 16 + 32 * (c / 2)), 4 * (c % 2), 15); }
#endif
};

struct Q5_K {
  static constexpr int values = 256, bytes = 176, sub = 32, off = 0;
  static constexpr bool is_signed = false, two = true;
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2, int32_t* sc, int32_t* mn) {
    w1 = f16_at(b), w2 = -f16_at(b + 2);
    k_scales_int(b, sc, mn);
  }
  Q8_INLINE void chunk(const uint8_t* b, int c, uint8_t* out) {
    const uint8_t* qs = b + 48 + 32 * (c / 2);
    for (int i = 0; i < 32; i++) out[i] = (c % 2 ? qs[i] >> 4 : qs[i] & 15) | (((b[16 + i] >> c) & 1) << 4);
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int c) {
    __m256i hi = _mm256_slli_epi16(bits_of(load32(b + 16), c, 1), 4);
    return _mm256_or_si256(bits_of(load32(b + 48 + 32 * (c / 2)), 4 * (c % 2), 15), hi);
  }
#endif
};

struct Q6_K {
  static constexpr int values = 256, bytes = 210, sub = 16, off = 32;
  static constexpr bool is_signed = false, two = false;
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2, int32_t* sc, int32_t*) {
    w1 = f16_at(b + 208), w2 = 0;
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)b[192 + j];
  }
  // chunk c: half h = c / 4 of the super-block, 32 values at 32 (c % 4) of it.
  Q8_INLINE void chunk(const uint8_t* b, int c, uint8_t* out) {
    int h = c / 4, cc = c % 4;
    const uint8_t* ql = b + 64 * h + 32 * (cc % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int i = 0; i < 32; i++) out[i] = ((ql[i] >> (4 * (cc / 2))) & 15) | (((qh[i] >> (2 * cc)) & 3) << 4);
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int c) {
    int h = c / 4, cc = c % 4;
    __m256i lo = bits_of(load32(b + 64 * h + 32 * (cc % 2)), 4 * (cc / 2), 15);
    return _mm256_or_si256(lo, _mm256_slli_epi16(bits_of(load32(b + 128 + 32 * h), 2 * cc, 3), 4));
  }
#endif
};

struct Q2_K {
  static constexpr int values = 256, bytes = 84, sub = 16, off = 0;
  static constexpr bool is_signed = false, two = true;
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2, int32_t* sc, int32_t* mn) {
    w1 = f16_at(b + 80), w2 = -f16_at(b + 82);
    for (int j = 0; j < 16; j++) sc[j] = b[j] & 15, mn[j] = b[j] >> 4;
  }
  Q8_INLINE void chunk(const uint8_t* b, int c, uint8_t* out) {
    const uint8_t* qs = b + 16 + 32 * (c / 4);
    for (int i = 0; i < 32; i++) out[i] = (qs[i] >> (2 * (c % 4))) & 3;
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int c) { return bits_of(load32(b + 16 + 32 * (c / 4)), 2 * (c % 4), 3); }
#endif
};

struct Q3_K {
  static constexpr int values = 256, bytes = 110, sub = 16, off = 4;
  static constexpr bool is_signed = false, two = false;
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2, int32_t* sc, int32_t*) {
    w1 = f16_at(b + 108), w2 = 0;
    uint32_t a[3], k2 = 0x0f0f0f0f, k1 = 0x03030303;       // as blocks.h's BQ3_K
    std::memcpy(a, b + 96, 12);
    uint32_t w[4] = {(a[0] & k2) | (((a[2] >> 0) & k1) << 4), (a[1] & k2) | (((a[2] >> 2) & k1) << 4),
                     ((a[0] >> 4) & k2) | (((a[2] >> 4) & k1) << 4), ((a[1] >> 4) & k2) | (((a[2] >> 6) & k1) << 4)};
    for (int j = 0; j < 16; j++) sc[j] = (int32_t)((w[j / 4] >> (8 * (j % 4))) & 0xFF) - 32;
  }
  // u = the 2 low bits | the hmask bit << 2: the value is u - 4.
  Q8_INLINE void chunk(const uint8_t* b, int c, uint8_t* out) {
    const uint8_t* qs = b + 32 + 32 * (c / 4);
    for (int i = 0; i < 32; i++) out[i] = ((qs[i] >> (2 * (c % 4))) & 3) | (((b[i] >> c) & 1) << 2);
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int c) {
    __m256i hi = _mm256_slli_epi16(bits_of(load32(b), c, 1), 2);
    return _mm256_or_si256(bits_of(load32(b + 32 + 32 * (c / 4)), 2 * (c % 4), 3), hi);
  }
#endif
};

struct IQ4_XS {
  static constexpr int values = 256, bytes = 136, sub = 32, off = 0;
  static constexpr bool is_signed = true, two = false;
  Q8_INLINE void scales(const uint8_t* b, float& w1, float& w2, int32_t* sc, int32_t*) {
    w1 = f16_at(b), w2 = 0;
    uint32_t lo4; std::memcpy(&lo4, b + 4, 4);
    uint32_t hi2 = b[2] | (b[3] << 8);
    for (int s = 0; s < 8; s++) sc[s] = (int32_t)(((lo4 >> (4 * s)) & 0xF) | (((hi2 >> (2 * s)) & 3) << 4)) - 32;
  }
  Q8_INLINE void chunk(const uint8_t* b, int c, uint8_t* out) {
    nibbles16_plain(b + 8 + 16 * c, out);
    for (int j = 0; j < 32; j++) out[j] = (uint8_t)kIQ4Levels[out[j]];
  }
#if defined(STRATA_Q8_AVX2)
  Q8_INLINE __m256i vchunk(const uint8_t* b, int c) { return iq4_levels(nibbles16(b + 8 + 16 * c)); }
#endif
};

}  // namespace i8
}  // namespace strata
