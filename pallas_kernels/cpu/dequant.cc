// Dequantization into a float buffer: blocks.h's block functions with a store as their sink.
#include "blocks.h"

namespace strata {
namespace {

template <class B>
void dequant_blocks(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  const uint8_t* b = row + (v0 / B::values) * B::bytes;
  for (int64_t left = nv / B::values; left > 0; left -= kGroup) {
    int n = (int)std::min<int64_t>(kGroup, left);
    alignas(64) float f[16];
    block_fields<B>(b, n, f);
    fields_barrier();
    for (int i = 0; i < n; i++, b += B::bytes, out += B::values)
      B::block(b, f + i * B::nf, [out](int v, f32x16 w) { store16(out + 16 * v, w); });
  }
}

// ---- plain floats: any count, so a scalar tail ---------------------------------------------------

void dequant_f32(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  std::memcpy(out, row + 4 * v0, 4 * nv);
}

void dequant_f16(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  const uint8_t* p = row + 2 * v0;
  int64_t i = 0;
  for (; i + 16 <= nv; i += 16) store16(out + i, halves16(p + 2 * i));
  for (; i < nv; i++) out[i] = f16_at(p + 2 * i);
}

void dequant_bf16(const uint8_t* row, int64_t v0, int64_t nv, float* out) {
  const uint8_t* p = row + 2 * v0;
  int64_t i = 0;
  for (; i + 16 <= nv; i += 16) store16(out + i, bfloat16s(p + 2 * i));
  for (; i < nv; i++) {
    uint16_t h; std::memcpy(&h, p + 2 * i, 2);
    uint32_t bits = uint32_t(h) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

template <class B>
TypeInfo info(int32_t qtype) { return {dequant_blocks<B>, direct_fn(qtype), B::values, B::bytes}; }

}  // namespace

TypeInfo type_info(int32_t qtype) {
  switch (qtype) {
    case F32: return {dequant_f32, nullptr, 1, 4};
    case F16: return {dequant_f16, nullptr, 1, 2};
    case BF16: return {dequant_bf16, nullptr, 1, 2};
    case Q8_0: return info<BQ8_0>(qtype);
    case Q4_0: return info<BQ4_0>(qtype);
    case Q4_1: return info<BQ4_1>(qtype);
    case Q5_0: return info<BQ5_0>(qtype);
    case Q5_1: return info<BQ5_1>(qtype);
    case IQ4_NL: return info<BIQ4_NL>(qtype);
    case Q2_K: return info<BQ2_K>(qtype);
    case Q3_K: return info<BQ3_K>(qtype);
    case Q4_K: return info<BQ4_K>(qtype);
    case Q5_K: return info<BQ5_K>(qtype);
    case Q6_K: return info<BQ6_K>(qtype);
    case IQ4_XS: return info<BIQ4_XS>(qtype);
    case MXFP4: return info<BMXFP4>(qtype);
    default: return {nullptr, nullptr, 0, 0};
  }
}

}  // namespace strata
