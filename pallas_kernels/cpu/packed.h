// Weights repacked at load for the int8 path (--cpu-math int8, resident weights; packed.cc).
//
// A GGUF matrix keeps one row's blocks together, so a kernel that puts 8 weight rows in the 8 lanes
// must gather 8 scattered blocks, unpack each row's values and add 8 rows' partial sums across lanes
// for every block: ~8 cycles a row-block on AVX2, compute-bound far below the memory's speed. Packed,
// every whole tile of 8 rows stores block b of its 8 rows together, in the order the lanes read them:
//
//     [8 x float16 d] [8 x float16 m (Q4_1 only)] [quants, interleaved by 4 bytes]
//
// (MXFP4: [8 x E8M0 byte e] [its 16 nibble bytes as IQ4_NL's].)
//
// where "interleaved by 4 bytes" means 32-byte vectors whose 32-bit lane r holds 4 consecutive quant
// bytes of row r: Q8_0's 32 bytes in 8 vectors, the 16 nibble bytes of Q4_0 / Q4_1 / IQ4_NL in 4 (vector
// g: bytes 4g..4g+3, whose low nibbles are values 4g..4g+3 and high nibbles values 16+4g..16+4g+3).
// One dot product of such a vector with 4 bytes of x broadcast gives 8 rows' partial sums in their own
// lanes: no gather, no cross-lane sums, the scales one load. Same bytes as the GGUF rows (a tile of 8
// rows is 8 * row_bytes, in place of those rows); rows past the last whole tile (n % 8) stay as they
// were. Like llama.cpp's CPU repack (block_q4_0x8) and ik_llama.cpp's _R8 types, our own layout.
//
// The integer sums and float operations are q8.h's, exactly as for the GGUF layout (int8.cc), so a
// packed matrix gives the same bits as its GGUF blocks at every M and ISA level.
#pragma once

#include <cstdint>

#include "int8.h"

namespace strata {

// Types with a packed layout: Q4_0, Q4_1, Q8_0, IQ4_NL, MXFP4 (packed.cc), Q4_K (packed_q4k.cc).
bool packs(int32_t qtype);

// Rows [0, n) of row_bytes each at src, packed into dst (the same size; dst != src).
void pack_rows(int32_t qtype, const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst);

// The int8 kernel over a packed matrix of n rows: rows [n0, n1) with n0 a multiple of 8 (Int8Fn's
// arguments, plus the matrix's row count, which says where the whole tiles end).
using PackedFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n, const Q8RowSet& xs,
                          int64_t n0, int64_t n1);
PackedFn packed_fn(int32_t qtype);

// Q4_K's packing and kernel (packed_q4k.cc; packed.cc's pack_rows and packed_fn dispatch to them).
void pack_q4k(const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst);
PackedFn packed_q4k_fn();

}  // namespace strata
