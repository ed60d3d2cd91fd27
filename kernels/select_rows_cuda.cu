// select_rows: CUDA backend.
//
// Only CUDA headers (and cub, which ships with the toolkit) here: tensor
// checks, value validation, output allocation and the current stream live in
// kernels/bindings.cpp (torch/ATen headers cost ~74 s per .cu and do not compile
// against the CPU torch wheel).
//
// Notation: P rows, C cells; cell c is the rows [off[c], off[c+1]); q[c] the
// kept count min(quota, cell size), already computed by the caller.
//
// Pipeline (one stream, no host sync):
//   1. key[i] = (cell(i) << 32) | ~bits(metric[i]), value[i] = i. A
//      non-negative float orders like its bit pattern, so the inverted bits
//      sort larger metrics first; cub's radix sort is stable, so equal keys
//      keep ascending positions: one sort gives every cell's rows in the
//      topk order (metric descending, position ascending) without spending
//      key bits on the position.
//   2. For sorted position j of cell c: rank = j - off[c]; keep iff rank < q[c]
//      (the position-in-segment test), written as a flag at the row's
//      original position, with the rank.
//   3. sample only: one thread per cell replaces the flags of its cell by the
//      sampling decision (sequential double arithmetic in the order of the
//      recipe in megatron_lrmoe/ops/select.py, with explicitly rounded
//      intrinsics so nvcc cannot fuse products into sums: the results equal
//      the CPU backend's bit for bit) and writes 1/pi per kept row.
//   4. cub::DeviceSelect::Flagged compacts the positions whose flag is set;
//      it is order-preserving, so the kept rows come out grouped by cell in
//      cell order and in ascending position inside a cell.
// uniform and hybrid replace steps 2-3 (hybrid runs step 1 and a step 2 that
// marks the q_top first rows of each cell instead of the q first; uniform
// skips step 1):
//   U1. key[i] = row_key of row i (64 bits, distinct within a cell); one
//       radix sort of (key, position) over all rows.
//   U2. A second, stable radix sort of that order by (cell << 1 | not top)
//       (cell_bits + 1 bits): least-significant-digit order, so every cell's
//       rows come out top rows first, then the others by ascending key.
//   U3. For sorted position j of cell c: keep iff j - off[c] < q[c]; scale 1 for
//       top rows and whole cells, float32((n - q_top) / (q - q_top)) for the
//       others, written at the row's position. Then step 4.
// One thread per cell in step 3 is simple and exact but serial within a
// cell. If very large cells make it a bottleneck, a block per cell needs a
// fixed-tree scan, and the recipe (CPU and torch too) must then name that
// tree as its summation order to keep the backends bitwise equal.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include "select_rows.h"

namespace lrmoe {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;
constexpr size_t kAlign = 256;  // cub and coalescing both like 256-byte alignment

dim3 grid_for(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned int>(wanted < kMaxBlocks ? wanted : kMaxBlocks));
}

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Bits needed for cell ids in [0, C): the radix sort skips the others.
int cell_bits(int64_t n_cells) {
  int bits = 0;
  while (bits < 32 && (int64_t{1} << bits) < n_cells) {
    ++bits;
  }
  return bits;
}

// Byte offsets of the workspace's arrays.
struct Layout {
  size_t keys_in, keys_out, pos_in, pos_out, pos_tmp, flags, rank, is_top, scale_full,
      n_selected, temp;
  size_t temp_bytes, total;
};

bool is_uniform_family(SelectRule rule) {
  return rule == SelectRule::kUniform || rule == SelectRule::kHybrid;
}

