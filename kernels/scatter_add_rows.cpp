// scatter_add_rows: CPU backend.
//
// Notation: N rows of out, M rows of src (= len(index)), H hidden size.
//   out[index[i], :] += scale[i] * src[i, :]        i in [0, M)
//
// Algorithm: a stable counting sort groups the source rows by destination
// (each group in ascending position, or with a key in ascending (key,
// position): the rows are visited in that order), then threads split the work into
// (destination row, column block) items. An item loads its slice of out into
// an accumulator of the op-math type (fp32 for half/bf16), adds its rows in
// index order and stores once. Distinct items never touch the same element,
// so there are no races, and each element's sum is formed in the same order
// whatever the thread count: results are bitwise reproducible. With a key
// that names each row (distinct values), the order does not depend on the
// rows' positions either: any permutation of the rows, with their keys, gives
// the same bits.
//
// Rounding: with a scale, the product is formed in the op-math type and
// rounded to out's dtype (as `(src * scale[:, None]).to(dtype)` does); the
// sum over a destination row is then kept in the op-math type and rounded to
// out's dtype once. For fp32/fp64 this is exactly a serial loop of
// `out[index[i]] += p[i]`; for half/bf16 it is more accurate than rounding
// after every add. The build passes -ffp-contract=off so the compiler cannot
// fuse the product and the sum into an FMA (that would change the last bit).
//
// Tensor checks are done by the caller (kernels/bindings.cpp); this file
// checks only the index values, which it reads anyway, and before any write,
// so a bad index leaves out unchanged.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

namespace lrmoe {
namespace {

// Columns per work item: 256 fp32 values = 1 KiB = 16 cache lines; the
// accumulator of this many op-math values lives on the stack.
constexpr int64_t kColBlock = 256;
// Element updates below which a thread is not worth waking; ATen uses the
// same figure (at::internal::GRAIN_SIZE, in a header too heavy to include).
constexpr int64_t kGrainElements = 32768;

// Source rows grouped by destination: rows order[offsets[d] .. offsets[d+1])
// go to out row d, in the order they were visited.
struct Groups {
  std::vector<int64_t> offsets;  // [N + 1]
  std::vector<int64_t> order;    // [M]
};

// Positions [0, M) in ascending (key, position): the visiting order with a key; empty
// (ascending position, the same order) when the keys already ascend, as the LRMoE
// region's kept pair indices do.
std::vector<int64_t> by_key(const int64_t* key, int64_t n_src) {
  if (std::is_sorted(key, key + n_src)) {
    return {};
  }
  std::vector<int64_t> visit(n_src);
  std::iota(visit.begin(), visit.end(), int64_t{0});
  std::stable_sort(visit.begin(), visit.end(),
                   [key](int64_t a, int64_t b) { return key[a] < key[b]; });
  return visit;
}

// `visit`: the positions in visiting order (empty: ascending position).
template <typename index_t>
Groups group_by_destination(const index_t* index, int64_t n_src, int64_t n_out,
                            const std::vector<int64_t>& visit) {
  Groups g;
  g.offsets.assign(n_out + 1, 0);
  for (int64_t i = 0; i < n_src; ++i) {
    const int64_t v = static_cast<int64_t>(index[i]);
    TORCH_CHECK_INDEX(v >= 0 && v < n_out, "scatter_add_rows: index[", i, "] = ", v,
                      " is outside [0, N) with N = ", n_out, " (rows of out)");
    ++g.offsets[v + 1];
  }
  for (int64_t d = 0; d < n_out; ++d) {
    g.offsets[d + 1] += g.offsets[d];
  }
  std::vector<int64_t> cursor(g.offsets.begin(), g.offsets.end() - 1);
  g.order.resize(n_src);
  for (int64_t k = 0; k < n_src; ++k) {
    const int64_t i = visit.empty() ? k : visit[k];
    g.order[cursor[static_cast<int64_t>(index[i])]++] = i;  // visiting order: stable
  }
  return g;
}

// out[d, c0:c1] += sum over the group of d, in its order, in op-math.
template <typename scalar_t, typename scale_t>
void add_group_slice(scalar_t* out_row, const scalar_t* src, const scale_t* scale,
                     const int64_t* rows_begin, const int64_t* rows_end, int64_t hidden,
                     int64_t c0, int64_t c1) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t acc[kColBlock];
  const int64_t width = c1 - c0;
  scalar_t* dst = out_row + c0;
  for (int64_t c = 0; c < width; ++c) {
    acc[c] = static_cast<acc_t>(dst[c]);
  }
  for (const int64_t* r = rows_begin; r != rows_end; ++r) {
    const scalar_t* row = src + *r * hidden + c0;
    if (scale == nullptr) {
      for (int64_t c = 0; c < width; ++c) {
        acc[c] += static_cast<acc_t>(row[c]);
      }
    } else {
      const acc_t w = static_cast<acc_t>(scale[*r]);
      for (int64_t c = 0; c < width; ++c) {
        // Round the product to the dtype first: the reference's rounding.
        acc[c] += static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(row[c]) * w));
      }
    }
  }
  for (int64_t c = 0; c < width; ++c) {
    dst[c] = static_cast<scalar_t>(acc[c]);
  }
}

