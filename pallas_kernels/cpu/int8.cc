// The int8 path (--cpu-math int8): x rows quantized per block (q8.h), each weight unit's integer sums
// with them (int8_blocks.h), and q8.h's float part. A tile of 8 weight rows at a time (the 8 float
// lanes), every x row of the call for it: up to 8 x rows each unit is unpacked into registers and
// multiplied with each x row (tile_direct: decode and verify windows); above, the tile is interleaved
// once into a buffer and read back for each x row (tile_buffered: prefill). Both compute the same
// integer sums and float operations, so a row's result never depends on the other rows.
#include "int8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "int8_blocks.h"

namespace strata {

// ---- quantizing x ---------------------------------------------------------------------------------

namespace {

// One block of n values (32 or 256): d = amax / 127, q = nearest-even(x * (1 / d)).
void quantize_block(const float* x, int n, int8_t* q, float& d) {
  float amax = 0;
  bool finite = true;
  for (int i = 0; i < n; i++) amax = std::max(amax, std::fabs(x[i])), finite &= std::isfinite(x[i]);
  d = amax / 127.0f;
  float id = d != 0.0f && finite ? 1.0f / d : 0.0f;
  // A NaN or infinite activation makes the block's scale NaN, so every product with it is NaN, as on the
  // exact path (the engine ends such a request with an error instead of sampling finite garbage).
  if (!finite) d = std::numeric_limits<float>::quiet_NaN();
#if defined(STRATA_Q8_AVX2)
  const __m256 vid = _mm256_set1_ps(id);
  for (int i = 0; i < n; i += 32) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid));          // nearest even
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid));
    __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid));
    // packs interleave the 128-bit halves: a permute puts the 32 bytes back in order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(q + i), _mm256_max_epi8(p, _mm256_set1_epi8(-127)));
  }
#else
  for (int i = 0; i < n; i++) {
    float v = std::nearbyint(x[i] * id);                  // the default rounding: to nearest, ties to even
    q[i] = v != v ? -127 : (int8_t)std::max(-127.0f, std::min(127.0f, v));   // NaN: as cvtps + packs give
  }
#endif
}

}  // namespace

void quantize_rows(const float* const* x, int64_t m, int64_t k, int unit, Q8Rows& out) {
  int64_t units = k / unit;
  out.q.resize(m * k);                     // every entry is written below
  out.d.resize(m * units);
  out.s32.resize(m * k / 32);
  out.s16.resize(unit == 256 ? m * units * 16 : 0);
  out.rows.resize(m);
  for (int64_t i = 0; i < m; i++) {
    int8_t* q = out.q.data() + i * k;
    float* d = out.d.data() + i * units;
    int32_t* s32 = out.s32.data() + i * k / 32;
    int32_t* s16 = unit == 256 ? out.s16.data() + i * units * 16 : nullptr;
    for (int64_t u = 0; u < units; u++) quantize_block(x[i] + u * unit, unit, q + u * unit, d[u]);
    for (int64_t j = 0; j < k / 32; j++) {
      int32_t s = 0;
      for (int t = 0; t < 32; t++) s += q[32 * j + t];
      s32[j] = s;
    }
    if (s16)
      for (int64_t u = 0; u < k / unit; u++)
        for (int j = 0; j < 16; j++) {
          int32_t s = 0;
          for (int t = 0; t < 16; t++) s += q[u * 256 + 16 * kSub16Order[j] + t];
          s16[u * 16 + j] = s;
        }
    out.rows[i] = Q8Row{q, d, s32, s16};
  }
}

// ---- a tile of 8 weight rows times every x row --------------------------------------------------

