// Per-type block dequantization (see dequant.h). Each block function mirrors its body in
// pallas_kernels/bodies.py; the index comments translate "value j" into "lane of vector v".
#include "dequant.h"

namespace strata {
namespace {

struct BQ8_0 {                       // d, qs[32] int8
  static constexpr int values = 32, bytes = 34;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b);
    store16(o, to_f32(i8_lanes(b + 2)) * d);
    store16(o + 16, to_f32(i8_lanes(b + 18)) * d);
  }
};

struct BQ4_0 {                       // d, qs[16]: value j is nibble (j / 16) of byte j % 16
  static constexpr int values = 32, bytes = 18;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b);
    i32x16 q = u8_lanes(b + 2);
    store16(o, d * to_f32((q & 0xF) - 8));
    store16(o + 16, d * to_f32((q >> 4) - 8));
  }
};

struct BQ4_1 {                       // d, m, qs[16]
  static constexpr int values = 32, bytes = 20;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b), m = f16_at(b + 2);
    i32x16 q = u8_lanes(b + 4);
    store16(o, (d * to_f32(q & 0xF)) + m);
    store16(o + 16, (d * to_f32(q >> 4)) + m);
  }
};

// Five-bit values: the nibble as in Q4, bit j of the little-endian uint32 qh on top.
static inline void q5_bits(const uint8_t* qh_at, const uint8_t* qs_at, i32x16& lo, i32x16& hi) {
  uint32_t qh; std::memcpy(&qh, qh_at, 4);
  i32x16 q = u8_lanes(qs_at);
  lo = (q & 0xF) | (bit_lanes(qh, 0) << 4);
  hi = (q >> 4) | (bit_lanes(qh, 16) << 4);
}

struct BQ5_0 {                       // d, qh[4], qs[16]
  static constexpr int values = 32, bytes = 22;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b);
    i32x16 lo, hi; q5_bits(b + 2, b + 6, lo, hi);
    store16(o, d * to_f32(lo - 16));
    store16(o + 16, d * to_f32(hi - 16));
  }
};

struct BQ5_1 {                       // d, m, qh[4], qs[16]
  static constexpr int values = 32, bytes = 24;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b), m = f16_at(b + 2);
    i32x16 lo, hi; q5_bits(b + 4, b + 8, lo, hi);
    store16(o, (d * to_f32(lo)) + m);
    store16(o + 16, (d * to_f32(hi)) + m);
  }
};

struct BIQ4_NL {                     // d, qs[16] -> indices into the 16 levels
  static constexpr int values = 32, bytes = 18;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b);
    i32x16 q = u8_lanes(b + 2);
    store16(o, d * to_f32(lookup16(kIQ4Levels, q & 0xF)));
    store16(o + 16, d * to_f32(lookup16(kIQ4Levels, q >> 4)));
  }
};

// ---- 256-value super-blocks ---------------------------------------------------------------------
// Vector v holds values j = 16 v + lane; so j / 16 = v, j % 32 = 16 (v % 2) + lane, j / 32 = v / 2.

struct BQ2_K {                       // scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
  static constexpr int values = 256, bytes = 84;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int v = 0; v < 16; v++) {
      float dl = d * float(b[v] & 0xF);
      float ml = dmin * float(b[v] >> 4);
      int half = v / 8, shift = 2 * ((v / 2) % 4);
      i32x16 q = (u8_lanes(b + 16 + half * 32 + 16 * (v % 2)) >> shift) & 3;
      store16(o + 16 * v, (dl * to_f32(q)) - ml);
    }
  }
};

struct BQ3_K {                       // hmask[32], qs[64], scales[12] (6-bit, offset 32), d
  static constexpr int values = 256, bytes = 110;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b + 108);
    for (int v = 0; v < 16; v++) {
      int low = (b[96 + v % 8] >> (4 * (v / 8))) & 0xF;
      int high = (b[104 + v % 4] >> (2 * (v / 4))) & 3;
      float dl = d * float((low | (high << 4)) - 32);
      int half = v / 8, shift = 2 * ((v / 2) % 4), l0 = 16 * (v % 2);
      i32x16 ql = (u8_lanes(b + 32 + half * 32 + l0) >> shift) & 3;
      i32x16 hbit = ((u8_lanes(b + l0) >> (v / 2)) & 1) ^ 1;   // the -4 applies where the mask bit is 0
      store16(o + 16 * v, dl * to_f32(ql - (hbit << 2)));
    }
  }
};

// Q4_K / Q5_K: 6-bit scale and min of sub-block s (32 values) from the 12 packed bytes.
static inline void k_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
  int lo = s % 4, dq = sc[lo], mq = sc[4 + lo], md = sc[8 + lo];
  if (s < 4) {
    scale = dq & 0x3F; min = mq & 0x3F;
  } else {
    scale = (md & 0xF) | ((dq >> 2) & 0x30); min = (md >> 4) | ((mq >> 2) & 0x30);
  }
}

