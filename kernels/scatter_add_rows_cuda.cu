// scatter_add_rows: CUDA backend.
//
// Only CUDA headers here: torch/ATen headers cost ~74 s per .cu and do not
// compile against the CPU torch wheel. Tensor checks
// and the current stream live in kernels/bindings.cpp.
//
// Notation: N rows of out, M rows of src (= len(index)), H hidden size.
//   out[index[i], :] += scale[i] * src[i, :]
//
// Two kernels.
// Fast path (scatter_add_rows_cuda): a block of (TX, TY) threads handles TY
// source rows at a time, TX threads striding over the H columns of each row;
// every element is added with atomicAdd, because several source rows may target
// the same destination. Consequences, unlike the CPU backend (which sums each
// destination in a fixed order, in fp32 for 16-bit types, rounding once): the
// order of the adds is not fixed (last bits may vary run to run), and 16-bit
// outputs are rounded after every add.
// Deterministic path (scatter_add_rows_sorted_cuda, a sorted segment sum): the
// caller has sorted the rows by destination; one warp per destination row finds
// its segment by binary search in the sorted index, lanes stride over the
// columns, and each element is summed over the segment in order in the op-math
// type, starting from out's value, and rounded once: the CPU backend's
// arithmetic in the CPU backend's order, so the two agree bitwise.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch.cuh"
#include "opmath.cuh"
#include "scatter_add_rows.h"

namespace lrmoe {
namespace {

using opmath::AccType;
using opmath::add_rows_in_order;
using opmath::from_acc;
using opmath::to_acc;

template <typename T, typename S, typename I>
__global__ void scatter_add_rows_kernel(T* __restrict__ out, const I* __restrict__ index,
                                        const T* __restrict__ src, const S* __restrict__ scale,
                                        int64_t n_out, int64_t n_src, int64_t hidden) {
  using acc_t = typename AccType<T>::type;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < n_src;
       row += row_stride) {
    const int64_t dst = static_cast<int64_t>(index[row]);
    if (dst < 0 || dst >= n_out) {
      continue;  // the binding refuses such input; never write out of bounds
    }
    T* out_row = out + dst * hidden;
    const T* src_row = src + row * hidden;
    if (scale == nullptr) {
      for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        atomicAdd(out_row + c, src_row[c]);
      }
    } else {
      const acc_t w = static_cast<acc_t>(to_acc(scale[row]));
      for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        atomicAdd(out_row + c, from_acc<T>(to_acc(src_row[c]) * w));
      }
    }
  }
}

constexpr int kThreadsPerBlock = 256;
// Enough blocks to fill any current GPU many times over; the kernel's
// grid-stride loop covers larger M.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

template <typename T, typename S, typename I>
const char* launch(void* out, const void* index, const void* src, const void* scale, int64_t n_out,
                   int64_t n_src, int64_t hidden, cudaStream_t stream) {
  // Narrow rows (small H) would leave most of a 256-thread row idle, so a
  // block spans several rows: TX threads per row (a multiple of the warp
  // size, at most 256) and TY = 256 / TX rows.
  int tx = 32;
  while (tx < kThreadsPerBlock && tx < hidden) {
    tx *= 2;
  }
  const int ty = kThreadsPerBlock / tx;
  const int64_t wanted = (n_src + ty - 1) / ty;
  const dim3 grid(static_cast<unsigned int>(wanted < kMaxBlocks ? wanted : kMaxBlocks));
  const dim3 block(tx, ty);
  scatter_add_rows_kernel<T, S, I><<<grid, block, 0, stream>>>(
      static_cast<T*>(out), static_cast<const I*>(index), static_cast<const T*>(src),
      static_cast<const S*>(scale), n_out, n_src, hidden);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// ---- deterministic path: sorted segment sum --------------------------------

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // warps per block, one destination row each

// First position in sorted[0, n) whose value is >= v.
template <typename I>
__device__ __forceinline__ int64_t lower_bound(const I* __restrict__ sorted, int64_t n,
                                               int64_t v) {
  int64_t lo = 0;
  int64_t hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(sorted[mid]) < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename T, typename S, typename I>
__global__ void scatter_add_rows_sorted_kernel(T* __restrict__ out,
                                               const I* __restrict__ sorted_index,
                                               const int64_t* __restrict__ order,
                                               const T* __restrict__ src,
                                               const S* __restrict__ scale, int64_t n_out,
                                               int64_t n_src, int64_t hidden) {
  using acc_t = typename AccType<T>::type;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; d < n_out;
       d += stride) {
    const int64_t begin = lower_bound(sorted_index, n_src, d);
    const int64_t end = begin + lower_bound(sorted_index + begin, n_src - begin, d + 1);
    if (begin == end) {
      continue;  // no row targets d: out[d] is left as it is
    }
    T* dst = out + d * hidden;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      const acc_t acc = static_cast<acc_t>(to_acc(dst[c]));
      dst[c] = from_acc<T>(
          add_rows_in_order<T, S>(acc, src, scale, order, begin, end, n_src, hidden, c));
    }
  }
}

