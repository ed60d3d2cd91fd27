// compact_rows: CPU backend.
//
// Notation: P rows of src, K kept rows (= len(kept_index)), H hidden size.
//   out[j, :] = scale[j] * src[kept_index[j], :]        j in [0, K)
//
// Every output row is written by exactly one thread, so rows are split
// across threads freely and the result does not depend on the thread count.
// Without a scale a row is a memcpy. With a scale the product is formed in
// the op-math type (fp32 for half/bf16, the dtype itself otherwise) and
// rounded to the dtype once, as `(src.to(opmath) * scale.to(opmath)).to(dtype)`
// does: the same rounding as scatter_add_rows, so compact-then-scatter and
// the torch reference agree bitwise.
//
// Tensor checks are done by the caller (kernels/bindings.cpp); this file
// checks the index values before writing anything.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace lrmoe {
namespace {

// Elements copied below which waking another thread does not pay (the
// figure scatter_add_rows and ATen's GRAIN_SIZE use).
constexpr int64_t kGrainElements = 32768;

template <typename index_t>
void check_index_range(const index_t* index, int64_t n_kept, int64_t n_src) {
  for (int64_t j = 0; j < n_kept; ++j) {
    const int64_t v = static_cast<int64_t>(index[j]);
    TORCH_CHECK_INDEX(v >= 0 && v < n_src, "compact_rows: kept_index[", j, "] = ", v,
                      " is outside [0, P) with P = ", n_src, " (rows of src)");
  }
}

template <typename scalar_t, typename scale_t, typename index_t>
void compact_rows_impl(scalar_t* out, const scalar_t* src, const index_t* index,
                       const scale_t* scale, int64_t n_src, int64_t n_kept, int64_t hidden) {
  using acc_t = at::opmath_type<scalar_t>;
  check_index_range(index, n_kept, n_src);
  if (hidden == 0) {
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / hidden);
  at::parallel_for(0, n_kept, grain, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const scalar_t* row = src + static_cast<int64_t>(index[j]) * hidden;
      scalar_t* dst = out + j * hidden;
      if (scale == nullptr) {
        std::memcpy(dst, row, sizeof(scalar_t) * hidden);
      } else {
        const acc_t w = static_cast<acc_t>(scale[j]);
        for (int64_t c = 0; c < hidden; ++c) {
          dst[c] = static_cast<scalar_t>(static_cast<acc_t>(row[c]) * w);
        }
      }
    }
  });
}

}  // namespace

// Declared in kernels/bindings.cpp, which has checked: out [K, H] freshly
// allocated with src's dtype, src [P, H] contiguous of one floating dtype,
// 1-D contiguous int32/int64 kept_index [K], optional 1-D contiguous scale
// [K] of src's dtype or fp32, all on the CPU, K > 0.
void compact_rows_cpu(const at::Tensor& out, const at::Tensor& src, const at::Tensor& kept_index,
                      const std::optional<at::Tensor>& scale) {
  const int64_t n_src = src.size(0);
  const int64_t n_kept = kept_index.size(0);
  const int64_t hidden = src.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, src.scalar_type(), "compact_rows_cpu", [&] {
        AT_DISPATCH_INDEX_TYPES(kept_index.scalar_type(), "compact_rows_cpu", [&] {
          scalar_t* out_ptr = out.data_ptr<scalar_t>();
          const scalar_t* src_ptr = src.const_data_ptr<scalar_t>();
          const index_t* index_ptr = kept_index.const_data_ptr<index_t>();
          if (!scale.has_value()) {
            compact_rows_impl<scalar_t, scalar_t, index_t>(out_ptr, src_ptr, index_ptr, nullptr,
                                                           n_src, n_kept, hidden);
          } else if (scale->scalar_type() == src.scalar_type()) {
            compact_rows_impl(out_ptr, src_ptr, index_ptr, scale->const_data_ptr<scalar_t>(),
                              n_src, n_kept, hidden);
          } else {
            compact_rows_impl(out_ptr, src_ptr, index_ptr, scale->const_data_ptr<float>(), n_src,
                              n_kept, hidden);
          }
        });
      });
}

}  // namespace lrmoe
