// strata_attention: attention over the KV cache where it lies (the cpu backend's attention).
//
// out[r, l, h] = sum over keys c = 0..p of softmax_c((q[r, l, h] / sqrt(D)) . k[layer, slot, c, h / G])
// * v[layer, slot, c, h / G], with p = pos[r, l] and slot = slots[r]; a query with p < 0 (padding) gives
// zeros. XLA's attention (model/layers.py: attend) first gathers each row's keys out of the cache and
// transposes them for its dots: ~45 us a layer and tensor at one decode row, more than the products.
// Here every key is read once a unit from the cache itself, and only the keys a query sees.
//
// Order (what makes a result depend only on its own query): each query walks its keys in tiles of
// kTile positions from position 0, with an online softmax (running max, sum and accumulator rescaled
// at each tile), each score one fixed-order dot (simd.h). The tiles are the same whatever the window
// holds, so a row gives the same bits alone or batched, in a decode, verify or prefill window, and
// whatever the window's KV bucket.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

constexpr int kTile = 32;      // key positions a tile
constexpr int kTokens = 16;    // query tokens a unit of work (all of one kv head's query heads)

// One cache tensor [layers, slots, positions, kv_heads, dim] of float32, bfloat16 or int8 (with a
// float32 scale a position and head, [layers, slots, positions, kv_heads]).
struct Cache {
  const uint8_t* data;
  ffi::DataType type;
  const float* scale;
  int64_t slots, positions, heads, dim;

  // Key c of (layer, slot, head) as float32 into out[0, dim), zeros up to dim16.
  void row(int64_t layer, int64_t slot, int64_t c, int64_t head, float* out, int64_t dim16) const {
    int64_t at = ((layer * slots + slot) * positions + c) * heads + head;
    if (type == ffi::DataType::F32) {
      std::copy_n(reinterpret_cast<const float*>(data) + at * dim, dim, out);
    } else if (type == ffi::DataType::BF16) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + at * dim;
      for (int64_t d = 0; d < dim; d++) {
        uint32_t bits = uint32_t(p[d]) << 16;
        std::memcpy(out + d, &bits, 4);
      }
    } else {                                     // int8: float(q) * scale, as the xla path reads it
      const int8_t* p = reinterpret_cast<const int8_t*>(data) + at * dim;
      float s = scale[at];
      for (int64_t d = 0; d < dim; d++) out[d] = float(p[d]) * s;
    }
    std::fill(out + dim, out + dim16, 0.0f);
  }
};

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// One unit: query tokens [l0, l1) of row r, the G query heads of kv head kh.
struct Unit {
  const float* q;          // [R, L, H, D]
  float* out;              // [R, L, H, Dv]
  const int32_t* pos;      // [R, L]
  const Cache *k, *v;
  int64_t L, H, G, layer;

  void run(int64_t r, int64_t slot, int64_t kh, int64_t l0, int64_t l1) const {
    const int64_t D = k->dim, Dv = v->dim, D16 = round16(D), Dv16 = round16(Dv);
    const int64_t nq = (l1 - l0) * G, last_pos = k->positions - 2;     // the last position is scratch
    thread_local std::vector<f32x16> qbuf, acc, ktile, vtile;
    thread_local std::vector<float> mx, sum;
    thread_local std::vector<int64_t> qpos;
    qbuf.resize(nq * D16 / 16), acc.assign(nq * Dv16 / 16, zero16());
    ktile.resize(kTile * D16 / 16), vtile.resize(kTile * Dv16 / 16);
    mx.assign(nq, -std::numeric_limits<float>::infinity()), sum.assign(nq, 0.0f), qpos.resize(nq);
    float* qf = reinterpret_cast<float*>(qbuf.data());
    float* kf = reinterpret_cast<float*>(ktile.data());
    float* vf = reinterpret_cast<float*>(vtile.data());
    const float rsd = std::sqrt(float(D));

    int64_t top = -1;                            // the last key position any query of the unit sees
    for (int64_t l = l0; l < l1; l++) {
      int64_t p = std::min<int64_t>(pos[r * L + l], last_pos);
      for (int64_t g = 0; g < G; g++) {
        int64_t i = (l - l0) * G + g;
        const float* src = q + ((r * L + l) * H + kh * G + g) * D;
        for (int64_t d = 0; d < D16; d++) qf[i * D16 + d] = d < D ? src[d] / rsd : 0.0f;
        qpos[i] = p;
      }
      top = std::max(top, p);
    }

    float scores[kTile];
    for (int64_t t0 = 0; t0 <= top; t0 += kTile) {
      int64_t n = std::min<int64_t>(kTile, top + 1 - t0);
      for (int64_t j = 0; j < n; j++) {
        k->row(layer, slot, t0 + j, kh, kf + j * D16, D16);
        v->row(layer, slot, t0 + j, kh, vf + j * Dv16, Dv16);
      }
      for (int64_t i = 0; i < nq; i++) {
        if (qpos[i] < t0) continue;
        int64_t cnt = std::min<int64_t>(n, qpos[i] + 1 - t0);
        float tmax = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < cnt; j++) {
          f32x16 a = zero16();
          for (int64_t d = 0; d < D16; d += 16) a = fma16(load16(qf + i * D16 + d), load16(kf + j * D16 + d), a);
          scores[j] = hsum16(a);
          tmax = std::max(tmax, scores[j]);
        }
        // NaN scores (a broken model) propagate through the exps into the sum: the output is NaN, which
        // the sampler reports, as the xla path's is.
        float m_new = std::max(mx[i], tmax);
        float corr = mx[i] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(mx[i] - m_new);
        f32x16* a = acc.data() + i * Dv16 / 16;
        float s = sum[i] * corr;
        for (int64_t d = 0; d < Dv16 / 16; d++) a[d] = a[d] * corr;
        for (int64_t j = 0; j < cnt; j++) {
          float e = std::exp(scores[j] - m_new);
          s += e;
          f32x16 ev = splat(e);
          for (int64_t d = 0; d < Dv16 / 16; d++) a[d] = fma16(ev, load16(vf + j * Dv16 + 16 * d), a[d]);
        }
        mx[i] = m_new, sum[i] = s;
      }
    }

