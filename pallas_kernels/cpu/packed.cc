// The packed layout (packed.h): packing at load, and the int8 kernel that reads it.
#include "packed.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_blocks.h"

namespace strata {
namespace {

constexpr int T = 8;   // rows a tile: the 8 lanes

// The nibbles' meaning: the value itself, IQ4_NL's levels or MXFP4's (kIQ4Levels, kMXFP4Levels).
enum Levels { kPlain, kIQ4, kMXFP4 };

// A packed type: its GGUF block (int8_blocks.h), the scales a block (float16 d, and m; or MXFP4's one
// E8M0 byte: ScaleBytes 1), where the quants start in a GGUF block, and whether they are nibbles (and
// whose levels) or bytes.
template <int32_t Code, class Block, int Scales, int QsAt, bool Nibbles, Levels Lv = kPlain, int ScaleBytes = 2>
struct Packed {
  using B = Block;
  static constexpr int32_t qtype = Code;
  static constexpr int scales = Scales, qs_at = QsAt, qbytes = Nibbles ? 16 : 32, scale_bytes = ScaleBytes;
  static constexpr bool nibbles = Nibbles, levels = Lv != kPlain, e8m0 = ScaleBytes == 1;
  static constexpr Levels lv = Lv;
  static constexpr int head = ScaleBytes * T * Scales;     // bytes of the 8 rows' scales in a packed unit
  static constexpr int unit = T * Block::bytes;            // bytes of a packed unit (= 8 GGUF blocks)
  static_assert(head + T * qbytes == unit);
};
using PQ4_0 = Packed<Q4_0, i8::Q4_0, 1, 2, true>;
using PQ4_1 = Packed<Q4_1, i8::Q4_1, 2, 4, true>;
using PIQ4_NL = Packed<IQ4_NL, i8::IQ4_NL, 1, 2, true, kIQ4>;
using PQ8_0 = Packed<Q8_0, i8::Q8_0, 1, 2, false>;
using PMXFP4 = Packed<MXFP4, i8::MXFP4, 1, 1, true, kMXFP4, 1>;   // [8 x E8M0 e] [quants]

// A nibble's value in P's levels (the scalar build).
template <class P>
inline int8_t level_of(uint8_t q) {
  return P::lv == kIQ4 ? kIQ4Levels[q] : P::lv == kMXFP4 ? kMXFP4Levels[q] : (int8_t)q;
}

template <class P>
void pack(const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst) {
  using B = typename P::B;
  int64_t nunits = row_bytes / B::bytes, whole = n / T * T;
  for (int64_t t = 0; t < whole; t += T) {
    for (int64_t b = 0; b < nunits; b++) {
      uint8_t* u = dst + t * row_bytes + b * P::unit;
      for (int r = 0; r < T; r++) {
        const uint8_t* blk = src + (t + r) * row_bytes + b * B::bytes;
        for (int s = 0; s < P::scales; s++)
          std::memcpy(u + P::scale_bytes * (T * s + r), blk + P::scale_bytes * s, P::scale_bytes);
        for (int g = 0; g < P::qbytes / 4; g++) std::memcpy(u + P::head + 32 * g + 4 * r, blk + P::qs_at + 4 * g, 4);
      }
    }
  }
  std::memcpy(dst + whole * row_bytes, src + whole * row_bytes, (n - whole) * row_bytes);
}

#if defined(STRATA_Q8_AVX2)
// A packed unit's 8 rows in registers: v[g] pairs with x bytes 4g..4g+3 (row r in lane r), and for the
// signed types |v| (v's sign goes onto x: dot_i8i8's trick); the rows' float scales.
template <class P>
struct Unpacked {
  __m256i v[8], va[8];
  f32x8 w1, w2;
};

template <class P>
Q8_INLINE void unpack_unit(const uint8_t* u, Unpacked<P>& o) {
  if constexpr (P::e8m0) {          // the 8 rows' exponent bytes -> e8m0_half's bits (int8.cc's scales8)
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)u));
    __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);          // e = 0, 1
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    o.w1 = f32x8{_mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)))};
    o.w2 = zero8();
  } else {
    o.w1 = f32x8{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)u))};
    o.w2 = f32x8{P::scales == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(u + 16))) : _mm256_setzero_ps()};
  }
  const uint8_t* q = u + P::head;
  if constexpr (P::nibbles) {
    const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
      __m256i p = load32(q + 32 * g);
      o.v[g] = _mm256_and_si256(p, low), o.v[g + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      if constexpr (P::lv == kIQ4) o.v[g] = i8::iq4_levels(o.v[g]), o.v[g + 4] = i8::iq4_levels(o.v[g + 4]);
      if constexpr (P::lv == kMXFP4) o.v[g] = i8::mxfp4_levels(o.v[g]), o.v[g + 4] = i8::mxfp4_levels(o.v[g + 4]);
    }
  } else {
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) o.v[g] = load32(q + 32 * g);
  }
  if constexpr (P::B::is_signed) {
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) o.va[g] = _mm256_sign_epi8(o.v[g], o.v[g]);
  }
}

