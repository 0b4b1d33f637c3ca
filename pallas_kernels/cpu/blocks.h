// One struct a GGUF block type: its geometry and `block(b, f, put)`, which dequantizes the block at
// b and hands vector i (values 16 i .. 16 i + 15 of the block) to put(i, w). put stores the vector
// (dequant.cc) or multiplies it straight into accumulators (direct.cc): the same floats either way.
//
// Each block mirrors its body in pallas_kernels/bodies.py, value for value as gguf.quants computes
// it. Most types build a table first: for each possible quant value q (16, or 32 with a fifth bit)
// the float the reference computes for it, with the reference's own operations (e.g. (d * q) + m),
// then pick each lane's entry by its bits (simd.h: pick16, pick32): the same floats as computing each
// value, in one permute a vector instead of mask, convert, multiply and add. Q8_0 and Q6_K have too
// many levels for a table and compute each value. Layouts: llama.cpp's ggml-common.h.
//
// Tables of the form (s * q) + m use one FMA: s is a float16 (11 significant bits) or a float16 times
// an integer of at most 6 bits (17 bits, itself exact), and q has at most 5 bits, so s * q has at most
// 22 significant bits and is exact in float32; rounding (s * q) + m once is then the reference's
// round(round(s * q) + m). Likewise for (s * q) - m. inf and NaN scales propagate the same way.
//
// 32-value types list their float16 fields (nf, fields): block_fields converts 8 blocks' worth at
// once and block() reads them from f (broadcast loads cost no vector ALU port; converting one half
// and broadcasting it costs three). 256-value types (nf = 0) read their own, once per 256 values.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dequant.h"
#include "simd.h"

#define STRATA_INLINE inline __attribute__((always_inline))

namespace strata {

// kIQ4Levels as floats.
STRATA_INLINE f32x16 levels_iq4() {
  alignas(64) static constexpr float v[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  return load16(v);
}

// kMXFP4Levels as floats.
STRATA_INLINE f32x16 levels_mxfp4() {
  alignas(64) static constexpr float v[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  return load16(v);
}

// The 2-bit fields sit at bits 2k of a byte: pick16 reads bits 2k..2k+3, so these tables depend only
// on the low 2 index bits (entry i is the value of q = i & 3).
STRATA_INLINE f32x16 iota4() {
  alignas(64) static constexpr float v[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  return load16(v);
}

// ---- 32-value blocks ----------------------------------------------------------------------------

struct BQ8_0 {                       // d, qs[32] int8
  static constexpr int values = 32, bytes = 34, nf = 1;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float* f, Put&& put) {
    float d = f[0];
    put(0, to_f32(i8_lanes(b + 2)) * d);
    put(1, to_f32(i8_lanes(b + 18)) * d);
  }
};

// 4-bit quants: value j is nibble (j / 16) of byte j % 16 of qs, so the low nibbles of the 16 bytes
// are values 0..15 and the high nibbles 16..31 (pick16 reads 4 index bits).
template <class Put>
STRATA_INLINE void nibbles(const uint8_t* qs, f32x16 table, Put&& put, int first = 0) {
  i32x16 q = u8_lanes(qs);
  put(first, pick16(table, q));
  put(first + 1, pick16(table, q >> 4));
}

struct BQ4_0 {                       // d, qs[16]: d * (q - 8)
  static constexpr int values = 32, bytes = 18, nf = 1;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float* f, Put&& put) {
    nibbles(b + 2, f[0] * (iota16() - 8.0f), put);
  }
};

struct BQ4_1 {                       // d, m, qs[16]: (d * q) + m
  static constexpr int values = 32, bytes = 20, nf = 2;
  static constexpr int fields[2] = {0, 2};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float* f, Put&& put) {
    nibbles(b + 4, fma16(splat(f[0]), iota16(), splat(f[1])), put);
  }
};

struct BIQ4_NL {                     // d, qs[16]: d * level[q]
  static constexpr int values = 32, bytes = 18, nf = 1;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float* f, Put&& put) {
    nibbles(b + 2, f[0] * levels_iq4(), put);
  }
};

// MXFP4: its one-byte E8M0 scale is read by block() (nf = 0: no float16 field for block_fields). Each
// product 2^(e - 128) * level is exact (a power of two times a small integer), as in gguf.quants,
// except where it overflows to inf (e >= 253) the same way there.
struct BMXFP4 {                      // e, qs[16]: 2^(e - 128) * level[q]
  static constexpr int values = 32, bytes = 17, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    nibbles(b + 1, e8m0_half(b[0]) * levels_mxfp4(), put);
  }
};

