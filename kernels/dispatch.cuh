// Dtype, index type and scale type -> one kernel instantiation, for the CUDA launchers
// (device code's host side; include from .cu only).
//
// `Op` is a class template over <T (row data), S (scale), I (index)> whose static
// `run(args...)` launches; dispatch_types picks T from `dtype`, S from `scale_type`
// (float for kFloat32, else T: kSameAsSrc, or kNone with a null scale pointer) and I
// from `index_type`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "scatter_add_rows.h"  // FloatType, IndexType, ScaleType

namespace lrmoe {

template <template <typename, typename, typename> class Op, typename... Args>
const char* dispatch_types(FloatType dtype, IndexType index_type, ScaleType scale_type,
                           Args... args) {
  auto by_index = [&](auto t_tag, auto s_tag) -> const char* {
    using T = decltype(t_tag);
    using S = decltype(s_tag);
    if (index_type == IndexType::kInt32) {
      return Op<T, S, int32_t>::run(args...);
    }
    return Op<T, S, int64_t>::run(args...);
  };
  auto by_scale = [&](auto t_tag) -> const char* {
    using T = decltype(t_tag);
    if (scale_type == ScaleType::kFloat32) {
      return by_index(t_tag, float{});
    }
    return by_index(t_tag, T{});
  };
  switch (dtype) {
    case FloatType::kFloat32:
      return by_scale(float{});
    case FloatType::kFloat64:
      return by_scale(double{});
    case FloatType::kFloat16:
      return by_scale(__half{});
    case FloatType::kBFloat16:
      return by_scale(__nv_bfloat16{});
  }
  return "unknown dtype";
}

}  // namespace lrmoe
