// megatron_lrmoe._kernels: the one pybind11 binding file of the kernel tier.
//
// Each entry point checks device, dtype, shape and contiguity up front,
// returns early on empty input, then calls the CPU implementation (kernels/
// *.cpp) or, in a build with WITH_CUDA defined by setup.py, the CUDA launcher
// (kernels/*.cu) on the current stream. Python code reaches these functions
// only through megatron_lrmoe/ops (the backend-selection point), never
// directly.
//
// Errors use TORCH_CHECK_{TYPE,VALUE,INDEX}, which reach Python as
// TypeError, ValueError and IndexError.
//
// Host syncs: on CUDA, checking index or metric values means reading a device
// reduction on the host, which stalls the CPU until the GPU drains. Those checks
// run only when the caller passes check = true (megatron_lrmoe/ops passes its
// debug switch, MEGATRON_LRMOE_DEBUG_CHECKS: on in the tests, off by default);
// without them the CUDA kernels skip out-of-range rows (never reading or writing
// out of bounds) and select_rows takes its output size from the caller. CPU
// checks read host memory the kernels read anyway, so they always run.
//
// Two front doors to the same functions: the torch ops lrmoe::* (TORCH_LIBRARY
// below, with CPU and CUDA kernels; megatron_lrmoe/ops calls these and registers
// their fake implementations, so the ops trace under FakeTensorMode and
// torch.compile), and the pybind11 module (the extension's binding: the
// built_with_cuda helper, and the same entry points for tests of the binding).
//
// Empty inputs are decided here, before any backend runs, so that no kernel sees
// the null data pointer of an empty tensor and every backend returns the same.
//
// Headers: torch/csrc/utils/pybind.h (pybind11 plus torch's Tensor casters)
// and the few ATen headers used, instead of torch/extension.h, which pulls in
// the whole C++ frontend: 14 s instead of 45-75 s of compile time here.

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "planner.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "combine_rows.h"
#include "scatter_add_rows.h"
#include "select_rows.h"

#ifdef WITH_CUDA
#include <ATen/ops/aminmax.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/stack.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lrmoe {

// Defined in kernels/scatter_add_rows.cpp (no header: its signature needs
// ATen, and kernels/scatter_add_rows.h stays free of torch for nvcc).
void scatter_add_rows_cpu(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src,
                          const std::optional<at::Tensor>& scale,
                          const std::optional<at::Tensor>& key);
// Defined in kernels/select_rows.cpp, for the same reason.
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_rows_cpu(const at::Tensor& metric,
                                                               const at::Tensor& cell_offsets,
                                                               const at::Tensor& quotas,
                                                               SelectRule rule, uint64_t seed,
                                                               double hybrid_fraction);
// Defined in kernels/combine_rows.cpp, for the same reason.
void combine_rows_cpu(const at::Tensor& out, const at::Tensor& src, const at::Tensor& scale,
                      const at::Tensor& order, const at::Tensor& offsets);
void combine_rows_backward_cpu(const at::Tensor& dscale, const at::Tensor& out,
                               const at::Tensor& dy, const at::Tensor& src,
                               const at::Tensor& token, const at::Tensor& scale,
                               const std::optional<at::Tensor>& kept_row,
                               const std::optional<at::Tensor>& w);

namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

#ifdef WITH_CUDA
FloatType to_float_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return FloatType::kFloat32;
    case at::kDouble:
      return FloatType::kFloat64;
    case at::kHalf:
      return FloatType::kFloat16;
    default:
      return FloatType::kBFloat16;  // the only other dtype check_scatter_args lets through
  }
}

IndexType to_index_type(at::ScalarType t) {
  return t == at::kInt ? IndexType::kInt32 : IndexType::kInt64;
}

// The CUDA kernels cannot report a bad index without a sync, so check here
// when the caller asks (its debug switch): one min/max reduction and one
// device-to-host copy of two integers. The message reads "<op>: <index_name> holds v, outside [0, <n_name>) with
// <n_name> = n (rows of <rows_of>)".
void check_index_range_cuda(const at::Tensor& index, int64_t n, const char* op,
                            const char* index_name, const char* n_name, const char* rows_of) {
  const auto [lo, hi] = at::aminmax(index);
  const at::Tensor bounds = at::stack({lo, hi}).to(at::kLong).cpu();  // host sync
  const int64_t min_v = bounds[0].item<int64_t>();
  const int64_t max_v = bounds[1].item<int64_t>();
  const int64_t bad = min_v < 0 ? min_v : max_v;
  TORCH_CHECK_INDEX(min_v >= 0 && max_v < n, op, ": ", index_name, " holds ", bad, ", outside [0, ",
                    n_name, ") with ", n_name, " = ", n, " (rows of ", rows_of, ")");
}

