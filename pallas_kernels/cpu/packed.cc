// The packed layout (packed.h): packing at load, and the int8 kernel that reads it.
#include "packed.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_blocks.h"

namespace strata {
namespace {

constexpr int T = 8;   // rows a tile: the 8 lanes

// A packed type: its GGUF block (int8_blocks.h), the float16 scales a block (d, and m), where the quants
// start in a GGUF block, and whether they are nibbles (and IQ4_NL's levels) or bytes.
template <int32_t Code, class Block, int Scales, int QsAt, bool Nibbles, bool Levels = false>
struct Packed {
  using B = Block;
  static constexpr int32_t qtype = Code;
  static constexpr int scales = Scales, qs_at = QsAt, qbytes = Nibbles ? 16 : 32;
  static constexpr bool nibbles = Nibbles, levels = Levels;
  static constexpr int head = 2 * T * Scales;              // bytes of the 8 rows' scales in a packed unit
  static constexpr int unit = T * Block::bytes;            // bytes of a packed unit (= 8 GGUF blocks)
  static_assert(head + T * qbytes == unit);
};
using PQ4_0 = Packed<Q4_0, i8::Q4_0, 1, 2, true>;
using PQ4_1 = Packed<Q4_1, i8::Q4_1, 2, 4, true>;
using PIQ4_NL = Packed<IQ4_NL, i8::IQ4_NL, 1, 2, true, true>;
using PQ8_0 = Packed<Q8_0, i8::Q8_0, 1, 2, false>;

template <class P>
void pack(const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst) {
  using B = typename P::B;
  int64_t nunits = row_bytes / B::bytes, whole = n / T * T;
  for (int64_t t = 0; t < whole; t += T) {
    for (int64_t b = 0; b < nunits; b++) {
      uint8_t* u = dst + t * row_bytes + b * P::unit;
      for (int r = 0; r < T; r++) {
        const uint8_t* blk = src + (t + r) * row_bytes + b * B::bytes;
        for (int s = 0; s < P::scales; s++) std::memcpy(u + 2 * T * s + 2 * r, blk + 2 * s, 2);
        for (int g = 0; g < P::qbytes / 4; g++) std::memcpy(u + P::head + 32 * g + 4 * r, blk + P::qs_at + 4 * g, 4);
      }
    }
  }
  std::memcpy(dst + whole * row_bytes, src + whole * row_bytes, (n - whole) * row_bytes);
}

// Packed unit b of a tile times every x row into acc[m]: the integer sums of int8.cc's tile_direct
// (exact, any order) and add_unit's float operations, so the same bits.
template <class P, bool One>
Q8_INLINE void unit_packed(const uint8_t* u, int64_t b, const Q8RowSet& xs, f32x8* acc) {
  using B = typename P::B;
#if defined(STRATA_Q8_AVX2)
  const f32x8 w1{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)u))};
  const f32x8 w2{P::scales == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(u + 16))) : _mm256_setzero_ps()};
  const uint8_t* q = u + P::head;
  __m256i v[8];                  // v[g] pairs with x bytes 4g..4g+3, row r in lane r
  if constexpr (P::nibbles) {
    const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
      __m256i p = load32(q + 32 * g);
      v[g] = _mm256_and_si256(p, low), v[g + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      if (P::levels) v[g] = i8::iq4_levels(v[g]), v[g + 4] = i8::iq4_levels(v[g + 4]);
    }
  } else {
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) v[g] = load32(q + 32 * g);
  }
  __m256i va[8];                 // signed types: |v|, with v's sign moved onto x (dot_i8i8's trick)
  if constexpr (B::is_signed) {
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) va[g] = _mm256_sign_epi8(v[g], v[g]);
  }
  for (int64_t m = 0; m < (One ? 1 : xs.m); m++) {
    const Q8Row& x = xs.x[m];
    const int8_t* xq = x.q + 32 * b;
    int32_t x4[8];
    std::memcpy(x4, xq, 32);
    __m256i S;
    if constexpr (B::is_signed) {
      S = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++)
        S = _mm256_add_epi32(S, dot_u8i8(va[g], _mm256_sign_epi8(_mm256_set1_epi32(x4[g]), v[g])));
    } else {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
      S = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        S = _mm256_dpbusd_epi32(S, v[g], _mm256_set1_epi32(x4[g]));
#else
        S = _mm256_dpbusd_avx_epi32(S, v[g], _mm256_set1_epi32(x4[g]));
#endif
      }
#else
      // Nibbles (<= 15) times |q| <= 127: each int16 of a maddubs is at most 2 * 15 * 127, and the sum of
      // 8 of them 30,480 < 32,768: added as int16, then one madd into int32 (exact).
      // (added as a tree: a shorter dependency chain than one running sum, the same exact integers)
      __m256i p[8];
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) p[g] = _mm256_maddubs_epi16(v[g], _mm256_set1_epi32(x4[g]));
      __m256i s16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                     _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
      S = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
    }
    if (B::off) S = _mm256_sub_epi32(S, _mm256_set1_epi32(B::off * x.s32[b]));
    f32x8 dx = splat8(x.d[b]);
    acc[m] = fma8(mul8(w1, dx), cvt8(S), acc[m]);
    if (B::two) acc[m] = fma8(mul8(w2, dx), cvt8(_mm256_set1_epi32(x.s32[b])), acc[m]);
  }
