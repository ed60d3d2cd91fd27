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
// Headers: torch/csrc/utils/pybind.h (pybind11 plus torch's Tensor casters)
// and the few ATen headers used, instead of torch/extension.h, which pulls in
// the whole C++ frontend: 14 s instead of 45-75 s of compile time here.

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "compact_rows.h"
#include "scatter_add_rows.h"
#include "select_rows.h"

#ifdef WITH_CUDA
#include <ATen/ops/aminmax.h>
#include <ATen/ops/stack.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lrmoe {

// Defined in kernels/scatter_add_rows.cpp (no header: its signature needs
// ATen, and kernels/scatter_add_rows.h stays free of torch for nvcc).
void scatter_add_rows_cpu(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src,
                          const std::optional<at::Tensor>& scale);
// Defined in kernels/compact_rows.cpp and kernels/select_rows.cpp, for the
// same reason.
void compact_rows_cpu(const at::Tensor& out, const at::Tensor& src, const at::Tensor& kept_index,
                      const std::optional<at::Tensor>& scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_rows_cpu(const at::Tensor& metric,
                                                               const at::Tensor& cell_offsets,
                                                               const at::Tensor& quotas,
                                                               SelectRule rule, uint64_t seed,
                                                               double hybrid_fraction);

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

// The CUDA kernels cannot report a bad index without a sync, so check here:
// one min/max reduction and one device-to-host copy of two integers. The
// message reads "<op>: <index_name> holds v, outside [0, <n_name>) with
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
                        const std::optional<at::Tensor>& scale) {
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
}

void check_compact_args(const at::Tensor& src, const at::Tensor& kept_index,
                        const std::optional<at::Tensor>& scale) {
  TORCH_CHECK_VALUE(src.dim() == 2, "compact_rows: src must be 2-D [P, H], got shape ",
                    src.sizes());
  TORCH_CHECK_VALUE(kept_index.dim() == 1, "compact_rows: kept_index must be 1-D [K], got shape ",
                    kept_index.sizes());
  TORCH_CHECK_TYPE(is_supported_float(src.scalar_type()),
                   "compact_rows: src must be float32, float64, float16 or bfloat16, got ",
                   src.scalar_type());
  TORCH_CHECK_TYPE(kept_index.scalar_type() == at::kLong || kept_index.scalar_type() == at::kInt,
                   "compact_rows: kept_index must be int64 or int32, got ",
                   kept_index.scalar_type());
  const at::Device device = src.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "compact_rows: tensors must be on a CPU or CUDA device, got ", device);
  TORCH_CHECK_VALUE(kept_index.device() == device, "compact_rows: kept_index is on ",
                    kept_index.device(), ", src on ", device);
  TORCH_CHECK_VALUE(src.is_contiguous(), "compact_rows: src must be contiguous");
  TORCH_CHECK_VALUE(kept_index.is_contiguous(), "compact_rows: kept_index must be contiguous");
  if (scale.has_value()) {
    const at::Tensor& s = *scale;
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == kept_index.size(0),
                      "compact_rows: scale must be 1-D [K] with K = ", kept_index.size(0),
                      ", got shape ", s.sizes());
    TORCH_CHECK_TYPE(s.scalar_type() == src.scalar_type() || s.scalar_type() == at::kFloat,
                     "compact_rows: scale must have src's dtype (", src.scalar_type(),
                     ") or float32, got ", s.scalar_type());
    TORCH_CHECK_VALUE(s.device() == device, "compact_rows: scale is on ", s.device(), ", src on ",
                      device);
    TORCH_CHECK_VALUE(s.is_contiguous(), "compact_rows: scale must be contiguous");
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

}  // namespace

