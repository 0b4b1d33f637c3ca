// The int8 path's entry points (int8.cc; q8.h defines its arithmetic).
#pragma once

#include <cstdint>

#include "dequant.h"
#include "q8.h"

namespace strata {

// The quantized x rows one weight matrix multiplies and where their results go (y[i][n]).
struct Q8RowSet {
  const Q8Row* x;
  float* const* y;
  int64_t m;
};

// y[i][n] = x[i] . w[n] for weight rows n in [n0, n1) (row n at w + n * row_bytes); k a whole number of
// the type's blocks; x quantized with int8_unit(qtype) values a unit.
using Int8Fn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t k, const Q8RowSet& xs, int64_t n0, int64_t n1);

// nullptr: the type has no int8 path (the float types: they keep the exact one).
Int8Fn int8_fn(int32_t qtype);

// Values a block of x for the type's int8 path: 32 (llama.cpp's Q8_0 / Q8_1) or 256 (Q8_K).
inline int int8_unit(int32_t qtype) { return qtype == Q2_K || qtype == Q3_K || qtype == Q4_K || qtype == Q5_K ||
                                             qtype == Q6_K || qtype == IQ4_XS ? 256 : 32; }

}  // namespace strata
