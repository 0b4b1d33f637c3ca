// XLA FFI handlers: strata_qmatmul, strata_qmatmul_many and strata_expert_matmul (registered by
// pallas_kernels/cpu).
//
// Work is split over weight rows: units of contiguous rows, taken from an atomic counter by the
// calling thread and by helper threads (parallel.h: a pool that spins between calls). Every unit
// handles all x rows for its weight rows, so a weight row is read once a call. The split changes no
// result: each output element is computed by one thread in the order simd.h defines.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "int8.h"
#include "matmul.h"
#include "packed.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

// Helpers to ask for: none for small products (waking a thread costs more than it saves).
int helpers_for(ffi::ThreadPool& pool, int64_t units, int64_t weight_bytes, int64_t flops) {
  if (weight_bytes < (64 << 10) && flops < (4 << 20)) return 0;
  int64_t h = std::min<int64_t>(helper_threads(pool), units - 1);
  return (int)std::max<int64_t>(h, 0);
}

// Weight rows a unit, a whole number of register tiles. m <= 2 rows of x (decode, memory-bound): about
// 2 units a thread, however long, so that each thread streams long runs of contiguous weight rows (the
// kernels prefetch ahead within a unit; units taken alternately by two threads cut every stream short):
// SmolLM2's decode chain of 211 products 3.5-3.6 -> 2.9-3.1 ms on 2 cores with 2 units a thread (a
// 576 x 1536 Q4_1 product 27 -> 18.5 us), 2.7-2.9 ms without the cap of 256 rows (the head's 49,152).
// More rows (compute-bound): about 8 units a thread of at most 256 rows, which balance better when a
// helper joins late (with 2 a thread, 8 rows x 576 x 1536 took 100 us against 68).
int64_t rows_per_unit(int64_t total_rows, int64_t m) {
  int64_t tile = weight_rows_per_tile();
  bool decode = m <= 2;
  int64_t want = total_rows / ((decode ? 2 : 8) * (int64_t)max_threads()) + 1;
  return std::clamp<int64_t>((want + tile - 1) / tile * tile, tile, decode ? total_rows + tile : 256);
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

// A qtype attribute with this bit set: the weight is in packed.h's layout (packed at load: the int8 math only).
constexpr int32_t kPackedBit = 1 << 16;

// The type's kernel, checked to have one and that rows of row_bytes hold k values of it.
ffi::Error check_type(int32_t qtype, int64_t k, int64_t row_bytes, TypeInfo& t) {
  if (qtype & kPackedBit) {
    if (!packs(qtype & ~kPackedBit))
      return ffi::Error::InvalidArgument("strata cpu kernels: GGML type " + std::to_string(qtype & ~kPackedBit) +
                                         " has no packed layout");
    qtype &= ~kPackedBit;
  }
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
  int32_t qtype;
};

// x's rows quantized for the int8 path (--cpu-math int8), once a call for each block size its weights need.
struct QuantizedX {
  Q8Rows by32, by256;

  // Quantizes x for every weight type among `qtypes` that has an int8 kernel.
  void prepare(const float* const* x, int64_t m, int64_t k, const std::vector<int32_t>& qtypes) {
    bool need32 = false, need256 = false;
    for (int32_t q : qtypes)
      if (int8_fn(q & ~kPackedBit)) (int8_unit(q & ~kPackedBit) == 32 ? need32 : need256) = true;
    if (need32) quantize_rows(x, m, k, 32, by32);
    if (need256) quantize_rows(x, m, k, 256, by256);
  }
  const Q8Rows& for_type(int32_t qtype) const { return int8_unit(qtype & ~kPackedBit) == 32 ? by32 : by256; }
};

// Weight rows [n0, n1) of a matrix of n rows times rows `x` (float, the exact path) or `xq` (quantized: the
// int8 path, when the call asked for it and the type has one; a packed weight, always).
void product_rows(const TypeInfo& t, int32_t qtype, bool int8, const uint8_t* w, int64_t row_bytes, int64_t k,
                  int64_t n, const RowSet& rows, const Q8Row* xq, int64_t n0, int64_t n1) {
  if (qtype & kPackedBit) return packed_fn(qtype & ~kPackedBit)(w, row_bytes, k, n, Q8RowSet{xq, rows.y, rows.m}, n0, n1);
  Int8Fn f = int8 ? int8_fn(qtype) : nullptr;
  if (f) return f(w, row_bytes, k, Q8RowSet{xq, rows.y, rows.m}, n0, n1);
  matmul_rows(t, w, row_bytes, k, rows, n0, n1);
}

// x [M, k] times each of `ps`, in one parallel region: the units of all the matrices share the threads
// (one wake-up and one wait a call, not one a matrix). A unit's output is computed as in a call of its
// matrix alone: the same bits.
void run_products(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, const std::vector<Product>& ps,
                  bool int8) {
  std::vector<f32x16> pad;
  std::vector<const float*> xp = x_rows(x, m, k, pad);
  QuantizedX xq;
  if (int8) {
    std::vector<int32_t> qtypes;
    for (const Product& p : ps) qtypes.push_back(p.qtype);
    xq.prepare(xp.data(), m, k, qtypes);
  }
  int64_t total = 0, bytes = 0;
  for (const Product& p : ps) total += p.n, bytes += p.n * p.row_bytes;
  int64_t per = rows_per_unit(total, m);
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
    product_rows(p.t, p.qtype, int8, p.w, p.row_bytes, k, p.n, rows, xq.for_type(p.qtype).rows.data(), n0,
                 std::min(p.n, n0 + per));
  });
}