// The 8 rows' exact integer sums with x's 32 bytes at xq (int8.cc's, in any order: the same integers).
template <class P>
Q8_INLINE __m256i unit_sums(const Unpacked<P>& o, const int8_t* xq) {
  // x's 4-byte groups broadcast straight from memory (one load each; not through a register and shuffles)
  auto x4 = [xq](int g) { int32_t v; std::memcpy(&v, xq + 4 * g, 4); return _mm256_set1_epi32(v); };
  __m256i S = _mm256_setzero_si256();
  if constexpr (P::B::is_signed) {
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++)
      S = _mm256_add_epi32(S, dot_u8i8(o.va[g], _mm256_sign_epi8(x4(g), o.v[g])));
  } else {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) S = _mm256_dpbusd_epi32(S, o.v[g], x4(g));
#elif defined(__AVXVNNI__)
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) S = _mm256_dpbusd_avx_epi32(S, o.v[g], x4(g));
#else
    // Nibbles (<= 15) times |q| <= 127: each int16 of a maddubs is at most 2 * 15 * 127, and the sum of 8
    // of them 30,480 < 32,768: added as int16, then one madd into int32 (exact).
    __m256i s16 = _mm256_maddubs_epi16(o.v[0], x4(0));
#pragma GCC unroll 8
    for (int g = 1; g < 8; g++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(o.v[g], x4(g)));
    S = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
  }
  return S;
}

// int8.cc's add_unit: the float part of unit b for x row x, given the rows' integer sums S.
template <class P>
Q8_INLINE void add_packed(const Unpacked<P>& o, __m256i S, const Q8Row& x, int64_t b, f32x8& acc) {
  using B = typename P::B;
  if (B::off) S = _mm256_sub_epi32(S, _mm256_set1_epi32(B::off * x.s32[b]));
  f32x8 dx = splat8(x.d[b]);
  acc = fma8(mul8(o.w1, dx), cvt8(S), acc);
  if (B::two) acc = fma8(mul8(o.w2, dx), cvt8(_mm256_set1_epi32(x.s32[b])), acc);
}
#endif