namespace {

Q8_INLINE int32_t load_u32(const uint8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

constexpr int T = 8;                  // weight rows a tile: the 8 float lanes
constexpr int kDirectMaxM = 8;        // the most x rows tile_direct takes at once
// Above this many x rows the tile is buffered (tile_buffered, MR rows at a time: prefill, and the
// experts of a prompt window); up to it, no buffer (decode and verify windows). From 5 rows on the
// buffer's one interleaving of the tile costs less than tile_direct's reduction of each row's sums
// (a 2048 x 768 Q8_0 product of 8 rows: 134 against 176-292 us on a 2-core Zen 4, session 38).
constexpr int kBufferedAbove = 4;

// Sum over i < n of u[i] * q[i] (the plain build).
template <bool is_signed>
inline int32_t dot_plain(const uint8_t* u, const int8_t* q, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; i++) s += (is_signed ? (int32_t)(int8_t)u[i] : (int32_t)u[i]) * q[i];
  return s;
}

#if defined(STRATA_Q8_AVX2)
// The float scales of block b of 8 whole rows (p: the first row's block), 32-value types: w1 = d, w2 = m
// (zeros for the types without one). Bytes 0..3 of each row's block (d and m, or d and two bytes of
// quants) as one 32-bit load each, the d's and m's gathered by byte shuffles, one conversion each.
template <class B>
Q8_INLINE void scales8(const uint8_t* p, int64_t row_bytes, __m256& w1, __m256& w2) {
  if constexpr (i8::kE8M0Scale<B>) {     // one exponent byte e a row: e8m0_half's bits, 8 lanes at once
    __m256i e = _mm256_setr_epi32(p[0], p[row_bytes], p[2 * row_bytes], p[3 * row_bytes], p[4 * row_bytes],
                                  p[5 * row_bytes], p[6 * row_bytes], p[7 * row_bytes]);
    __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);          // e = 0, 1
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    w1 = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, small));
    w2 = _mm256_setzero_ps();
    return;
  }
  auto four = [&](int r0) {
    __m128i a = _mm_unpacklo_epi32(_mm_cvtsi32_si128(load_u32(p + r0 * row_bytes)),
                                   _mm_cvtsi32_si128(load_u32(p + (r0 + 1) * row_bytes)));
    __m128i c = _mm_unpacklo_epi32(_mm_cvtsi32_si128(load_u32(p + (r0 + 2) * row_bytes)),
                                   _mm_cvtsi32_si128(load_u32(p + (r0 + 3) * row_bytes)));
    // [d m] of 4 rows -> [d0 d1 d2 d3 | m0 m1 m2 m3] (16-bit values)
    return _mm_shuffle_epi8(_mm_unpacklo_epi64(a, c), _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  };
  __m128i lo = four(0), hi = four(4);
  w1 = _mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi));
  w2 = B::two ? _mm256_cvtph_ps(_mm_unpackhi_epi64(lo, hi)) : _mm256_setzero_ps();
}
#endif

// Unit b's scales for the tile's rows (zeros past nr): the floats w1, w2 by row, and for the super-block
// types the integer scales sc[j][r], mn[j][r] of sub-block j (in kSub16Order for 16-value sub-blocks:
// the order of the sums halves8 gives).
template <class B>
struct TileScales {
  alignas(32) float w1[T], w2[T];
  alignas(32) int32_t sc[16][T], mn[16][T];

  void read(const uint8_t* w, int64_t row_bytes, int64_t b, int nr) {
#if defined(STRATA_Q8_AVX2)
    if constexpr (B::values == 32) {
      if (nr == T) {            // the fields (float16 d, and m, at bytes 0 and 2) of 8 rows in one conversion
        __m256 a, c;
        scales8<B>(w + b * B::bytes, row_bytes, a, c);
        _mm256_store_ps(w1, a);
        _mm256_store_ps(w2, c);
        return;
      }
    }
#endif
    for (int r = 0; r < T; r++) {
      const uint8_t* p = w + r * row_bytes + b * B::bytes;
      if constexpr (B::values == 32) {
        if (r < nr) B::scales(p, w1[r], w2[r]);
        else w1[r] = w2[r] = 0;
      } else {
        int32_t s[16] = {}, m[16] = {};
        if (r < nr) B::scales(p, w1[r], w2[r], s, m);
        else w1[r] = w2[r] = 0;
        constexpr int nsub = 256 / B::sub;
        for (int j = 0; j < nsub; j++) {
          int src = nsub == 16 ? kSub16Order[j] : j;
          sc[j][r] = s[src], mn[j][r] = m[src];
        }
      }
    }
  }
};