const char* make_layout(int64_t n_rows, int64_t n_cells, SelectRule rule, Layout* l) {
  if (n_cells >= (int64_t{1} << 32)) {
    return "select_rows_cuda: more than 2^32 - 1 cells do not fit the sort key";
  }
  const size_t n = static_cast<size_t>(n_rows);
  const bool sample = rule == SelectRule::kSample;
  const bool keyed = is_uniform_family(rule);
  const bool hybrid = rule == SelectRule::kHybrid;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t start = at;
    at = align_up(at + bytes);
    return start;
  };
  l->keys_in = take(n * sizeof(uint64_t));
  l->keys_out = take(n * sizeof(uint64_t));
  l->pos_in = take(n * sizeof(int64_t));
  l->pos_out = take(n * sizeof(int64_t));
  l->pos_tmp = take(keyed ? n * sizeof(int64_t) : 0);
  l->flags = take(n * sizeof(uint8_t));
  l->rank = take(sample ? n * sizeof(int64_t) : 0);
  l->is_top = take(hybrid ? n * sizeof(uint8_t) : 0);
  l->scale_full = take(sample || keyed ? n * sizeof(float) : 0);
  l->n_selected = take(sizeof(int64_t));

  // Size queries only (null temp storage): nothing is launched. The three
  // sorts (metric, row key, cell + top flag) differ only in their bit ranges.
  size_t sort_bytes = 0;
  const int bit_ranges[3] = {32 + cell_bits(n_cells), 64, cell_bits(n_cells) + 1};
  for (int end_bit : bit_ranges) {
    size_t bytes = 0;
    cudaError_t e = cub::DeviceRadixSort::SortPairs(
        nullptr, bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
        static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), n_rows, 0, end_bit);
    if (e != cudaSuccess) {
      return cudaGetErrorString(e);
    }
    sort_bytes = bytes > sort_bytes ? bytes : sort_bytes;
  }
  size_t select_bytes = 0;
  const cudaError_t err = cub::DeviceSelect::Flagged(
      nullptr, select_bytes, static_cast<const int64_t*>(nullptr),
      static_cast<const uint8_t*>(nullptr), static_cast<int64_t*>(nullptr),
      static_cast<int64_t*>(nullptr), n_rows);
  if (err != cudaSuccess) {
    return cudaGetErrorString(err);
  }
  l->temp_bytes = sort_bytes > select_bytes ? sort_bytes : select_bytes;
  l->temp = take(l->temp_bytes);
  l->total = at;
  return nullptr;
}

// The cell holding `row`: the largest c with off[c] <= row (empty cells
// before it share its offset and are skipped this way).
__device__ int64_t cell_of_row(const int64_t* __restrict__ off, int64_t n_cells, int64_t row) {
  int64_t lo = 0;
  int64_t hi = n_cells - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (off[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__global__ void build_keys_kernel(const float* __restrict__ metric, const int64_t* __restrict__ off,
                                  int64_t n_rows, int64_t n_cells, uint64_t* __restrict__ keys,
                                  int64_t* __restrict__ pos) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_rows;
       i += stride) {
    const float m = metric[i];
    // -0.0 has the sign bit set: fold it onto +0.0 so the two tie (as they
    // compare equal on the CPU) and fall back to position order.
    const uint32_t bits = m == 0.0f ? 0u : __float_as_uint(m);
    keys[i] = (static_cast<uint64_t>(cell_of_row(off, n_cells, i)) << 32) |
              static_cast<uint64_t>(~bits);
    pos[i] = i;
  }
}

// Step 2: the position-in-segment test, scattered back to row positions.
__global__ void mark_kept_kernel(const uint64_t* __restrict__ keys, const int64_t* __restrict__ pos,
                                 const int64_t* __restrict__ off,
                                 const int64_t* __restrict__ kept_counts, int64_t n_rows,
                                 uint8_t* __restrict__ flags, int64_t* __restrict__ rank) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n_rows;
       j += stride) {
    const int64_t c = static_cast<int64_t>(keys[j] >> 32);
    const int64_t r = j - off[c];
    const int64_t p = pos[j];
    flags[p] = r < kept_counts[c] ? 1 : 0;
    if (rank != nullptr) {
      rank[p] = r;
    }
  }
}

// pi of an uncapped row: min(lambda * m, 1), or pi_zero in the zero branch.
__device__ __forceinline__ double inclusion(bool zero_branch, double lambda, double pi_zero,
                                            float m) {
  if (zero_branch) {
    return pi_zero;
  }
  const double p = __dmul_rn(lambda, static_cast<double>(m));
  return p < 1.0 ? p : 1.0;
}

// scale = 1/pi in double, rounded once to fp32 (as static_cast<float> on the CPU).
__device__ __forceinline__ float inverse(double pi) {
  return __double2float_rn(__ddiv_rn(1.0, pi));
}