ScaleType to_scale_type(const std::optional<at::Tensor>& scale, at::ScalarType src_type) {
  if (!scale.has_value()) {
    return ScaleType::kNone;
  }
  return scale->scalar_type() == src_type ? ScaleType::kSameAsSrc : ScaleType::kFloat32;
}
#endif

void check_scatter_args(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src,
                        const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& key) {
  TORCH_CHECK_VALUE(out.dim() == 2, "scatter_add_rows: out must be 2-D [N, H], got shape ",
                    out.sizes());
  TORCH_CHECK_VALUE(src.dim() == 2, "scatter_add_rows: src must be 2-D [M, H], got shape ",
                    src.sizes());
  TORCH_CHECK_VALUE(index.dim() == 1, "scatter_add_rows: index must be 1-D [M], got shape ",
                    index.sizes());
  TORCH_CHECK_VALUE(src.size(1) == out.size(1), "scatter_add_rows: src [M, H] = ", src.sizes(),
                    " and out [N, H] = ", out.sizes(), " differ in H");
  TORCH_CHECK_VALUE(index.size(0) == src.size(0), "scatter_add_rows: index has ", index.size(0),
                    " entries but src has ", src.size(0), " rows");

  TORCH_CHECK_TYPE(is_supported_float(out.scalar_type()),
                   "scatter_add_rows: out must be float32, float64, float16 or bfloat16, got ",
                   out.scalar_type());
  TORCH_CHECK_TYPE(src.scalar_type() == out.scalar_type(), "scatter_add_rows: src dtype ",
                   src.scalar_type(), " differs from out dtype ", out.scalar_type());
  TORCH_CHECK_TYPE(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
                   "scatter_add_rows: index must be int64 or int32, got ", index.scalar_type());

  const at::Device device = out.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "scatter_add_rows: tensors must be on a CPU or CUDA device, got ", device);
  TORCH_CHECK_VALUE(src.device() == device && index.device() == device,
                    "scatter_add_rows: all tensors must be on one device; out is on ", device,
                    ", src on ", src.device(), ", index on ", index.device());

  // In-place on out: copying a non-contiguous out would silently lose the
  // update, so every operand must already be contiguous (the Python wrapper
  // makes the read-only operands contiguous).
  TORCH_CHECK_VALUE(out.is_contiguous(), "scatter_add_rows: out must be contiguous");
  TORCH_CHECK_VALUE(src.is_contiguous(), "scatter_add_rows: src must be contiguous");
  TORCH_CHECK_VALUE(index.is_contiguous(), "scatter_add_rows: index must be contiguous");
  at::assert_no_overlap(out, src);

  if (scale.has_value()) {
    const at::Tensor& s = *scale;
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == src.size(0),
                      "scatter_add_rows: scale must be 1-D [M] with M = ", src.size(0),
                      ", got shape ", s.sizes());
    TORCH_CHECK_TYPE(s.scalar_type() == src.scalar_type() || s.scalar_type() == at::kFloat,
                     "scatter_add_rows: scale must have src's dtype (", src.scalar_type(),
                     ") or float32, got ", s.scalar_type());
    TORCH_CHECK_VALUE(s.device() == device, "scatter_add_rows: scale is on ", s.device(),
                      ", out on ", device);
    TORCH_CHECK_VALUE(s.is_contiguous(), "scatter_add_rows: scale must be contiguous");
    at::assert_no_overlap(out, s);
  }
  if (key.has_value()) {
    const at::Tensor& k = *key;
    TORCH_CHECK_VALUE(k.dim() == 1 && k.size(0) == src.size(0),
                      "scatter_add_rows: key must be 1-D [M] with M = ", src.size(0),
                      ", got shape ", k.sizes());
    TORCH_CHECK_TYPE(k.scalar_type() == at::kLong, "scatter_add_rows: key must be int64, got ",
                     k.scalar_type());
    TORCH_CHECK_VALUE(k.device() == device, "scatter_add_rows: key is on ", k.device(),
                      ", out on ", device);
    TORCH_CHECK_VALUE(k.is_contiguous(), "scatter_add_rows: key must be contiguous");
  }
}

