// scatter_add_rows: CUDA backend.
//
// Only CUDA headers here: torch/ATen headers cost ~74 s per .cu and do not
// compile against the CPU torch wheel (shared/CPU_RUNTIME.md). Tensor checks
// and the current stream live in kernels/bindings.cpp.
//
// Notation: N rows of out, M rows of src (= len(index)), H hidden size.
//   out[index[i], :] += scale[i] * src[i, :]
//
// Layout: a block of (TX, TY) threads handles TY source rows at a time, TX
// threads striding over the H columns of each row; every element is added
// with atomicAdd, because several source rows may target the same
// destination. Consequences, unlike the CPU backend (which sums each
// destination in index order, in fp32 for 16-bit types, rounding once):
// the order of the adds is not fixed (last bits may vary run to run), and
// 16-bit outputs are rounded after every add. A deterministic variant
// (sorted by destination, one segment per block) is the upgrade path.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "opmath.cuh"
#include "scatter_add_rows.h"

namespace lrmoe {
namespace {

using opmath::AccType;
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

template <typename T, typename I>
const char* launch_scale(void* out, const void* index, const void* src, const void* scale,
                         int64_t n_out, int64_t n_src, int64_t hidden, ScaleType scale_type,
                         cudaStream_t stream) {
  switch (scale_type) {
    case ScaleType::kNone:
      return launch<T, T, I>(out, index, src, nullptr, n_out, n_src, hidden, stream);
    case ScaleType::kSameAsSrc:
      return launch<T, T, I>(out, index, src, scale, n_out, n_src, hidden, stream);
    case ScaleType::kFloat32:
      return launch<T, float, I>(out, index, src, scale, n_out, n_src, hidden, stream);
  }
  return "scatter_add_rows_cuda: unknown scale type";
}

template <typename T>
const char* launch_index(void* out, const void* index, const void* src, const void* scale,
                         int64_t n_out, int64_t n_src, int64_t hidden, IndexType index_type,
                         ScaleType scale_type, cudaStream_t stream) {
  switch (index_type) {
    case IndexType::kInt32:
      return launch_scale<T, int32_t>(out, index, src, scale, n_out, n_src, hidden, scale_type,
                                      stream);
    case IndexType::kInt64:
      return launch_scale<T, int64_t>(out, index, src, scale, n_out, n_src, hidden, scale_type,
                                      stream);
  }
  return "scatter_add_rows_cuda: unknown index type";
}

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
  switch (dtype) {
    case FloatType::kFloat32:
      return launch_index<float>(out, index, src, scale, n_out, n_src, hidden, index_type,
                                 scale_type, stream);
    case FloatType::kFloat64:
      return launch_index<double>(out, index, src, scale, n_out, n_src, hidden, index_type,
                                  scale_type, stream);
    case FloatType::kFloat16:
      return launch_index<__half>(out, index, src, scale, n_out, n_src, hidden, index_type,
                                  scale_type, stream);
    case FloatType::kBFloat16:
      return launch_index<__nv_bfloat16>(out, index, src, scale, n_out, n_src, hidden, index_type,
                                         scale_type, stream);
  }
  return "scatter_add_rows_cuda: unknown dtype";
}

}  // namespace lrmoe