    for (int64_t i = 0; i < nq; i++) {
      int64_t l = l0 + i / G, h = kh * G + i % G;
      float* dst = out + ((r * L + l) * H + h) * Dv;
      const float* a = reinterpret_cast<const float*>(acc.data() + i * Dv16 / 16);
      for (int64_t d = 0; d < Dv; d++) dst[d] = qpos[i] >= 0 ? a[d] / sum[i] : 0.0f;
    }
  }
};

ffi::Error check_cache(const char* name, ffi::AnyBuffer& c, ffi::Buffer<ffi::F32>& scale, Cache& out) {
  auto d = c.dimensions();
  if (d.size() != 5)
    return ffi::Error::InvalidArgument(std::string("strata_attention: the ") + name +
                                       " cache must be [layers, slots, positions, kv_heads, dim]");
  ffi::DataType t = c.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::S8)
    return ffi::Error::InvalidArgument(std::string("strata_attention: the ") + name +
                                       " cache must be float32, bfloat16 or int8");
  if (t == ffi::DataType::S8 && (int64_t)scale.element_count() != d[0] * d[1] * d[2] * d[3])
    return ffi::Error::InvalidArgument(std::string("strata_attention: an int8 ") + name +
                                       " cache needs a scale [layers, slots, positions, kv_heads]");
  out = Cache{static_cast<const uint8_t*>(c.untyped_data()), t, scale.typed_data(), d[1], d[2], d[3], d[4]};
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                         ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out) {
  Cache k, v;
  if (ffi::Error e = check_cache("key", kc, k_scale, k); e.failure()) return e;
  if (ffi::Error e = check_cache("value", vc, v_scale, v); e.failure()) return e;
  auto qd = q.dimensions(), kd = kc.dimensions();
  if (qd.size() != 4 || qd[3] != k.dim || slots.element_count() != (size_t)qd[0] ||
      pos.element_count() != (size_t)(qd[0] * qd[1]) || layer.element_count() != 1 || qd[2] % k.heads ||
      vc.dimensions()[0] != kd[0] || v.slots != k.slots || v.positions != k.positions || v.heads != k.heads)
    return ffi::Error::InvalidArgument(
        "strata_attention: q must be [R, L, H, D] with H a multiple of the kv heads, slots [R], pos [R, L], "
        "layer a scalar, and the caches alike but for their last dim");
  int64_t R = qd[0], L = qd[1], H = qd[2], lay = layer.typed_data()[0];
  if (lay < 0 || lay >= kd[0])
    return ffi::Error::InvalidArgument("strata_attention: layer " + std::to_string(lay) + " outside [0, " +
                                       std::to_string(kd[0]) + ")");
  const int32_t* sl = slots.typed_data();
  for (int64_t r = 0; r < R; r++)
    if (sl[r] < 0 || sl[r] >= k.slots)
      return ffi::Error::InvalidArgument("strata_attention: slot " + std::to_string(sl[r]) + " outside [0, " +
                                         std::to_string(k.slots) + ")");
  Unit unit{q.typed_data(), out->typed_data(), pos.typed_data(), &k, &v, L, H, H / k.heads, lay};
  int64_t blocks = (L + kTokens - 1) / kTokens, units = R * k.heads * blocks;
  // Helpers only when the keys to read are many (waking a thread costs ~ a few thousand keys' dots).
  int64_t keys = 0;
  for (int64_t i = 0; i < R * L; i++) keys += std::max<int32_t>(pos.typed_data()[i] + 1, 0);
  int helpers = keys * H < 4096 ? 0 : (int)std::min<int64_t>({max_threads() - 1, pool.num_threads(), units - 1});
  parallel_units(pool, units, std::max(helpers, 0), [&](int64_t u) {
    int64_t r = u / (k.heads * blocks), kh = u / blocks % k.heads, b = u % blocks;
    unit.run(r, sl[r], kh, b * kTokens, std::min(L, (b + 1) * kTokens));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace strata

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))
STRATA_EXPORT XLA_FFI_Error* StrataAttention(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataAttention, strata::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q [R, L, H, D]
                                  .Arg<ffi::AnyBuffer>()            // key cache
                                  .Arg<ffi::AnyBuffer>()            // value cache
                                  .Arg<ffi::Buffer<ffi::F32>>()     // key scales (int8 caches)
                                  .Arg<ffi::Buffer<ffi::F32>>()     // value scales
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()     // slots [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // pos [R, L]
                                  .Ret<ffi::Buffer<ffi::F32>>());   // [R, L, H, Dv]