// The float part of unit b for x row x into acc (8 rows), given the rows' integer sums.
template <class B>
Q8_INLINE void add_unit(const TileScales<B>& s, const Q8Row& x, int64_t b, const int32_t* int1, const int32_t* int2,
                        f32x8& acc) {
  f32x8 dx = splat8(x.d[b]);
  acc = fma8(mul8(load8(s.w1), dx), cvt8(int1), acc);
  if (B::two) acc = fma8(mul8(load8(s.w2), dx), cvt8(int2), acc);
}

#if defined(STRATA_Q8_AVX2)
Q8_INLINE __m256i dot_of(bool is_signed, __m256i w, __m256i x) { return is_signed ? dot_i8i8(w, x) : dot_u8i8(w, x); }

// [sum(p[0]), ..., sum(p[7])] for maddubs results p (16 pair sums each) of values <= 15 with x's bytes:
// every partial sum of up to 16 products stays within int16 (16 * 15 * 127 = 30480), so three levels of
// 16-bit horizontal adds reduce the 8 rows (each 128-bit half: one sum of 16 a row), and the two halves
// are added as int32. Exact integers, as sums8's.
Q8_INLINE __m256i sums16(const __m256i* p) {
  __m256i a = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
  __m256i b = _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7]));
  __m256i s = _mm256_hadd_epi16(a, b);               // half h: rows 0..7's sums of bytes 16h..16h+15
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)));
}

// 8 rows' integer sums of a 32-value block with x's 32 bytes xq (wv: the rows' values, vchunk's).
template <class B>
Q8_INLINE __m256i block_sums(const __m256i* wv, __m256i xq) {
  __m256i p[T];
  if constexpr (B::nibble) {
#pragma GCC unroll 8
    for (int r = 0; r < T; r++) p[r] = _mm256_maddubs_epi16(wv[r], xq);
    return sums16(p);
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < T; r++) p[r] = dot_of(B::is_signed, wv[r], xq);
    return sums8(p);
  }
}

// One x row (decode) and a whole tile of a 32-value type: tile_direct's integer sums and float
// operations with the accumulator, scales and sums in registers (nothing goes through memory).
template <class B>
void tile_one(const uint8_t* w, int64_t row_bytes, int64_t nunits, const Q8Row& x, f32x8& acc) {
  __m256 a = acc.v;
  for (int64_t b = 0; b < nunits; b++) {
    const uint8_t* p = w + b * B::bytes;
    // The next tile's rows at the same place, 8 requests a block spread over the tile: from memory the
    // tile's 8 rows are 8 short streams the hardware prefetcher does not follow (the burst of requests a
    // tile that rows_int8 makes for the other paths was ~1.4x slower here, out of cache).
#pragma GCC unroll 8
    for (int r = 0; r < T; r++) __builtin_prefetch(p + (T + r) * row_bytes, 0, 3);
    __m256 w1, w2;
    scales8<B>(p, row_bytes, w1, w2);
    __m256i wv[T];
#pragma GCC unroll 8
    for (int r = 0; r < T; r++) wv[r] = B::vchunk(p + r * row_bytes, 0);
    __m256i S = block_sums<B>(wv, load32(x.q + 32 * b));
    if (B::off) S = _mm256_sub_epi32(S, _mm256_set1_epi32(B::off * x.s32[b]));
    __m256 dx = _mm256_set1_ps(x.d[b]);
    a = _mm256_fmadd_ps(_mm256_mul_ps(w1, dx), _mm256_cvtepi32_ps(S), a);
    if (B::two) a = _mm256_fmadd_ps(_mm256_mul_ps(w2, dx), _mm256_cvtepi32_ps(_mm256_set1_epi32(x.s32[b])), a);
  }
  acc.v = a;
}