// Five-bit values: the nibble as in Q4, bit j of the little-endian uint32 qh on top; lo and hi are
// the tables for a clear and a set fifth bit.
template <class Put>
STRATA_INLINE void nibbles5(const uint8_t* qh_at, const uint8_t* qs, f32x16 lo, f32x16 hi, Put&& put) {
  uint32_t qh; std::memcpy(&qh, qh_at, 4);
  i32x16 q = u8_lanes(qs);
  put(0, pick32(lo, hi, q, qh & 0xFFFF));
  put(1, pick32(lo, hi, q >> 4, qh >> 16));
}

struct BQ5_0 {                       // d, qh[4], qs[16]: d * (q - 16)
  static constexpr int values = 32, bytes = 22, nf = 1;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float* f, Put&& put) {
    float d = f[0];
    nibbles5(b + 2, b + 6, d * (iota16() - 16.0f), d * iota16(), put);
  }
};

struct BQ5_1 {                       // d, m, qh[4], qs[16]: (d * q) + m
  static constexpr int values = 32, bytes = 24, nf = 2;
  static constexpr int fields[2] = {0, 2};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float* f, Put&& put) {
    f32x16 d = splat(f[0]), m = splat(f[1]);
    nibbles5(b + 4, b + 8, fma16(d, iota16(), m), fma16(d, iota16() + 16.0f, m), put);
  }
};

// ---- 256-value super-blocks ---------------------------------------------------------------------
// Vector v holds values j = 16 v + lane; so j / 16 = v, j % 32 = 16 (v % 2) + lane, j / 32 = v / 2.

// Super-blocks compute their sub-block scales (16 floats) for all sub-blocks at once into sc and read
// them back by broadcast loads (fields_barrier, below).
STRATA_INLINE void fields_barrier();

struct BQ2_K {                       // scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
  static constexpr int values = 256, bytes = 84, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    alignas(64) float dl[16], ml[16];                          // d * scale, -(dmin * min) of sub-block v
    i32x16 sc = u8_lanes(b);
    store16(dl, to_f32(sc & 0xF) * d);
    store16(ml, to_f32(sc >> 4) * -dmin);
    fields_barrier();
    for (int v = 0; v < 16; v++) {
      int half = v / 8, shift = 2 * ((v / 2) % 4);
      i32x16 q = u8_lanes(b + 16 + half * 32 + 16 * (v % 2)) >> shift;
      put(v, pick16(fma16(splat(dl[v]), iota4(), splat(ml[v])), q));      // (dl * q) - (dmin * min)
    }
  }
};

struct BQ3_K {                       // hmask[32], qs[64], scales[12] (6-bit, offset 32), d
  static constexpr int values = 256, bytes = 110, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    float d = f16_at(b + 108);
    // The 16 6-bit scales: low nibbles from bytes 96..103, two high bits from bytes 104..107 (llama.cpp's
    // unpacking, 4 at a time in 32-bit words).
    uint32_t a[3], k2 = 0x0f0f0f0f, k1 = 0x03030303;
    std::memcpy(a, b + 96, 12);
    uint64_t lo = ((a[0] & k2) | (((a[2] >> 0) & k1) << 4)) | uint64_t((a[1] & k2) | (((a[2] >> 2) & k1) << 4)) << 32;
    uint64_t hi = (((a[0] >> 4) & k2) | (((a[2] >> 4) & k1) << 4)) |
                  uint64_t(((a[1] >> 4) & k2) | (((a[2] >> 6) & k1) << 4)) << 32;
    alignas(64) float dl[16];
    store16(dl, to_f32(u8_lanes_of(lo, hi) - 32) * d);
    fields_barrier();
    for (int v = 0; v < 16; v++) {
      int half = v / 8, shift = 2 * ((v / 2) % 4), l0 = 16 * (v % 2);
      i32x16 ql = u8_lanes(b + 32 + half * 32 + l0) >> shift;
      uint32_t mask = lane_bits(u8_lanes(b + l0), v / 2);     // set: q = ql; clear: q = ql - 4
      f32x16 s = splat(dl[v]);
      put(v, pick32(s * (iota4() - 4.0f), s * iota4(), ql, mask));
    }
  }
};

// Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks (32 values each), unpacked from their 12
// bytes into d * scale (sc[0..7]) and -(dmin * min) (sc[8..15]; negating is exact).
STRATA_INLINE void k_scales(const uint8_t* b, float* sc) {
  uint32_t u[3], k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;   // llama.cpp's unpacking
  std::memcpy(u, b + 4, 12);
  uint32_t s0 = u[0] & k1, s1 = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  uint32_t m0 = u[1] & k1, m1 = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  i32x16 v = u8_lanes_of(s0 | uint64_t(s1) << 32, m0 | uint64_t(m1) << 32);
  store16(sc, times_halves(v, f16_at(b), -f16_at(b + 2)));
}

struct BQ4_K {                       // d, dmin, scales[12], qs[128]: (ds * q) - dm
  static constexpr int values = 256, bytes = 144, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    alignas(64) float sc[16];
    k_scales(b, sc);
    fields_barrier();
    for (int p = 0; p < 4; p++) {    // sub-blocks 2p, 2p + 1: the low, high nibbles of 32 bytes
      i32x16 q0 = u8_lanes(b + 16 + 32 * p), q1 = u8_lanes(b + 32 + 32 * p);
      f32x16 t0 = fma16(splat(sc[2 * p]), iota16(), splat(sc[8 + 2 * p]));
      f32x16 t1 = fma16(splat(sc[2 * p + 1]), iota16(), splat(sc[9 + 2 * p]));
      put(4 * p, pick16(t0, q0));
      put(4 * p + 1, pick16(t0, q1));
      put(4 * p + 2, pick16(t1, q0 >> 4));
      put(4 * p + 3, pick16(t1, q1 >> 4));
    }
  }
};

struct BQ5_K {                       // d, dmin, scales[12], qh[32], qs[128]
  static constexpr int values = 256, bytes = 176, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    alignas(64) float sc[16];
    k_scales(b, sc);
    fields_barrier();
    i32x16 qh[2] = {u8_lanes(b + 16), u8_lanes(b + 32)};       // bit s: the fifth bit of sub-block s
    for (int p = 0; p < 4; p++) {
      i32x16 q[2] = {u8_lanes(b + 48 + 32 * p), u8_lanes(b + 64 + 32 * p)};
      for (int o = 0; o < 2; o++) {  // sub-block s = 2p + o
        int s = 2 * p + o;
        f32x16 ds = splat(sc[s]), dm = splat(sc[8 + s]);
        f32x16 lo = fma16(ds, iota16(), dm), hi = fma16(ds, iota16() + 16.0f, dm);
        for (int h = 0; h < 2; h++) put(2 * s + h, pick32(lo, hi, o ? q[h] >> 4 : q[h], lane_bits(qh[h], s)));
      }
    }
  }
};

struct BQ6_K {                       // ql[128], qh[64], scales[16] (int8), d
  static constexpr int values = 256, bytes = 210, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    alignas(64) float ds[16];
    store16(ds, to_f32(i8_lanes(b + 192)) * f16_at(b + 208));
    fields_barrier();
    for (int half = 0; half < 2; half++) {
      const uint8_t* ql = b + half * 64;
      const uint8_t* qh = b + 128 + half * 32;
      i32x16 h2[2] = {u8_lanes(qh), u8_lanes(qh + 16)};
      i32x16 l4[4] = {u8_lanes(ql), u8_lanes(ql + 16), u8_lanes(ql + 32), u8_lanes(ql + 48)};
      for (int vr = 0; vr < 8; vr++) {   // r = j % 128 = 16 vr + lane
        int v = 8 * half + vr;
        i32x16 lo = (l4[vr % 4] >> (4 * (vr / 4))) & 0xF;
        i32x16 hi = (h2[vr % 2] >> (2 * (vr / 2))) & 3;
        put(v, to_f32((lo | (hi << 4)) - 32) * ds[v]);
      }
    }
  }
};

