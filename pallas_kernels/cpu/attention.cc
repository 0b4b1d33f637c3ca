// strata_attention: attention over the KV cache where it lies (the cpu backend's attention).
//
// out[r, l, h] = sum over keys c = 0..p of softmax_c((q[r, l, h] / sqrt(D)) . k[layer, slot, c, h / G])
// * v[layer, slot, c, h / G], with p = pos[r, l] and slot = slots[r]; a query with p < 0 (padding) gives
// zeros. XLA's attention (model/layers.py: attend) first gathers each row's keys out of the cache and
// transposes them for its dots: ~45 us a layer and tensor at one decode row, more than the products.
// Here every key is read once a unit from the cache itself, and only the keys a query sees.
//
// Order (what makes a result depend only on its own query): each query's keys in tiles of kTile
// positions from position 0 (--kv-resident: the same tiles over the device part, then the host blocks,
// the softmax state carried from call to call: strata_attention_part). A tile's softmax is computed
// alone (its max mt, sum st and sum of e^(score - mt) v, each score one fixed-order dot: simd.h), then
// joined to the query's state in position order (Attention::combine). The tiles and the joins are the
// same whatever the window holds and whichever thread computed a tile, so a row gives the same bits
// alone or batched, in a decode, verify or prefill window, and whatever the window's KV bucket.
//
// Memory: a tile's positions, every kv head, are one piece of the cache ([positions, kv_heads, dim]),
// and a unit reads them together. Few rows (decode): each row's tiles are split over the threads and
// the tile states kept, then joined; many rows: a run of a slot's tokens a unit, joined as they come.
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
constexpr int kTokens = 16;    // query tokens a run (a unit of work reads each key tile once for all of them)
constexpr int kAhead = 2;      // tiles a unit asks for before it reads them

// One cache tensor [layers, slots, positions, kv_heads, dim] of float32, bfloat16, float16 or int8 (with a
// float32 scale a position and head, [layers, slots, positions, kv_heads]).
struct Cache {
  const uint8_t* data;
  ffi::DataType type;
  const float* scale;
  int64_t slots, positions, heads, dim;