// out[index[i], :] += scale[i] * src[i, :], in place; returns out.
at::Tensor scatter_add_rows(at::Tensor out, const at::Tensor& index, const at::Tensor& src,
                            const std::optional<at::Tensor>& scale) {
  check_scatter_args(out, index, src, scale);
  if (src.size(0) == 0 || src.size(1) == 0) {
    return out;
  }

  if (out.device().is_cpu()) {
    scatter_add_rows_cpu(out, index, src, scale);
    return out;
  }

#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(out.device());
  check_index_range_cuda(index, out.size(0), "scatter_add_rows", "index", "N", "out");
  const char* err = scatter_add_rows_cuda(
      out.data_ptr(), index.const_data_ptr(), src.const_data_ptr(),
      scale.has_value() ? scale->const_data_ptr() : nullptr, out.size(0), src.size(0),
      src.size(1), to_float_type(out.scalar_type()), to_index_type(index.scalar_type()),
      to_scale_type(scale, src.scalar_type()),
      c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
  TORCH_CHECK(err == nullptr, "scatter_add_rows: CUDA launch failed: ", err);
  return out;
#else
  TORCH_CHECK_VALUE(false, "scatter_add_rows: out is on ", out.device(),
                    " but megatron_lrmoe._kernels was built without CUDA support; rebuild it "
                    "on a machine with a CUDA build of torch and the CUDA toolkit");
  return out;
#endif
}

// out[j, :] = scale[j] * src[kept_index[j], :]; returns the new [K, H] out.
at::Tensor compact_rows(const at::Tensor& src, const at::Tensor& kept_index,
                        const std::optional<at::Tensor>& scale) {
  check_compact_args(src, kept_index, scale);
  at::Tensor out = at::empty({kept_index.size(0), src.size(1)}, src.options());
  if (kept_index.size(0) == 0) {
    return out;
  }

  if (src.device().is_cpu()) {
    compact_rows_cpu(out, src, kept_index, scale);
    return out;
  }

#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(src.device());
  check_index_range_cuda(kept_index, src.size(0), "compact_rows", "kept_index", "P", "src");
  const char* err = compact_rows_cuda(
      out.data_ptr(), src.const_data_ptr(), kept_index.const_data_ptr(),
      scale.has_value() ? scale->const_data_ptr() : nullptr, src.size(0), kept_index.size(0),
      src.size(1), to_float_type(src.scalar_type()), to_index_type(kept_index.scalar_type()),
      to_scale_type(scale, src.scalar_type()),
      c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
  TORCH_CHECK(err == nullptr, "compact_rows: CUDA launch failed: ", err);
  return out;
#else
  TORCH_CHECK_VALUE(false, "compact_rows: src is on ", src.device(),
                    " but megatron_lrmoe._kernels was built without CUDA support; rebuild it "
                    "on a machine with a CUDA build of torch and the CUDA toolkit");
  return out;
#endif
}

// Per-cell row selection (topk, sample, uniform or hybrid); returns
// (kept_index [K] int64, scale [K] fp32, kept_counts [C] int64) on the
// inputs' device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_rows(const at::Tensor& metric,
                                                           const at::Tensor& cell_offsets,
                                                           const at::Tensor& quotas,
                                                           const std::string& rule, int64_t seed,
                                                           double hybrid_fraction) {
  check_select_args(metric, cell_offsets, quotas);
  const SelectRule select_rule = parse_rule(rule);
  // Written so that NaN fails too.
  TORCH_CHECK_VALUE(hybrid_fraction >= 0.0 && hybrid_fraction <= 1.0,
                    "select_rows: hybrid_fraction must be in [0, 1], got ", hybrid_fraction);
  // The seed's two's-complement bits: Python passes any int64, the generator
  // works on uint64.
  const uint64_t seed_bits = static_cast<uint64_t>(seed);

  if (metric.device().is_cpu()) {
    return select_rows_cpu(metric, cell_offsets, quotas, select_rule, seed_bits,
                           hybrid_fraction);
  }

#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard guard(metric.device());
  const int64_t n_rows = metric.size(0);
  const int64_t n_cells = quotas.size(0);
  // Validate on the device and learn K (which sizes the outputs) with one
  // device-to-host copy of two integers. On failure, the inputs go to the
  // host and the CPU backend's checks raise the same error as on the CPU
  // (that copy happens only on the error path).
  const at::Tensor sizes = cell_offsets.slice(0, 1).sub(cell_offsets.slice(0, 0, n_cells));
  const at::Tensor kept_counts = quotas.minimum(sizes).clamp_min(0);
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
    TORCH_CHECK(false, "select_rows: the device found invalid input that the host check accepted");
  }
  const int64_t n_kept = summary[1].item<int64_t>();
  at::Tensor kept_index = at::empty({n_kept}, cell_offsets.options());
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

bool built_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace lrmoe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-lrmoe compiled kernels (CPU, and CUDA when built with it)";
  m.def("scatter_add_rows", &lrmoe::scatter_add_rows,
        "out[index[i], :] += scale[i] * src[i, :] in place; returns out", py::arg("out"),
        py::arg("index"), py::arg("src"), py::arg("scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("compact_rows", &lrmoe::compact_rows,
        "out[j, :] = scale[j] * src[kept_index[j], :]; returns the new [K, H] out",
        py::arg("src"), py::arg("kept_index"), py::arg("scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("select_rows", &lrmoe::select_rows,
        "per-cell row selection (rule 'topk', 'sample', 'uniform' or 'hybrid'); returns "
        "(kept_index, scale, kept_counts)",
        py::arg("metric"), py::arg("cell_offsets"), py::arg("quotas"), py::arg("rule"),
        py::arg("seed"), py::arg("hybrid_fraction") = 0.5,
        py::call_guard<py::gil_scoped_release>());
  m.def("built_with_cuda", &lrmoe::built_with_cuda,
        "True when this build includes the CUDA backend");
}