struct BIQ4_XS {                     // d, scales_h (u16), scales_l[4], qs[128]
  static constexpr int values = 256, bytes = 136, nf = 0;
  static constexpr int fields[1] = {0};
  template <class Put>
  STRATA_INLINE static void block(const uint8_t* b, const float*, Put&& put) {
    uint64_t ls = 0;                 // the 8 6-bit scales (offset 32) as bytes
    uint32_t lo4; std::memcpy(&lo4, b + 4, 4);
    uint32_t hi2 = b[2] | (b[3] << 8);
    for (int s = 0; s < 8; s++) ls |= uint64_t(((lo4 >> (4 * s)) & 0xF) | (((hi2 >> (2 * s)) & 3) << 4)) << (8 * s);
    alignas(64) float dl[16];
    store16(dl, to_f32(u8_lanes_of(ls, 0) - 32) * f16_at(b));
    fields_barrier();
    for (int s = 0; s < 8; s++)      // sub-block s: the low then the high nibbles of qs[16 s .. 16 s + 15]
      nibbles(b + 8 + 16 * s, dl[s] * levels_iq4(), put, 2 * s);
  }
};

// ---- driving them -------------------------------------------------------------------------------

// Blocks a group: a chunk of 256 values (matmul.cc) is 8 blocks of 32.
constexpr int kGroup = 8;

// The float16 fields of n <= kGroup blocks of B as floats: f[i * nf + k] is field k of block i.
template <class B>
STRATA_INLINE void block_fields(const uint8_t* b, int n, float* f) {
  if constexpr (B::nf == 0) return;
#if defined(__AVX512VBMI__)
  if (B::fields[0] == 0 && (B::nf == 1 || B::fields[1] == 2) && (kGroup - 1) * B::bytes + 4 <= 256) {
    // The n <= 8 blocks' leading fields (2 or 4 bytes each) picked out of their bytes by byte permutes
    // over two 128-byte windows (a gather of 8 dwords costs AMD's cores ~12 cycles: a third of a Q4_1
    // product at one row). Field byte j of block i is byte i * bytes + j of b. Loads past the n blocks'
    // bytes are masked off, so nothing past them is read (or can fault).
    constexpr int per = 2 * B::nf;
    const int span = n * B::bytes;
    alignas(64) static const uint8_t idx[64] = {
#define S_(i) (uint8_t)((i) / per < kGroup ? (i) / per * B::bytes + (i) % per : 0)
        S_(0), S_(1), S_(2), S_(3), S_(4), S_(5), S_(6), S_(7), S_(8), S_(9), S_(10), S_(11), S_(12), S_(13),
        S_(14), S_(15), S_(16), S_(17), S_(18), S_(19), S_(20), S_(21), S_(22), S_(23), S_(24), S_(25), S_(26),
        S_(27), S_(28), S_(29), S_(30), S_(31)};
#undef S_
    auto part = [&](int at) {        // bytes [at, at + 64) of the group, zeros past its end
      int have = span - at;
      if (have >= 64) return _mm512_loadu_si512(b + at);
      return _mm512_maskz_loadu_epi8(have <= 0 ? 0 : (1ull << have) - 1, b + at);
    };
    const __m512i i = _mm512_load_si512(idx);
    __m512i dw = _mm512_permutex2var_epi8(part(0), i, part(64));
    if (span > 128) dw = _mm512_mask_blend_epi8(_mm512_movepi8_mask(i), dw,
                                                          _mm512_permutex2var_epi8(part(128), i, part(192)));
    if constexpr (B::nf == 1) _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm512_castsi512_si128(dw)));
    else _mm512_storeu_ps(f, _mm512_cvtph_ps(_mm512_castsi512_si256(dw)));
    return;
  }
#endif
#if defined(__AVX512F__)
  if (n == kGroup && B::fields[0] == 0 && (B::nf == 1 || B::fields[1] == 2)) {
    // One gather of the dword at each block's start (its fields: 2 or 4 bytes) and one conversion.
    __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(B::bytes));
    __m256i dw = _mm256_i32gather_epi32((const int*)b, at, 1);
    if constexpr (B::nf == 1) _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dw)));
    else _mm512_storeu_ps(f, _mm512_cvtph_ps(dw));
    return;
  }
#endif
  for (int i = 0; i < n; i++)
    for (int k = 0; k < B::nf; k++) f[i * B::nf + k] = f16_at(b + i * B::bytes + B::fields[k]);
}

// Keeps the compiler from forwarding f's floats through registers (it would broadcast them with
// permutes, on the vector ports the dequantization needs); reading them back is a broadcast load.
STRATA_INLINE void fields_barrier() { asm volatile("" ::: "memory"); }

}  // namespace strata
