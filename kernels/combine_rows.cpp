// combine_rows: CPU backend of the weighted combine and its adjoint.
//
// Notation: P pair rows of src, T tokens, M entries of order, K backward rows,
// H hidden size (see kernels/combine_rows.h for the semantics).
//
// Forward: token t's output row sums its segment of `order` in ascending j,
// each product scale * src rounded to the dtype first and the sum kept in the
// op-math type (fp32 for half/bf16), rounded once: the rounding of
// scatter_add_rows, so with `order` = the pairs stably sorted by token the
// result equals scatter_add_rows(zeros, token, src, scale) bitwise. Threads
// take (token, column block) items; each output element is written by one
// item, so the result does not depend on the thread count.
//
// Backward: one pass over the pairs (dscale in the op-math type: fp32, or fp64
// for fp64 rows). The dot product <dy[token[i]], src[i]>
// is formed in op-math over kLanes interleaved partial sums (lane c % kLanes
// adds column c in ascending order), combined by a fixed pairwise tree: a
// fixed order (bitwise reproducible on this backend) that the compiler can
// vectorise without reassociating. The scaled row is one product in op-math
// rounded once, as scatter_add_rows rounds its products.
//
// -ffp-contract=off (setup.py) keeps products and sums from fusing into FMAs.
// Tensor checks are done by the caller (kernels/bindings.cpp); this file
// checks the index values it reads, before writing anything.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace lrmoe {
namespace {

constexpr int64_t kColBlock = 256;        // columns per forward work item (as scatter_add_rows)
constexpr int64_t kGrainElements = 32768;  // element updates worth a thread (ATen's figure)
constexpr int kLanes = 8;                  // partial sums of the backward dot product

template <typename index_t>
void check_forward_values(const index_t* order, const int64_t* off, int64_t n_order,
                          int64_t n_src, int64_t n_tokens) {
  TORCH_CHECK_VALUE(off[0] == 0, "combine_rows: offsets[0] = ", off[0], " but must be 0");
  for (int64_t t = 0; t < n_tokens; ++t) {
    TORCH_CHECK_VALUE(off[t + 1] >= off[t], "combine_rows: offsets[", t + 1, "] = ", off[t + 1],
                      " is less than offsets[", t, "] = ", off[t],
                      " (offsets must be non-decreasing)");
  }
  TORCH_CHECK_VALUE(off[n_tokens] == n_order, "combine_rows: offsets[", n_tokens, "] = ",
                    off[n_tokens], " but order has M = ", n_order, " entries");
  for (int64_t j = 0; j < n_order; ++j) {
    const int64_t v = static_cast<int64_t>(order[j]);
    TORCH_CHECK_INDEX(v >= 0 && v < n_src, "combine_rows: order[", j, "] = ", v,
                      " is outside [0, P) with P = ", n_src, " (rows of src)");
  }
}

template <typename scalar_t, typename scale_t, typename index_t>
void combine_forward_impl(scalar_t* out, const scalar_t* src, const scale_t* scale,
                          const index_t* order, const int64_t* off, int64_t n_src,
                          int64_t n_tokens, int64_t hidden) {
  using acc_t = at::opmath_type<scalar_t>;
  check_forward_values(order, off, off[n_tokens], n_src, n_tokens);
  const int64_t n_blocks = (hidden + kColBlock - 1) / kColBlock;
  const int64_t n_items = n_tokens * n_blocks;
  const int64_t work = std::max<int64_t>(1, off[n_tokens] * hidden);
  const int64_t grain = std::max<int64_t>(1, (kGrainElements * n_items) / work);
  at::parallel_for(0, n_items, grain, [&](int64_t k0, int64_t k1) {
    acc_t acc[kColBlock];
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t t = k / n_blocks;
      const int64_t c0 = (k % n_blocks) * kColBlock;
      const int64_t width = std::min(hidden, c0 + kColBlock) - c0;
      std::fill(acc, acc + width, acc_t(0));
      for (int64_t j = off[t]; j < off[t + 1]; ++j) {
        const int64_t r = static_cast<int64_t>(order[j]);
        const scalar_t* row = src + r * hidden + c0;
        const acc_t w = static_cast<acc_t>(scale[r]);
        for (int64_t c = 0; c < width; ++c) {
          acc[c] += static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(row[c]) * w));
        }
      }
      scalar_t* dst = out + t * hidden + c0;
      for (int64_t c = 0; c < width; ++c) {
        dst[c] = static_cast<scalar_t>(acc[c]);
      }
    }
  });
}

