// XLA FFI handlers: strata_qmatmul, strata_qmatmul_many and strata_expert_matmul (registered by
// pallas_kernels/cpu).
//
// Work is split over weight rows: units of contiguous rows, taken from an atomic counter by the
// calling thread and by helpers scheduled on XLA's intra-op pool (ffi::ThreadPool). Every unit
// handles all x rows for its weight rows, so a weight row is read once a call. The split changes no
// result: each output element is computed by one thread in the order simd.h defines.
#include <algorithm>
#include <string>
#include <vector>

#include "matmul.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

// Helpers to ask for: none for small products (waking a thread costs more than it saves).
int helpers_for(ffi::ThreadPool& pool, int64_t units, int64_t weight_bytes, int64_t flops) {
  if (weight_bytes < (64 << 10) && flops < (4 << 20)) return 0;
  int64_t h = std::min<int64_t>({max_threads() - 1, pool.num_threads(), units - 1});
  return (int)std::max<int64_t>(h, 0);
}

// Weight rows a unit: about 8 units a thread, a whole number of register tiles.
int64_t rows_per_unit(int64_t total_rows) {
  int64_t tile = weight_rows_per_tile();
  int64_t want = total_rows / (8 * (int64_t)max_threads()) + 1;
  return std::clamp<int64_t>((want + tile - 1) / tile * tile, tile, 256);
}

// x rows as pointers, each 64-byte aligned with k readable up to a multiple of 16: in place when
// they are (XLA aligns buffers to 64 bytes, so whenever k is a multiple of 16), else copied into
// `pad` with zeros after k (the small-M kernels load x once an FMA: a load split across two cache
// lines costs two).
std::vector<const float*> x_rows(const float* x, int64_t m, int64_t k, std::vector<f32x16>& pad) {
  std::vector<const float*> p(m);
  if (k % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 64 == 0) {
    for (int64_t i = 0; i < m; i++) p[i] = x + i * k;
    return p;
  }
  int64_t k16 = (k + 15) / 16 * 16;
  pad.assign(m * k16 / 16, zero16());
  float* base = reinterpret_cast<float*>(pad.data());
  for (int64_t i = 0; i < m; i++) {
    std::copy(x + i * k, x + (i + 1) * k, base + i * k16);
    p[i] = base + i * k16;
  }
  return p;
}

// The type's kernel, checked to have one and that rows of row_bytes hold k values of it.
ffi::Error check_type(int32_t qtype, int64_t k, int64_t row_bytes, TypeInfo& t) {
  t = type_info(qtype);
  if (!t.fn)
    return ffi::Error::InvalidArgument("strata cpu kernels: no C++ kernel for GGML type " + std::to_string(qtype));
  if (k % t.block_values || k / t.block_values * t.block_bytes != row_bytes)
    return ffi::Error::InvalidArgument("strata cpu kernels: GGML type " + std::to_string(qtype) + ": x has k = " +
                                       std::to_string(k) + " values a row but the weight rows have " +
                                       std::to_string(row_bytes) + " bytes");
  return ffi::Error::Success();
}

// One weight matrix of a product call: its type, blocks and output rows (y[i] + n0 for x row i).
struct Product {
  TypeInfo t;
  const uint8_t* w;
  int64_t row_bytes, n;
  float* y;                // [M, n]
};

// x [M, k] times each of `ps`, in one parallel region: the units of all the matrices share the threads
// (one wake-up and one wait a call, not one a matrix). A unit's output is computed as in a call of its
// matrix alone: the same bits.
void run_products(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, const std::vector<Product>& ps) {
  std::vector<f32x16> pad;
  std::vector<const float*> xp = x_rows(x, m, k, pad);
  int64_t total = 0, bytes = 0;
  for (const Product& p : ps) total += p.n, bytes += p.n * p.row_bytes;
  int64_t per = rows_per_unit(total);
  std::vector<std::pair<int, int64_t>> units;          // (matrix, first row)
  for (size_t j = 0; j < ps.size(); j++)
    for (int64_t n0 = 0; n0 < ps[j].n; n0 += per) units.push_back({(int)j, n0});
  std::vector<std::vector<float*>> yp(ps.size(), std::vector<float*>(m));
  for (size_t j = 0; j < ps.size(); j++)
    for (int64_t i = 0; i < m; i++) yp[j][i] = ps[j].y + i * ps[j].n;
  int helpers = helpers_for(pool, (int64_t)units.size(), bytes, 2 * m * total * k);
  parallel_units(pool, (int64_t)units.size(), helpers, [&](int64_t u) {
    auto [j, n0] = units[u];
    const Product& p = ps[j];
    RowSet rows{xp.data(), yp[j].data(), m};
    matmul_rows(p.t, p.w, p.row_bytes, k, rows, n0, std::min(p.n, n0 + per));
  });
}