#else
  alignas(32) float w1[T], w2[T];
  for (int r = 0; r < T; r++) {
    w1[r] = f16_at(u + 2 * r);
    w2[r] = P::scales == 2 ? f16_at(u + 16 + 2 * r) : 0.0f;
  }
  const uint8_t* q = u + P::head;
  int8_t vals[T][32];                // row r's 32 values as the GGUF block's chunk() gives them
  for (int r = 0; r < T; r++)
    for (int g = 0; g < P::qbytes / 4; g++)
      for (int t = 0; t < 4; t++) {
        uint8_t byte = q[32 * g + 4 * r + t];
        if (P::nibbles) {
          uint8_t lo = byte & 15, hi = byte >> 4;
          vals[r][4 * g + t] = P::levels ? kIQ4Levels[lo] : (int8_t)lo;
          vals[r][16 + 4 * g + t] = P::levels ? kIQ4Levels[hi] : (int8_t)hi;
        } else {
          vals[r][4 * g + t] = (int8_t)byte;
        }
      }
  for (int64_t m = 0; m < (One ? 1 : xs.m); m++) {
    const Q8Row& x = xs.x[m];
    const int8_t* xq = x.q + 32 * b;
    alignas(32) int32_t int1[T], int2[T];
    for (int r = 0; r < T; r++) {
      int32_t s = 0;
      for (int i = 0; i < 32; i++) s += (int32_t)vals[r][i] * xq[i];
      int1[r] = s - B::off * x.s32[b], int2[r] = x.s32[b];
    }
    f32x8 dx = splat8(x.d[b]);
    acc[m] = fma8(mul8(load8(w1), dx), cvt8(int1), acc[m]);
    if (B::two) acc[m] = fma8(mul8(load8(w2), dx), cvt8(int2), acc[m]);
  }
#endif
}

template <class P>
void rows_packed(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n, const Q8RowSet& xs, int64_t n0,
                 int64_t n1) {
  using B = typename P::B;
  thread_local std::vector<f32x8> acc;
  if ((int64_t)acc.size() < xs.m) acc.resize(xs.m);
  int64_t nunits = k / B::values, whole = n / T * T;
  // Units of work start at multiples of 8 rows (matmul.cc's weight_rows_per_tile); a tile cut by one
  // anyway is computed whole and only its rows in [n0, n1) are written.
  for (int64_t t = n0 / T * T; t < std::min(n1, whole); t += T) {
    const uint8_t* tile = w + t * row_bytes;
    std::fill(acc.begin(), acc.begin() + xs.m, zero8());
    f32x8 one = zero8();            // M = 1 (decode): the accumulator in a register
    for (int64_t b = 0; b < nunits; b++) {
      // A tile is one run of bytes: the hardware prefetcher follows it; this keeps it ahead at the start
      // of each tile's units too (a prefetch never faults past the matrix's end).
      const uint8_t* ahead = tile + (b + 4) * P::unit;
#pragma GCC unroll 8
      for (int o = 0; o < P::unit; o += 64) __builtin_prefetch(ahead + o, 0, 3);
      if (xs.m == 1) unit_packed<P, true>(tile + b * P::unit, b, xs, &one);
      else unit_packed<P, false>(tile + b * P::unit, b, xs, acc.data());
    }
    if (xs.m == 1) acc[0] = one;
    for (int64_t m = 0; m < xs.m; m++) {
      alignas(32) float out[T];
      store8(out, acc[m]);
      for (int64_t r = std::max(n0, t); r < std::min(n1, t + T); r++) xs.y[m][r] = out[r - t];
    }
  }
  if (n1 > whole) int8_fn(P::qtype)(w, row_bytes, k, xs, std::max(n0, whole), n1);   // the rows left as they were
}

}  // namespace

bool packs(int32_t qtype) { return packed_fn(qtype) != nullptr; }

void pack_rows(int32_t qtype, const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst) {
  switch (qtype) {
    case Q4_0: return pack<PQ4_0>(src, n, row_bytes, dst);
    case Q4_1: return pack<PQ4_1>(src, n, row_bytes, dst);
    case Q8_0: return pack<PQ8_0>(src, n, row_bytes, dst);
    case IQ4_NL: return pack<PIQ4_NL>(src, n, row_bytes, dst);
    default: std::memcpy(dst, src, n * row_bytes);
  }
}

PackedFn packed_fn(int32_t qtype) {
  switch (qtype) {
    case Q4_0: return rows_packed<PQ4_0>;
    case Q4_1: return rows_packed<PQ4_1>;
    case Q8_0: return rows_packed<PQ8_0>;
    case IQ4_NL: return rows_packed<PIQ4_NL>;
    default: return nullptr;
  }
}

}  // namespace strata
