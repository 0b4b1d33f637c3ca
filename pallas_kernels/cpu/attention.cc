// strata_attention: attention over the KV cache where it lies (the cpu backend's attention).
//
// out[r, l, h] = sum over keys c = 0..p of softmax_c((q[r, l, h] / sqrt(D)) . k[layer, slot, c, h / G])
// * v[layer, slot, c, h / G], with p = pos[r, l] and slot = slots[r]; a query with p < 0 (padding) gives
// zeros. XLA's attention (model/layers.py: attend) first gathers each row's keys out of the cache and
// transposes them for its dots: ~45 us a layer and tensor at one decode row, more than the products.
// Here every key is read once a unit from the cache itself, and only the keys a query sees.
//
// Order (what makes a result depend only on its own query): each query walks its keys in tiles of
// kTile positions from position 0 (--kv-resident: the same tiles over the device part, then the host
// blocks, the softmax state carried from call to call: strata_attention_part), with an online softmax (running max, sum and accumulator rescaled
// at each tile), each score one fixed-order dot (simd.h). The tiles are the same whatever the window
// holds, so a row gives the same bits alone or batched, in a decode, verify or prefill window, and
// whatever the window's KV bucket.
//
// gpt-oss (strata_jax/model/gpt_oss.py): a sink logit a query head, joined to the softmax's
// denominator only at the end (out = acc e^(m - m') / (s e^(m - m') + e^(sink - m')), m' = max(m, sink));
// and a sliding window, keys with pos - key >= window skipped (a tile wholly before a query's window is
// skipped for it as one wholly in its future is, so the tiles it reads, and its bits, stay its own).
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

constexpr int kTile = 16;      // key positions a tile (every --attn-chunk, so every host block, is a multiple)
constexpr int kTokens = 16;    // query tokens a unit of work (all of one kv head's query heads)

// One cache tensor [layers, slots, positions, kv_heads, dim] of float32, bfloat16 or int8 (with a
// float32 scale a position and head, [layers, slots, positions, kv_heads]).
struct Cache {
  const uint8_t* data;
  ffi::DataType type;
  const float* scale;
  int64_t slots, positions, heads, dim;

  void prefetch(int64_t layer, int64_t slot, int64_t c, int64_t head) const {
    int64_t at = ((layer * slots + slot) * positions + c) * heads + head;
    int64_t bytes = dim * (type == ffi::DataType::F32 ? 4 : type == ffi::DataType::BF16 ? 2 : 1);
    const uint8_t* p = data + at * bytes;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
  }

  // Key c of (layer, slot, head) as float32, readable up to dim16 (zeros after dim): in place for a
  // float32 cache whose rows are whole vectors (no copy: at a decode row the copies were ~20% of the
  // step), else converted into buf.
  const float* row(int64_t layer, int64_t slot, int64_t c, int64_t head, float* buf, int64_t dim16) const {
    int64_t at = ((layer * slots + slot) * positions + c) * heads + head;
    if (type == ffi::DataType::F32) {
      const float* p = reinterpret_cast<const float*>(data) + at * dim;
      if (dim == dim16) return p;
      std::copy_n(p, dim, buf);
    } else if (type == ffi::DataType::BF16) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + at * dim;
      for (int64_t d = 0; d < dim; d++) {
        uint32_t bits = uint32_t(p[d]) << 16;
        std::memcpy(buf + d, &bits, 4);
      }
    } else {                                     // int8: float(q) * scale, as the xla path reads it
      const int8_t* p = reinterpret_cast<const int8_t*>(data) + at * dim;
      float s = scale[at];
      for (int64_t d = 0; d < dim; d++) buf[d] = float(p[d]) * s;
    }
    std::fill(buf + dim, buf + dim16, 0.0f);
    return buf;
  }
};

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// Which keys a call reads: positions [lo, hi) (each a multiple of kTile, or hi past every query), found
// at index (position - base) of the source's position axis. One call over the whole cache is
// {0, 0, positions - 1} (the last position is scratch); --kv-resident runs the device part and then each
// host block as a call of its own, the softmax state carried between them.
struct Range {
  int64_t base, lo, hi;
};