struct BQ4_K {                       // d, dmin, scales[12], qs[128]
  static constexpr int values = 256, bytes = 144;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b), dmin = f16_at(b + 2);
    for (int s = 0; s < 8; s++) {    // sub-block s: values 32 s .. 32 s + 31
      int sc, mn; k_scale_min(b + 4, s, sc, mn);
      float ds = d * float(sc), dm = dmin * float(mn);
      const uint8_t* qs = b + 16 + (s / 2) * 32;
      int shift = 4 * (s % 2);
      for (int h = 0; h < 2; h++) {
        i32x16 q = (u8_lanes(qs + 16 * h) >> shift) & 0xF;
        store16(o + 32 * s + 16 * h, (ds * to_f32(q)) - dm);
      }
    }
  }
};

struct BQ5_K {                       // d, dmin, scales[12], qh[32], qs[128]
  static constexpr int values = 256, bytes = 176;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b), dmin = f16_at(b + 2);
    for (int s = 0; s < 8; s++) {
      int sc, mn; k_scale_min(b + 4, s, sc, mn);
      float ds = d * float(sc), dm = dmin * float(mn);
      const uint8_t* qs = b + 48 + (s / 2) * 32;
      int shift = 4 * (s % 2);
      for (int h = 0; h < 2; h++) {
        i32x16 ql = (u8_lanes(qs + 16 * h) >> shift) & 0xF;
        i32x16 qh = (u8_lanes(b + 16 + 16 * h) >> s) & 1;
        store16(o + 32 * s + 16 * h, (ds * to_f32(ql | (qh << 4))) - dm);
      }
    }
  }
};

struct BQ6_K {                       // ql[128], qh[64], scales[16] (int8), d
  static constexpr int values = 256, bytes = 210;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b + 208);
    for (int v = 0; v < 16; v++) {   // r = j % 128 = 16 (v % 8) + lane
      float ds = d * float(int8_t(b[192 + v]));
      int half = v / 8, vr = v % 8;
      i32x16 ql = (u8_lanes(b + half * 64 + 16 * (vr % 4)) >> (4 * (vr / 4))) & 0xF;
      i32x16 qh = (u8_lanes(b + 128 + half * 32 + 16 * (vr % 2)) >> (2 * (vr / 2))) & 3;
      store16(o + 16 * v, ds * to_f32((ql | (qh << 4)) - 32));
    }
  }
};

struct BIQ4_XS {                     // d, scales_h (u16), scales_l[4], qs[128]
  static constexpr int values = 256, bytes = 136;
  static void block(const uint8_t* b, float* o) {
    float d = f16_at(b);
    for (int s = 0; s < 8; s++) {
      int low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
      int high = (b[2 + s / 4] >> (2 * (s % 4))) & 3;
      float dl = d * float((low | (high << 4)) - 32);
      i32x16 q = u8_lanes(b + 8 + 16 * s);
      store16(o + 32 * s, dl * to_f32(lookup16(kIQ4Levels, q & 0xF)));
      store16(o + 32 * s + 16, dl * to_f32(lookup16(kIQ4Levels, q >> 4)));
    }
  }
};

template <class B>
void dequant_blocks(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  const uint8_t* b = row + (v0 / B::values) * B::bytes;
  for (int64_t i = 0; i < nv; i += B::values, b += B::bytes, out += B::values) B::block(b, out);
}

// ---- plain floats: any count, so a scalar tail ---------------------------------------------------

void dequant_f32(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  std::memcpy(out, row + 4 * v0, 4 * nv);
}

void dequant_f16(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  const uint8_t* p = row + 2 * v0;
  int64_t i = 0;
  for (; i + 16 <= nv; i += 16) store16(out + i, halves16(p + 2 * i));
  for (; i < nv; i++) out[i] = f16_at(p + 2 * i);
}

void dequant_bf16(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  const uint8_t* p = row + 2 * v0;
  for (int64_t i = 0; i < nv; i++) {
    uint16_t h; std::memcpy(&h, p + 2 * i, 2);
    uint32_t bits = uint32_t(h) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

template <class B>
constexpr TypeInfo info() { return {dequant_blocks<B>, B::values, B::bytes}; }

}  // namespace

TypeInfo type_info(int32_t qtype) {
  switch (qtype) {
    case F32: return {dequant_f32, 1, 4};
    case F16: return {dequant_f16, 1, 2};
    case BF16: return {dequant_bf16, 1, 2};
    case Q8_0: return info<BQ8_0>();
    case Q4_0: return info<BQ4_0>();
    case Q4_1: return info<BQ4_1>();
    case Q5_0: return info<BQ5_0>();
    case Q5_1: return info<BQ5_1>();
    case IQ4_NL: return info<BIQ4_NL>();
    case Q2_K: return info<BQ2_K>();
    case Q3_K: return info<BQ3_K>();
    case Q4_K: return info<BQ4_K>();
    case Q5_K: return info<BQ5_K>();
    case Q6_K: return info<BQ6_K>();
    case IQ4_XS: return info<BIQ4_XS>();
    default: return {nullptr, 0, 0};
  }
}

}  // namespace strata
