// strata_greedy_pick: a greedy sampler's answer for each row of logits [R, V]: the first index of the
// largest logit, or -1 where the row holds a NaN or an inf (the engine ends that request with an error:
// engine/execute/sampler.py's mark_non_finite). XLA:CPU ran the same as ~10 small operations between two
// decode windows (argmax, is-finite, compare, reduce: 0.25-0.45 ms for SmolLM2's 49,152 logits), and the
// next window run ahead waits for this answer; here two passes over the row, a few microseconds.
// Exact whatever the ISA level: a max and an equality compare have no rounding.
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

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

}  // namespace
}  // namespace strata

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))
STRATA_EXPORT XLA_FFI_Error* StrataGreedyPick(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataGreedyPick, strata::GreedyPickImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