SelectRule parse_rule(const std::string& rule) {
  if (rule == "topk") {
    return SelectRule::kTopK;
  }
  if (rule == "sample") {
    return SelectRule::kSample;
  }
  if (rule == "uniform") {
    return SelectRule::kUniform;
  }
  TORCH_CHECK_VALUE(rule == "hybrid",
                    "select_rows: rule must be one of 'topk', 'sample', 'uniform', 'hybrid', "
                    "got '",
                    rule, "'");
  return SelectRule::kHybrid;
}

void check_select_args(const at::Tensor& metric, const at::Tensor& cell_offsets,
                       const at::Tensor& quotas) {
  TORCH_CHECK_VALUE(metric.dim() == 1, "select_rows: metric must be 1-D [P], got shape ",
                    metric.sizes());
  TORCH_CHECK_VALUE(cell_offsets.dim() == 1 && cell_offsets.size(0) >= 1,
                    "select_rows: cell_offsets must be 1-D [C + 1] with at least one entry, got "
                    "shape ",
                    cell_offsets.sizes());
  TORCH_CHECK_VALUE(quotas.dim() == 1 && quotas.size(0) == cell_offsets.size(0) - 1,
                    "select_rows: quotas must be 1-D [C] with C = ", cell_offsets.size(0) - 1,
                    " (len(cell_offsets) - 1), got shape ", quotas.sizes());
  TORCH_CHECK_TYPE(metric.scalar_type() == at::kFloat, "select_rows: metric must be float32, got ",
                   metric.scalar_type());
  TORCH_CHECK_TYPE(cell_offsets.scalar_type() == at::kLong,
                   "select_rows: cell_offsets must be int64, got ", cell_offsets.scalar_type());
  TORCH_CHECK_TYPE(quotas.scalar_type() == at::kLong, "select_rows: quotas must be int64, got ",
                   quotas.scalar_type());
  const at::Device device = metric.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "select_rows: tensors must be on a CPU or CUDA device, got ", device);
  TORCH_CHECK_VALUE(cell_offsets.device() == device && quotas.device() == device,
                    "select_rows: all tensors must be on one device; metric is on ", device,
                    ", cell_offsets on ", cell_offsets.device(), ", quotas on ", quotas.device());
  TORCH_CHECK_VALUE(metric.is_contiguous(), "select_rows: metric must be contiguous");
  TORCH_CHECK_VALUE(cell_offsets.is_contiguous(), "select_rows: cell_offsets must be contiguous");
  TORCH_CHECK_VALUE(quotas.is_contiguous(), "select_rows: quotas must be contiguous");
}

void check_row_scale(const char* op, const at::Tensor& scale, const at::Tensor& src,
                     int64_t rows, const char* rows_symbol) {
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == rows, op, ": scale must be 1-D [",
                    rows_symbol, "] with ", rows_symbol, " = ", rows, ", got shape ",
                    scale.sizes());
  TORCH_CHECK_TYPE(scale.scalar_type() == src.scalar_type() || scale.scalar_type() == at::kFloat,
                   op, ": scale must have src's dtype (", src.scalar_type(), ") or float32, got ",
                   scale.scalar_type());
  TORCH_CHECK_VALUE(scale.device() == src.device(), op, ": scale is on ", scale.device(),
                    ", src on ", src.device());
  TORCH_CHECK_VALUE(scale.is_contiguous(), op, ": scale must be contiguous");
}

void check_combine_args(const at::Tensor& src, const at::Tensor& scale, const at::Tensor& order,
                        const at::Tensor& offsets) {
  TORCH_CHECK_VALUE(src.dim() == 2, "combine_rows: src must be 2-D [P, H], got shape ",
                    src.sizes());
  TORCH_CHECK_VALUE(order.dim() == 1, "combine_rows: order must be 1-D [M], got shape ",
                    order.sizes());
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) >= 1,
                    "combine_rows: offsets must be 1-D [T + 1] with at least one entry, got "
                    "shape ",
                    offsets.sizes());
  TORCH_CHECK_TYPE(is_supported_float(src.scalar_type()),
                   "combine_rows: src must be float32, float64, float16 or bfloat16, got ",
                   src.scalar_type());
  TORCH_CHECK_TYPE(order.scalar_type() == at::kLong || order.scalar_type() == at::kInt,
                   "combine_rows: order must be int64 or int32, got ", order.scalar_type());
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kLong, "combine_rows: offsets must be int64, got ",
                   offsets.scalar_type());
  const at::Device device = src.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "combine_rows: tensors must be on a CPU or CUDA device, got ", device);
  TORCH_CHECK_VALUE(order.device() == device && offsets.device() == device,
                    "combine_rows: all tensors must be on one device; src is on ", device,
                    ", order on ", order.device(), ", offsets on ", offsets.device());
  TORCH_CHECK_VALUE(src.is_contiguous() && order.is_contiguous() && offsets.is_contiguous(),
                    "combine_rows: src, order and offsets must be contiguous");
  check_row_scale("combine_rows", scale, src, src.size(0), "P");
}

