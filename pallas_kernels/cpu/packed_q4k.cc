// Q4_K packed (packed.h's layout for a 256-value super-block type; packed.cc has the 32-value types).
//
// A Q4_K block (144 bytes): float16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of
// nibbles (bytes 32p..32p+31: sub-block 2p in the low nibbles, 2p+1 in the high ones). Packed, a tile of 8
// rows stores block b of its 8 rows as
//     [8 x d] [8 x dmin] [scale bytes, interleaved by 4: 3 vectors] [nibble bytes, interleaved by 4: 32 vectors]
// (1,152 bytes, 8 blocks' worth), so the 8 rows' scales unpack with one vector's shifts and masks and each
// nibble vector times x's 4 bytes broadcast gives 8 rows' partial sums in their lanes. The integer sums a
// sub-block and the float operations are int8.cc's, so the same bits as the GGUF blocks.
#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_blocks.h"
#include "packed.h"

namespace strata {
namespace {

constexpr int T = 8;
constexpr int kBlock = 144, kUnit = T * kBlock;
// (offset in a GGUF block, bytes): the float16 fields go side by side, the byte fields interleaved by 4
constexpr int kF16[2] = {0, 2};
constexpr int kRunAt[2] = {4, 16}, kRunBytes[2] = {12, 128};

// Block b of tile rows [t, t + 8) between the GGUF rows and the packed unit u: to_packed, or back.
void move_unit(uint8_t* rows, int64_t row_bytes, int64_t b, uint8_t* u, bool to_packed) {
  for (int r = 0; r < T; r++) {
    uint8_t* blk = rows + r * row_bytes + b * kBlock;
    auto move = [to_packed](uint8_t* packed, uint8_t* gguf, int bytes) {
      to_packed ? std::memcpy(packed, gguf, bytes) : std::memcpy(gguf, packed, bytes);
    };
    uint8_t* at = u;
    for (int f : kF16) move(at + 2 * r, blk + f, 2), at += 2 * T;
    for (int i = 0; i < 2; i++) {
      for (int g = 0; g < kRunBytes[i] / 4; g++) move(at + 32 * g + 4 * r, blk + kRunAt[i] + 4 * g, 4);
      at += T * kRunBytes[i];
    }
  }
}

#if defined(STRATA_Q8_AVX2)
// The integer sums of unit u (8 rows) with x row x's super-block b: int1 = sum_j sc_j S_j, int2 = sum_j mn_j
// s_j over the 8 sub-blocks j (S_j: the nibbles times x, s_j: x's sum), each lane a row (int8.cc's
// superblock_sums gives each row the same integers).
Q8_INLINE void unit_sums(const uint8_t* u, const Q8Row& x, int64_t b, __m256i& int1, __m256i& int2) {
  const __m256i k1 = _mm256_set1_epi32(0x3f3f3f3f), k2 = _mm256_set1_epi32(0x0f0f0f0f), k3 = _mm256_set1_epi32(0x03030303);
  const __m256i A = load32(u + 32), Bv = load32(u + 64), C = load32(u + 96);
  // int8_blocks.h's k_scales_int, on 8 rows' 32-bit words at once
  const __m256i s[2] = {_mm256_and_si256(A, k1),
                        _mm256_or_si256(_mm256_and_si256(C, k2),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(A, 6), k3), 4))};
  const __m256i mn[2] = {_mm256_and_si256(Bv, k1),
                         _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(C, 4), k2),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(Bv, 6), k3), 4))};
  const __m256i ff = _mm256_set1_epi32(0xFF), low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* q = u + 128;
  const int8_t* xq = x.q + 256 * b;
  auto x4 = [xq](int at) { int32_t v; std::memcpy(&v, xq + at, 4); return _mm256_set1_epi32(v); };
  int1 = _mm256_setzero_si256(), int2 = _mm256_setzero_si256();
  for (int p = 0; p < 4; p++) {                // sub-blocks 2p (low nibbles) and 2p + 1 (high)
    __m256i lo16 = _mm256_setzero_si256(), hi16 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
      __m256i v = load32(q + 32 * (8 * p + g));
      // nibbles (<= 15) times |x| <= 127: 8 maddubs a sub-block add to at most 30,480 in int16
      lo16 = _mm256_add_epi16(lo16, _mm256_maddubs_epi16(_mm256_and_si256(v, low), x4(64 * p + 4 * g)));
      hi16 = _mm256_add_epi16(hi16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                         x4(64 * p + 32 + 4 * g)));
    }
    for (int h = 0; h < 2; h++) {
      int j = 2 * p + h;
      __m256i S = _mm256_madd_epi16(h ? hi16 : lo16, ones);
      __m256i sc = _mm256_and_si256(_mm256_srli_epi32(s[j / 4], 8 * (j % 4)), ff);
      __m256i m = _mm256_and_si256(_mm256_srli_epi32(mn[j / 4], 8 * (j % 4)), ff);
      int1 = _mm256_add_epi32(int1, _mm256_mullo_epi32(sc, S));
      int2 = _mm256_add_epi32(int2, _mm256_mullo_epi32(m, _mm256_set1_epi32(x.s32[8 * b + j])));
    }
  }
}