ffi::Error product_of(int64_t k, int32_t qtype, ffi::AnyBuffer w, float* y, Product& p) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("strata_qmatmul: each w must be [n, row_bytes]");
  p = Product{{}, static_cast<const uint8_t*>(w.untyped_data()), wd[1] * (int64_t)ffi::ByteWidth(w.element_type()),
              wd[0], y, qtype};
  return check_type(qtype, k, p.row_bytes, p.t);
}

// A packed weight is read by the int8 kernel only (packed at load for --cpu-math int8).
template <class P>
ffi::Error check_math(const std::vector<P>& ps, int32_t int8) {
  for (const P& p : ps)
    if ((p.qtype & kPackedBit) && !int8)
      return ffi::Error::InvalidArgument("strata cpu kernels: a packed weight (GGML type " +
                                         std::to_string(p.qtype & ~kPackedBit) + ") needs the int8 math, not exact");
  return ffi::Error::Success();
}

ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int32_t int8) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("strata_qmatmul: x must be [M, k] and w [n, row_bytes]");
  std::vector<Product> ps(1);
  if (ffi::Error err = product_of(xd[1], qtype, w, y->typed_data(), ps[0]); err.failure()) return err;
  if (ffi::Error err = check_math(ps, int8); err.failure()) return err;
  run_products(pool, x.typed_data(), xd[0], xd[1], ps, int8);
  return ffi::Error::Success();
}

// x times several weights at once (q, k and v; gate and up): weights and results in the same order.
ffi::Error QMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                           ffi::RemainingRets ys, ffi::Span<const int32_t> qtypes, int32_t int8) {
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
  if (ffi::Error err = check_math(ps, int8); err.failure()) return err;
  run_products(pool, x.typed_data(), xd[0], xd[1], ps, int8);
  return ffi::Error::Success();
}

// RMSNorm of each row of x [M, k] (llama.cpp's rms_norm and then the weight): hx = x * (1 / sqrt(mean(x^2)
// + eps)) * w, in float32, the sum of squares in a fixed order a row (16 lanes, then simd.h's tree, then
// the tail): a row's result depends on that row only. One call of this instead of XLA's four operations
// a norm (a SmolLM2 decode step ran ~500 small XLA operations, 1-2 us each).
void rms_norm_rows(const float* x, const float* w, float eps, int64_t m, int64_t k, float* hx) {
  for (int64_t i = 0; i < m; i++) {
    const float* xi = x + i * k;
    float* hi = hx + i * k;
    f32x16 acc = zero16();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
      f32x16 v = load16(xi + j);
      acc = fma16(v, v, acc);
    }
    float ss = hsum16(acc);
    for (; j < k; j++) ss += xi[j] * xi[j];
    float r = 1.0f / std::sqrt(ss / (float)k + eps);
    for (j = 0; j < k; j++) hi[j] = (xi[j] * r) * w[j];
  }
}