void check_combine_backward_args(const at::Tensor& dy, const at::Tensor& src,
                                 const at::Tensor& token, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& kept_row,
                                 const std::optional<at::Tensor>& w, int64_t n_out) {
  const char* op = "combine_rows_backward";
  TORCH_CHECK_VALUE(dy.dim() == 2 && src.dim() == 2 && dy.size(1) == src.size(1), op,
                    ": dy [T, H] and src [P, H] must be 2-D with one H, got ", dy.sizes(), " and ",
                    src.sizes());
  TORCH_CHECK_VALUE(token.dim() == 1 && token.size(0) == src.size(0), op,
                    ": token must be 1-D [P] with P = ", src.size(0), ", got shape ",
                    token.sizes());
  TORCH_CHECK_TYPE(is_supported_float(src.scalar_type()) && dy.scalar_type() == src.scalar_type(),
                   op, ": dy and src must share one of float32, float64, float16, bfloat16; got ",
                   dy.scalar_type(), " and ", src.scalar_type());
  TORCH_CHECK_TYPE(token.scalar_type() == at::kLong || token.scalar_type() == at::kInt, op,
                   ": token must be int64 or int32, got ", token.scalar_type());
  const at::Device device = src.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), op,
                    ": tensors must be on a CPU or CUDA device, got ", device);
  TORCH_CHECK_VALUE(dy.device() == device && token.device() == device, op,
                    ": all tensors must be on one device; src is on ", device, ", dy on ",
                    dy.device(), ", token on ", token.device());
  TORCH_CHECK_VALUE(dy.is_contiguous() && src.is_contiguous() && token.is_contiguous(), op,
                    ": dy, src and token must be contiguous");
  check_row_scale(op, scale, src, src.size(0), "P");
  if (kept_row.has_value()) {
    TORCH_CHECK_VALUE(kept_row->dim() == 1 && kept_row->size(0) == src.size(0), op,
                      ": kept_row must be 1-D [P] with P = ", src.size(0), ", got shape ",
                      kept_row->sizes());
    TORCH_CHECK_TYPE(kept_row->scalar_type() == at::kLong, op, ": kept_row must be int64, got ",
                     kept_row->scalar_type());
    TORCH_CHECK_VALUE(kept_row->device() == device && kept_row->is_contiguous(), op,
                      ": kept_row must be contiguous on ", device);
  } else {
    TORCH_CHECK_VALUE(n_out == src.size(0), op, ": without kept_row every pair has its row, so K = ",
                      n_out, " must equal P = ", src.size(0));
  }
  if (w.has_value()) {
    TORCH_CHECK_VALUE(w->dim() == 1 && w->size(0) == n_out, op, ": w must be 1-D [K] with K = ",
                      n_out, ", got shape ", w->sizes());
    TORCH_CHECK_TYPE(w->scalar_type() == at::kFloat, op, ": w must be float32, got ",
                     w->scalar_type());
    TORCH_CHECK_VALUE(w->device() == device && w->is_contiguous(), op,
                      ": w must be contiguous on ", device);
  }
  TORCH_CHECK_VALUE(n_out >= 0, op, ": K = ", n_out, " must be >= 0");
}

at::ScalarType opmath_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

