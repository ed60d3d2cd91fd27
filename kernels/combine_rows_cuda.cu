// combine_rows: CUDA backend of the weighted combine and its adjoint.
//
// Only CUDA headers here (see kernels/scatter_add_rows_cuda.cu for why); tensor
// checks and the current stream live in kernels/bindings.cpp.
//
// Notation: P pair rows of src, T tokens, M entries of order, K backward rows,
// H hidden size (semantics: kernels/combine_rows.h).
//
// Layout: one warp per output row (forward: a token; backward: a pair), eight
// warps per block, lanes striding over the H columns, so every row read is
// coalesced and each output element has exactly one writer.
//
// Forward: no atomics. A token's segment of `order` is summed in ascending j,
// each product rounded to the dtype and the running sum kept in the op-math
// type with explicitly rounded intrinsics (nvcc may not fuse them into FMAs):
// the CPU backend's operations in the CPU backend's order, so the two agree
// bitwise, and a run is bitwise reproducible (unlike scatter_add_rows' atomics).
//
// Backward: per pair, one pass over dy[token] and src: each lane accumulates
// its columns' products, a warp shuffle tree adds the lanes (so dscale is
// reproducible run to run but not bitwise equal to the CPU backend, whose
// summation order differs), and the same loop writes the scaled gradient row
// of a kept pair (one product in op-math, rounded once, as on the CPU).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "combine_rows.h"
#include "dispatch.cuh"
#include "opmath.cuh"

namespace lrmoe {
namespace {

using opmath::AccType;
using opmath::add_rows_in_order;
using opmath::from_acc;
using opmath::mul_rn;
using opmath::to_acc;

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

dim3 grid_for_rows(int64_t rows) {
  const int64_t wanted = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  return dim3(static_cast<unsigned int>(wanted < kMaxBlocks ? wanted : kMaxBlocks));
}

template <typename T, typename S, typename I>
__global__ void combine_forward_kernel(T* __restrict__ out, const T* __restrict__ src,
                                       const S* __restrict__ scale, const I* __restrict__ order,
                                       const int64_t* __restrict__ off, int64_t n_src,
                                       int64_t n_tokens, int64_t hidden) {
  using acc_t = typename AccType<T>::type;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; t < n_tokens;
       t += stride) {
    const int64_t begin = off[t];
    const int64_t end = off[t + 1];
    T* dst = out + t * hidden;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      // Entries of order outside [0, P) (refused by the debug checks) are skipped.
      dst[c] = from_acc<T>(
          add_rows_in_order<T, S, I>(acc_t(0), src, scale, order, begin, end, n_src, hidden, c));
    }
  }
}

template <typename T, typename S, typename I>
__global__ void combine_backward_kernel(typename AccType<T>::type* __restrict__ dscale,
                                        T* __restrict__ out, const T* __restrict__ dy,
                                        const T* __restrict__ src, const I* __restrict__ token,
                                        const S* __restrict__ scale,
                                        const int64_t* __restrict__ kept_row,
                                        const float* __restrict__ w, int64_t n_tokens,
                                        int64_t n_src, int64_t n_out, int64_t hidden) {
  using acc_t = typename AccType<T>::type;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; i < n_src;
       i += stride) {
    const int64_t t = static_cast<int64_t>(token[i]);
    const bool valid = t >= 0 && t < n_tokens;
    int64_t s = kept_row == nullptr ? i : kept_row[i];
    if (!valid || s >= n_out) {
      s = -1;  // never write out of bounds
    }
    acc_t factor = acc_t(0);
    if (s >= 0) {
      factor = static_cast<acc_t>(to_acc(scale[i]));
      if (w != nullptr) {
        factor = mul_rn(factor, static_cast<acc_t>(w[s]));
      }
    }
    acc_t dot = acc_t(0);
    if (valid) {
      const T* g = dy + t * hidden;
      const T* o = src + i * hidden;
      T* dst = s >= 0 ? out + s * hidden : nullptr;
      for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        const acc_t gv = static_cast<acc_t>(to_acc(g[c]));
        dot += gv * static_cast<acc_t>(to_acc(o[c]));
        if (dst != nullptr) {
          dst[c] = from_acc<T>(mul_rn(gv, factor));
        }
      }
    }
    for (int shift = kWarp / 2; shift > 0; shift /= 2) {
      dot += __shfl_xor_sync(0xffffffffu, dot, shift);
    }
    if (threadIdx.x == 0) {
      dscale[i] = dot;
    }
  }
}

