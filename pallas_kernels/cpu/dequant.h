// Dequantization of GGUF blocks into float32, value for value as pallas_kernels/bodies.py (and so
// gguf.quants.dequantize) computes them: the same products in the same order, f16 scales converted
// exactly. Block layouts: llama.cpp's ggml-common.h. A "vector" below is 16 consecutive values.
#pragma once

#include <cstdint>

#include "simd.h"

namespace strata {

// GGML type numbers (gguf.GGMLQuantizationType).
enum QType : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
};

// Writes values [v0, v0 + nv) of one weight row to out. v0 and nv are whole blocks (any count for
// the float types).
using DequantFn = void (*)(const uint8_t* row, int64_t v0, int64_t nv, float* out);

struct TypeInfo {
  DequantFn fn;
  int block_values;   // values a block (1 for the float types)
  int block_bytes;    // bytes a block
};

// nullptr fn for a type without a C++ kernel.
TypeInfo type_info(int32_t qtype);

// IQ4_NL / IQ4_XS levels (gguf.quants.IQ4_NL.kvalues; the tests check the kernels against gguf).
alignas(16) static const int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                   1, 13, 25, 38, 53, 69, 89, 113};

}  // namespace strata