// out[index[i], :] += scale[i] * src[i, :], in place; returns out. Each destination's
// rows are summed in ascending (key, position) (key absent: position) on the CPU always,
// on CUDA where deterministic or a key is given (a sorted segment sum); otherwise CUDA
// adds with atomics (the fast path, in no fixed order).
at::Tensor scatter_add_rows(at::Tensor out, const at::Tensor& index, const at::Tensor& src,
                            const std::optional<at::Tensor>& scale, bool check,
                            const std::optional<at::Tensor>& key, bool deterministic) {
  check_scatter_args(out, index, src, scale, key);
  if (src.size(0) == 0 || src.size(1) == 0) {
    return out;
  }

  if (out.device().is_cpu()) {
    scatter_add_rows_cpu(out, index, src, scale, key);
    return out;
  }

#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(out.device());
  if (check) {
    check_index_range_cuda(index, out.size(0), "scatter_add_rows", "index", "N", "out");
  }
  const FloatType dtype = to_float_type(out.scalar_type());
  const IndexType index_type = to_index_type(index.scalar_type());
  const ScaleType scale_type = to_scale_type(scale, src.scalar_type());
  const void* scale_ptr = scale.has_value() ? scale->const_data_ptr() : nullptr;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  const char* err = nullptr;
  if (deterministic || key.has_value()) {
    // Stable sorts on the device (no host read): by key first when there is one, then
    // by destination, so each destination's rows line up in (key, position) order.
    at::Tensor sorted_index;
    at::Tensor order;
    if (key.has_value()) {
      const at::Tensor by_key = std::get<1>(at::sort(*key, /*stable=*/true, 0, false));
      at::Tensor within;
      std::tie(sorted_index, within) =
          at::sort(index.index_select(0, by_key), /*stable=*/true, 0, false);
      order = by_key.index_select(0, within);
    } else {
      std::tie(sorted_index, order) = at::sort(index, /*stable=*/true, 0, false);
    }
    err = scatter_add_rows_sorted_cuda(out.data_ptr(), sorted_index.const_data_ptr(),
                                       order.const_data_ptr<int64_t>(), src.const_data_ptr(),
                                       scale_ptr, out.size(0), src.size(0), src.size(1), dtype,
                                       index_type, scale_type, stream);
  } else {
    err = scatter_add_rows_cuda(out.data_ptr(), index.const_data_ptr(), src.const_data_ptr(),
                                scale_ptr, out.size(0), src.size(0), src.size(1), dtype,
                                index_type, scale_type, stream);
  }
  TORCH_CHECK(err == nullptr, "scatter_add_rows: CUDA launch failed: ", err);
  return out;
#else
  TORCH_CHECK_VALUE(false, "scatter_add_rows: out is on ", out.device(),
                    " but megatron_lrmoe._kernels was built without CUDA support; rebuild it "
                    "on a machine with a CUDA build of torch and the CUDA toolkit");
  return out;
#endif
}

