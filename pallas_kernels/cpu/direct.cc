// The direct kernels (small M: decode and verify windows): a tile of RR weight rows is dequantized
// block by block straight into MM x RR register accumulators, with no float buffer between (its
// stores would cost as much as the dequantization). The accumulation is simd.h's, in the order the
// buffered path (matmul.cc) uses, so either path gives the same bits for a row.
#include "blocks.h"

namespace strata {
namespace {

constexpr int RR = kDirectRows;

template <class B, int MM, int R>
void direct_tile(const uint8_t* w, int64_t row_bytes, int64_t nblocks, const float* const* x, float* const* y,
                 int64_t n) {
  f32x16 acc[MM][R];
#pragma GCC unroll 16
  for (int m = 0; m < MM; m++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[m][r] = zero16();
  for (int64_t g = 0; g < nblocks; g += kGroup) {
    int cnt = (int)std::min<int64_t>(kGroup, nblocks - g);
    // The same blocks two tiles on (rows are contiguous, so two tiles ahead of this read): without
    // it the short matrices of a decode step stream from memory at ~60% of the rate (8.0 against
    // 12.3 ms for SmolLM2's 210 products). A prefetch never faults, so past the matrix's end is harmless.
    const uint8_t* ahead = w + (n + 2 * R) * row_bytes + g * B::bytes;
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      for (int64_t o = 0; o < cnt * B::bytes; o += 64) __builtin_prefetch(ahead + r * row_bytes + o, 0, 3);
    alignas(64) float f[R][16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) block_fields<B>(w + (n + r) * row_bytes + g * B::bytes, cnt, f[r]);
    fields_barrier();
    for (int i = 0; i < cnt; i++) {
      int64_t k0 = (g + i) * B::values;
#pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        B::block(w + (n + r) * row_bytes + (g + i) * B::bytes, f[r] + i * B::nf, [&](int v, f32x16 wv) {
#pragma GCC unroll 16
          for (int m = 0; m < MM; m++) acc[m][r] = fma16(load16(x[m] + k0 + 16 * v), wv, acc[m][r]);
        });
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MM; m++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) y[m][n + r] = hsum16(acc[m][r]);
}

template <class B, int MM>
void direct_rows(const uint8_t* w, int64_t row_bytes, int64_t k, const RowSet& rows, int64_t n0, int64_t n1) {
  int64_t nblocks = k / B::values, n = n0;
  constexpr int R2 = MM == 1 ? 2 * RR : RR;
  for (; n + R2 <= n1; n += R2) direct_tile<B, MM, R2>(w, row_bytes, nblocks, rows.x, rows.y, n);
  for (; n + RR <= n1; n += RR) direct_tile<B, MM, RR>(w, row_bytes, nblocks, rows.x, rows.y, n);
  for (; n < n1; n++) direct_tile<B, MM, 1>(w, row_bytes, nblocks, rows.x, rows.y, n);
}

template <class B, int... MM>
constexpr DirectFn pick_m(int m, std::integer_sequence<int, MM...>) {
  DirectFn fns[] = {direct_rows<B, MM + 1>...};
  return fns[m - 1];
}

template <class B>
void direct(const uint8_t* w, int64_t row_bytes, int64_t k, const RowSet& rows, int64_t n0, int64_t n1) {
  if (rows.m < 1) return;
  pick_m<B>((int)rows.m, std::make_integer_sequence<int, kDirectMaxM>())(w, row_bytes, k, rows, n0, n1);
}

}  // namespace

DirectFn direct_fn(int32_t qtype) {
  switch (qtype) {
    case Q8_0: return direct<BQ8_0>;
    case Q4_0: return direct<BQ4_0>;
    case Q4_1: return direct<BQ4_1>;
    case Q5_0: return direct<BQ5_0>;
    case Q5_1: return direct<BQ5_1>;
    case IQ4_NL: return direct<BIQ4_NL>;
    case Q2_K: return direct<BQ2_K>;
    case Q3_K: return direct<BQ3_K>;
    case Q4_K: return direct<BQ4_K>;
    case Q5_K: return direct<BQ5_K>;
    case Q6_K: return direct<BQ6_K>;
    case IQ4_XS: return direct<BIQ4_XS>;
    case MXFP4: return direct<BMXFP4>;
    default: return nullptr;
  }
}

}  // namespace strata
