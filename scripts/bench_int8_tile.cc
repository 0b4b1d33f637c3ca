// The int8 decode kernels alone, in cache and without JAX: one x row times a 1536 x 576 matrix of random
// blocks, the GGUF-block kernel (int8.cc) against the packed one (packed.cc), one thread, the best of 3,000
// calls each, and a check that both give the same bits. Build and run from pallas_kernels/cpu (a level's
// flags from setup.py, e.g. -march=x86-64-v3 for AVX2):
//   g++ -O3 -ffp-contract=off -std=c++17 -march=x86-64-v3 -DSTRATA_LEVEL='"avx2"' -I. \
//       -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") ../../scripts/bench_int8_tile.cc \
//       int8.cc packed.cc packed_q4k.cc dequant.cc direct.cc matmul.cc -o /tmp/bench_int8_tile -lpthread
//   /tmp/bench_int8_tile 3        # the GGML type number: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 20 IQ4_NL
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "int8.h"
#include "packed.h"

using namespace strata;

int main(int argc, char** argv) {
  int qt = argc > 1 ? atoi(argv[1]) : Q4_1;
  int bb = qt == Q4_1 ? 20 : qt == Q8_0 ? 34 : qt == Q5_0 ? 22 : qt == Q5_1 ? 24 : 18;
  int64_t n = 1536, k = 576, rb = k / 32 * bb;
  std::mt19937 g(1);
  std::vector<uint8_t> w(n * rb), p(n * rb);
  for (auto& v : w) v = g();
  for (int64_t r = 0; r < n; r++)          // finite scales (d, and m for the types with one): 2^-7
    for (int64_t b = 0; b < k / 32; b++) {
      uint16_t h = 0x2000;
      memcpy(&w[r * rb + b * bb], &h, 2);
      if (qt == Q4_1 || qt == Q5_1) memcpy(&w[r * rb + b * bb + 2], &h, 2);
    }
  std::vector<float> x(k);
  for (auto& v : x) v = (g() % 1000) / 500.0f - 1;
  const float* xp = x.data();
  Q8Rows q;
  quantize_rows(&xp, 1, k, 32, q);
  std::vector<float> y1(n), y2(n);
  float *yp1 = y1.data(), *yp2 = y2.data();
  Q8RowSet s1{q.rows.data(), &yp1, 1}, s2{q.rows.data(), &yp2, 1};
  Int8Fn f = int8_fn(qt);
  PackedFn pf = packs(qt) ? packed_fn(qt) : nullptr;
  if (pf) pack_rows(qt, w.data(), n, rb, p.data());
  double best1 = 1e9, best2 = 1e9;
  for (int it = 0; it < 3000; it++) {
    auto t0 = std::chrono::steady_clock::now();
    f(w.data(), rb, k, s1, 0, n);
    auto t1 = std::chrono::steady_clock::now();
    if (pf) pf(p.data(), rb, k, n, s2, 0, n);
    auto t2 = std::chrono::steady_clock::now();
    best1 = std::min(best1, std::chrono::duration<double>(t1 - t0).count());
    best2 = std::min(best2, std::chrono::duration<double>(t2 - t1).count());
  }
  if (pf && memcmp(y1.data(), y2.data(), 4 * n)) { printf("packed and GGUF blocks differ\n"); return 1; }
  printf("GGML type %d: GGUF blocks %.1f us (%.1f GB/s)", qt, best1 * 1e6, n * rb / best1 / 1e9);
  if (pf) printf(", packed %.1f us (%.1f GB/s)", best2 * 1e6, n * rb / best2 / 1e9);
  printf("\n");
}