// The online softmax state of every query [R, L, H] (acc [R, L, H, Dv]); null: a fresh state, not kept.
struct State {
  float *m, *s, *acc;
};

// One unit: query tokens [t0, t1) (flat indices r * L + l, all of one slot), the G query heads of kv head kh.
struct Unit {
  const float* q;          // [R, L, H, D]
  float* out;              // [R, L, H, Dv], or null: the state only
  const int32_t* pos;      // [R, L]
  const Cache *k, *v;
  int64_t L, H, G, layer;
  Range range;
  State in, kept;          // in: the state to start from (null: fresh); kept: where it goes (null: nowhere)
  const float* sinks;      // [H] (gpt-oss), or null
  int64_t window;          // keys with pos - key >= window are masked; 0: none

  void run(int64_t slot, int64_t kh, int64_t t0, int64_t t1) const {
    const int64_t D = k->dim, Dv = v->dim, D16 = round16(D), Dv16 = round16(Dv);
    const int64_t nq = (t1 - t0) * G;
    const int64_t hi = std::min(range.hi, range.base + k->positions);      // never past the source
    thread_local std::vector<f32x16> qbuf, acc, ktile, vtile;
    thread_local std::vector<float> mx, sum;
    thread_local std::vector<int64_t> qpos, at, qlo;
    qbuf.resize(nq * D16 / 16), acc.assign(nq * Dv16 / 16, zero16());
    ktile.resize(kTile * D16 / 16), vtile.resize(kTile * Dv16 / 16);
    mx.assign(nq, -std::numeric_limits<float>::infinity()), sum.assign(nq, 0.0f), qpos.resize(nq), at.resize(nq), qlo.resize(nq);
    float* qf = reinterpret_cast<float*>(qbuf.data());
    float* kf = reinterpret_cast<float*>(ktile.data());
    float* vf = reinterpret_cast<float*>(vtile.data());
    float* af = reinterpret_cast<float*>(acc.data());
    const float rsd = std::sqrt(float(D));

    int64_t top = -1;                            // the last key position any query of the unit sees here
    int64_t bottom = std::numeric_limits<int64_t>::max();  // the first, with a window
    for (int64_t t = t0; t < t1; t++) {
      int64_t p = pos[t];
      int64_t lo = window > 0 ? std::max<int64_t>(p - window + 1, 0) : 0;
      if (p >= 0) bottom = std::min(bottom, lo);
      for (int64_t g = 0; g < G; g++) {
        int64_t i = (t - t0) * G + g, h = kh * G + g;
        const float* src = q + (t * H + h) * D;
        for (int64_t d = 0; d < D16; d++) qf[i * D16 + d] = d < D ? src[d] / rsd : 0.0f;
        qpos[i] = p;
        qlo[i] = lo;
        at[i] = t * H + h;
        if (in.m) {
          mx[i] = in.m[at[i]], sum[i] = in.s[at[i]];
          std::copy_n(in.acc + at[i] * Dv, Dv, af + i * Dv16);
        }
      }
      top = std::max(top, std::min(p, hi - 1));
    }

    float scores[kTile];
    int64_t first = range.lo;
    if (window > 0 && bottom != std::numeric_limits<int64_t>::max())
      first = std::max(range.lo, bottom / kTile * kTile);
    for (int64_t t0 = first; t0 <= top; t0 += kTile) {
      int64_t n = std::min<int64_t>(kTile, top + 1 - t0);
      // The next tile's keys and values, asked for now: a key is a few cache lines `heads` rows apart, and
      // read on demand each one missed (attention was half load stalls at a few hundred positions).
      for (int64_t j = 0, next = t0 + kTile - range.base; j < kTile && t0 + kTile + j <= top; j++) {
        k->prefetch(layer, slot, next + j, kh);
        v->prefetch(layer, slot, next + j, kh);
      }
      const float *kr[kTile], *vr[kTile];
      for (int64_t j = 0; j < n; j++) {
        kr[j] = k->row(layer, slot, t0 + j - range.base, kh, kf + j * D16, D16);
        vr[j] = v->row(layer, slot, t0 + j - range.base, kh, vf + j * Dv16, Dv16);
      }
      for (int64_t i = 0; i < nq; i++) {
        if (qpos[i] < t0 || qlo[i] >= t0 + n) continue;
        int64_t cnt = std::min<int64_t>(n, qpos[i] + 1 - t0);
        int64_t j0 = std::max<int64_t>(qlo[i] - t0, 0);          // the window's first key in the tile
        float tmax = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j < cnt; j++) {
          f32x16 a = zero16();
          for (int64_t d = 0; d < D16; d += 16) a = fma16(load16(qf + i * D16 + d), load16(kr[j] + d), a);
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
        for (int64_t j = j0; j < cnt; j++) {
          float e = std::exp(scores[j] - m_new);
          s += e;
          f32x16 ev = splat(e);
          for (int64_t d = 0; d < Dv16 / 16; d++) a[d] = fma16(ev, load16(vr[j] + 16 * d), a[d]);
        }
        mx[i] = m_new, sum[i] = s;
      }
    }

    for (int64_t i = 0; i < nq; i++) {
      if (kept.m) {
        kept.m[at[i]] = mx[i], kept.s[at[i]] = sum[i];
        std::copy_n(af + i * Dv16, Dv, kept.acc + at[i] * Dv);
      }
      if (out) {
        float* dst = out + at[i] * Dv;
        float keep = 1.0f, s = sum[i];
        if (sinks && qpos[i] >= 0) {
          float sink = sinks[at[i] % H], m_new = std::max(mx[i], sink);
          keep = std::exp(mx[i] - m_new);
          s = s * keep + std::exp(sink - m_new);
        }
        for (int64_t d = 0; d < Dv; d++) dst[d] = qpos[i] >= 0 ? af[i * Dv16 + d] * keep / s : 0.0f;
      }
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

// The checks and the split into units, for both handlers.
ffi::Error attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& kc, ffi::AnyBuffer& vc,
                  ffi::Buffer<ffi::F32>& k_scale, ffi::Buffer<ffi::F32>& v_scale, ffi::Buffer<ffi::S32>& layer,
                  ffi::Buffer<ffi::S32>& slots, ffi::Buffer<ffi::S32>& pos, float* out, Range range, State in,
                  State kept, const float* sinks = nullptr, int64_t window = 0) {
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
  if (range.lo % kTile || range.lo < range.base)
    return ffi::Error::InvalidArgument("strata_attention: keys from position " + std::to_string(range.lo) +
                                       " (a multiple of " + std::to_string(kTile) + " at or after base " +
                                       std::to_string(range.base) + " needed)");
  const int32_t* sl = slots.typed_data();
  for (int64_t r = 0; r < R; r++)
    if (sl[r] < 0 || sl[r] >= k.slots)
      return ffi::Error::InvalidArgument("strata_attention: slot " + std::to_string(sl[r]) + " outside [0, " +
                                         std::to_string(k.slots) + ")");
  Unit unit{q.typed_data(), out, pos.typed_data(), &k, &v, L, H, H / k.heads, lay, range, in, kept, sinks,
            window};
  // Runs of up to kTokens query tokens of one slot (a row's tokens; in a packed window, one token a row,
  // a prompt chunk's consecutive rows): a unit reads each key tile once for all of them. Which queries
  // share a unit changes no result (each walks its own keys in the same tiles).
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t t = 0; t < R * L;) {
    int64_t e = t + 1;
    while (e < R * L && e - t < kTokens && sl[e / L] == sl[t / L]) e++;
    runs.push_back({t, e});
    t = e;
  }
  int64_t units = (int64_t)runs.size() * k.heads;
  // Helpers only when the keys to read are many (handing work to a spinning helper costs ~1 us, a few
  // hundred keys' dots).
  int64_t keys = 0;
  for (int64_t i = 0; i < R * L; i++) keys += std::max<int64_t>(std::min<int64_t>(pos.typed_data()[i] + 1, range.hi) - range.lo, 0);
  int helpers = keys * H < 1024 ? 0 : (int)std::min<int64_t>(helper_threads(pool), units - 1);
  parallel_units(pool, units, std::max(helpers, 0), [&](int64_t u) {
    auto [t0, t1] = runs[u / k.heads];
    unit.run(sl[t0 / L], u % k.heads, t0, t1);
  });
  return ffi::Error::Success();
}

// Every key of the cache a query sees, in one call.
// sinks: [H] (gpt-oss) or empty (none); window: [] int32, 0 none.
ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                         ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::F32> sinks,
                         ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out) {
  Range all{0, 0, kc.dimensions().size() == 5 ? kc.dimensions()[2] - 1 : 0};
  auto qd = q.dimensions();
  if (window.element_count() != 1 || (sinks.element_count() != 0 && (qd.size() != 4 ||
                                                                     (int64_t)sinks.element_count() != qd[2])))
    return ffi::Error::InvalidArgument("strata_attention: sinks must be [H] or empty, window a scalar");
  return attend(pool, q, kc, vc, k_scale, v_scale, layer, slots, pos, out->typed_data(), all, {}, {},
                sinks.element_count() ? sinks.typed_data() : nullptr, window.typed_data()[0]);
}