// Per-cell row selection (topk, sample, uniform or hybrid); returns
// (kept_index [K] int64, scale [K] fp32, kept_counts [C] int64) on the
// inputs' device. n_kept: K when the caller knows it (the LRMoE region does,
// from its plan), which spares the CUDA backend its one host sync; -1 = learn
// it on the device (a sync). With check (or n_kept = -1) the CUDA backend
// validates the values on the device and compares K (a sync).
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_rows(const at::Tensor& metric,
                                                           const at::Tensor& cell_offsets,
                                                           const at::Tensor& quotas,
                                                           const std::string& rule, int64_t seed,
                                                           double hybrid_fraction, int64_t n_kept,
                                                           bool check) {
  check_select_args(metric, cell_offsets, quotas);
  TORCH_CHECK_VALUE(n_kept >= -1 && n_kept <= metric.size(0), "select_rows: n_kept = ", n_kept,
                    " must be -1 (unknown) or in [0, P] with P = ", metric.size(0));
  const SelectRule select_rule = parse_rule(rule);
  // Written so that NaN fails too.
  TORCH_CHECK_VALUE(hybrid_fraction >= 0.0 && hybrid_fraction <= 1.0,
                    "select_rows: hybrid_fraction must be in [0, 1], got ", hybrid_fraction);
  // The seed's two's-complement bits: Python passes any int64, the generator
  // works on uint64.
  const uint64_t seed_bits = static_cast<uint64_t>(seed);

  if (metric.device().is_cpu()) {
    auto result = select_rows_cpu(metric, cell_offsets, quotas, select_rule, seed_bits,
                                  hybrid_fraction);
    TORCH_CHECK_VALUE(n_kept < 0 || std::get<0>(result).size(0) == n_kept, "select_rows: n_kept = ",
                      n_kept, " but the quotas keep ", std::get<0>(result).size(0), " rows");
    return result;
  }

#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(metric.device());
  const int64_t n_rows = metric.size(0);
  const int64_t n_cells = quotas.size(0);
  const at::Tensor sizes = cell_offsets.slice(0, 1).sub(cell_offsets.slice(0, 0, n_cells));
  const at::Tensor kept_counts = quotas.minimum(sizes).clamp_min(0);
  if (check || n_kept < 0) {
    // Validate on the device and learn K with one device-to-host copy of two
    // integers. On failure, the inputs go to the host and the CPU backend's
    // checks raise the same error as on the CPU (that copy happens only on
    // the error path).
    const at::Tensor metric_ok =
        metric.ge(0).logical_and(metric.le(std::numeric_limits<float>::max())).all();
    const at::Tensor valid = cell_offsets[0]
                                 .eq(0)
                                 .logical_and(cell_offsets[n_cells].eq(n_rows))
                                 .logical_and(sizes.ge(0).all())
                                 .logical_and(quotas.ge(0).all())
                                 .logical_and(metric_ok);
    const at::Tensor summary =
        at::stack({valid.to(at::kLong), kept_counts.sum()}).cpu();  // host sync
    if (summary[0].item<int64_t>() == 0) {
      select_rows_cpu(metric.cpu(), cell_offsets.cpu(), quotas.cpu(), select_rule, seed_bits,
                      hybrid_fraction);
      TORCH_CHECK(false,
                  "select_rows: the device found invalid input that the host check accepted");
    }
    const int64_t actual = summary[1].item<int64_t>();
    TORCH_CHECK_VALUE(n_kept < 0 || n_kept == actual, "select_rows: n_kept = ", n_kept,
                      " but the quotas keep ", actual, " rows");
    n_kept = actual;
  }
  // A P-row buffer, so the compaction below never writes past it even if a
  // caller's n_kept were wrong; the result is its first K rows.
  at::Tensor kept_index = at::empty({n_rows}, cell_offsets.options()).narrow(0, 0, n_kept);
  at::Tensor scale = at::empty({n_kept}, metric.options());
  if (n_kept == 0) {
    return {kept_index, scale, kept_counts};
  }
  size_t workspace_bytes = 0;
  const char* err =
      select_rows_cuda_workspace_bytes(n_rows, n_cells, select_rule, &workspace_bytes);
  TORCH_CHECK(err == nullptr, "select_rows: ", err);
  // From torch's caching allocator, on the current stream: freeing it when
  // this function returns is safe, since reuse is ordered on that stream.
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)},
                                   metric.options().dtype(at::kByte));
  err = select_rows_cuda(metric.const_data_ptr<float>(), cell_offsets.const_data_ptr<int64_t>(),
                         kept_counts.const_data_ptr<int64_t>(), n_rows, n_cells, n_kept,
                         select_rule, seed_bits, hybrid_fraction,
                         kept_index.data_ptr<int64_t>(),
                         scale.data_ptr<float>(), workspace.data_ptr(), workspace_bytes,
                         c10::cuda::getCurrentCUDAStream(metric.device().index()).stream());
  TORCH_CHECK(err == nullptr, "select_rows: CUDA launch failed: ", err);
  return {kept_index, scale, kept_counts};
#else
  TORCH_CHECK_VALUE(false, "select_rows: metric is on ", metric.device(),
                    " but megatron_lrmoe._kernels was built without CUDA support; rebuild it "
                    "on a machine with a CUDA build of torch and the CUDA toolkit");
  return {};
#endif
}

