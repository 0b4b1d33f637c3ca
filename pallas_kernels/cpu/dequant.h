// The types the C++ kernels handle and, for each, its two ways into a product: dequantization into a
// float buffer (any M) and a direct kernel that dequantizes into the accumulators (small M).
#pragma once

#include <cstdint>

namespace strata {

// GGML type numbers (gguf.GGMLQuantizationType).
enum QType : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
  MXFP4 = 39,
};

// The rows one weight matrix multiplies: x[i] has k values readable up to the next multiple of 16
// (zeros there), y[i] has one value per weight row.
struct RowSet {
  const float* const* x;
  float* const* y;
  int64_t m;
};

// Writes values [v0, v0 + nv) of one weight row to out. v0 and nv are whole blocks (any count for
// the float types).
using DequantFn = void (*)(const uint8_t* row, int64_t v0, int64_t nv, float* out);

// y[i][n] = x[i] . w[n] for weight rows n in [n0, n1) (row n at w + n * row_bytes), for
// rows.m <= kDirectMaxM; k is a whole number of blocks.
using DirectFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t k, const RowSet& rows, int64_t n0,
                          int64_t n1);

// Up to kDirectMaxM x rows the direct kernel keeps every accumulator in registers, for a tile of
// kDirectRows weight rows (4 chains of FMAs: the dequantization, not the FMA latency, bounds it).
#if defined(__AVX512F__)
constexpr int kDirectMaxM = 4, kDirectRows = 4;
#elif defined(__AVX2__)
constexpr int kDirectMaxM = 2, kDirectRows = 2;
#else
constexpr int kDirectMaxM = 1, kDirectRows = 2;
#endif

struct TypeInfo {
  DequantFn fn;       // nullptr: no C++ kernel for the type
  DirectFn direct;    // nullptr: the buffered path only (the float types)
  int block_values;   // values a block (1 for the float types)
  int block_bytes;    // bytes a block
};

TypeInfo type_info(int32_t qtype);
DirectFn direct_fn(int32_t qtype);

// IQ4_NL / IQ4_XS levels (gguf.quants.IQ4_NL.kvalues; the tests check the kernels against gguf).
alignas(16) static const int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                   1, 13, 25, 38, 53, 69, 89, 113};

// MXFP4's e2m1 values, doubled (gguf.quants.MXFP4.kvalues, ggml's kvalues_mxfp4): the block's scale
// 2^(e - 128) is half its E8M0 exponent's 2^(e - 127), so that these are integers.
alignas(16) static const int8_t kMXFP4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml_e8m0_to_fp32_half (gguf.quants.MXFP4.e8m0_to_fp32_half): 2^(e - 128) as float32 bits, the
// denormals 2^-128, 2^-127 for e = 0, 1; e = 255 is 2^127 (no NaN).
inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

}  // namespace strata