template <typename T, typename S, typename I>
const char* launch_sorted(void* out, const void* sorted_index, const int64_t* order,
                          const void* src, const void* scale, int64_t n_out, int64_t n_src,
                          int64_t hidden, cudaStream_t stream) {
  const int64_t wanted = (n_out + kRowsPerBlock - 1) / kRowsPerBlock;
  const dim3 grid(static_cast<unsigned int>(wanted < kMaxBlocks ? wanted : kMaxBlocks));
  scatter_add_rows_sorted_kernel<T, S, I><<<grid, dim3(kWarp, kRowsPerBlock), 0, stream>>>(
      static_cast<T*>(out), static_cast<const I*>(sorted_index), order,
      static_cast<const T*>(src), static_cast<const S*>(scale), n_out, n_src, hidden);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// The two launchers as dispatch_types' Op (kernels/dispatch.cuh).
template <typename T, typename S, typename I>
struct AtomicLaunch {
  static const char* run(void* out, const void* index, const void* src, const void* scale,
                         int64_t n_out, int64_t n_src, int64_t hidden, cudaStream_t stream) {
    return launch<T, S, I>(out, index, src, scale, n_out, n_src, hidden, stream);
  }
};

template <typename T, typename S, typename I>
struct SortedLaunch {
  static const char* run(void* out, const void* sorted_index, const int64_t* order,
                         const void* src, const void* scale, int64_t n_out, int64_t n_src,
                         int64_t hidden, cudaStream_t stream) {
    return launch_sorted<T, S, I>(out, sorted_index, order, src, scale, n_out, n_src, hidden,
                                  stream);
  }
};

}  // namespace

const char* scatter_add_rows_cuda(void* out, const void* index, const void* src, const void* scale,
                                  int64_t n_out, int64_t n_src, int64_t hidden, FloatType dtype,
                                  IndexType index_type, ScaleType scale_type,
                                  CUstream_st* stream) {
  if (n_src <= 0 || hidden <= 0) {
    return nullptr;  // nothing to add; a zero-sized grid would be a launch error
  }
  if (scale_type != ScaleType::kNone && scale == nullptr) {
    return "scatter_add_rows_cuda: scale_type says a scale is given but the pointer is null";
  }
  return dispatch_types<AtomicLaunch>(dtype, index_type, scale_type, out, index, src,
                                      scale_type == ScaleType::kNone ? nullptr : scale, n_out,
                                      n_src, hidden, static_cast<cudaStream_t>(stream));
}

const char* scatter_add_rows_sorted_cuda(void* out, const void* sorted_index,
                                         const int64_t* order, const void* src,
                                         const void* scale, int64_t n_out, int64_t n_src,
                                         int64_t hidden, FloatType dtype, IndexType index_type,
                                         ScaleType scale_type, CUstream_st* stream) {
  if (n_src <= 0 || n_out <= 0 || hidden <= 0) {
    return nullptr;  // nothing to add; a zero-sized grid would be a launch error
  }
  if (scale_type != ScaleType::kNone && scale == nullptr) {
    return "scatter_add_rows_sorted_cuda: scale_type says a scale is given but the pointer is "
           "null";
  }
  return dispatch_types<SortedLaunch>(dtype, index_type, scale_type, out, sorted_index, order,
                                      src, scale_type == ScaleType::kNone ? nullptr : scale,
                                      n_out, n_src, hidden, static_cast<cudaStream_t>(stream));
}

}  // namespace lrmoe