// Packed unit b of a tile times every x row into acc[m]: the integer sums of int8.cc's tile_direct
// (exact, any order) and add_unit's float operations, so the same bits.
template <class P, bool One>
Q8_INLINE void unit_packed(const uint8_t* u, int64_t b, const Q8RowSet& xs, f32x8* acc) {
#if defined(STRATA_Q8_AVX2)
  Unpacked<P> o;
  unpack_unit(u, o);
  for (int64_t m = 0; m < (One ? 1 : xs.m); m++) {
    const Q8Row& x = xs.x[m];
    add_packed(o, unit_sums(o, x.q + 32 * b), x, b, acc[m]);
  }
#else
  using B = typename P::B;
  alignas(32) float w1[T], w2[T];
  for (int r = 0; r < T; r++) {
    w1[r] = P::e8m0 ? e8m0_half(u[r]) : f16_at(u + 2 * r);
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
          vals[r][4 * g + t] = level_of<P>(lo);
          vals[r][16 + 4 * g + t] = level_of<P>(hi);
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

// A tile is one run of bytes: the hardware prefetcher follows it; this keeps it ahead at the start of each
// tile's units too (a prefetch never faults past the matrix's end). 16 units ahead (2.5 KB of Q4_1), not 4:
// SmolLM2's decode chain of products (scripts/bench_kernels.py --decode-chain, Zen 3, AVX2, five runs
// alternated) took a median 6.30 -> 5.69 ms on one thread and 3.97 -> 3.73 ms on two; 32 and 64 were slower.
template <class P>
Q8_INLINE void prefetch_ahead(const uint8_t* tile, int64_t b) {
  const uint8_t* ahead = tile + (b + 16) * P::unit;
#pragma GCC unroll 8
  for (int o = 0; o < P::unit; o += 64) __builtin_prefetch(ahead + o, 0, 3);
}

// Decode and verify windows (M <= 8): unit by unit, each unpacked once into registers for every x row.
template <class P>
void tile_direct(const uint8_t* tile, int64_t nunits, const Q8RowSet& xs, f32x8* acc) {
  if (xs.m == 1) {
    // M = 1 (decode): a loop of its own, with the accumulator a local that nothing points to and the x
    // row copied, so that both stay in registers. Through memory, each unit's two dependent FMAs also
    // waited for a store and a load of the accumulator: that chain, not the memory, bounded the loop.
    const Q8Row x = xs.x[0];
    const Q8RowSet one{&x, xs.y, 1};
    f32x8 a = zero8();
    for (int64_t b = 0; b < nunits; b++) {
      prefetch_ahead<P>(tile, b);
      unit_packed<P, true>(tile + b * P::unit, b, one, &a);
    }
    acc[0] = a;
    return;
  }
  for (int64_t b = 0; b < nunits; b++) {
    prefetch_ahead<P>(tile, b);
    unit_packed<P, false>(tile + b * P::unit, b, xs, acc);
  }
}

// Prefill (M > 8): the tile unpacked once into a buffer, then each x row over it with its accumulator in
// a register (unit by unit as tile_direct would re-read every row's accumulator a unit).
template <class P>
void tile_buffered(const uint8_t* tile, int64_t nunits, const Q8RowSet& xs, f32x8* acc) {
#if defined(STRATA_Q8_AVX2)
  thread_local std::vector<Unpacked<P>> buf;
  buf.resize(nunits);
  for (int64_t b = 0; b < nunits; b++) unpack_unit(tile + b * P::unit, buf[b]);
  for (int64_t m = 0; m < xs.m; m++) {
    const Q8Row& x = xs.x[m];
    f32x8 a = zero8();
    for (int64_t b = 0; b < nunits; b++) add_packed(buf[b], unit_sums(buf[b], x.q + 32 * b), x, b, a);
    acc[m] = a;
  }
#else
  tile_direct<P>(tile, nunits, xs, acc);
#endif
}

template <class P>
void rows_packed(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n, const Q8RowSet& xs, int64_t n0,
                 int64_t n1) {
  thread_local std::vector<f32x8> acc;
  if ((int64_t)acc.size() < xs.m) acc.resize(xs.m);
  int64_t nunits = k / P::B::values, whole = n / T * T;
  // Units of work start at multiples of 8 rows (matmul.cc's weight_rows_per_tile); a tile cut by one
  // anyway is computed whole and only its rows in [n0, n1) are written.
  for (int64_t t = n0 / T * T; t < std::min(n1, whole); t += T) {
    const uint8_t* tile = w + t * row_bytes;
    std::fill(acc.begin(), acc.begin() + xs.m, zero8());
    if (xs.m > 8) tile_buffered<P>(tile, nunits, xs, acc.data());
    else tile_direct<P>(tile, nunits, xs, acc.data());
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
    case MXFP4: return pack<PMXFP4>(src, n, row_bytes, dst);
    case Q4_K: return pack_q4k(src, n, row_bytes, dst);
    default: std::memcpy(dst, src, n * row_bytes);
  }
}

PackedFn packed_fn(int32_t qtype) {
  switch (qtype) {
    case Q4_0: return rows_packed<PQ4_0>;
    case Q4_1: return rows_packed<PQ4_1>;
    case Q8_0: return rows_packed<PQ8_0>;
    case IQ4_NL: return rows_packed<PIQ4_NL>;
    case MXFP4: return rows_packed<PMXFP4>;
    case Q4_K: return packed_q4k_fn();
    default: return nullptr;
  }
}

}  // namespace strata