// The norm of x, then its product by each weight (q, k, v; gate, up; or none: the norm alone): results
// hx [M, k] first, then one [M, n] a weight.
ffi::Error NormQMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm,
                               ffi::RemainingArgs ws, ffi::RemainingRets ys, ffi::Span<const int32_t> qtypes,
                               float eps, int32_t int8) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || norm.element_count() != xd[1] || ws.size() + 1 != ys.size() || ws.size() != qtypes.size())
    return ffi::Error::InvalidArgument("strata_norm_qmatmul_many: x [M, k], norm [k], then as many weights and "
                                       "qtypes as results after hx");
  auto hx = ys.get<ffi::Buffer<ffi::F32>>(0);
  if (hx.has_error()) return ffi::Error::InvalidArgument("strata_norm_qmatmul_many: bad hx");
  float* h = (*hx)->typed_data();
  rms_norm_rows(x.typed_data(), norm.typed_data(), eps, xd[0], xd[1], h);
  std::vector<Product> ps(qtypes.size());
  for (size_t j = 0; j < qtypes.size(); j++) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j + 1);
    if (w.has_error() || y.has_error()) return ffi::Error::InvalidArgument("strata_norm_qmatmul_many: bad operand");
    if (ffi::Error err = product_of(xd[1], qtypes[j], *w, (*y)->typed_data(), ps[j]); err.failure()) return err;
  }
  if (ffi::Error err = check_math(ps, int8); err.failure()) return err;
  if (!ps.empty()) run_products(pool, h, xd[0], xd[1], ps, int8);
  return ffi::Error::Success();
}

// One expert weight of an expert call: its experts in one or more places ("sources": an expert tier's
// arena slots, then the host tier's blocks), each [E_s, n, row_bytes] of its own type and layout (the same
// logical matrix: packed slots, GGUF blocks), and its output [R, n]. The call's expert ids run over the
// sources in order: id e < E_0 is source 0's expert e, E_0 <= e < E_0 + E_1 source 1's expert e - E_0, ...
struct ExpertSource {
  TypeInfo t;
  const uint8_t* w;
  int64_t n_exp, row_bytes;
  int32_t qtype;
};
struct ExpertProduct {
  std::vector<ExpertSource> src;
  int64_t n;
  float* y;

  int64_t n_exp() const {
    int64_t e = 0;
    for (const ExpertSource& s : src) e += s.n_exp;
    return e;
  }
  // The source of expert id e, and e's index in it.
  const ExpertSource& source(int64_t& e) const {
    size_t i = 0;
    while (e >= src[i].n_exp) e -= src[i++].n_exp;
    return src[i];
  }
};