template <typename T, typename S, typename I>
const char* launch_forward(void* out, const void* src, const void* scale, const void* order,
                           const int64_t* off, int64_t n_src, int64_t n_tokens, int64_t hidden,
                           cudaStream_t stream) {
  combine_forward_kernel<T, S, I><<<grid_for_rows(n_tokens), dim3(kWarp, kRowsPerBlock), 0,
                                    stream>>>(
      static_cast<T*>(out), static_cast<const T*>(src), static_cast<const S*>(scale),
      static_cast<const I*>(order), off, n_src, n_tokens, hidden);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, typename S, typename I>
const char* launch_backward(void* dscale, void* out, const void* dy, const void* src,
                            const void* token, const void* scale, const int64_t* kept_row,
                            const float* w, int64_t n_tokens, int64_t n_src, int64_t n_out,
                            int64_t hidden, cudaStream_t stream) {
  using acc_t = typename AccType<T>::type;
  combine_backward_kernel<T, S, I><<<grid_for_rows(n_src), dim3(kWarp, kRowsPerBlock), 0,
                                     stream>>>(
      static_cast<acc_t*>(dscale), static_cast<T*>(out), static_cast<const T*>(dy),
      static_cast<const T*>(src), static_cast<const I*>(token), static_cast<const S*>(scale),
      kept_row, w, n_tokens, n_src, n_out, hidden);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, typename S, typename I>
struct ForwardOp {
  static const char* run(void* out, const void* src, const void* scale, const void* order,
                         const int64_t* off, int64_t n_src, int64_t n_tokens, int64_t hidden,
                         cudaStream_t stream) {
    return launch_forward<T, S, I>(out, src, scale, order, off, n_src, n_tokens, hidden, stream);
  }
};

template <typename T, typename S, typename I>
struct BackwardOp {
  static const char* run(void* dscale, void* out, const void* dy, const void* src,
                         const void* token, const void* scale, const int64_t* kept_row,
                         const float* w, int64_t n_tokens, int64_t n_src, int64_t n_out,
                         int64_t hidden, cudaStream_t stream) {
    return launch_backward<T, S, I>(dscale, out, dy, src, token, scale, kept_row, w, n_tokens, n_src,
                                    n_out, hidden, stream);
  }
};

}  // namespace

const char* combine_rows_cuda(void* out, const void* src, const void* scale, const void* order,
                              const int64_t* offsets, int64_t n_src, int64_t n_tokens,
                              int64_t hidden, FloatType dtype, IndexType index_type,
                              ScaleType scale_type, CUstream_st* stream) {
  if (n_tokens <= 0 || hidden <= 0) {
    return nullptr;  // nothing to write; a zero-sized grid would be a launch error
  }
  if (scale_type == ScaleType::kNone || scale == nullptr) {
    return "combine_rows_cuda: a scale is required";
  }
  return dispatch_types<ForwardOp>(dtype, index_type, scale_type, out, src, scale, order,
                                   offsets, n_src, n_tokens, hidden,
                                   static_cast<cudaStream_t>(stream));
}

const char* combine_rows_backward_cuda(void* dscale, void* out, const void* dy, const void* src,
                                       const void* token, const void* scale, const int64_t* kept_row,
                                       const float* w, int64_t n_tokens, int64_t n_src,
                                       int64_t n_out, int64_t hidden, FloatType dtype,
                                       IndexType index_type, ScaleType scale_type,
                                       CUstream_st* stream) {
  if (n_src <= 0) {
    return nullptr;  // no pair; a zero-sized grid would be a launch error
  }
  if (scale_type == ScaleType::kNone || scale == nullptr) {
    return "combine_rows_backward_cuda: a scale is required";
  }
  return dispatch_types<BackwardOp>(dtype, index_type, scale_type, dscale, out, dy, src, token,
                                    scale, kept_row, w, n_tokens, n_src, n_out, hidden,
                                    static_cast<cudaStream_t>(stream));
}

}  // namespace lrmoe