// Step 3, one thread per cell. Mirrors sample_cell in kernels/select_rows.cpp
// operation for operation; see the recipe in megatron_lrmoe/ops/select.py.
__global__ void sample_cells_kernel(const float* __restrict__ metric,
                                    const int64_t* __restrict__ off,
                                    const int64_t* __restrict__ kept_counts,
                                    const int64_t* __restrict__ sorted_pos,
                                    const int64_t* __restrict__ rank, int64_t n_cells,
                                    uint64_t seed, uint8_t* __restrict__ flags,
                                    float* __restrict__ scale_full) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n_cells;
       c += stride) {
    const int64_t begin = off[c];
    const int64_t end = off[c + 1];
    const int64_t n = end - begin;
    const int64_t q = kept_counts[c];
    if (q == n) {  // everything kept (flags are set by step 2)
      for (int64_t i = begin; i < end; ++i) {
        scale_full[i] = 1.0f;
      }
      continue;
    }
    if (q == 0) {
      continue;  // nothing kept (flags are clear)
    }
    const int64_t* sorted = sorted_pos + begin;  // the cell's rows in topk order
    int64_t n_pos = 0;
    for (int64_t i = begin; i < end; ++i) {
      n_pos += metric[i] > 0.0f ? 1 : 0;
    }

    bool zero_branch = false;
    double lambda = 0.0;
    double pi_zero = 0.0;
    int64_t k_star = 0;
    if (n_pos <= q) {
      zero_branch = true;  // positive rows capped; the rest of the quota spread over zeros
      k_star = n_pos;
      pi_zero = __ddiv_rn(static_cast<double>(q - n_pos), static_cast<double>(n - n_pos));
    } else {
      double sum_rest = 0.0;  // ranks >= q, in position order
      for (int64_t i = begin; i < end; ++i) {
        if (rank[i] >= q) {
          sum_rest = __dadd_rn(sum_rest, static_cast<double>(metric[i]));
        }
      }
      double t = sum_rest;
      double t_star = sum_rest;
      k_star = q;
      for (int64_t k = q - 1; k >= 0; --k) {
        const double vk = static_cast<double>(metric[sorted[k]]);
        t = __dadd_rn(t, vk);
        if (__dmul_rn(static_cast<double>(q - k), vk) < t) {
          k_star = k;
          t_star = t;
        }
      }
      lambda = __ddiv_rn(static_cast<double>(q - k_star), t_star);
    }

    // Systematic pass over the uncapped rows (rank >= k_star) in position
    // order; capped rows are kept with scale 1.
    const int64_t r = q - k_star;
    const double u = cell_uniform(seed, c);
    const double b_start = u > 0.0 ? -1.0 : 0.0;
    const double b_max = b_start + static_cast<double>(r);
    double b_prev = b_start;
    double cum = 0.0;
    int64_t drawn = 0;
    for (int64_t i = begin; i < end; ++i) {
      if (rank[i] < k_star) {
        flags[i] = 1;
        scale_full[i] = 1.0f;
        continue;
      }
      uint8_t keep = 0;
      if (r > 0) {
        const double pi = inclusion(zero_branch, lambda, pi_zero, metric[i]);
        cum = __dadd_rn(cum, pi);
        const double b = fmin(floor(__dsub_rn(cum, u)), b_max);
        if (b > b_prev) {
          keep = 1;
          scale_full[i] = inverse(pi);
          ++drawn;
        }
        b_prev = b;
      }
      flags[i] = keep;
    }
    // Rounding fix-up: the first undrawn uncapped rows of the topk order.
    for (int64_t j = k_star; j < n && drawn < r; ++j) {
      const int64_t p = sorted[j];
      if (flags[p] == 0) {
        flags[p] = 1;
        scale_full[p] = inverse(inclusion(zero_branch, lambda, pi_zero, metric[p]));
        ++drawn;
      }
    }
  }
}

// hybrid, after step 1: is_top[p] = 1 for the q_top first rows of TopK order.
__global__ void mark_top_kernel(const uint64_t* __restrict__ keys, const int64_t* __restrict__ pos,
                                const int64_t* __restrict__ off,
                                const int64_t* __restrict__ kept_counts, int64_t n_rows,
                                double hybrid_fraction, uint8_t* __restrict__ is_top) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n_rows;
       j += stride) {
    const int64_t c = static_cast<int64_t>(keys[j] >> 32);
    is_top[pos[j]] = j - off[c] < hybrid_top_count(hybrid_fraction, kept_counts[c]) ? 1 : 0;
  }
}

