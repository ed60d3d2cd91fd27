// select_rows: shared definitions of the CPU and CUDA backends, and the CUDA
// launcher interface.
//
// Plain C++ on purpose: included by the nvcc-compiled .cu, the host-compiled
// .cpp and kernels/bindings.cpp, so it needs neither torch nor CUDA headers.
// The counter-based generator lives here, once, because every backend must
// draw the same numbers (megatron_lrmoe/ops/select.py repeats it in Python
// and its tests pin the values).
//
// Notation (as in megatron_lrmoe/ops/select.py):
//   P  rows (pairs) of the per-pair arrays; C cells
//   cell c is the rows [cell_offsets[c], cell_offsets[c + 1])
//   kept_counts[c] = min(quotas[c], cell size); K = sum of kept_counts

#pragma once

#include <cstddef>
#include <cstdint>

// The helpers below run on the host and, compiled by nvcc, on the device.
#if defined(__CUDACC__)
#define LRMOE_HOST_DEVICE __host__ __device__
#else
#define LRMOE_HOST_DEVICE
#endif

struct CUstream_st;  // cudaStream_t without the CUDA headers (see scatter_add_rows.h)

namespace lrmoe {

enum class SelectRule : int32_t { kTopK = 0, kSample = 1, kUniform = 2, kHybrid = 3 };

// SplitMix64's output function applied to x + golden gamma (Steele, Lea and
// Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014): a
// bijective 64-bit mixer, so (seed, cell) -> u is a pure function, the same
// on every backend and independent of thread scheduling.
LRMOE_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The systematic-sampling offset u in [0, 1) of one cell: the top 53 bits of
// splitmix64(splitmix64(seed) + cell), times 2^-53 (exact in double).
LRMOE_HOST_DEVICE inline double cell_uniform(uint64_t seed, int64_t cell) {
  const uint64_t z = splitmix64(splitmix64(seed) + static_cast<uint64_t>(cell));
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

// The uniform/hybrid key base of one cell: h_c = splitmix64(splitmix64(seed) + cell).
LRMOE_HOST_DEVICE inline uint64_t cell_key_base(uint64_t seed, int64_t cell) {
  return splitmix64(splitmix64(seed) + static_cast<uint64_t>(cell));
}

// The uniform/hybrid key of row j (position in its cell) given its cell's
// base: splitmix64(h_c + j). Distinct within a cell (splitmix64 is a
// bijection), so the "smallest keys" of the recipe never tie.
LRMOE_HOST_DEVICE inline uint64_t row_key(uint64_t cell_base, int64_t j) {
  return splitmix64(cell_base + static_cast<uint64_t>(j));
}

// hybrid's q_top = floor(f * q), the product rounded once in double (the
// explicit-rounding intrinsic on the device keeps nvcc from changing it).
LRMOE_HOST_DEVICE inline int64_t hybrid_top_count(double fraction, int64_t q) {
#if defined(__CUDA_ARCH__)
  const double p = __dmul_rn(fraction, static_cast<double>(q));
#else
  const double p = fraction * static_cast<double>(q);
#endif
  return static_cast<int64_t>(p);  // 0 <= p <= q: truncation is floor
}

// Bytes of device scratch space select_rows_cuda needs for n_rows rows and
// n_cells cells (a query of cub's temporary-storage sizes; launches nothing).
// Returns nullptr on success, otherwise a static error description.
const char* select_rows_cuda_workspace_bytes(int64_t n_rows, int64_t n_cells, SelectRule rule,
                                             size_t* bytes);

// Enqueues the selection on `stream` (`hybrid_fraction` in [0, 1] is used by
// kHybrid only). Device pointers: metric [P] fp32,
// cell_offsets [C + 1], kept_counts [C] (= min(quota, cell size)), and the
// outputs kept_index [K] int64 and scale [K] fp32; workspace holds
// workspace_bytes (at least what select_rows_cuda_workspace_bytes reported).
// The caller has validated every value (offsets from 0 to P, non-decreasing;
// finite non-negative metric) when its debug checks are on, and gives
// K = n_kept = sum of kept_counts, which sizes scale (the LRMoE region knows K
// from its plan, so no device value is read). kept_index must have room for P
// entries, so the compaction stays in bounds whatever K the caller gave; the
// first K are the result. Nothing is launched when K == 0.
//
// Returns nullptr on success, otherwise a static error description.
const char* select_rows_cuda(const float* metric, const int64_t* cell_offsets,
                             const int64_t* kept_counts, int64_t n_rows, int64_t n_cells,
                             int64_t n_kept, SelectRule rule, uint64_t seed,
                             double hybrid_fraction, int64_t* kept_index, float* scale,
                             void* workspace, size_t workspace_bytes, CUstream_st* stream);

}  // namespace lrmoe
