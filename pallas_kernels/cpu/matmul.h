// The product of a set of float32 rows with a range of GGUF weight rows, dequantized in registers.
#pragma once

#include <cstdint>

#include "dequant.h"
#include "simd.h"

namespace strata {

// Rows a unit of work should be a multiple of (the register tiles' weight rows, both paths).
int weight_rows_per_tile();

// y[i][n] = x[i] . w[n] for every row i of `rows` and weight rows n in [n0, n1). w points at weight
// row 0; row n starts at w + n * row_bytes. Each y[i][n] depends only on x[i] and w[n]: the direct
// kernel (small M) and the buffered one give the same bits.
void matmul_rows(const TypeInfo& t, const uint8_t* w, int64_t row_bytes, int64_t k, const RowSet& rows,
                 int64_t n0, int64_t n1);

}  // namespace strata