// U1: the row keys (pos[i] = i is already there from build_keys_kernel or
// set here).
__global__ void build_row_keys_kernel(const int64_t* __restrict__ off, int64_t n_rows,
                                      int64_t n_cells, uint64_t seed, uint64_t* __restrict__ keys,
                                      int64_t* __restrict__ pos) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_rows;
       i += stride) {
    const int64_t c = cell_of_row(off, n_cells, i);
    keys[i] = row_key(cell_key_base(seed, c), i - off[c]);
    pos[i] = i;
  }
}

// U2's key for sorted position j: (cell << 1) | (row is not a top row).
__global__ void build_group_keys_kernel(const int64_t* __restrict__ off,
                                        const int64_t* __restrict__ pos,
                                        const uint8_t* __restrict__ is_top, int64_t n_rows,
                                        int64_t n_cells, uint64_t* __restrict__ keys) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n_rows;
       j += stride) {
    const int64_t p = pos[j];
    const uint64_t not_top = (is_top != nullptr && is_top[p] != 0) ? 0u : 1u;
    keys[j] = (static_cast<uint64_t>(cell_of_row(off, n_cells, p)) << 1) | not_top;
  }
}

// U3: the position-in-segment test on the (cell, not top, key) order, with
// the scale of each kept row.
__global__ void mark_uniform_kernel(const uint64_t* __restrict__ keys,
                                    const int64_t* __restrict__ pos,
                                    const int64_t* __restrict__ off,
                                    const int64_t* __restrict__ kept_counts, int64_t n_rows,
                                    bool hybrid, double hybrid_fraction,
                                    uint8_t* __restrict__ flags, float* __restrict__ scale_full) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n_rows;
       j += stride) {
    const uint64_t key = keys[j];
    const int64_t c = static_cast<int64_t>(key >> 1);
    const int64_t q = kept_counts[c];
    const int64_t p = pos[j];
    const bool keep = j - off[c] < q;
    flags[p] = keep ? 1 : 0;
    if (!keep) {
      continue;
    }
    const int64_t n = off[c + 1] - off[c];
    const int64_t q_top = hybrid ? hybrid_top_count(hybrid_fraction, q) : 0;
    float sc = 1.0f;
    if ((key & 1u) != 0 && q < n) {  // a key-drawn row of a partial cell: q > q_top
      sc = __double2float_rn(
          __ddiv_rn(static_cast<double>(n - q_top), static_cast<double>(q - q_top)));
    }
    scale_full[p] = sc;
  }
}

__global__ void fill_ones_kernel(float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = 1.0f;
  }
}

__global__ void gather_scale_kernel(const float* __restrict__ scale_full,
                                    const int64_t* __restrict__ kept_index, int64_t n_kept,
                                    int64_t n_rows, float* __restrict__ scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n_kept;
       j += stride) {
    // A caller-given K larger than the rows actually selected (a caller bug,
    // caught by the debug checks) leaves entries unset: never read past P.
    const int64_t p = kept_index[j];
    scale[j] = p >= 0 && p < n_rows ? scale_full[p] : 0.0f;
  }
}