// The integer sums of one super-block row (chunks wv) with x's super-block: int1 = sum_j sc_j * (S_j -
// off * s_j), int2 = sum_j mn_j * s_j, for sub-blocks j (sc, mn: this row's, in the order of S).
template <class B>
Q8_INLINE void superblock_sums(const __m256i* wv, const int8_t* q, const int32_t* s32, const int32_t* s16,
                               const __m256i* sc, const __m256i* mn, int32_t& i1, int32_t& i2) {
  __m256i p[8];
#pragma GCC unroll 8
  for (int c = 0; c < 8; c++) p[c] = dot_of(B::is_signed, wv[c], load32(q + 32 * c));
  const __m256i off = _mm256_set1_epi32(B::off);
  __m256i t1, t2;
  if constexpr (B::sub == 32) {
    __m256i xs = load32(s32), S = sums8(p);
    if (B::off) S = _mm256_sub_epi32(S, _mm256_mullo_epi32(xs, off));
    t1 = _mm256_mullo_epi32(sc[0], S);
    t2 = _mm256_mullo_epi32(mn[0], xs);
  } else {
    __m256i xa = load32(s16), xb = load32(s16 + 8), Sa = halves8(p), Sb = halves8(p + 4);
    if (B::off) Sa = _mm256_sub_epi32(Sa, _mm256_mullo_epi32(xa, off)), Sb = _mm256_sub_epi32(Sb, _mm256_mullo_epi32(xb, off));
    t1 = _mm256_add_epi32(_mm256_mullo_epi32(sc[0], Sa), _mm256_mullo_epi32(sc[1], Sb));
    t2 = _mm256_add_epi32(_mm256_mullo_epi32(mn[0], xa), _mm256_mullo_epi32(mn[1], xb));
  }
  i1 = hsum_i32(t1);
  if (B::two) i2 = hsum_i32(t2);
}
#endif

// Few x rows: each unit of each weight row unpacked into registers and multiplied with every x row.
template <class B>
void tile_direct(const uint8_t* w, int64_t row_bytes, int64_t nunits, int nr, const Q8RowSet& xs, f32x8* acc) {
  constexpr int nsub = 256 / B::sub;
  TileScales<B> s;
  for (int64_t b = 0; b < nunits; b++) {
    s.read(w, row_bytes, b, nr);
    alignas(32) int32_t int1[kDirectMaxM][T], int2[kDirectMaxM][T];
    if (B::values == 256 && nr < T)         // rows past the matrix's end: zeros (the 32-value types write all 8)
      for (int64_t m = 0; m < xs.m; m++) std::fill(int1[m], int1[m] + T, 0), std::fill(int2[m], int2[m] + T, 0);
#if defined(STRATA_Q8_AVX2)
    if constexpr (B::values == 32) {
      __m256i wv[T];
      for (int r = 0; r < T; r++) wv[r] = r < nr ? B::vchunk(w + r * row_bytes + b * B::bytes, 0) : _mm256_setzero_si256();
      for (int64_t m = 0; m < xs.m; m++) {
        const Q8Row& x = xs.x[m];
        __m256i S = block_sums<B>(wv, load32(x.q + 32 * b));
        if (B::off) S = _mm256_sub_epi32(S, _mm256_set1_epi32(B::off * x.s32[b]));
        _mm256_store_si256((__m256i*)int1[m], S);
        if (B::two) _mm256_store_si256((__m256i*)int2[m], _mm256_set1_epi32(x.s32[b]));
      }
    } else {
      for (int r = 0; r < nr; r++) {
        const uint8_t* p = w + r * row_bytes + b * B::bytes;
        __m256i wv[8], sc[2], mn[2];
        for (int c = 0; c < 8; c++) wv[c] = B::vchunk(p, c);
        alignas(32) int32_t rs[16], rm[16];
        for (int j = 0; j < nsub; j++) rs[j] = s.sc[j][r], rm[j] = s.mn[j][r];
        sc[0] = load32(rs), sc[1] = load32(rs + 8), mn[0] = load32(rm), mn[1] = load32(rm + 8);
        for (int64_t m = 0; m < xs.m; m++) {
          const Q8Row& x = xs.x[m];
          superblock_sums<B>(wv, x.q + 256 * b, x.s32 + 8 * b, x.s16 + 16 * b, sc, mn, int1[m][r], int2[m][r]);
        }
      }
    }
#else
    for (int r = 0; r < nr; r++) {
      const uint8_t* p = w + r * row_bytes + b * B::bytes;
      alignas(32) uint8_t wb[B::values];
      for (int c = 0; c < B::values / 32; c++) B::chunk(p, c, wb + 32 * c);
      for (int64_t m = 0; m < xs.m; m++) {
        const Q8Row& x = xs.x[m];
        const int8_t* q = x.q + B::values * b;
        if constexpr (B::values == 32) {
          int1[m][r] = dot_plain<B::is_signed>(wb, q, 32) - B::off * x.s32[b];
          int2[m][r] = x.s32[b];
        } else {
          int32_t t1 = 0, t2 = 0;
          for (int j = 0; j < nsub; j++) {
            int sj = nsub == 16 ? kSub16Order[j] : j;         // s.sc is in that order
            int32_t S = dot_plain<B::is_signed>(wb + sj * B::sub, q + sj * B::sub, B::sub), xsum = 0;
            for (int t = 0; t < B::sub; t++) xsum += q[sj * B::sub + t];
            t1 += s.sc[j][r] * (S - B::off * xsum);
            t2 += s.mn[j][r] * xsum;
          }
          int1[m][r] = t1, int2[m][r] = t2;
        }
      }
    }
#endif
    for (int64_t m = 0; m < xs.m; m++) add_unit<B>(s, xs.x[m], b, int1[m], int2[m], acc[m]);
  }
}

