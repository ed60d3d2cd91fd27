// Op-math conversions shared by the CUDA kernels (device code only; include from .cu).
//
// Products and sums are formed in fp32 for 16-bit types (and in the type itself
// otherwise), then rounded to the output type, as the CPU backends and the torch
// references round them. Explicit intrinsics, since torch builds with
// __CUDA_NO_HALF_CONVERSIONS__ and __CUDA_NO_BFLOAT16_CONVERSIONS__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lrmoe {
namespace opmath {

template <typename T>
struct AccType {
  using type = T;
};
template <>
struct AccType<__half> {
  using type = float;
};
template <>
struct AccType<__nv_bfloat16> {
  using type = float;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(typename AccType<T>::type v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Explicitly rounded product and sum: nvcc may not contract them into an FMA, so the
// device rounds where the CPU backends (built with -ffp-contract=off) round.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// acc + the rows order[begin .. end) of column c, in that order: each row's value times
// its scale (scale null: the value itself) rounded to T, then added in the op-math type
// with an explicit rounding: the CPU backends' arithmetic in their order. Entries of
// order outside [0, n_src) are skipped (never read out of bounds).
template <typename T, typename S, typename I>
__device__ __forceinline__ typename AccType<T>::type add_rows_in_order(
    typename AccType<T>::type acc, const T* __restrict__ src, const S* __restrict__ scale,
    const I* __restrict__ order, int64_t begin, int64_t end, int64_t n_src, int64_t hidden,
    int64_t c) {
  using acc_t = typename AccType<T>::type;
  for (int64_t j = begin; j < end; ++j) {
    const int64_t r = static_cast<int64_t>(order[j]);
    if (r < 0 || r >= n_src) {
      continue;
    }
    const acc_t v = static_cast<acc_t>(to_acc(src[r * hidden + c]));
    if (scale == nullptr) {
      acc = add_rn(acc, v);
    } else {
      const T product = from_acc<T>(mul_rn(v, static_cast<acc_t>(to_acc(scale[r]))));
      acc = add_rn(acc, static_cast<acc_t>(to_acc(product)));
    }
  }
  return acc;
}

}  // namespace opmath
}  // namespace lrmoe