  // Positions [c, c + count) of (layer, slot), every head: one piece of the cache.
  void prefetch(int64_t layer, int64_t slot, int64_t c, int64_t count) const {
    if (count <= 0) return;
    int64_t at = ((layer * slots + slot) * positions + c) * heads;
    int64_t width = type == ffi::DataType::F32 ? 4 : type == ffi::DataType::S8 ? 1 : 2;
    const uint8_t* p = data + at * dim * width;
    for (int64_t o = 0, bytes = count * heads * dim * width; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
  }

  // Key c of (layer, slot, head) as float32, readable up to dim16 (zeros after dim): in place for a
  // float32 cache whose rows are whole vectors (no copy: at a decode row the copies were ~20% of the
  // step), else converted into buf, 16 values at a time (a value at a time, a bfloat16 cache ran
  // SmolLM2's decode at a fifth of the float32 one's speed).
  const float* row(int64_t layer, int64_t slot, int64_t c, int64_t head, float* buf, int64_t dim16) const {
    int64_t at = ((layer * slots + slot) * positions + c) * heads + head;
    int64_t whole = dim / 16 * 16;           // converted by vectors; the rest (dim % 16) a value at a time
    if (type == ffi::DataType::F32) {
      const float* p = reinterpret_cast<const float*>(data) + at * dim;
      if (dim == dim16) return p;
      std::copy_n(p, dim, buf);
    } else if (type == ffi::DataType::BF16) {
      const uint8_t* p = data + at * dim * 2;
      for (int64_t d = 0; d < whole; d += 16) store16(buf + d, bfloat16s(p + 2 * d));
      for (int64_t d = whole; d < dim; d++) {
        uint32_t bits = uint32_t(p[2 * d] | (p[2 * d + 1] << 8)) << 16;
        std::memcpy(buf + d, &bits, 4);
      }
    } else if (type == ffi::DataType::F16) {
      const uint8_t* p = data + at * dim * 2;
      for (int64_t d = 0; d < whole; d += 16) store16(buf + d, halves16(p + 2 * d));
      for (int64_t d = whole; d < dim; d++) buf[d] = f16_at(p + 2 * d);
    } else {                                     // int8: float(q) * scale, as the xla path reads it
      const uint8_t* p = data + at * dim;
      float s = scale[at];
      for (int64_t d = 0; d < whole; d += 16) store16(buf + d, to_f32(i8_lanes(p + d)) * splat(s));
      for (int64_t d = whole; d < dim; d++) buf[d] = float(int8_t(p[d])) * s;
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

// A query's state: the running max m, sum s and accumulator acc[Dv16] of the softmax over the keys
// walked so far.
struct QState {
  float m, s;
  float* acc;
};

// The tiles a run of query tokens (consecutive flat indices r * L + l, all of one slot) reads.
struct Run {
  int64_t t0, t1, slot;
  int64_t first, top;      // key positions [first, top]: `first` a multiple of kTile
  int64_t tiles() const { return top < first ? 0 : (top - first) / kTile + 1; }
};

struct Attention {
  const float* q;          // [R, L, H, D]
  float* out;              // [R, L, H, Dv], or null: the state only
  const int32_t* pos;      // [R, L]
  const int32_t* slots;    // [R]
  const Cache *k, *v;
  int64_t L, H, G, layer;
  Range range;
  State in, kept;          // in: the state to start from (null: fresh); kept: where it goes (null: nowhere)
  const float* sinks;      // [H] (gpt-oss), or null
  int64_t window;          // keys with pos - key >= window are masked; 0: none
  int64_t D, Dv, D16, Dv16, hi;

  int64_t first_key(int64_t p) const { return window > 0 ? std::max<int64_t>(p - window + 1, 0) : 0; }

  Run make_run(int64_t t0, int64_t t1) const {
    int64_t top = -1, bottom = std::numeric_limits<int64_t>::max();
    for (int64_t t = t0; t < t1; t++) {
      if (pos[t] >= 0) bottom = std::min(bottom, first_key(pos[t]));
      top = std::max(top, std::min<int64_t>(pos[t], hi - 1));
    }
    int64_t first = range.lo;
    if (window > 0 && bottom != std::numeric_limits<int64_t>::max())
      first = std::max(range.lo, bottom / kTile * kTile);
    return Run{t0, t1, slots[t0 / L], first, top};
  }

  // The softmax of each query of run r over each tile of [a, b) (tile indices from r.first) alone,
  // from a fresh state: emit(query of the run ((t - t0) * H + h), tile, mt, st, acct) for every tile
  // the query sees a key of. Every kv head's keys of a tile are read together: a tile's positions lie
  // in one piece of the cache ([positions, kv_heads, dim]), read whole, not a head's slice at a time.
  template <class Emit>
  void tile_states(const Run& r, int64_t a, int64_t b, Emit&& emit) const {
    const int64_t K = k->heads, nq = (r.t1 - r.t0) * H;
    thread_local std::vector<f32x16> qbuf, ktile, vtile, accbuf;
    qbuf.resize(nq * D16 / 16), ktile.resize(K * kTile * D16 / 16), vtile.resize(K * kTile * Dv16 / 16);
    accbuf.resize(Dv16 / 16);
    float* qf = reinterpret_cast<float*>(qbuf.data());
    float* kf = reinterpret_cast<float*>(ktile.data());
    float* vf = reinterpret_cast<float*>(vtile.data());
    float* acct = reinterpret_cast<float*>(accbuf.data());
    const float rsd = std::sqrt(float(D));
    for (int64_t i = 0; i < nq; i++) {
      const float* src = q + (r.t0 * H + i) * D;
      for (int64_t d = 0; d < D16; d++) qf[i * D16 + d] = d < D ? src[d] / rsd : 0.0f;
    }
    alignas(64) float e[kTile];
    thread_local std::vector<float> gscores_buf;
    thread_local std::vector<const float*> kr_buf, vr_buf;
    gscores_buf.resize(G * kTile), kr_buf.resize(K * kTile), vr_buf.resize(K * kTile);
    // plain pointers: a thread_local's address is a call (__tls_get_addr) in a shared library
    float* gscores = gscores_buf.data();
    const float** kr = kr_buf.data();
    const float** vr = vr_buf.data();
    for (int64_t tile = a; tile < b; tile++) {
      int64_t p0 = r.first + tile * kTile, n = std::min<int64_t>(kTile, r.top + 1 - p0);
      // The tile after next, asked for now (one piece of the cache for all kv heads): a tile's work is
      // about the time its keys take to come from memory, so one tile ahead arrived late.
      for (int64_t ahead = tile == a ? 1 : kAhead; ahead <= kAhead && tile + ahead < b; ahead++) {
        int64_t c = p0 + ahead * kTile, count = std::min<int64_t>(kTile, r.top + 1 - c);
        k->prefetch(layer, r.slot, c - range.base, count);
        v->prefetch(layer, r.slot, c - range.base, count);
      }
      for (int64_t kh = 0; kh < K; kh++)
        for (int64_t j = 0; j < n; j++) {
          kr[kh * kTile + j] = k->row(layer, r.slot, p0 + j - range.base, kh, kf + (kh * kTile + j) * D16, D16);
          vr[kh * kTile + j] = v->row(layer, r.slot, p0 + j - range.base, kh, vf + (kh * kTile + j) * Dv16, Dv16);
        }
      // A token's G query heads of one kv head at a time: each key row loaded once for up to 4 of them
      // (4 independent FMA chains; one chain a key left the core waiting on each FMA's latency).
      for (int64_t i0 = 0; i0 < nq; i0 += G) {
        int64_t p = pos[r.t0 + i0 / H], lo = first_key(p);
        if (p < p0 || lo >= p0 + n) continue;
        int64_t cnt = std::min<int64_t>(n, p + 1 - p0), j0 = std::max<int64_t>(lo - p0, 0);
        const float* const* ks = kr + (i0 % H / G) * kTile;
        const float* const* vs = vr + (i0 % H / G) * kTile;
        // each score one fixed-order dot: a lane-wise FMA chain, then hsum16's tree
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const int64_t gn = std::min<int64_t>(4, G - g0);
          const float* q0 = qf + (i0 + g0) * D16;
          for (int64_t j = j0; j < cnt; j++) {
            f32x16 a0 = zero16(), a1 = zero16(), a2 = zero16(), a3 = zero16();
#pragma GCC unroll 8
            for (int64_t d = 0; d < D16; d += 16) {
              f32x16 kv = load16(ks[j] + d);
              a0 = fma16(load16(q0 + d), kv, a0);
              if (gn > 1) a1 = fma16(load16(q0 + D16 + d), kv, a1);
              if (gn > 2) a2 = fma16(load16(q0 + 2 * D16 + d), kv, a2);
              if (gn > 3) a3 = fma16(load16(q0 + 3 * D16 + d), kv, a3);
            }
            gscores[g0 * kTile + j] = hsum16(a0);
            if (gn > 1) gscores[(g0 + 1) * kTile + j] = hsum16(a1);
            if (gn > 2) gscores[(g0 + 2) * kTile + j] = hsum16(a2);
            if (gn > 3) gscores[(g0 + 3) * kTile + j] = hsum16(a3);
          }
        }
        for (int64_t g = 0; g < G; g++) {
        const int64_t i = i0 + g;
        float* scores = gscores + g * kTile;
        float mt = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j < cnt; j++) mt = std::max(mt, scores[j]);
        // NaN scores (a broken model) propagate through the exps into the sums: the output is NaN,
        // which the sampler reports, as the xla path's is.
        for (int64_t j = 0; j < kTile; j++) scores[j] = j >= j0 && j < cnt ? scores[j] - mt : 0.0f;
        exp16(scores, e);
        // the tile's sum by hsum16's fixed tree (16 adds one after the other were a chain of their
        // latencies), the keys outside [j0, cnt) as zeros
        for (int64_t j = 0; j < kTile; j++) e[j] = j >= j0 && j < cnt ? e[j] : 0.0f;
        float st = hsum16(load16(e));
        // acct = sum of e_j v_j in key order, 64 values at a time held in registers
        for (int64_t d0 = 0; d0 < Dv16; d0 += 64) {
          int64_t nv = std::min<int64_t>(4, (Dv16 - d0) / 16);
          f32x16 r0 = zero16(), r1 = zero16(), r2 = zero16(), r3 = zero16();
          for (int64_t j = j0; j < cnt; j++) {
            f32x16 ev = splat(e[j]);
            const float* vj = vs[j] + d0;
            r0 = fma16(ev, load16(vj), r0);
            if (nv > 1) r1 = fma16(ev, load16(vj + 16), r1);
            if (nv > 2) r2 = fma16(ev, load16(vj + 32), r2);
            if (nv > 3) r3 = fma16(ev, load16(vj + 48), r3);
          }
          store16(acct + d0, r0);
          if (nv > 1) store16(acct + d0 + 16, r1);
          if (nv > 2) store16(acct + d0 + 32, r2);
          if (nv > 3) store16(acct + d0 + 48, r3);
        }
        emit(i, tile, mt, st, acct);
        }
      }
    }
  }

  // The state of query flat index `at` ([R, L, H]) before the first tile: `in`, or fresh.
  void start(int64_t at, QState& qs) const {
    if (in.m) {
      qs.m = in.m[at], qs.s = in.s[at];
      std::copy_n(in.acc + at * Dv, Dv, qs.acc);
      std::fill(qs.acc + Dv, qs.acc + Dv16, 0.0f);
    } else {
      qs.m = -std::numeric_limits<float>::infinity(), qs.s = 0.0f;
      std::fill(qs.acc, qs.acc + Dv16, 0.0f);
    }
  }

  // A tile's softmax joined to the state: the definition of the result's order (the same whichever
  // thread computed the tile, and whether tiles were computed one after the other or at once).
  void combine(QState& qs, float mt, float st, const float* acct) const {
    float m_new = std::max(qs.m, mt);
    // one of the two factors is e^0 = 1 (exp1(0) is 1 exactly): one exponential, not two (the joins
    // were a fifth of a decode call at 700 positions)
    float a, b;
    if (mt <= qs.m) {
      a = 1.0f, b = exp1(mt - m_new);
    } else {
      a = qs.m == -std::numeric_limits<float>::infinity() ? 0.0f : exp1(qs.m - m_new), b = 1.0f;
    }
    qs.s = qs.s * a + st * b;
    f32x16 av = splat(a), bv = splat(b);
    for (int64_t d = 0; d < Dv16; d += 16) store16(qs.acc + d, fma16(load16(acct + d), bv, load16(qs.acc + d) * av));
    qs.m = m_new;
  }

  // The state where `kept` asks for it, and the output (sinks joined to the denominator at the end).
  void finish(int64_t at, const QState& qs) const {
    int64_t p = pos[at / H];
    if (kept.m) {
      kept.m[at] = qs.m, kept.s[at] = qs.s;
      std::copy_n(qs.acc, Dv, kept.acc + at * Dv);
    }
    if (out) {
      float* dst = out + at * Dv;
      float keep = 1.0f, s = qs.s;
      if (sinks && p >= 0) {
        float sink = sinks[at % H], m_new = std::max(qs.m, sink);
        keep = exp1(qs.m - m_new);
        s = s * keep + exp1(sink - m_new);
      }
      for (int64_t d = 0; d < Dv; d++) dst[d] = p >= 0 ? qs.acc[d] * keep / s : 0.0f;
    }
  }

  // A run's tiles one after the other, each joined to its queries' states as it comes.
  void whole_run(const Run& r) const {
    const int64_t nq = (r.t1 - r.t0) * H;
    thread_local std::vector<f32x16> accs;
    thread_local std::vector<QState> state_buf;
    accs.resize(nq * Dv16 / 16), state_buf.resize(nq);
    QState* states = state_buf.data();
    for (int64_t i = 0; i < nq; i++) {
      states[i].acc = reinterpret_cast<float*>(accs.data()) + i * Dv16;
      start(r.t0 * H + i, states[i]);
    }
    tile_states(r, 0, r.tiles(), [&](int64_t i, int64_t, float mt, float st, const float* acct) {
      combine(states[i], mt, st, acct);
    });
    for (int64_t i = 0; i < nq; i++) finish(r.t0 * H + i, states[i]);
  }
};

ffi::Error check_cache(const char* name, ffi::AnyBuffer& c, ffi::Buffer<ffi::F32>& scale, Cache& out) {
  auto d = c.dimensions();
  if (d.size() != 5)
    return ffi::Error::InvalidArgument(std::string("strata_attention: the ") + name +
                                       " cache must be [layers, slots, positions, kv_heads, dim]");
  ffi::DataType t = c.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16 && t != ffi::DataType::S8)
    return ffi::Error::InvalidArgument(std::string("strata_attention: the ") + name +
                                       " cache must be float32, bfloat16, float16 or int8");
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
  const int64_t D = k.dim, Dv = v.dim;
  Attention att{q.typed_data(), out, pos.typed_data(), sl, &k, &v, L, H, H / k.heads, lay, range, in, kept,
                sinks, window, D, Dv, round16(D), round16(Dv), std::min(range.hi, range.base + k.positions)};
  // Runs of up to kTokens query tokens of one slot (a row's tokens; in a packed window, one token a row,
  // a prompt chunk's consecutive rows): a unit reads each key tile once for all of them. Which queries
  // share a unit, and which thread computes a tile, changes no result (each query's tiles are joined
  // in position order: Attention::combine).
  std::vector<Run> runs;
  for (int64_t t = 0; t < R * L;) {
    int64_t e = t + 1;
    while (e < R * L && e - t < kTokens && sl[e / L] == sl[t / L]) e++;
    runs.push_back(att.make_run(t, e));
    t = e;
  }
  // Helpers only when the keys to read are many (handing work to a spinning helper costs ~1 us, a few
  // hundred keys' dots). 256 (query head, key) pairs, not 1,024: SmolLM2's decode attention at 48 and
  // 96 positions (scripts/attention_decode_bench.py 1 P 30 f32, Zen 3, AVX2, two rounds) took 228-305 ->
  // 207-208 us and 391 -> 339-349 us a step (30 layers) split; at 24 positions (216 pairs) it stays alone.
  int64_t keys = 0;
  for (int64_t i = 0; i < R * L; i++) keys += std::max<int64_t>(std::min<int64_t>(pos.typed_data()[i] + 1, range.hi) - range.lo, 0);
  const int threads = keys * H < 256 ? 1 : 1 + helper_threads(pool);
  // Few runs (decode: a row or a few), many tiles: each run's tiles split over units, their softmax
  // states kept and joined afterwards; else a unit a run. Kept states cost (Dv + 2) floats a query
  // and tile: at most kSplitFloats of them (a buffer each calling thread keeps: at most 16 MiB).
  constexpr int64_t kSplitFloats = 4 << 20;
  const int64_t want = 2 * threads;
  int64_t state_floats = 0;
  for (const Run& r : runs) state_floats += (r.t1 - r.t0) * H * r.tiles() * (att.Dv16 + 2);
  if (threads == 1 || (int64_t)runs.size() >= want || state_floats > kSplitFloats) {
    parallel_units(pool, (int64_t)runs.size(), threads - 1, [&](int64_t u) { att.whole_run(runs[u]); });
    return ffi::Error::Success();
  }
  // Units: (run, tiles [a, b)); a query's tile states at base[run] + (query * tiles + tile) * (Dv16 + 2).
  struct Part { int64_t run, a, b; };
  std::vector<Part> parts;
  std::vector<int64_t> base(runs.size());
  int64_t per_run = (want + (int64_t)runs.size() - 1) / (int64_t)runs.size(), at = 0;
  for (int64_t ri = 0; ri < (int64_t)runs.size(); ri++) {
    int64_t n = runs[ri].tiles(), pieces = std::min<int64_t>(per_run, std::max<int64_t>(n, 1));
    for (int64_t i = 0; i < pieces; i++) parts.push_back({ri, n * i / pieces, n * (i + 1) / pieces});
    base[ri] = at;
    at += (runs[ri].t1 - runs[ri].t0) * H * n * (att.Dv16 + 2);
  }
  thread_local std::vector<float> kept_tiles;
  thread_local std::vector<uint8_t> seen;
  kept_tiles.resize(at);
  seen.assign(at / (att.Dv16 + 2), 0);
  const int64_t stride = att.Dv16 + 2;
  float* kt = kept_tiles.data();
  uint8_t* sn = seen.data();
  parallel_units(pool, (int64_t)parts.size(), threads - 1, [&](int64_t u) {
    const Part& pt = parts[u];
    const Run& r = runs[pt.run];
    int64_t n = r.tiles();
    att.tile_states(r, pt.a, pt.b, [&](int64_t i, int64_t tile, float mt, float st, const float* acct) {
      int64_t slot = base[pt.run] / stride + i * n + tile;
      float* dst = kt + slot * stride;
      dst[0] = mt, dst[1] = st;
      std::copy_n(acct, att.Dv16, dst + 2);
      sn[slot] = 1;
    });
  });
  // Each query's tiles joined in position order.
  std::vector<std::pair<int64_t, int64_t>> queries;          // (run, query of the run)
  for (int64_t ri = 0; ri < (int64_t)runs.size(); ri++)
    for (int64_t i = 0; i < (runs[ri].t1 - runs[ri].t0) * H; i++) queries.push_back({ri, i});
  parallel_units(pool, (int64_t)queries.size(), threads - 1, [&](int64_t u) {
    auto [ri, i] = queries[u];
    const Run& r = runs[ri];
    int64_t n = r.tiles();
    thread_local std::vector<f32x16> acc;
    acc.resize(att.Dv16 / 16);
    QState qs{0.0f, 0.0f, reinterpret_cast<float*>(acc.data())};
    att.start(r.t0 * H + i, qs);
    for (int64_t tile = 0; tile < n; tile++) {
      int64_t slot = base[ri] / stride + i * n + tile;
      if (sn[slot]) att.combine(qs, kt[slot * stride], kt[slot * stride + 1], kt + slot * stride + 2);
    }
    att.finish(r.t0 * H + i, qs);
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