template <typename T>
T* at_offset(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

const char* select_rows_cuda_workspace_bytes(int64_t n_rows, int64_t n_cells, SelectRule rule,
                                             size_t* bytes) {
  Layout l{};
  const char* err = make_layout(n_rows, n_cells, rule, &l);
  *bytes = err == nullptr ? l.total : 0;
  return err;
}

const char* select_rows_cuda(const float* metric, const int64_t* cell_offsets,
                             const int64_t* kept_counts, int64_t n_rows, int64_t n_cells,
                             int64_t n_kept, SelectRule rule, uint64_t seed,
                             double hybrid_fraction, int64_t* kept_index, float* scale,
                             void* workspace, size_t workspace_bytes, CUstream_st* stream) {
  if (n_rows <= 0 || n_cells <= 0 || n_kept <= 0) {
    return nullptr;  // nothing kept; a zero-sized grid would be a launch error
  }
  Layout l{};
  if (const char* err = make_layout(n_rows, n_cells, rule, &l)) {
    return err;
  }
  if (workspace == nullptr || workspace_bytes < l.total) {
    return "select_rows_cuda: workspace smaller than select_rows_cuda_workspace_bytes";
  }
  uint64_t* keys_in = at_offset<uint64_t>(workspace, l.keys_in);
  uint64_t* keys_out = at_offset<uint64_t>(workspace, l.keys_out);
  int64_t* pos_in = at_offset<int64_t>(workspace, l.pos_in);
  int64_t* pos_out = at_offset<int64_t>(workspace, l.pos_out);
  uint8_t* flags = at_offset<uint8_t>(workspace, l.flags);
  int64_t* n_selected = at_offset<int64_t>(workspace, l.n_selected);
  void* temp = at_offset<void>(workspace, l.temp);
  const bool sample = rule == SelectRule::kSample;
  int64_t* rank = sample ? at_offset<int64_t>(workspace, l.rank) : nullptr;
  float* scale_full = sample ? at_offset<float>(workspace, l.scale_full) : nullptr;

  const dim3 rows_grid = grid_for(n_rows);
  size_t temp_bytes = l.temp_bytes;
  cudaError_t err = cudaSuccess;
  if (is_uniform_family(rule)) {
    const bool hybrid = rule == SelectRule::kHybrid;
    uint8_t* is_top = hybrid ? at_offset<uint8_t>(workspace, l.is_top) : nullptr;
    int64_t* pos_tmp = at_offset<int64_t>(workspace, l.pos_tmp);
    scale_full = at_offset<float>(workspace, l.scale_full);
    if (hybrid) {  // steps 1 and 2 with q_top: which rows are top rows
      build_keys_kernel<<<rows_grid, kThreads, 0, stream>>>(metric, cell_offsets, n_rows,
                                                            n_cells, keys_in, pos_in);
      err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_in, pos_out,
                                            n_rows, 0, 32 + cell_bits(n_cells), stream);
      if (err != cudaSuccess) {
        return cudaGetErrorString(err);
      }
      mark_top_kernel<<<rows_grid, kThreads, 0, stream>>>(keys_out, pos_out, cell_offsets,
                                                          kept_counts, n_rows, hybrid_fraction,
                                                          is_top);
    }
    // U1: rows by key (pos_in = 0..P-1 again).
    build_row_keys_kernel<<<rows_grid, kThreads, 0, stream>>>(cell_offsets, n_rows, n_cells,
                                                              seed, keys_in, pos_in);
    temp_bytes = l.temp_bytes;
    err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_in, pos_out,
                                          n_rows, 0, 64, stream);
    if (err != cudaSuccess) {
      return cudaGetErrorString(err);
    }
    // U2: stable by (cell, not top); the key order survives inside each group.
    build_group_keys_kernel<<<rows_grid, kThreads, 0, stream>>>(cell_offsets, pos_out, is_top,
                                                                n_rows, n_cells, keys_in);
    temp_bytes = l.temp_bytes;
    err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_out, pos_tmp,
                                          n_rows, 0, cell_bits(n_cells) + 1, stream);
    if (err != cudaSuccess) {
      return cudaGetErrorString(err);
    }
    // U3.
    mark_uniform_kernel<<<rows_grid, kThreads, 0, stream>>>(keys_out, pos_tmp, cell_offsets,
                                                            kept_counts, n_rows, hybrid,
                                                            hybrid_fraction, flags, scale_full);
  } else {
    build_keys_kernel<<<rows_grid, kThreads, 0, stream>>>(metric, cell_offsets, n_rows, n_cells,
                                                          keys_in, pos_in);
    err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_in, pos_out,
                                          n_rows, 0, 32 + cell_bits(n_cells), stream);
    if (err != cudaSuccess) {
      return cudaGetErrorString(err);
    }
    mark_kept_kernel<<<rows_grid, kThreads, 0, stream>>>(keys_out, pos_out, cell_offsets,
                                                         kept_counts, n_rows, flags, rank);
  }
  if (sample) {
    sample_cells_kernel<<<grid_for(n_cells), kThreads, 0, stream>>>(
        metric, cell_offsets, kept_counts, pos_out, rank, n_cells, seed, flags, scale_full);
  }
  // pos_in still holds 0..P-1: the non-DoubleBuffer sort leaves its inputs.
  temp_bytes = l.temp_bytes;
  err = cub::DeviceSelect::Flagged(temp, temp_bytes, pos_in, flags, kept_index, n_selected, n_rows,
                                   stream);
  if (err != cudaSuccess) {
    return cudaGetErrorString(err);
  }
  if (scale_full != nullptr) {  // sample, uniform, hybrid
    gather_scale_kernel<<<grid_for(n_kept), kThreads, 0, stream>>>(scale_full, kept_index, n_kept,
                                                                   n_rows, scale);
  } else {
    fill_ones_kernel<<<grid_for(n_kept), kThreads, 0, stream>>>(scale, n_kept);
  }
  err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace lrmoe
