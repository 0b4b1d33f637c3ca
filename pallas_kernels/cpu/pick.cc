// strata_greedy_pick: a greedy sampler's answer for each row of logits [R, V]: the first index of the
// largest logit, or -1 where the row holds a NaN or an inf (the engine ends that request with an error:
// engine/execute/sampler.py's mark_non_finite). XLA:CPU ran the same as ~10 small operations between two
// decode windows (argmax, is-finite, compare, reduce: 0.25-0.45 ms for SmolLM2's 49,152 logits), and the
// next window run ahead waits for this answer; here two passes over the row, a few microseconds.
// Exact whatever the ISA level: a max and an equality compare have no rounding.
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

constexpr int kMaxTopK = 64;     // experts a token (top_k's k): 8 to 22 in the families here

int32_t pick_row(const float* x, int64_t v) {
  int64_t i = 0;
  float m = -__builtin_inff();
  bool bad = false;
#if defined(__AVX2__)
  __m256 vm = _mm256_set1_ps(m), vbad = _mm256_setzero_ps(), zero = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    __m256 a = _mm256_loadu_ps(x + i);
    vm = _mm256_max_ps(vm, a);
    vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(_mm256_sub_ps(a, a), zero, _CMP_NEQ_UQ));   // a - a: NaN unless finite
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = l > m ? l : m;
  bad = _mm256_movemask_ps(vbad) != 0;
#endif
  for (; i < v; i++) {
    bad |= !(x[i] - x[i] == 0.0f);
    m = x[i] > m ? x[i] : m;
  }
  if (bad) return -1;
  // every value is finite, so m is one of them: its first place
  i = 0;
#if defined(__AVX2__)
  __m256 vmax = _mm256_set1_ps(m);
  for (; i + 8 <= v; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vmax, _CMP_EQ_OQ));
    if (hit) return (int32_t)(i + __builtin_ctz(hit));
  }
#endif
  for (; i < v; i++)
    if (x[i] == m) return (int32_t)i;
  return -1;                                  // not reached: m is in the row
}

ffi::Error GreedyPickImpl(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  auto dims = logits.dimensions();
  if (dims.size() != 2 || out->dimensions().size() != 1 || out->dimensions()[0] != dims[0] || dims[1] < 1)
    return ffi::Error::InvalidArgument("strata_greedy_pick: logits [R, V] with V >= 1 and a result [R]");
  for (int64_t r = 0; r < dims[0]; r++) out->typed_data()[r] = pick_row(logits.typed_data() + r * dims[1], dims[1]);
  return ffi::Error::Success();
}

// A float's place in XLA's total order as a signed integer: -NaN < -inf < ... < -0 < +0 < ... < inf < NaN
// (the comparator of jax.lax.top_k's sort on a CPU).
inline int32_t order_key(float f) {
  int32_t b;
  std::memcpy(&b, &f, 4);
  return b < 0 ? b ^ 0x7fffffff : b;
}

// strata_top_k: jax.lax.top_k of each row of x [R, E] -> the k largest values [R, k] and their indices
// [R, k], in descending order, the lower index first among equal values. XLA:CPU sorted every router row
// whole for it (160 experts a token, each layer: 4-6% of a decode or prompt window of a 30B MoE);
// here one pass a row keeps the k best in order. The same values and indices as lax.top_k.
ffi::Error TopKImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> indices) {
  auto dims = x.dimensions();
  if (dims.size() != 2 || values->dimensions().size() != 2 || indices->dimensions().size() != 2 ||
      values->dimensions()[0] != dims[0] || indices->dimensions()[0] != dims[0] ||
      values->dimensions()[1] != indices->dimensions()[1] || values->dimensions()[1] < 1 ||
      values->dimensions()[1] > dims[1] || values->dimensions()[1] > kMaxTopK)
    return ffi::Error::InvalidArgument("strata_top_k: x [R, E], values and indices [R, k] with 1 <= k <= E, k <= 64");
  const int64_t e_all = dims[1];
  const int k = (int)values->dimensions()[1];
  for (int64_t r = 0; r < dims[0]; r++) {
    const float* row = x.typed_data() + r * e_all;
    int32_t key[kMaxTopK], idx[kMaxTopK];
    int n = 0;
    for (int64_t e = 0; e < e_all; e++) {
      int32_t kk = order_key(row[e]);
      // a value equal to the k-th comes later than it: not taken (the lower index stays first)
      if (n == k && kk <= key[k - 1]) continue;
      int i = n < k ? n++ : k - 1;
      for (; i > 0 && key[i - 1] < kk; i--) key[i] = key[i - 1], idx[i] = idx[i - 1];
      key[i] = kk, idx[i] = (int32_t)e;
    }
    for (int j = 0; j < k; j++) {
      values->typed_data()[r * k + j] = row[idx[j]];
      indices->typed_data()[r * k + j] = idx[j];
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace strata

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))
STRATA_EXPORT XLA_FFI_Error* StrataGreedyPick(XLA_FFI_CallFrame* call_frame);
STRATA_EXPORT XLA_FFI_Error* StrataTopK(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataGreedyPick, strata::GreedyPickImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataTopK, strata::TopKImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