template <typename scalar_t, typename scale_t, typename index_t>
void scatter_add_rows_impl(scalar_t* out, const index_t* index, const scalar_t* src,
                           const scale_t* scale, const int64_t* key, int64_t n_out,
                           int64_t n_src, int64_t hidden) {
  const Groups g = group_by_destination(index, n_src, n_out,
                                        key == nullptr ? std::vector<int64_t>{}
                                                       : by_key(key, n_src));
  const int64_t n_blocks = (hidden + kColBlock - 1) / kColBlock;
  const int64_t n_items = n_out * n_blocks;
  // Grain in items: enough items that a chunk averages kGrainElements
  // updates (n_src * hidden updates spread over n_items items).
  const int64_t grain =
      std::max<int64_t>(1, (kGrainElements * n_items) / std::max<int64_t>(1, n_src * hidden));
  const int64_t* offsets = g.offsets.data();
  const int64_t* order = g.order.data();
  at::parallel_for(0, n_items, grain, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t d = k / n_blocks;
      const int64_t* begin = order + offsets[d];
      const int64_t* end = order + offsets[d + 1];
      if (begin == end) {
        continue;  // no source row targets d
      }
      const int64_t c0 = (k % n_blocks) * kColBlock;
      const int64_t c1 = std::min(hidden, c0 + kColBlock);
      add_group_slice(out + d * hidden, src, scale, begin, end, hidden, c0, c1);
    }
  });
}

}  // namespace

// Declared in kernels/bindings.cpp, which has checked: 2-D contiguous out
// [N, H] and src [M, H] of one floating dtype, 1-D contiguous int32/int64
// index [M], optional 1-D contiguous scale [M] of src's dtype or fp32,
// optional 1-D contiguous int64 key [M], all on the CPU, no aliasing of out
// and src, M > 0 and H > 0.
void scatter_add_rows_cpu(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src,
                          const std::optional<at::Tensor>& scale,
                          const std::optional<at::Tensor>& key) {
  const int64_t* key_ptr = key.has_value() ? key->const_data_ptr<int64_t>() : nullptr;
  const int64_t n_out = out.size(0);
  const int64_t n_src = src.size(0);
  const int64_t hidden = src.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, out.scalar_type(), "scatter_add_rows_cpu", [&] {
        AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "scatter_add_rows_cpu", [&] {
          scalar_t* out_ptr = out.data_ptr<scalar_t>();
          const index_t* index_ptr = index.const_data_ptr<index_t>();
          const scalar_t* src_ptr = src.const_data_ptr<scalar_t>();
          if (!scale.has_value()) {
            scatter_add_rows_impl<scalar_t, scalar_t, index_t>(
                out_ptr, index_ptr, src_ptr, nullptr, key_ptr, n_out, n_src, hidden);
          } else if (scale->scalar_type() == out.scalar_type()) {
            scatter_add_rows_impl(out_ptr, index_ptr, src_ptr, scale->const_data_ptr<scalar_t>(),
                                  key_ptr, n_out, n_src, hidden);
          } else {
            scatter_add_rows_impl(out_ptr, index_ptr, src_ptr, scale->const_data_ptr<float>(),
                                  key_ptr, n_out, n_src, hidden);
          }
        });
      });
}

}  // namespace lrmoe
