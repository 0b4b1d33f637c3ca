// The int8 path (--cpu-math int8): x rows quantized per block (q8.h), each weight unit's integer sums
// with them (int8_blocks.h), and q8.h's float part. One weight row at a time, every x row of the call
// for it (a group of 8 units is unpacked once, into L1, and read back for each x row), so a row's
// result never depends on the other rows.
#include "int8.h"

#include <algorithm>

#include "int8_blocks.h"

namespace strata {

// ---- quantizing x ---------------------------------------------------------------------------------

namespace {

// One block of n values (32 or 256): d = amax / 127, q = nearest-even(x * (1 / d)).
void quantize_block(const float* x, int n, int8_t* q, float& d) {
  float amax = 0;
  for (int i = 0; i < n; i++) amax = std::max(amax, std::fabs(x[i]));
  d = amax / 127.0f;
  float id = d != 0.0f ? 1.0f / d : 0.0f;
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
  int64_t units = (k / unit + 7) / 8 * 8, kp = units * unit;
  out.unit = unit;
  out.units = units;
  out.q.assign(m * kp, 0);
  out.d.assign(m * units, 0.0f);
  out.s32.assign(m * kp / 32, 0);
  out.s16.assign(unit == 256 ? m * units * 16 : 0, 0);
  out.rows.resize(m);
  for (int64_t i = 0; i < m; i++) {
    int8_t* q = out.q.data() + i * kp;
    float* d = out.d.data() + i * units;
    int32_t* s32 = out.s32.data() + i * kp / 32;
    int32_t* s16 = unit == 256 ? out.s16.data() + i * units * 16 : nullptr;
    for (int64_t u = 0; u < k / unit; u++) quantize_block(x[i] + u * unit, unit, q + u * unit, d[u]);
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

// ---- a weight row times every x row ----------------------------------------------------------------

namespace {


// Sum over i < n of u[i] * q[i] (the plain build).
template <bool is_signed>
inline int32_t dot_plain(const uint8_t* u, const int8_t* q, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; i++) s += (is_signed ? (int32_t)(int8_t)u[i] : (int32_t)u[i]) * q[i];
  return s;
}

// The 32-value types: a group of 8 blocks at once. int1 = S - off * s32 (S: the blocks' dot products),
// int2 = s32.
template <class B>
void row_32(const uint8_t* w, int64_t nblocks, const Q8RowSet& xs, f32x8* acc) {
  for (int64_t g = 0; g < nblocks; g += 8) {
    int cnt = (int)std::min<int64_t>(8, nblocks - g);
    alignas(32) float w1[8] = {}, w2[8] = {};
    for (int i = 0; i < cnt; i++) B::scales(w + (g + i) * B::bytes, w1[i], w2[i]);
#if defined(STRATA_Q8_AVX2)
    __m256i wv[8];
    for (int i = 0; i < 8; i++) wv[i] = i < cnt ? B::vchunk(w + (g + i) * B::bytes, 0) : _mm256_setzero_si256();
    for (int64_t m = 0; m < xs.m; m++) {
      const Q8Row& x = xs.x[m];
      const int8_t* q = x.q + g * 32;
      __m256i p[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++)
        p[i] = B::is_signed ? dot_i8i8(wv[i], load32(q + 32 * i)) : dot_u8i8(wv[i], load32(q + 32 * i));
      __m256i s = load32(x.s32 + g);
      __m256i int1 = sums8(p);
      if (B::off) int1 = _mm256_sub_epi32(int1, _mm256_mullo_epi32(s, _mm256_set1_epi32(B::off)));
      f32x8 dx = load8(x.d + g);
      acc[m] = fma8(mul8(load8(w1), dx), cvt8(int1), acc[m]);
      if (B::two) acc[m] = fma8(mul8(load8(w2), dx), cvt8(s), acc[m]);
    }
#else
    alignas(32) uint8_t wb[8][32] = {};
    for (int i = 0; i < cnt; i++) B::chunk(w + (g + i) * B::bytes, 0, wb[i]);
    for (int64_t m = 0; m < xs.m; m++) {
      const Q8Row& x = xs.x[m];
      alignas(32) int32_t int1[8];
      for (int i = 0; i < 8; i++) int1[i] = dot_plain<B::is_signed>(wb[i], x.q + (g + i) * 32, 32) - B::off * x.s32[g + i];
      f32x8 dx = load8(x.d + g);
      acc[m] = fma8(mul8(load8(w1), dx), cvt8(int1), acc[m]);
      if (B::two) acc[m] = fma8(mul8(load8(w2), dx), cvt8(x.s32 + g), acc[m]);
    }
#endif
  }
}

// The 256-value types: one super-block's int1 = sum_j sc_j * (S_j - off * s_j), int2 = sum_j mn_j * s_j
// (S_j, s_j: the dot product and the x sum of sub-block j).
template <class B>
void row_256(const uint8_t* w, int64_t nunits, const Q8RowSet& xs, f32x8* acc, int32_t* i1, int32_t* i2) {
  constexpr int nsub = 256 / B::sub;
  for (int64_t g = 0; g < nunits; g += 8) {
    int cnt = (int)std::min<int64_t>(8, nunits - g);
    alignas(32) float w1[8] = {}, w2[8] = {};
    std::fill(i1, i1 + 8 * xs.m, 0);
    std::fill(i2, i2 + 8 * xs.m, 0);
    for (int i = 0; i < cnt; i++) {
      const uint8_t* b = w + (g + i) * B::bytes;
      alignas(32) int32_t sc[16] = {}, mn[16] = {};
      B::scales(b, w1[i], w2[i], sc, mn);
#if defined(STRATA_Q8_AVX2)
      __m256i wv[8];
      for (int c = 0; c < 8; c++) wv[c] = B::vchunk(b, c);
      __m256i vsc[2], vmn[2];                 // in the order of the sub-block sums (sums8, halves8)
      if constexpr (nsub == 8) {
        vsc[0] = load32(sc), vmn[0] = load32(mn);
      } else {
        alignas(32) int32_t psc[16], pmn[16];
        for (int j = 0; j < 16; j++) psc[j] = sc[kSub16Order[j]], pmn[j] = mn[kSub16Order[j]];
        vsc[0] = load32(psc), vsc[1] = load32(psc + 8), vmn[0] = load32(pmn), vmn[1] = load32(pmn + 8);
      }
      for (int64_t m = 0; m < xs.m; m++) {
        const Q8Row& x = xs.x[m];
        const int8_t* q = x.q + (g + i) * 256;
        __m256i p[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
          p[c] = B::is_signed ? dot_i8i8(wv[c], load32(q + 32 * c)) : dot_u8i8(wv[c], load32(q + 32 * c));
        __m256i t1, t2;
        if constexpr (nsub == 8) {
          __m256i s = load32(x.s32 + (g + i) * 8), S = sums8(p);
          if (B::off) S = _mm256_sub_epi32(S, _mm256_mullo_epi32(s, _mm256_set1_epi32(B::off)));
          t1 = _mm256_mullo_epi32(vsc[0], S);
          t2 = _mm256_mullo_epi32(vmn[0], s);
        } else {
          const int32_t* s16 = x.s16 + (g + i) * 16;
          __m256i sa = load32(s16), sb = load32(s16 + 8), Sa = halves8(p), Sb = halves8(p + 4);
          if (B::off) {
            Sa = _mm256_sub_epi32(Sa, _mm256_mullo_epi32(sa, _mm256_set1_epi32(B::off)));
            Sb = _mm256_sub_epi32(Sb, _mm256_mullo_epi32(sb, _mm256_set1_epi32(B::off)));
          }
          t1 = _mm256_add_epi32(_mm256_mullo_epi32(vsc[0], Sa), _mm256_mullo_epi32(vsc[1], Sb));
          t2 = _mm256_add_epi32(_mm256_mullo_epi32(vmn[0], sa), _mm256_mullo_epi32(vmn[1], sb));
        }
        i1[8 * m + i] = hsum_i32(t1);
        if (B::two) i2[8 * m + i] = hsum_i32(t2);
      }
#else
      alignas(32) uint8_t wb[8][32];
      for (int c = 0; c < 8; c++) B::chunk(b, c, wb[c]);
      for (int64_t m = 0; m < xs.m; m++) {
        const Q8Row& x = xs.x[m];
        const int8_t* q = x.q + (g + i) * 256;
        int32_t t1 = 0, t2 = 0;
        for (int j = 0; j < nsub; j++) {
          int32_t S = dot_plain<B::is_signed>(wb[j * B::sub / 32] + (j * B::sub) % 32, q + j * B::sub, B::sub);
          int32_t s = 0;
          for (int t = 0; t < B::sub; t++) s += q[j * B::sub + t];
          t1 += sc[j] * (S - B::off * s);
          t2 += mn[j] * s;
        }
        i1[8 * m + i] = t1;
        if (B::two) i2[8 * m + i] = t2;
      }
#endif
    }
    for (int64_t m = 0; m < xs.m; m++) {
      f32x8 dx = load8(xs.x[m].d + g);
      acc[m] = fma8(mul8(load8(w1), dx), cvt8(i1 + 8 * m), acc[m]);
      if (B::two) acc[m] = fma8(mul8(load8(w2), dx), cvt8(i2 + 8 * m), acc[m]);
    }
  }
}

template <class B>
void rows_int8(const uint8_t* w, int64_t row_bytes, int64_t k, const Q8RowSet& xs, int64_t n0, int64_t n1) {
  thread_local std::vector<f32x8> acc;
  thread_local std::vector<int32_t> i1, i2;
  if ((int64_t)acc.size() < xs.m) acc.resize(xs.m);
  if ((int64_t)i1.size() < 8 * xs.m) i1.resize(8 * xs.m), i2.resize(8 * xs.m);
  int64_t nunits = k / B::values;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    // Two rows on (a prefetch never faults): the short matrices of a decode step stream from memory
    // at a fraction of the rate without it (direct.cc measured the same).
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + 2 * row_bytes + o, 0, 3);
    std::fill(acc.begin(), acc.begin() + xs.m, zero8());
    if constexpr (B::values == 32) row_32<B>(row, nunits, xs, acc.data());
    else row_256<B>(row, nunits, xs, acc.data(), i1.data(), i2.data());
    for (int64_t m = 0; m < xs.m; m++) xs.y[m][n] = hsum8(acc[m]);
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
    default: return nullptr;
  }
}

}  // namespace strata