template <typename scalar_t, typename scale_t, typename index_t>
void combine_backward_impl(at::opmath_type<scalar_t>* dscale, scalar_t* out, const scalar_t* dy,
                           const scalar_t* src, const index_t* token, const scale_t* scale,
                           const int64_t* kept_row, const float* w, int64_t n_tokens, int64_t n_src,
                           int64_t n_out, int64_t hidden) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = 0; i < n_src; ++i) {
    const int64_t t = static_cast<int64_t>(token[i]);
    TORCH_CHECK_INDEX(t >= 0 && t < n_tokens, "combine_rows_backward: token[", i, "] = ", t,
                      " is outside [0, T) with T = ", n_tokens, " (rows of dy)");
    if (kept_row != nullptr) {
      TORCH_CHECK_INDEX(kept_row[i] >= -1 && kept_row[i] < n_out, "combine_rows_backward: kept_row[", i,
                        "] = ", kept_row[i], " is outside [-1, K) with K = ", n_out);
    }
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, hidden));
  at::parallel_for(0, n_src, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const scalar_t* g = dy + static_cast<int64_t>(token[i]) * hidden;
      const scalar_t* o = src + i * hidden;
      acc_t lane[kLanes] = {};
      int64_t c = 0;
      for (; c + kLanes <= hidden; c += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          lane[l] += static_cast<acc_t>(g[c + l]) * static_cast<acc_t>(o[c + l]);
        }
      }
      for (int l = 0; c < hidden; ++c, ++l) {
        lane[l] += static_cast<acc_t>(g[c]) * static_cast<acc_t>(o[c]);
      }
      dscale[i] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                  ((lane[4] + lane[5]) + (lane[6] + lane[7]));
      const int64_t s = kept_row == nullptr ? i : kept_row[i];
      if (s < 0) {
        continue;  // a dropped pair: its router gradient only
      }
      acc_t factor = static_cast<acc_t>(scale[i]);
      if (w != nullptr) {
        factor = factor * static_cast<acc_t>(w[s]);
      }
      scalar_t* dst = out + s * hidden;
      for (int64_t col = 0; col < hidden; ++col) {
        dst[col] = static_cast<scalar_t>(static_cast<acc_t>(g[col]) * factor);
      }
    }
  });
}

}  // namespace

// Declared in kernels/bindings.cpp, which has checked shapes, dtypes, devices
// and contiguity: out [T, H] zero-free (every element written), src [P, H],
// scale [P], order [M], offsets [T + 1] int64, all on the CPU, T > 0, H > 0.
void combine_rows_cpu(const at::Tensor& out, const at::Tensor& src, const at::Tensor& scale,
                      const at::Tensor& order, const at::Tensor& offsets) {
  const int64_t n_src = src.size(0);
  const int64_t n_tokens = out.size(0);
  const int64_t hidden = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, src.scalar_type(), "combine_rows_cpu", [&] {
        AT_DISPATCH_INDEX_TYPES(order.scalar_type(), "combine_rows_cpu", [&] {
          scalar_t* out_ptr = out.data_ptr<scalar_t>();
          const scalar_t* src_ptr = src.const_data_ptr<scalar_t>();
          const index_t* order_ptr = order.const_data_ptr<index_t>();
          const int64_t* off = offsets.const_data_ptr<int64_t>();
          if (scale.scalar_type() == src.scalar_type()) {
            combine_forward_impl(out_ptr, src_ptr, scale.const_data_ptr<scalar_t>(), order_ptr,
                                 off, n_src, n_tokens, hidden);
          } else {
            combine_forward_impl(out_ptr, src_ptr, scale.const_data_ptr<float>(), order_ptr, off,
                                 n_src, n_tokens, hidden);
          }
        });
      });
}

// Declared in kernels/bindings.cpp, which has checked shapes, dtypes, devices
// and contiguity: dscale [P] of the op-math type, out [K, H], dy [T, H], src [P, H], token [P],
// scale [P], optional kept_row [P] int64 and w [K] fp32, all on the CPU, P > 0.
void combine_rows_backward_cpu(const at::Tensor& dscale, const at::Tensor& out,
                               const at::Tensor& dy, const at::Tensor& src,
                               const at::Tensor& token, const at::Tensor& scale,
                               const std::optional<at::Tensor>& kept_row,
                               const std::optional<at::Tensor>& w) {
  const int64_t n_tokens = dy.size(0);
  const int64_t n_src = src.size(0);
  const int64_t n_out = out.size(0);
  const int64_t hidden = dy.size(1);
  const int64_t* kept_row_ptr = kept_row.has_value() ? kept_row->const_data_ptr<int64_t>() : nullptr;
  const float* w_ptr = w.has_value() ? w->const_data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dy.scalar_type(), "combine_rows_backward_cpu", [&] {
        AT_DISPATCH_INDEX_TYPES(token.scalar_type(), "combine_rows_backward_cpu", [&] {
          auto* dscale_ptr = dscale.data_ptr<at::opmath_type<scalar_t>>();
          scalar_t* out_ptr = out.data_ptr<scalar_t>();
          const scalar_t* dy_ptr = dy.const_data_ptr<scalar_t>();
          const scalar_t* src_ptr = src.const_data_ptr<scalar_t>();
          const index_t* token_ptr = token.const_data_ptr<index_t>();
          if (scale.scalar_type() == src.scalar_type()) {
            combine_backward_impl(dscale_ptr, out_ptr, dy_ptr, src_ptr, token_ptr,
                                  scale.const_data_ptr<scalar_t>(), kept_row_ptr, w_ptr, n_tokens,
                                  n_src, n_out, hidden);
          } else {
            combine_backward_impl(dscale_ptr, out_ptr, dy_ptr, src_ptr, token_ptr,
                                  scale.const_data_ptr<float>(), kept_row_ptr, w_ptr, n_tokens,
                                  n_src, n_out, hidden);
          }
        });
      });
}

}  // namespace lrmoe