// Unit b (at u, the 8 rows' scales w1 and -dmin w2) times x row x, added to acc: q8.h's float part.
Q8_INLINE f32x8 add_unit(const uint8_t* u, f32x8 w1, f32x8 w2, const Q8Row& x, int64_t b, f32x8 acc) {
  __m256i int1, int2;
  unit_sums(u, x, b, int1, int2);
  f32x8 dx = splat8(x.d[b]);
  acc = fma8(mul8(w1, dx), cvt8(int1), acc);
  return fma8(mul8(w2, dx), cvt8(int2), acc);
}

// Decode and verify windows (M <= 16): unit by unit, every x row.
void tile_direct(const uint8_t* tile, int64_t nunits, const Q8RowSet& xs, f32x8* acc) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const bool one = xs.m == 1;
  const Q8Row x0 = one ? xs.x[0] : Q8Row{};
  f32x8 a = one ? acc[0] : zero8();
  for (int64_t b = 0; b < nunits; b++) {
    const uint8_t* u = tile + b * kUnit;
    const uint8_t* ahead = u + 2 * kUnit;              // the unit after next (a prefetch never faults)
    for (int o = 0; o < kUnit; o += 64) __builtin_prefetch(ahead + o, 0, 3);
    const f32x8 w1{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)u))};
    const f32x8 w2{_mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(u + 16))), sign)};   // -dmin
    if (one) a = add_unit(u, w1, w2, x0, b, a);   // decode: the accumulator in a register (packed.cc says why)
    else
      for (int64_t m = 0; m < xs.m; m++) acc[m] = add_unit(u, w1, w2, xs.x[m], b, acc[m]);
  }
  if (one) acc[0] = a;
}
#endif

void rows(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n, const Q8RowSet& xs, int64_t n0, int64_t n1) {
  const Int8Fn gguf = int8_fn(Q4_K);
  int64_t nunits = k / 256, whole = n / T * T;
  thread_local std::vector<f32x8> acc;
  thread_local std::vector<uint8_t> rows8;
  thread_local std::vector<float> ybuf;
  for (int64_t t = n0 / T * T; t < std::min(n1, whole); t += T) {
    const uint8_t* tile = w + t * row_bytes;
#if defined(STRATA_Q8_AVX2)
    // Up to 16 x rows the packed kernel is the faster; past that, unpacking the tile once and the GGUF
    // kernel's buffered path (measured, 4,101 x 2,048: M = 9 1.4 against 2.2 ms; M = 33 about even).
    if (xs.m <= 16) {
      if ((int64_t)acc.size() < xs.m) acc.resize(xs.m);
      std::fill(acc.begin(), acc.begin() + xs.m, zero8());
      tile_direct(tile, nunits, xs, acc.data());
      for (int64_t m = 0; m < xs.m; m++) {
        alignas(32) float out[T];
        store8(out, acc[m]);
        for (int64_t r = std::max(n0, t); r < std::min(n1, t + T); r++) xs.y[m][r] = out[r - t];
      }
      continue;
    }
#endif
    // Prefill, and the plain build: the tile back in GGUF rows, then the GGUF kernel (the same bits).
    rows8.resize(T * row_bytes);
    for (int64_t b = 0; b < nunits; b++) move_unit(rows8.data(), row_bytes, b, const_cast<uint8_t*>(tile) + b * kUnit, false);
    ybuf.resize(xs.m * T);
    std::vector<float*> yp(xs.m);
    for (int64_t m = 0; m < xs.m; m++) yp[m] = ybuf.data() + m * T;
    gguf(rows8.data(), row_bytes, k, Q8RowSet{xs.x, yp.data(), xs.m}, 0, T);
    for (int64_t m = 0; m < xs.m; m++)
      for (int64_t r = std::max(n0, t); r < std::min(n1, t + T); r++) xs.y[m][r] = yp[m][r - t];
  }
  if (n1 > whole) gguf(w, row_bytes, k, xs, std::max(n0, whole), n1);      // the rows left as they were
}

}  // namespace

void pack_q4k(const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst) {
  int64_t nunits = row_bytes / kBlock, whole = n / T * T;
  for (int64_t t = 0; t < whole; t += T)
    for (int64_t b = 0; b < nunits; b++)
      move_unit(const_cast<uint8_t*>(src) + t * row_bytes, row_bytes, b, dst + t * row_bytes + b * kUnit, true);
  std::memcpy(dst + whole * row_bytes, src + whole * row_bytes, (n - whole) * row_bytes);
}

PackedFn packed_q4k_fn() { return rows; }

}  // namespace strata
