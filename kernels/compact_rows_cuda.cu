// compact_rows: CUDA backend.
//
// Only CUDA headers here (see kernels/scatter_add_rows_cuda.cu for why); tensor
// checks, the index range check and the current stream live in
// kernels/bindings.cpp.
//
// Notation: P rows of src, K kept rows (= len(kept_index)), H hidden size.
//   out[j, :] = scale[j] * src[kept_index[j], :]
//
// Layout: a block of (TX, TY) threads handles TY output rows at a time, TX
// threads striding over the H columns of a row. Each output element is
// written once, so the result is deterministic; products are formed in fp32
// for 16-bit types (the dtype itself otherwise) and rounded once, as on the
// CPU, so the backends agree bitwise.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "compact_rows.h"
#include "opmath.cuh"

namespace lrmoe {
namespace {

using opmath::AccType;
using opmath::from_acc;
using opmath::to_acc;

template <typename T, typename S, typename I>
__global__ void compact_rows_kernel(T* __restrict__ out, const T* __restrict__ src,
                                    const I* __restrict__ index, const S* __restrict__ scale,
                                    int64_t n_src, int64_t n_kept, int64_t hidden) {
  using acc_t = typename AccType<T>::type;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; j < n_kept;
       j += row_stride) {
    const int64_t s = static_cast<int64_t>(index[j]);
    if (s < 0 || s >= n_src) {
      continue;  // the binding refuses such input; never read out of bounds
    }
    const T* src_row = src + s * hidden;
    T* out_row = out + j * hidden;
    if (scale == nullptr) {
      for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        out_row[c] = src_row[c];
      }
    } else {
      const acc_t w = static_cast<acc_t>(to_acc(scale[j]));
      for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        // A lone product (no following add) cannot be fused into an FMA.
        out_row[c] = from_acc<T>(to_acc(src_row[c]) * w);
      }
    }
  }
}

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

template <typename T, typename S, typename I>
const char* launch(void* out, const void* src, const void* index, const void* scale,
                   int64_t n_src, int64_t n_kept, int64_t hidden, cudaStream_t stream) {
  // As in scatter_add_rows: TX threads per row (a multiple of the warp size,
  // at most 256), TY = 256 / TX rows per block, so narrow rows fill a block.
  int tx = 32;
  while (tx < kThreadsPerBlock && tx < hidden) {
    tx *= 2;
  }
  const int ty = kThreadsPerBlock / tx;
  const int64_t wanted = (n_kept + ty - 1) / ty;
  const dim3 grid(static_cast<unsigned int>(wanted < kMaxBlocks ? wanted : kMaxBlocks));
  const dim3 block(tx, ty);
  compact_rows_kernel<T, S, I><<<grid, block, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(src), static_cast<const I*>(index),
      static_cast<const S*>(scale), n_src, n_kept, hidden);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, typename I>
const char* launch_scale(void* out, const void* src, const void* index, const void* scale,
                         int64_t n_src, int64_t n_kept, int64_t hidden, ScaleType scale_type,
                         cudaStream_t stream) {
  switch (scale_type) {
    case ScaleType::kNone:
      return launch<T, T, I>(out, src, index, nullptr, n_src, n_kept, hidden, stream);
    case ScaleType::kSameAsSrc:
      return launch<T, T, I>(out, src, index, scale, n_src, n_kept, hidden, stream);
    case ScaleType::kFloat32:
      return launch<T, float, I>(out, src, index, scale, n_src, n_kept, hidden, stream);
  }
  return "compact_rows_cuda: unknown scale type";
}

template <typename T>
const char* launch_index(void* out, const void* src, const void* index, const void* scale,
                         int64_t n_src, int64_t n_kept, int64_t hidden, IndexType index_type,
                         ScaleType scale_type, cudaStream_t stream) {
  switch (index_type) {
    case IndexType::kInt32:
      return launch_scale<T, int32_t>(out, src, index, scale, n_src, n_kept, hidden, scale_type,
                                      stream);
    case IndexType::kInt64:
      return launch_scale<T, int64_t>(out, src, index, scale, n_src, n_kept, hidden, scale_type,
                                      stream);
  }
  return "compact_rows_cuda: unknown index type";
}

}  // namespace

const char* compact_rows_cuda(void* out, const void* src, const void* kept_index,
                              const void* scale, int64_t n_src, int64_t n_kept, int64_t hidden,
                              FloatType dtype, IndexType index_type, ScaleType scale_type,
                              CUstream_st* stream) {
  if (n_kept <= 0 || hidden <= 0) {
    return nullptr;  // nothing to copy; a zero-sized grid would be a launch error
  }
  if (scale_type != ScaleType::kNone && scale == nullptr) {
    return "compact_rows_cuda: scale_type says a scale is given but the pointer is null";
  }
  switch (dtype) {
    case FloatType::kFloat32:
      return launch_index<float>(out, src, kept_index, scale, n_src, n_kept, hidden, index_type,
                                 scale_type, stream);
    case FloatType::kFloat64:
      return launch_index<double>(out, src, kept_index, scale, n_src, n_kept, hidden, index_type,
                                  scale_type, stream);
    case FloatType::kFloat16:
      return launch_index<__half>(out, src, kept_index, scale, n_src, n_kept, hidden, index_type,
                                  scale_type, stream);
    case FloatType::kBFloat16:
      return launch_index<__nv_bfloat16>(out, src, kept_index, scale, n_src, n_kept, hidden,
                                         index_type, scale_type, stream);
  }
  return "compact_rows_cuda: unknown dtype";
}

}  // namespace lrmoe