// Keys [lo, hi) (at index position - base of the source), from the state m, s, acc to the updated state
// and the output as if these were the last keys (--kv-resident: the device part, then each host block).
ffi::Error AttentionPartImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                             ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pos,
                             ffi::Buffer<ffi::S32> bounds, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> s,
                             ffi::Buffer<ffi::F32> acc, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> m_out,
                             ffi::ResultBuffer<ffi::F32> s_out, ffi::ResultBuffer<ffi::F32> acc_out) {
  if (bounds.element_count() != 3 || m.element_count() != s.element_count() ||
      m.element_count() != (size_t)(q.dimensions()[0] * q.dimensions()[1] * q.dimensions()[2]) ||
      acc.element_count() != out->element_count())
    return ffi::Error::InvalidArgument("strata_attention_part: bounds [base, lo, hi], m and s [R, L, H], acc [R, L, H, Dv]");
  const int32_t* b = bounds.typed_data();
  return attend(pool, q, kc, vc, k_scale, v_scale, layer, slots, pos, out->typed_data(), Range{b[0], b[1], b[2]},
                State{m.typed_data(), s.typed_data(), acc.typed_data()},
                State{m_out->typed_data(), s_out->typed_data(), acc_out->typed_data()});
}

}  // namespace
}  // namespace strata

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))
STRATA_EXPORT XLA_FFI_Error* StrataAttention(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataAttentionPart(XLA_FFI_CallFrame* call_frame);

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
                                  .Arg<ffi::Buffer<ffi::F32>>()     // sinks [H] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // window []
                                  .Ret<ffi::Buffer<ffi::F32>>());   // [R, L, H, Dv]

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataAttentionPart, strata::AttentionPartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q [R, L, H, D]
                                  .Arg<ffi::AnyBuffer>()            // key source
                                  .Arg<ffi::AnyBuffer>()            // value source
                                  .Arg<ffi::Buffer<ffi::F32>>()     // key scales (int8)
                                  .Arg<ffi::Buffer<ffi::F32>>()     // value scales
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()     // slots [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // pos [R, L]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // [base, lo, hi]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // m [R, L, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // s [R, L, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // acc [R, L, H, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // out [R, L, H, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // m
                                  .Ret<ffi::Buffer<ffi::F32>>()     // s
                                  .Ret<ffi::Buffer<ffi::F32>>());   // acc