#if defined(STRATA_Q8_AVX2)
// 8 rows' 32 bytes -> 8 vectors, vector g holding bytes 4g..4g+3 of every row (row r in lane r): the
// layout in which one dot product with x's 4 bytes broadcast gives 8 rows' sums at once.
Q8_INLINE void interleave8(__m256i* v) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; h++)
      u[i + h] = _mm256_unpacklo_epi64(t[i + h], t[i + 2 + h]), u[i + 2 + h] = _mm256_unpackhi_epi64(t[i + h], t[i + 2 + h]);
  // u[i], u[i + 1], u[i + 2], u[i + 3]: rows i..i+3 of groups (0 | 4), (2 | 6), (1 | 5), (3 | 7) in the two
  // 128-bit halves
  constexpr int group[4] = {0, 2, 1, 3};
  for (int g = 0; g < 4; g++) {
    v[group[g]] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
    v[group[g] + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
  }
}

// x rows m0..m0+MR-1 of tile_buffered: the tile's interleaved units `buf`, their scales, and for the
// offset x (xu) each unit's 128 * row sums `wsum`.
template <class B, int MR>
Q8_INLINE void rows_buffered(const __m256i* buf, const TileScales<B>* scales, const __m256i* wsum, int64_t nunits,
                             const Q8RowSet& xs, int64_t m0, f32x8* acc, const uint8_t* xu) {
  constexpr int nch = B::values / 32, nsub = 256 / B::sub, steps = B::sub / 4;
  f32x8 a[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++) a[i] = acc[m0 + i];
  for (int64_t b = 0; b < nunits; b++) {
    const __m256i* v = buf + b * nch * 8;
    const TileScales<B>& s = scales[b];
    __m256i i1[MR], i2[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) i1[i] = i2[i] = _mm256_setzero_si256();
    for (int j = 0; j < (B::values == 32 ? 1 : nsub); j++) {
      // j runs in s.sc's order (kSub16Order for 16-value sub-blocks): sub-block sj, its bytes at B::sub * sj
      const int sj = B::values == 32 ? 0 : (nsub == 16 ? kSub16Order[j] : j);
      __m256i S[MR];
#pragma GCC unroll 4
      for (int i = 0; i < MR; i++) S[i] = _mm256_setzero_si256();
#if defined(STRATA_Q8_OFFSET_X)
      if constexpr (B::is_signed && B::values == 32) {
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
          const __m256i wv = v[g];
#pragma GCC unroll 4
          for (int i = 0; i < MR; i++) {
            int32_t x4; std::memcpy(&x4, xu + (m0 + i) * nunits * 32 + 32 * b + 4 * g, 4);
            S[i] = dot_acc(S[i], _mm256_set1_epi32(x4), wv);
          }
        }
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) S[i] = _mm256_sub_epi32(S[i], wsum[b]);
      } else
#endif
#pragma GCC unroll 8
      for (int g = 0; g < steps; g++) {
        const __m256i wv = v[(B::sub * sj) / 4 + g];
        const __m256i wu = B::is_signed ? _mm256_sign_epi8(wv, wv) : wv;
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
          int32_t x4; std::memcpy(&x4, xs.x[m0 + i].q + B::values * b + B::sub * sj + 4 * g, 4);
          __m256i xv = _mm256_set1_epi32(x4);
          if (B::is_signed) xv = _mm256_sign_epi8(xv, wv);
          S[i] = dot_acc(S[i], wu, xv);
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; i++) {
        const Q8Row& x = xs.x[m0 + i];
        if constexpr (B::values == 32) {
          if (B::off) S[i] = _mm256_sub_epi32(S[i], _mm256_set1_epi32(B::off * x.s32[b]));
          i1[i] = S[i];
          i2[i] = _mm256_set1_epi32(x.s32[b]);
        } else {
          int32_t xsum = nsub == 16 ? x.s16[16 * b + j] : x.s32[8 * b + j];     // both in s.sc's order
          if (B::off) S[i] = _mm256_sub_epi32(S[i], _mm256_set1_epi32(B::off * xsum));
          i1[i] = _mm256_add_epi32(i1[i], _mm256_mullo_epi32(load32(s.sc[j]), S[i]));
          if (B::two) i2[i] = _mm256_add_epi32(i2[i], _mm256_mullo_epi32(load32(s.mn[j]), _mm256_set1_epi32(xsum)));
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
      f32x8 dx = splat8(xs.x[m0 + i].d[b]);
      a[i] = fma8(mul8(load8(s.w1), dx), cvt8(i1[i]), a[i]);
      if (B::two) a[i] = fma8(mul8(load8(s.w2), dx), cvt8(i2[i]), a[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++) acc[m0 + i] = a[i];
}

// Many x rows: the tile's units unpacked once into `buf` (8 rows interleaved by 4 bytes), then for
// every x row 8 rows' integer sums a unit by dot products with x's bytes broadcast. The same integer
// sums and float operations as tile_direct: the same bits.
//
// xu (VNNI builds, the signed 32-value types): the x rows' bytes plus 128 (row m at xu + m * k), which
// multiply the signed weights as they are (q8.h's offset_x); wsum then holds 128 * each row's sum of a
// block, taken off once a block. Otherwise nullptr.
template <class B>
void tile_buffered(const uint8_t* w, int64_t row_bytes, int64_t nunits, int nr, const Q8RowSet& xs, f32x8* acc,
                   const uint8_t* xu) {
  constexpr int nch = B::values / 32;
  thread_local std::vector<__m256i> buf, wsum;
  thread_local std::vector<TileScales<B>> scales;
  buf.resize(nunits * nch * 8);
  scales.resize(nunits);
  if (xu) wsum.resize(nunits);
  for (int64_t b = 0; b < nunits; b++) {
    scales[b].read(w, row_bytes, b, nr);
    for (int c = 0; c < nch; c++) {
      __m256i* v = buf.data() + (b * nch + c) * 8;
      for (int r = 0; r < T; r++) v[r] = r < nr ? B::vchunk(w + r * row_bytes + b * B::bytes, c) : _mm256_setzero_si256();
      interleave8(v);
#if defined(STRATA_Q8_OFFSET_X)
      if (xu) {                 // interleaved: lane r of every vector is row r's
        __m256i t = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) t = dot_acc(t, _mm256_set1_epi8(1), v[g]);
        wsum[b] = _mm256_slli_epi32(t, 7);
      }
#endif
    }
  }
  // MR x rows at a time: each unit's interleaved vectors are loaded once for the MR rows, and the rows'
  // MR sums are independent chains (one row at a time waited on each dot product's latency: a 44 x 2048 x
  // 4096 Q8_0 product took 4.3-6.6 ms on a 2-core Zen 4, 2.3-2.9 ms so, with the offset x). Each row's
  // operations and their order are unchanged: the same bits.
  for (int64_t m0 = 0; m0 < xs.m; m0 += 4) {
    switch (std::min<int64_t>(4, xs.m - m0)) {
      case 4: rows_buffered<B, 4>(buf.data(), scales.data(), wsum.data(), nunits, xs, m0, acc, xu); break;
      case 3: rows_buffered<B, 3>(buf.data(), scales.data(), wsum.data(), nunits, xs, m0, acc, xu); break;
      case 2: rows_buffered<B, 2>(buf.data(), scales.data(), wsum.data(), nunits, xs, m0, acc, xu); break;
      default: rows_buffered<B, 1>(buf.data(), scales.data(), wsum.data(), nunits, xs, m0, acc, xu);
    }
  }
}
#endif

#if defined(STRATA_Q8_AVX2)
// 2..4 x rows (MR) and a whole tile of a 32-value type (decode and verify windows of a few rows, and an
// expert a few of a window's rows chose): each unit's 8 rows interleaved in registers (interleave8), then
// every x row's 8 sums at once by dot products with its bytes broadcast, the rows' sums independent
// chains: no reduction of each row's sums, no buffer. The same integer sums and float operations as
// tile_one and tile_direct: the same bits.
template <class B, int MR>
void tile_few(const uint8_t* w, int64_t row_bytes, int64_t nunits, const Q8RowSet& xs, f32x8* acc) {
  __m256 a[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++) a[i] = acc[i].v;
  for (int64_t b = 0; b < nunits; b++) {
    const uint8_t* p = w + b * B::bytes;
#pragma GCC unroll 8
    for (int r = 0; r < T; r++) __builtin_prefetch(p + (T + r) * row_bytes, 0, 3);     // as tile_one
    __m256 w1, w2;
    scales8<B>(p, row_bytes, w1, w2);
    __m256i v[T];
#pragma GCC unroll 8
    for (int r = 0; r < T; r++) v[r] = B::vchunk(p + r * row_bytes, 0);
    interleave8(v);
    __m256i S[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) S[i] = _mm256_setzero_si256();
#if defined(STRATA_Q8_OFFSET_X)
    if constexpr (B::is_signed) {
      __m256i t = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) t = dot_acc(t, _mm256_set1_epi8(1), v[g]);
      const __m256i w128 = _mm256_slli_epi32(t, 7);
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++)
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
          const uint8_t* q = reinterpret_cast<const uint8_t*>(xs.x[i].q) + 32 * b + 4 * g;
          S[i] = dot_acc(S[i], _mm256_set1_epi32(load_u32(q) ^ (int32_t)0x80808080), v[g]);
        }
#pragma GCC unroll 4
      for (int i = 0; i < MR; i++) S[i] = _mm256_sub_epi32(S[i], w128);
    } else
#endif
    {
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) {
        const __m256i wv = v[g];
        const __m256i wu = B::is_signed ? _mm256_sign_epi8(wv, wv) : wv;
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
          __m256i xv = _mm256_set1_epi32(load_u32(reinterpret_cast<const uint8_t*>(xs.x[i].q) + 32 * b + 4 * g));
          if (B::is_signed) xv = _mm256_sign_epi8(xv, wv);
          S[i] = dot_acc(S[i], wu, xv);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
      const Q8Row& x = xs.x[i];
      if (B::off) S[i] = _mm256_sub_epi32(S[i], _mm256_set1_epi32(B::off * x.s32[b]));
      __m256 dx = _mm256_set1_ps(x.d[b]);
      a[i] = _mm256_fmadd_ps(_mm256_mul_ps(w1, dx), _mm256_cvtepi32_ps(S[i]), a[i]);
      if (B::two) a[i] = _mm256_fmadd_ps(_mm256_mul_ps(w2, dx), _mm256_cvtepi32_ps(_mm256_set1_epi32(x.s32[b])), a[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++) acc[i].v = a[i];
}

#endif

template <class B>
void rows_int8(const uint8_t* w, int64_t row_bytes, int64_t k, const Q8RowSet& xs, int64_t n0, int64_t n1) {
  thread_local std::vector<f32x8> acc;
  if ((int64_t)acc.size() < xs.m) acc.resize(xs.m);
  int64_t nunits = k / B::values;
  // tile_buffered's offset x rows, made once a call of this unit: a copy here measured ~20% faster at 44
  // rows than xoring each broadcast 4 bytes in the inner loop (session 38)
  const uint8_t* xu = nullptr;
#if defined(STRATA_Q8_OFFSET_X)
  thread_local std::vector<uint8_t> xu_rows;
  if constexpr (B::is_signed && B::values == 32) {
    if (xs.m > kBufferedAbove) {
      xu_rows.resize(xs.m * k);
      for (int64_t m = 0; m < xs.m; m++) {
        const int8_t* q = xs.x[m].q;
        uint8_t* o = xu_rows.data() + m * k;
        for (int64_t i = 0; i < k; i += 32) _mm256_storeu_si256((__m256i*)(o + i), offset_x(load32(q + i)));
      }
      xu = xu_rows.data();
    }
  }
#endif
  for (int64_t n = n0; n < n1; n += T) {
    int nr = (int)std::min<int64_t>(T, n1 - n);
    const uint8_t* tile = w + n * row_bytes;
    bool one = false;                  // one x row, a whole tile of a 32-value type: tile_one
    bool few = false;                  // 2..kBufferedAbove x rows, likewise: tile_few
#if defined(STRATA_Q8_AVX2)
    if constexpr (B::values == 32) one = xs.m == 1 && nr == T, few = xs.m >= 2 && xs.m <= kBufferedAbove && nr == T;
#endif
    // The next tile's rows (a prefetch never faults): the short matrices of a decode step stream from
    // memory at a fraction of the rate without it (direct.cc measured the same). tile_one spreads its own.
    if (!one && !few)
      for (int64_t o = 0; o < T * row_bytes; o += 64) __builtin_prefetch(tile + T * row_bytes + o, 0, 3);
    std::fill(acc.begin(), acc.begin() + xs.m, zero8());
#if defined(STRATA_Q8_AVX2)
    if (xs.m > kBufferedAbove) tile_buffered<B>(tile, row_bytes, nunits, nr, xs, acc.data(), xu);
    else if (one) {
      if constexpr (B::values == 32) tile_one<B>(tile, row_bytes, nunits, xs.x[0], acc[0]);
    } else if (few) {
      static_assert(kBufferedAbove == 4, "tile_few takes 2 to 4 rows");
      if constexpr (B::values == 32) {
        if (xs.m == 2) tile_few<B, 2>(tile, row_bytes, nunits, xs, acc.data());
        else if (xs.m == 3) tile_few<B, 3>(tile, row_bytes, nunits, xs, acc.data());
        else tile_few<B, 4>(tile, row_bytes, nunits, xs, acc.data());
      }
    } else
#endif
    for (int64_t m0 = 0; m0 < xs.m; m0 += kDirectMaxM) {
      Q8RowSet part{xs.x + m0, xs.y + m0, std::min<int64_t>(kDirectMaxM, xs.m - m0)};
      tile_direct<B>(tile, row_bytes, nunits, nr, part, acc.data() + m0);
    }
    for (int64_t m = 0; m < xs.m; m++) {
      alignas(32) float out[T];
      store8(out, acc[m]);
      std::copy(out, out + nr, xs.y[m] + n);
    }
  }
}

}  // namespace

Int8Fn int8_fn(int32_t qtype) {
  switch (qtype) {
    case Q4_0: return rows_int8<i8::Q4_0>;
    case Q4_1: return rows_int8<i8::Q4_1>;
    case Q5_0: return rows_int8<i8::Q5_0>;
    case Q5_1: return rows_int8<i8::Q5_1>;
    case Q8_0: return rows_int8<i8::Q8_0>;
    case IQ4_NL: return rows_int8<i8::IQ4_NL>;
    case Q2_K: return rows_int8<i8::Q2_K>;
    case Q3_K: return rows_int8<i8::Q3_K>;
    case Q4_K: return rows_int8<i8::Q4_K>;
    case Q5_K: return rows_int8<i8::Q5_K>;
    case Q6_K: return rows_int8<i8::Q6_K>;
    case IQ4_XS: return rows_int8<i8::IQ4_XS>;
    case MXFP4: return rows_int8<i8::MXFP4>;
    default: return nullptr;
  }
}

}  // namespace strata
