// compact_rows: CUDA launcher interface.
//
// Plain C++ on purpose: included by the nvcc-compiled .cu and by the
// host-compiled binding file (see kernels/scatter_add_rows.h, whose dtype
// enums this op shares).
//
// Notation (as in megatron_lrmoe/ops/compact.py):
//   P  rows of `src` (per-pair rows in forward order)
//   K  kept rows, K == len(kept_index) == len(scale)
//   H  hidden size, the row length of `src` and `out`
//
//   out[j, :] = scale[j] * src[kept_index[j], :]   for j in [0, K)

#pragma once

#include <cstdint>

#include "scatter_add_rows.h"  // FloatType, IndexType, ScaleType, CUstream_st

namespace lrmoe {

// Enqueues the gather on `stream`. All pointers are device pointers to
// contiguous row-major data; out is [K, H] of src's dtype and does not alias
// src. The caller has checked that every index lies in [0, n_src) (rows
// outside are left unwritten, never read out of bounds, as a last line of
// defence). Nothing is launched when n_kept == 0 or hidden == 0.
//
// Returns nullptr on success, otherwise a static error description.
const char* compact_rows_cuda(void* out, const void* src, const void* kept_index,
                              const void* scale, int64_t n_src, int64_t n_kept, int64_t hidden,
                              FloatType dtype, IndexType index_type, ScaleType scale_type,
                              CUstream_st* stream);

}  // namespace lrmoe