ffi::Error product_of(int64_t k, int32_t qtype, ffi::AnyBuffer w, float* y, Product& p) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("strata_qmatmul: each w must be [n, row_bytes]");
  p = Product{{}, static_cast<const uint8_t*>(w.untyped_data()), wd[1] * (int64_t)ffi::ByteWidth(w.element_type()),
              wd[0], y};
  return check_type(qtype, k, p.row_bytes, p.t);
}

ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::ResultBuffer<ffi::F32> y, int32_t qtype) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("strata_qmatmul: x must be [M, k] and w [n, row_bytes]");
  std::vector<Product> ps(1);
  if (ffi::Error err = product_of(xd[1], qtype, w, y->typed_data(), ps[0]); err.failure()) return err;
  run_products(pool, x.typed_data(), xd[0], xd[1], ps);
  return ffi::Error::Success();
}

// x times several weights at once (q, k and v; gate and up): weights and results in the same order.
ffi::Error QMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                           ffi::RemainingRets ys, ffi::Span<const int32_t> qtypes) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() != qtypes.size() || ys.size() != qtypes.size())
    return ffi::Error::InvalidArgument("strata_qmatmul_many: x [M, k], then as many weights, results and qtypes");
  std::vector<Product> ps(qtypes.size());
  for (size_t j = 0; j < qtypes.size(); j++) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (w.has_error() || y.has_error()) return ffi::Error::InvalidArgument("strata_qmatmul_many: bad operand");
    if (ffi::Error err = product_of(xd[1], qtypes[j], *w, (*y)->typed_data(), ps[j]); err.failure()) return err;
  }
  run_products(pool, x.typed_data(), xd[0], xd[1], ps);
  return ffi::Error::Success();
}

// Rows whose expert id is outside [0, E) (-1: no expert) get zeros and read no weights.
ffi::Error ExpertMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y, int32_t qtype) {
  auto xd = x.dimensions(), wd = w.dimensions(), idd = ids.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || idd.size() != 1 || idd[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "strata_expert_matmul: x must be [R, k], w [E, n, row_bytes] and expert_ids [R]");
  int64_t r_all = xd[0], k = xd[1], n_exp = wd[0], n = wd[1];
  int64_t row_bytes = wd[2] * (int64_t)ffi::ByteWidth(w.element_type());
  TypeInfo t;
  if (ffi::Error err = check_type(qtype, k, row_bytes, t); err.failure()) return err;
  const int32_t* id = ids.typed_data();
  float* yd = y->typed_data();

  // Rows grouped by expert, in row order within an expert (a counting sort).
  std::vector<int64_t> count(n_exp + 1, 0);
  for (int64_t r = 0; r < r_all; r++) {
    int32_t e = id[r];
    if (e >= 0 && e < n_exp) count[e + 1]++;
    else std::fill(yd + r * n, yd + (r + 1) * n, 0.0f);
  }
  for (int64_t e = 0; e < n_exp; e++) count[e + 1] += count[e];
  int64_t chosen_rows = count[n_exp];
  std::vector<f32x16> pad;
  std::vector<const float*> xall = x_rows(x.typed_data(), r_all, k, pad);
  std::vector<const float*> xp(chosen_rows);
  std::vector<float*> yp(chosen_rows);
  {
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t r = 0; r < r_all; r++) {
      int32_t e = id[r];
      if (e < 0 || e >= n_exp) continue;
      xp[fill[e]] = xall[r];
      yp[fill[e]] = yd + r * n;
      fill[e]++;
    }
  }
  std::vector<int64_t> chosen;
  for (int64_t e = 0; e < n_exp; e++)
    if (count[e + 1] > count[e]) chosen.push_back(e);
  if (chosen.empty()) return ffi::Error::Success();

  const uint8_t* wb = static_cast<const uint8_t*>(w.untyped_data());
  int64_t per = rows_per_unit(n * (int64_t)chosen.size()), per_expert = (n + per - 1) / per;
  int64_t units = per_expert * (int64_t)chosen.size();
  int helpers = helpers_for(pool, units, (int64_t)chosen.size() * n * row_bytes, 2 * chosen_rows * n * k);
  parallel_units(pool, units, helpers, [&](int64_t u) {
    int64_t e = chosen[u / per_expert], n0 = (u % per_expert) * per;
    RowSet rows{xp.data() + count[e], yp.data() + count[e], count[e + 1] - count[e]};
    matmul_rows(t, wb + e * n * row_bytes, row_bytes, k, rows, n0, std::min(n, n0 + per));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace strata

// The library is built with hidden symbols (-fvisibility=hidden); these are what Python looks up.
#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))
STRATA_EXPORT XLA_FFI_Error* StrataQMatmul(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataExpertMatmul(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataQMatmulMany(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT const char* strata_cpu_isa();

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataQMatmul, strata::QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataQMatmulMany, strata::QMatmulManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("qtypes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataExpertMatmul, strata::ExpertMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype"));

// For the Python side's checks and log lines: which SIMD path this build took.
const char* strata_cpu_isa() { return strata::kIsa; }