// y[t, :] = sum over j in [offsets[t], offsets[t+1]) of scale[order[j]] * src[order[j], :]
// (the region's weighted combine, deterministic); returns the new [T, H] y.
at::Tensor combine_rows(const at::Tensor& src, const at::Tensor& scale, const at::Tensor& order,
                        const at::Tensor& offsets, bool check) {
  check_combine_args(src, scale, order, offsets);
  const int64_t n_tokens = offsets.size(0) - 1;
  at::Tensor out = at::empty({n_tokens, src.size(1)}, src.options());
  if (n_tokens == 0 || src.size(1) == 0) {
    return out;
  }
  if (src.size(0) == 0 || order.size(0) == 0) {
    // No pair contributes: y = 0 on every backend. Decided here because an empty
    // tensor's data pointer is null, which the CUDA launcher refuses for scale. The
    // value checks (offsets from 0 to M, order in [0, P)) still run where values are
    // checked: always on the host, on a GPU with check (host copies; debug only).
    if (src.device().is_cpu() || check) {
      combine_rows_cpu(at::empty({n_tokens, src.size(1)}, src.options().device(at::kCPU)),
                       src.cpu(), scale.cpu(), order.cpu(), offsets.cpu());
    }
    return out.zero_();
  }
  if (src.device().is_cpu()) {
    combine_rows_cpu(out, src, scale, order, offsets);
    return out;
  }
#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(src.device());
  if (check) {
    // The CPU backend's value checks, on host copies (a sync; debug only).
    combine_rows_cpu(at::empty({n_tokens, src.size(1)}, src.options().device(at::kCPU)),
                     src.cpu(), scale.cpu(), order.cpu(), offsets.cpu());
  }
  const char* err = combine_rows_cuda(
      out.data_ptr(), src.const_data_ptr(), scale.const_data_ptr(), order.const_data_ptr(),
      offsets.const_data_ptr<int64_t>(), src.size(0), n_tokens, src.size(1),
      to_float_type(src.scalar_type()), to_index_type(order.scalar_type()),
      to_scale_type(scale, src.scalar_type()),
      c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
  TORCH_CHECK(err == nullptr, "combine_rows: CUDA launch failed: ", err);
  return out;
#else
  TORCH_CHECK_VALUE(false, "combine_rows: src is on ", src.device(),
                    " but megatron_lrmoe._kernels was built without CUDA support; rebuild it "
                    "on a machine with a CUDA build of torch and the CUDA toolkit");
  return out;
#endif
}

// The adjoint of combine_rows over one pass of dy per pair: returns
// (dscale [P] in op-math, out [K, H]) with dscale[i] = <dy[token[i]], src[i]> and
// out[kept_row[i]] = scale[i] * w[kept_row[i]] * dy[token[i]] for kept_row[i] >= 0 (kept_row
// absent: kept_row[i] = i and K = P; w absent: 1).
std::tuple<at::Tensor, at::Tensor> combine_rows_backward(
    const at::Tensor& dy, const at::Tensor& src, const at::Tensor& token, const at::Tensor& scale,
    const std::optional<at::Tensor>& kept_row, const std::optional<at::Tensor>& w, int64_t n_out,
    bool check) {
  if (n_out == -1 && !kept_row.has_value()) {
    n_out = src.size(0);  // every pair has its row
  }
  check_combine_backward_args(dy, src, token, scale, kept_row, w, n_out);
  at::Tensor dscale = at::empty({src.size(0)}, src.options().dtype(opmath_type(src.scalar_type())));
  at::Tensor out = at::empty({n_out, dy.size(1)}, dy.options());
  if (src.size(0) == 0) {
    // No pair, so no kept_row names a row of out: zeros on every backend (the
    // torch backend's result), instead of whatever memory at::empty handed out.
    out.zero_();
    return {dscale, out};
  }
  if (src.device().is_cpu()) {
    combine_rows_backward_cpu(dscale, out, dy, src, token, scale, kept_row, w);
    return {dscale, out};
  }
#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(src.device());
  if (check) {
    check_index_range_cuda(token, dy.size(0), "combine_rows_backward", "token", "T", "dy");
    if (kept_row.has_value()) {
      const auto [lo, hi] = at::aminmax(*kept_row);
      const at::Tensor bounds = at::stack({lo, hi}).cpu();  // host sync
      TORCH_CHECK_INDEX(bounds[0].item<int64_t>() >= -1 && bounds[1].item<int64_t>() < n_out,
                        "combine_rows_backward: kept_row holds values outside [-1, K) with K = ",
                        n_out);
    }
  }
  const char* err = combine_rows_backward_cuda(
      dscale.data_ptr(), out.data_ptr(), dy.const_data_ptr(), src.const_data_ptr(),
      token.const_data_ptr(), scale.const_data_ptr(),
      kept_row.has_value() ? kept_row->const_data_ptr<int64_t>() : nullptr,
      w.has_value() ? w->const_data_ptr<float>() : nullptr, dy.size(0), src.size(0), n_out,
      dy.size(1), to_float_type(src.scalar_type()), to_index_type(token.scalar_type()),
      to_scale_type(scale, src.scalar_type()),
      c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
  TORCH_CHECK(err == nullptr, "combine_rows_backward: CUDA launch failed: ", err);
  return {dscale, out};
#else
  TORCH_CHECK_VALUE(false, "combine_rows_backward: src is on ", src.device(),
                    " but megatron_lrmoe._kernels was built without CUDA support; rebuild it "
                    "on a machine with a CUDA build of torch and the CUDA toolkit");
  return {dscale, out};
#endif
}

namespace {

// Dispatcher entry points of the lrmoe::* ops: the schemas' argument types over
// the functions above. scatter_add_rows returns nothing: its schema marks out as
// mutated (Tensor(a!)), and an op that also returned that alias could not be
// functionalized by torch.compile.
void scatter_add_rows_op(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src,
                         const std::optional<at::Tensor>& scale, bool check,
                         const std::optional<at::Tensor>& key, bool deterministic) {
  scatter_add_rows(out, index, src, scale, check, key, deterministic);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> select_rows_op(
    const at::Tensor& metric, const at::Tensor& cell_offsets, const at::Tensor& quotas,
    c10::string_view rule, int64_t seed, double hybrid_fraction, int64_t n_kept, bool check) {
  return select_rows(metric, cell_offsets, quotas, std::string(rule), seed, hybrid_fraction,
                     n_kept, check);
}

}  // namespace

bool built_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace lrmoe

// The schemas. Fake implementations (output shape, dtype and device without
// computing) are registered in Python, each next to its op in the module named by
// set_python_module, which torch imports when a fake tensor meets an op first.
TORCH_LIBRARY(lrmoe, m) {
  m.set_python_module("megatron_lrmoe.ops.scatter_add_rows");
  m.def(
      "scatter_add_rows(Tensor(a!) out, Tensor index, Tensor src, Tensor? scale=None, "
      "bool check=True, Tensor? key=None, bool deterministic=False) -> ()");
  m.set_python_module("megatron_lrmoe.ops.select");
  m.def(
      "select_rows(Tensor metric, Tensor cell_offsets, Tensor quotas, str rule, int seed, "
      "float hybrid_fraction=0.5, int n_kept=-1, bool check=True) -> (Tensor, Tensor, Tensor)");
  m.set_python_module("megatron_lrmoe.ops.combine");
  m.def(
      "combine_rows(Tensor src, Tensor scale, Tensor order, Tensor offsets, bool check=True) "
      "-> Tensor");
  m.def(
      "combine_rows_backward(Tensor dy, Tensor src, Tensor token, Tensor scale, "
      "Tensor? kept_row=None, Tensor? w=None, int n_out=-1, bool check=True) -> (Tensor, Tensor)");
}

// One set of functions serves both devices (they branch on the tensors' device),
// registered under each dispatch key that has a backend in this build.
TORCH_LIBRARY_IMPL(lrmoe, CPU, m) {
  m.impl("scatter_add_rows", &lrmoe::scatter_add_rows_op);
  m.impl("select_rows", &lrmoe::select_rows_op);
  m.impl("combine_rows", &lrmoe::combine_rows);
  m.impl("combine_rows_backward", &lrmoe::combine_rows_backward);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(lrmoe, CUDA, m) {
  m.impl("scatter_add_rows", &lrmoe::scatter_add_rows_op);
  m.impl("select_rows", &lrmoe::select_rows_op);
  m.impl("combine_rows", &lrmoe::combine_rows);
  m.impl("combine_rows_backward", &lrmoe::combine_rows_backward);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-lrmoe compiled kernels (CPU, and CUDA when built with it)";
  m.def("scatter_add_rows", &lrmoe::scatter_add_rows,
        "out[index[i], :] += scale[i] * src[i, :] in place; returns out", py::arg("out"),
        py::arg("index"), py::arg("src"), py::arg("scale") = py::none(),
        py::arg("check") = true, py::arg("key") = py::none(), py::arg("deterministic") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("select_rows", &lrmoe::select_rows,
        "per-cell row selection (rule 'topk', 'sample', 'uniform' or 'hybrid'); returns "
        "(kept_index, scale, kept_counts)",
        py::arg("metric"), py::arg("cell_offsets"), py::arg("quotas"), py::arg("rule"),
        py::arg("seed"), py::arg("hybrid_fraction") = 0.5, py::arg("n_kept") = -1,
        py::arg("check") = true, py::call_guard<py::gil_scoped_release>());
  m.def("combine_rows", &lrmoe::combine_rows,
        "y[t] = sum over j in [offsets[t], offsets[t+1]) of scale[order[j]] * src[order[j]]; "
        "returns the new [T, H] y",
        py::arg("src"), py::arg("scale"), py::arg("order"), py::arg("offsets"),
        py::arg("check") = true, py::call_guard<py::gil_scoped_release>());
  m.def("combine_rows_backward", &lrmoe::combine_rows_backward,
        "(dscale, out): dscale[i] = <dy[token[i]], src[i]>, out[kept_row[i]] = scale[i] * w[kept_row[i]] "
        "* dy[token[i]]",
        py::arg("dy"), py::arg("src"), py::arg("token"), py::arg("scale"),
        py::arg("kept_row") = py::none(), py::arg("w") = py::none(), py::arg("n_out") = -1,
        py::arg("check") = true, py::call_guard<py::gil_scoped_release>());
  m.def("built_with_cuda", &lrmoe::built_with_cuda,
        "True when this build includes the CUDA backend");
  lrmoe::register_planner(m);
}
