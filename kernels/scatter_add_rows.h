// scatter_add_rows: CUDA launcher interface.
//
// Plain C++ on purpose: this header is included both by the nvcc-compiled .cu
// file and by the host-compiled binding file, and must need neither torch nor
// the CUDA headers (see kernels/bindings.cpp for the tensor-level entry point).
//
// Notation (as in megatron_lrmoe/ops/scatter_add_rows.py):
//   N  rows of `out`  (tokens receiving gradients)
//   M  rows of `src`  (returned pairs), M == len(index) == len(scale)
//   H  hidden size, the row length of both `out` and `src`
//
//   out[index[i], :] += scale[i] * src[i, :]   for i in [0, M)

#pragma once

#include <cstdint>

// cudaStream_t is `CUstream_st*`; forward-declaring the struct keeps this
// header free of CUDA includes while staying type-compatible with it.
struct CUstream_st;

namespace lrmoe {

enum class FloatType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };
// kNone: no scale pointer; kSameAsSrc: scale has the dtype of src/out;
// kFloat32: fp32 scale with a lower- or higher-precision src (e.g. routing
// probabilities in fp32 next to bf16 activations).
enum class ScaleType : int32_t { kNone = 0, kSameAsSrc = 1, kFloat32 = 2 };

// Enqueues out[index[i], :] += scale[i] * src[i, :] on `stream`, using atomic
// adds in out's dtype (so the summation order of repeated destinations is not
// fixed, and 16-bit sums round after every add): the fast path.
// All pointers are device pointers to contiguous row-major data; the caller
// has checked that every index lies in [0, n_out) (rows outside are skipped,
// never written, as a last line of defence). Nothing is launched when
// n_src == 0 or hidden == 0.
//
// Returns nullptr on success, otherwise a static error description.
const char* scatter_add_rows_cuda(void* out, const void* index, const void* src, const void* scale,
                                  int64_t n_out, int64_t n_src, int64_t hidden, FloatType dtype,
                                  IndexType index_type, ScaleType scale_type, CUstream_st* stream);

// The deterministic variant, a sorted segment sum. `sorted_index` [M] holds the
// index values in ascending order (index_type) and `order` [M] (int64) the source
// row of each, so that each destination's rows form one segment in the order to
// sum them (the caller's stable sort fixes it). For every d in [0, n_out) with a
// non-empty segment:
//   out[d, :] = round(out[d, :] + sum over its segment, in order, of scale[r] * src[r, :])
// in the op-math type, one rounding: the CPU backend's operations in the CPU
// backend's order (bitwise equal to it), one writer per element and no atomics
// (bitwise reproducible). Values outside [0, n_out) lie in no segment: skipped.
// Nothing is launched when n_src == 0, n_out == 0 or hidden == 0.
const char* scatter_add_rows_sorted_cuda(void* out, const void* sorted_index,
                                         const int64_t* order, const void* src,
                                         const void* scale, int64_t n_out, int64_t n_src,
                                         int64_t hidden, FloatType dtype, IndexType index_type,
                                         ScaleType scale_type, CUstream_st* stream);

}  // namespace lrmoe