// Row r of x [R, k] times expert ids[r] of each weight of `ps` (all with the same sources' expert counts).
// Rows whose expert id is outside [0, E) (-1: no expert) get zeros and read no weights. The rows are
// grouped by expert once; the units of every weight and chosen expert share the threads, each computed as
// alone (so a row's bits do not depend on which source its expert came from, when the sources' layouts
// give the same bits: packed and GGUF blocks do).
void run_expert_products(ffi::ThreadPool& pool, const float* x, int64_t r_all, int64_t k, const int32_t* id,
                         const std::vector<ExpertProduct>& ps, bool int8) {
  int64_t n_exp = ps[0].n_exp();
  std::vector<int64_t> count(n_exp + 1, 0);        // rows by expert, in row order within one (counting sort)
  for (int64_t r = 0; r < r_all; r++) {
    int32_t e = id[r];
    if (e >= 0 && e < n_exp) count[e + 1]++;
    else
      for (const ExpertProduct& p : ps) std::fill(p.y + r * p.n, p.y + (r + 1) * p.n, 0.0f);
  }
  for (int64_t e = 0; e < n_exp; e++) count[e + 1] += count[e];
  int64_t chosen_rows = count[n_exp];
  std::vector<f32x16> pad;
  std::vector<const float*> xall = x_rows(x, r_all, k, pad);
  QuantizedX xq;
  if (int8) {
    std::vector<int32_t> qtypes;
    for (const ExpertProduct& p : ps)
      for (const ExpertSource& s : p.src) qtypes.push_back(s.qtype);
    xq.prepare(xall.data(), r_all, k, qtypes);
  }
  std::vector<const float*> xp(chosen_rows);
  std::vector<int64_t> row_of(chosen_rows);
  {
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t r = 0; r < r_all; r++) {
      int32_t e = id[r];
      if (e < 0 || e >= n_exp) continue;
      xp[fill[e]] = xall[r];
      row_of[fill[e]++] = r;
    }
  }
  // The quantized rows in the same (grouped) order, for each block size quantized.
  std::vector<Q8Row> xq32(xq.by32.rows.empty() ? 0 : chosen_rows), xq256(xq.by256.rows.empty() ? 0 : chosen_rows);
  for (int64_t i = 0; i < chosen_rows; i++) {
    if (!xq32.empty()) xq32[i] = xq.by32.rows[row_of[i]];
    if (!xq256.empty()) xq256[i] = xq.by256.rows[row_of[i]];
  }
  std::vector<std::vector<float*>> yp(ps.size(), std::vector<float*>(chosen_rows));
  for (size_t j = 0; j < ps.size(); j++)
    for (int64_t i = 0; i < chosen_rows; i++) yp[j][i] = ps[j].y + row_of[i] * ps[j].n;
  std::vector<int64_t> chosen;
  for (int64_t e = 0; e < n_exp; e++)
    if (count[e + 1] > count[e]) chosen.push_back(e);
  if (chosen.empty()) return;

  int64_t total = 0, bytes = 0;
  for (const ExpertProduct& p : ps) total += p.n, bytes += p.n * p.src[0].row_bytes;
  int64_t per = rows_per_unit(total * (int64_t)chosen.size(), chosen_rows / (int64_t)chosen.size());
  std::vector<std::tuple<int, int64_t, int64_t>> units;     // (weight, expert, first row)
  for (size_t j = 0; j < ps.size(); j++)
    for (int64_t e : chosen)
      for (int64_t n0 = 0; n0 < ps[j].n; n0 += per) units.push_back({(int)j, e, n0});
  int helpers = helpers_for(pool, (int64_t)units.size(), (int64_t)chosen.size() * bytes, 2 * chosen_rows * total * k);
  parallel_units(pool, (int64_t)units.size(), helpers, [&](int64_t u) {
    auto [j, e, n0] = units[u];
    const ExpertProduct& p = ps[j];
    int64_t local = e;
    const ExpertSource& s = p.source(local);
    RowSet rows{xp.data() + count[e], yp[j].data() + count[e], count[e + 1] - count[e]};
    const std::vector<Q8Row>& q = int8_unit(s.qtype & ~kPackedBit) == 32 ? xq32 : xq256;
    product_rows(s.t, s.qtype, int8, s.w + local * p.n * s.row_bytes, s.row_bytes, k, p.n, rows,
                 q.empty() ? nullptr : q.data() + count[e], n0, std::min(p.n, n0 + per));
  });
}

// One source of an expert weight: w [E, n, row_bytes] of GGML type qtype, for rows of k values.
ffi::Error expert_source_of(int64_t k, int32_t qtype, ffi::AnyBuffer w, ExpertSource& s, int64_t& n) {
  auto wd = w.dimensions();
  if (wd.size() != 3) return ffi::Error::InvalidArgument("strata_expert_matmul: each w must be [E, n, row_bytes]");
  s = ExpertSource{{}, static_cast<const uint8_t*>(w.untyped_data()), wd[0],
                   wd[2] * (int64_t)ffi::ByteWidth(w.element_type()), qtype};
  n = wd[1];
  return check_type(qtype, k, s.row_bytes, s.t);
}

ffi::Error check_math(const std::vector<ExpertProduct>& ps, int32_t int8) {
  for (const ExpertProduct& p : ps)
    if (ffi::Error err = check_math(p.src, int8); err.failure()) return err;
  return ffi::Error::Success();
}

