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
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "scatter_add_rows.h"

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

// The CUDA kernel cannot report a bad index without a sync, so check here:
// one min/max reduction and one device-to-host copy of two integers.
void check_index_range_cuda(const at::Tensor& index, int64_t n_out) {
  const auto [lo, hi] = at::aminmax(index);
  const at::Tensor bounds = at::stack({lo, hi}).to(at::kLong).cpu();  // host sync
  const int64_t min_v = bounds[0].item<int64_t>();
  const int64_t max_v = bounds[1].item<int64_t>();
  const int64_t bad = min_v < 0 ? min_v : max_v;
  TORCH_CHECK_INDEX(min_v >= 0 && max_v < n_out, "scatter_add_rows: index holds ", bad,
                    ", outside [0, N) with N = ", n_out, " (rows of out)");
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
  check_index_range_cuda(index, out.size(0));
  ScaleType scale_type = ScaleType::kNone;
  const void* scale_ptr = nullptr;
  if (scale.has_value()) {
    scale_type =
        scale->scalar_type() == src.scalar_type() ? ScaleType::kSameAsSrc : ScaleType::kFloat32;
    scale_ptr = scale->const_data_ptr();
  }
  const char* err = scatter_add_rows_cuda(
      out.data_ptr(), index.const_data_ptr(), src.const_data_ptr(), scale_ptr, out.size(0),
      src.size(0), src.size(1), to_float_type(out.scalar_type()),
      index.scalar_type() == at::kInt ? IndexType::kInt32 : IndexType::kInt64, scale_type,
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
  m.def("built_with_cuda", &lrmoe::built_with_cuda,
        "True when this build includes the CUDA backend");
}
