// combine_rows: the weighted combine of the LRMoE region and its adjoint; CUDA
// launcher interface.
//
// Plain C++ on purpose: included by the nvcc-compiled .cu and by the
// host-compiled binding file (see kernels/scatter_add_rows.h, whose dtype
// enums these ops share).
//
// Notation (as in megatron_lrmoe/ops/combine.py):
//   P  pair rows of `src` (expert outputs o, one per routed pair)
//   T  tokens, rows of the combined output y and of its gradient dy
//   M  entries of `order` (normally P: every pair once)
//   K  rows of the backward output (kept pairs)
//   H  hidden size
//
// Forward (a segmented gather-sum; no atomics, so deterministic):
//   y[t, :] = sum over j in [offsets[t], offsets[t+1]) of
//             scale[order[j]] * src[order[j], :]
// each product and the running sum in op-math (fp32 for 16-bit types), j
// ascending, rounded to the dtype once.
//
// Backward (one pass over dy per pair):
//   dscale[i] = <dy[token[i], :], src[i, :]>   (in and out in op-math: fp32, fp64 for fp64)
//   out[kept_row[i], :] = (scale[i] * w[kept_row[i]]) * dy[token[i], :]   if kept_row[i] >= 0
// with kept_row == nullptr meaning kept_row[i] = i, and w == nullptr meaning w = 1.

#pragma once

#include <cstdint>

#include "scatter_add_rows.h"  // FloatType, IndexType, ScaleType, CUstream_st

namespace lrmoe {

// Enqueues the forward on `stream`. Device pointers to contiguous data:
// out [T, H] (written entirely), src [P, H], scale [P] (scale_type), order [M]
// (index_type), offsets [T + 1] int64. Entries of order outside [0, P) are
// skipped (never read out of bounds); the caller has validated offsets (from 0
// to M, non-decreasing) when its debug checks are on. Nothing is launched when
// T == 0 or H == 0. Returns nullptr on success, otherwise a static error text.
const char* combine_rows_cuda(void* out, const void* src, const void* scale, const void* order,
                              const int64_t* offsets, int64_t n_src, int64_t n_tokens,
                              int64_t hidden, FloatType dtype, IndexType index_type,
                              ScaleType scale_type, CUstream_st* stream);

// Enqueues the backward on `stream`. Device pointers to contiguous data:
// dscale [P] of the op-math type (written entirely), out [K, H] of dy's dtype, dy [T, H],
// src [P, H], token [P] (index_type), scale [P] (scale_type, never kNone),
// kept_row [P] int64 or nullptr, w [K] fp32 or nullptr. A token outside [0, T)
// gives dscale 0 and no row; a kept_row outside [0, K) writes no row. Nothing is
// launched when P == 0. Returns nullptr on success, otherwise a static text.
const char* combine_rows_backward_cuda(void* dscale, void* out, const void* dy, const void* src,
                                       const void* token, const void* scale, const int64_t* kept_row,
                                       const float* w, int64_t n_tokens, int64_t n_src,
                                       int64_t n_out, int64_t hidden, FloatType dtype,
                                       IndexType index_type, ScaleType scale_type,
                                       CUstream_st* stream);

}  // namespace lrmoe
