// The buffered path (M above kDirectMaxM, and the float types). For one range of weight rows: a tile
// of NR weight rows is dequantized up to KC values at a time into a buffer (L1 for k <= ~500, else
// L2), and every x row is multiplied with it by an MR x NR register tile of 16-lane accumulators
// (simd.h defines the arithmetic). So each weight row is read and dequantized once a call, whatever
// M; x streams from L2 once a tile. When k > KC the accumulators of all M rows for the tile wait in
// a buffer between chunks (stored and reloaded exactly: chunking changes no bits), which costs L2
// traffic, hence a large KC.
#include "matmul.h"

#include <algorithm>
#include <array>
#include <numeric>
#include <utility>
#include <vector>

namespace strata {
namespace {

// Register tiles of MR x rows by NR weight rows: each x vector (from L2 when M is large) serves NR
// FMAs, each weight vector MR.
#if defined(__AVX512F__)
constexpr int MR = 4, NR = 6;        // 24 accumulators + 6 weight vectors + 1 x vector of 32 registers
#elif defined(__AVX2__)
constexpr int MR = 1, NR = 6;        // a 16-lane vector is two of the 16 ymm registers
#else
constexpr int MR = 1, NR = 4;
#endif
constexpr int KC = 1024;             // values a chunk: a whole number of blocks of 32 and of 256

template <int mr, int nr>
void micro(const float* const* x, int64_t kc, const float* wbuf, f32x16* acc, int nvec, bool first,
           bool last, float* const* y, int64_t n) {
  f32x16 a[mr][nr];
#pragma GCC unroll 16
  for (int i = 0; i < mr; i++)
#pragma GCC unroll 16
    for (int r = 0; r < nr; r++) a[i][r] = first ? zero16() : acc[i * NR + r];
  for (int v = 0; v < nvec; v++) {
    f32x16 w[nr];
#pragma GCC unroll 16
    for (int r = 0; r < nr; r++) w[r] = load16(wbuf + r * KC + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) {
      f32x16 xv = load16(x[i] + kc + 16 * v);
#pragma GCC unroll 16
      for (int r = 0; r < nr; r++) a[i][r] = fma16(xv, w[r], a[i][r]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < mr; i++)
#pragma GCC unroll 16
    for (int r = 0; r < nr; r++) {
      if (last) y[i][n + r] = hsum16(a[i][r]);
      else acc[i * NR + r] = a[i][r];
    }
}

using MicroFn = void (*)(const float* const*, int64_t, const float*, f32x16*, int, bool, bool, float* const*,
                         int64_t);

template <int mr, int... nr>
constexpr auto micro_row(std::integer_sequence<int, nr...>) {
  return std::array<MicroFn, NR>{micro<mr, nr + 1>...};
}

template <int... mr>
constexpr auto micro_table(std::integer_sequence<int, mr...>) {
  return std::array<std::array<MicroFn, NR>, MR>{micro_row<mr + 1>(std::make_integer_sequence<int, NR>())...};
}

const auto kMicro = micro_table(std::make_integer_sequence<int, MR>());

}  // namespace

// Also a multiple of 8: the int8 kernels' tile (int8.cc, packed.cc), whose packed tiles must not be cut.
int weight_rows_per_tile() { return std::lcm(std::lcm(NR, kDirectRows), 8); }

void matmul_rows(const TypeInfo& t, const uint8_t* w, int64_t row_bytes, int64_t k, const RowSet& rows,
                 int64_t n0, int64_t n1) {
  if (t.direct && rows.m <= kDirectMaxM) return t.direct(w, row_bytes, k, rows, n0, n1);
  // Per thread, reused across calls (the XLA pool's threads live as long as the process).
  thread_local std::vector<f32x16> acc, wvec(NR * KC / 16);
  float* wbuf = reinterpret_cast<float*>(wvec.data());
  if ((int64_t)acc.size() < rows.m * NR) acc.resize(rows.m * NR);
  for (int64_t n = n0; n < n1; n += NR) {
    int nr = (int)std::min<int64_t>(NR, n1 - n);
    for (int64_t kc = 0; kc < k; kc += KC) {
      int64_t kv = std::min<int64_t>(KC, k - kc), kv16 = (kv + 15) / 16 * 16;
      const uint8_t* ahead = w + (n + 2 * NR) * row_bytes + kc / t.block_values * t.block_bytes;
      for (int r = 0; r < NR; r++)        // two tiles on, as in direct.cc (a prefetch never faults)
        for (int64_t o = 0; o < kv / t.block_values * t.block_bytes; o += 64)
          __builtin_prefetch(ahead + r * row_bytes + o, 0, 3);
      for (int r = 0; r < nr; r++) {
        float* out = wbuf + r * KC;
        t.fn(w + (n + r) * row_bytes, kc, kv, out);
        std::fill(out + kv, out + kv16, 0.0f);
      }
      bool first = kc == 0, last = kc + KC >= k;
      for (int64_t i = 0; i < rows.m; i += MR) {
        int mr = (int)std::min<int64_t>(MR, rows.m - i);
        kMicro[mr - 1][nr - 1](rows.x + i, kc, wbuf, acc.data() + i * NR, (int)(kv16 / 16), first, last,
                               rows.y + i, n);
      }
    }
  }
}

}  // namespace strata