ffi::Error check_expert_inputs(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& ids) {
  auto xd = x.dimensions(), idd = ids.dimensions();
  if (xd.size() != 2 || idd.size() != 1 || idd[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "strata_expert_matmul: x must be [R, k], w [E, n, row_bytes] and expert_ids [R]");
  return ffi::Error::Success();
}

ffi::Error ExpertMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int32_t int8) {
  if (ffi::Error err = check_expert_inputs(x, ids); err.failure()) return err;
  std::vector<ExpertProduct> ps(1);
  ps[0].src.resize(1);
  ps[0].y = y->typed_data();
  if (ffi::Error err = expert_source_of(x.dimensions()[1], qtype, w, ps[0].src[0], ps[0].n); err.failure())
    return err;
  if (ffi::Error err = check_math(ps, int8); err.failure()) return err;
  run_expert_products(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], ids.typed_data(), ps, int8);
  return ffi::Error::Success();
}

// Several expert weights of the same rows and ids at once (gate and up), each from S sources (S = the
// weights given / the results): weights product by product, each product's sources in order, and a
// qtype a weight; results in product order.
ffi::Error ExpertMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                                ffi::RemainingArgs ws, ffi::RemainingRets ys, ffi::Span<const int32_t> qtypes,
                                int32_t int8) {
  if (ffi::Error err = check_expert_inputs(x, ids); err.failure()) return err;
  if (ws.size() != qtypes.size() || ys.size() == 0 || ws.size() % ys.size() != 0)
    return ffi::Error::InvalidArgument("strata_expert_matmul_many: a qtype a weight, and the same number of "
                                       "weights (sources) for each result");
  size_t n_src = ws.size() / ys.size();
  std::vector<ExpertProduct> ps(ys.size());
  for (size_t j = 0; j < ps.size(); j++) {
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (y.has_error()) return ffi::Error::InvalidArgument("strata_expert_matmul_many: bad result");
    ps[j].y = (*y)->typed_data();
    ps[j].src.resize(n_src);
    for (size_t s = 0; s < n_src; s++) {
      size_t a = j * n_src + s;
      auto w = ws.get<ffi::AnyBuffer>(a);
      if (w.has_error()) return ffi::Error::InvalidArgument("strata_expert_matmul_many: bad weight");
      int64_t n;
      if (ffi::Error err = expert_source_of(x.dimensions()[1], qtypes[a], *w, ps[j].src[s], n); err.failure())
        return err;
      if (s == 0) ps[j].n = n;
      if (n != ps[j].n || ps[j].src[s].n_exp != ps[0].src[s].n_exp)
        return ffi::Error::InvalidArgument("strata_expert_matmul_many: a weight's sources differ in rows, or the "
                                           "weights' sources in experts");
    }
  }
  if (ffi::Error err = check_math(ps, int8); err.failure()) return err;
  run_expert_products(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], ids.typed_data(), ps, int8);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace strata

// The library is built with hidden symbols (-fvisibility=hidden); these are what Python looks up.
#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))
STRATA_EXPORT XLA_FFI_Error* StrataQMatmul(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataExpertMatmul(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataQMatmulMany(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataExpertMatmulMany(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataNormQMatmulMany(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT const char* strata_cpu_isa();

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataQMatmul, strata::QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("int8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataQMatmulMany, strata::QMatmulManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("qtypes")
                                  .Attr<int32_t>("int8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataNormQMatmulMany, strata::NormQMatmulManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("qtypes")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("int8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataExpertMatmulMany, strata::ExpertMatmulManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("qtypes")
                                  .Attr<int32_t>("int8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataExpertMatmul, strata::ExpertMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("int8"));

// Packs rows [0, n) of src (row_bytes each, GGML type qtype) into dst, the same size (packed.h): 0, or -1
// when the type has no packed layout or the rows are not whole blocks of it.
STRATA_EXPORT int strata_pack_rows(int32_t qtype, const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst) {
  strata::TypeInfo t = strata::type_info(qtype);
  if (!strata::packs(qtype) || row_bytes % t.block_bytes) return -1;
  strata::pack_rows(qtype, src, n, row_bytes, dst);
  return 0;
}

// For the Python side's checks and log lines: which SIMD path this build took.
const char* strata_cpu_isa() { return strata::kIsa; }
