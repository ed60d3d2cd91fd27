// select_rows: CPU backend.
//
// Notation: P rows, C cells; cell c is the rows [off[c], off[c+1]) with
// quota q[c]; n = cell size; m the metric. Semantics, the sampling design and
// the exact floating-point recipe are specified in
// megatron_lrmoe/ops/select.py; this file, kernels/select_rows_cuda.cu and
// select_rows_reference there follow that one recipe step by step, because
// the results must be bitwise equal on every backend.
//
// Work split: cells are independent and write disjoint slices of the output
// (cell c writes [kept_offsets[c], kept_offsets[c] + kept_counts[c])), so
// threads take whole cells: no races, no order dependence, results bitwise
// independent of the thread count.
//
// Floating point: every sum is a sequential loop in double in the order the
// recipe names, and the build passes -ffp-contract=off so no product is fused
// into a following sum (an FMA would change last bits and break equality
// with the torch reference).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "select_rows.h"

namespace lrmoe {
namespace {

// Rows per parallel chunk below which waking another thread does not pay.
constexpr int64_t kGrainRows = 16384;

// The topk order of a cell's rows: metric descending, then position
// ascending. A strict total order (metrics are validated non-NaN; -0.0 and
// 0.0 compare equal, so they tie and fall back to position like in torch).
struct TopKOrder {
  const float* v;  // the cell's metrics, indexed by position in the cell
  bool operator()(int64_t a, int64_t b) const {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  }
};

// Row states while a cell is processed.
constexpr uint8_t kDropped = 0;
constexpr uint8_t kKept = 1;      // topk keep, sample row with pi = 1, hybrid top row
constexpr uint8_t kSampled = 2;   // sample row with pi < 1 drawn; uniform/hybrid key draw

// Scratch reused across the cells of one thread's chunk.
struct Scratch {
  std::vector<int64_t> order;  // cell positions, the first entries in TopKOrder
  std::vector<uint8_t> state;  // [n] kDropped / kKept / kSampled
  std::vector<std::pair<uint64_t, int64_t>> keys;  // uniform/hybrid: (key, position)
};

// Positions 0..n-1, with order[0..q) the q first rows of TopKOrder, in
// TopKOrder (sorted only when `sorted`); requires 0 < q < n.
void top_rows(const float* v, int64_t n, int64_t q, bool sorted, std::vector<int64_t>& order) {
  order.resize(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  const TopKOrder cmp{v};
  std::nth_element(order.begin(), order.begin() + q, order.end(), cmp);
  if (sorted) {
    std::sort(order.begin(), order.begin() + q, cmp);
  }
}

// topk, 0 < q < n: keep the q first rows of TopKOrder.
void topk_cell(const float* v, int64_t n, int64_t q, Scratch& s) {
  top_rows(v, n, q, /*sorted=*/false, s.order);
  s.state.assign(n, kDropped);
  for (int64_t j = 0; j < q; ++j) {
    s.state[s.order[j]] = kKept;
  }
}

// uniform (q_top = 0) and hybrid, 0 < q < n: the q_top first rows of TopKOrder
// are kept (kKept), then the r = q - q_top other rows of smallest key
// (kSampled). Keys are distinct within a cell, so no tie-break is ever used
// (pairs compare the position second only to make the order total).
void uniform_cell(const float* v, int64_t n, int64_t q, int64_t q_top, uint64_t key_base,
                  Scratch& s) {
  s.state.assign(n, kDropped);
  if (q_top > 0) {
    top_rows(v, n, q_top, /*sorted=*/false, s.order);
    for (int64_t j = 0; j < q_top; ++j) {
      s.state[s.order[j]] = kKept;
    }
  }
  const int64_t r = q - q_top;
  if (r == 0) {
    return;
  }
  s.keys.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (s.state[i] == kDropped) {
      s.keys.emplace_back(row_key(key_base, i), i);
    }
  }
  std::nth_element(s.keys.begin(), s.keys.begin() + (r - 1), s.keys.end());
  for (int64_t j = 0; j < r; ++j) {
    s.state[s.keys[j].second] = kSampled;
  }
}

// How a sampled cell's uncapped rows get their inclusion probability pi
// (recomputed, identically, for the scales).
struct SampleParams {
  bool zero_branch;  // fewer than q positive rows: pi(zero row) = r / n_zero
  double lambda;     // pi = min(lambda * m, 1) for uncapped rows (not zero_branch)
  double pi_zero;    // pi of every zero row (zero_branch)
  double pi(float m) const {
    return zero_branch ? pi_zero : std::min(lambda * static_cast<double>(m), 1.0);
  }
};

// sample, 0 < q < n: fills s.state with exactly q kept rows.
SampleParams sample_cell(const float* v, int64_t n, int64_t q, double u, Scratch& s) {
  std::vector<int64_t>& order = s.order;
  std::vector<uint8_t>& state = s.state;
  state.assign(n, kDropped);
  int64_t n_pos = 0;
  for (int64_t i = 0; i < n; ++i) {
    n_pos += v[i] > 0.0f ? 1 : 0;
  }

  SampleParams p{false, 0.0, 0.0};
  int64_t k_star = 0;  // rows capped at pi = 1: the k_star first of TopKOrder
  if (n_pos <= q) {
    // Every positive row is capped; the remaining quota is spread uniformly
    // over the zero rows. The zero rows in position order are exactly the
    // tail of TopKOrder, so no sort is needed.
    p.zero_branch = true;
    k_star = n_pos;
    p.pi_zero = static_cast<double>(q - n_pos) / static_cast<double>(n - n_pos);
    for (int64_t i = 0; i < n; ++i) {
      if (v[i] > 0.0f) {
        state[i] = kKept;
      }
    }
  } else {
    // Capping: k_star is the smallest k in [0, q) with (q - k) * v_(k) < T_k,
    // where v_(k) is the k-th metric of TopKOrder (from 0) and T_k the sum of
    // the metrics of ranks >= k; q when there is none (then the top q have
    // pi = 1 in double precision). T is built from the bottom:
    // B = sum of the ranks >= q in position order, T_q = B,
    // T_k = T_{k+1} + v_(k); the downward scan remembers the smallest k.
    top_rows(v, n, q, /*sorted=*/true, order);
    for (int64_t j = 0; j < q; ++j) {
      state[order[j]] = kKept;  // marks the top q while B is summed
    }
    double sum_rest = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (state[i] == kDropped) {
        sum_rest += static_cast<double>(v[i]);
      }
    }
    double t = sum_rest;
    double t_star = sum_rest;
    k_star = q;
    for (int64_t k = q - 1; k >= 0; --k) {
      const double vk = static_cast<double>(v[order[k]]);
      t = t + vk;
      if (static_cast<double>(q - k) * vk < t) {
        k_star = k;
        t_star = t;
      }
    }
    for (int64_t j = k_star; j < q; ++j) {
      state[order[j]] = kDropped;  // only the k_star first stay capped
    }
    p.lambda = static_cast<double>(q - k_star) / t_star;
  }

  const int64_t r = q - k_star;  // draws among the uncapped rows
  if (r == 0) {
    return p;
  }
  // Systematic sampling over the uncapped rows in position order: with
  // S_i = their cumulative pi, row i is drawn iff floor(S_i - u) exceeds the
  // previous row's value (b starts at floor(-u)). Skipping the capped rows
  // selects the same rows as including them in exact arithmetic (each adds
  // exactly 1 to S) and keeps rounding out of the capped rows. Clamping b at
  // floor(-u) + r makes an overshooting sum draw at most r rows.
  const double b_start = u > 0.0 ? -1.0 : 0.0;
  const double b_max = b_start + static_cast<double>(r);
  double b_prev = b_start;
  double cum = 0.0;
  int64_t drawn = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (state[i] == kKept) {
      continue;
    }
    cum = cum + p.pi(v[i]);
    const double b = std::min(std::floor(cum - u), b_max);
    if (b > b_prev) {
      state[i] = kSampled;
      ++drawn;
    }
    b_prev = b;
  }
  // Rounding can leave the sum a hair under r (or give one row two points),
  // so fewer than r rows were drawn: draw the missing ones deterministically,
  // the first undrawn uncapped rows of TopKOrder (largest pi first; positive
  // rows come before zero rows, and there are more than r positive uncapped
  // rows in the general case, so no pi = 0 row is ever drawn).
  if (drawn < r) {
    if (p.zero_branch) {
      // The uncapped rows are the zero rows, whose TopKOrder is position order.
      for (int64_t i = 0; i < n && drawn < r; ++i) {
        if (state[i] == kDropped) {
          state[i] = kSampled;
          ++drawn;
        }
      }
    } else {
      std::sort(order.begin() + q, order.end(), TopKOrder{v});  // now all of TopKOrder
      for (int64_t j = k_star; j < n && drawn < r; ++j) {
        if (state[order[j]] == kDropped) {
          state[order[j]] = kSampled;
          ++drawn;
        }
      }
    }
  }
  return p;
}

void check_values(const int64_t* off, const int64_t* quotas, const float* metric, int64_t n_cells,
                  int64_t n_rows) {
  TORCH_CHECK_VALUE(off[0] == 0, "select_rows: cell_offsets[0] = ", off[0], " but must be 0");
  for (int64_t c = 0; c < n_cells; ++c) {
    TORCH_CHECK_VALUE(off[c + 1] >= off[c], "select_rows: cell_offsets[", c + 1, "] = ",
                      off[c + 1], " is less than cell_offsets[", c, "] = ", off[c],
                      " (offsets must be non-decreasing)");
  }
  TORCH_CHECK_VALUE(off[n_cells] == n_rows, "select_rows: cell_offsets[", n_cells, "] = ",
                    off[n_cells], " but metric has P = ", n_rows,
                    " rows (the last offset must be P)");
  for (int64_t c = 0; c < n_cells; ++c) {
    TORCH_CHECK_VALUE(quotas[c] >= 0, "select_rows: quotas[", c, "] = ", quotas[c],
                      " is negative");
  }
  constexpr float kMax = std::numeric_limits<float>::max();
  for (int64_t i = 0; i < n_rows; ++i) {
    const float m = metric[i];
    // Written so that NaN fails too (every comparison with NaN is false).
    TORCH_CHECK_VALUE(m >= 0.0f && m <= kMax, "select_rows: metric[", i, "] = ", m,
                      " is not finite and non-negative (NaN, inf and negative metrics are "
                      "refused)");
  }
}

}  // namespace

// Declared in kernels/bindings.cpp, which has checked: 1-D contiguous CPU
// tensors, metric fp32 [P], cell_offsets int64 [C + 1] with C + 1 >= 1,
// quotas int64 [C], hybrid_fraction in [0, 1]. The values are checked here,
// before anything is written.
// Returns (kept_index [K] int64, scale [K] fp32, kept_counts [C] int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_rows_cpu(const at::Tensor& metric,
                                                               const at::Tensor& cell_offsets,
                                                               const at::Tensor& quotas,
                                                               SelectRule rule, uint64_t seed,
                                                               double hybrid_fraction) {
  const int64_t n_rows = metric.size(0);
  const int64_t n_cells = quotas.size(0);
  const float* m = metric.const_data_ptr<float>();
  const int64_t* off = cell_offsets.const_data_ptr<int64_t>();
  const int64_t* q = quotas.const_data_ptr<int64_t>();
  check_values(off, q, m, n_cells, n_rows);

  at::Tensor kept_counts = at::empty({n_cells}, quotas.options());
  int64_t* counts = kept_counts.data_ptr<int64_t>();
  std::vector<int64_t> kept_offsets(n_cells + 1, 0);
  for (int64_t c = 0; c < n_cells; ++c) {
    counts[c] = std::min(q[c], off[c + 1] - off[c]);
    kept_offsets[c + 1] = kept_offsets[c] + counts[c];
  }
  const int64_t n_kept = kept_offsets[n_cells];
  at::Tensor kept_index = at::empty({n_kept}, cell_offsets.options());
  at::Tensor scale = at::empty({n_kept}, metric.options());
  if (n_kept == 0) {
    return {kept_index, scale, kept_counts};
  }
  int64_t* out_index = kept_index.data_ptr<int64_t>();
  float* out_scale = scale.data_ptr<float>();

  const int64_t grain =
      std::max<int64_t>(1, (kGrainRows * n_cells) / std::max<int64_t>(1, n_rows));
  at::parallel_for(0, n_cells, grain, [&](int64_t c0, int64_t c1) {
    Scratch s;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = off[c];
      const int64_t n = off[c + 1] - begin;
      const int64_t k = counts[c];
      int64_t* idx = out_index + kept_offsets[c];
      float* scl = out_scale + kept_offsets[c];
      if (k == n) {  // quota at or above the cell size (or an empty cell)
        for (int64_t i = 0; i < n; ++i) {
          idx[i] = begin + i;
          scl[i] = 1.0f;
        }
        continue;
      }
      if (k == 0) {
        continue;
      }
      const float* v = m + begin;
      SampleParams p{false, 0.0, 0.0};
      float uniform_scale = 1.0f;  // uniform/hybrid: scale of the key-drawn rows
      if (rule == SelectRule::kTopK) {
        topk_cell(v, n, k, s);
      } else if (rule == SelectRule::kSample) {
        p = sample_cell(v, n, k, cell_uniform(seed, c), s);
      } else {
        const int64_t q_top =
            rule == SelectRule::kHybrid ? hybrid_top_count(hybrid_fraction, k) : 0;
        uniform_cell(v, n, k, q_top, cell_key_base(seed, c), s);
        if (k > q_top) {
          // (n - q_top) / r in double, rounded once to fp32.
          uniform_scale = static_cast<float>(static_cast<double>(n - q_top) /
                                             static_cast<double>(k - q_top));
        }
      }
      const bool by_pi = rule == SelectRule::kSample;
      int64_t w = 0;  // position order: the compaction keeps the forward order
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t st = s.state[i];
        if (st == kDropped) {
          continue;
        }
        idx[w] = begin + i;
        // sample: 1/pi in double, rounded once to fp32.
        scl[w] = st == kKept  ? 1.0f
                 : by_pi      ? static_cast<float>(1.0 / p.pi(v[i]))
                              : uniform_scale;
        ++w;
      }
      TORCH_INTERNAL_ASSERT(w == k, "select_rows: cell ", c, " kept ", w, " rows, not ", k);
    }
  });
  return {kept_index, scale, kept_counts};
}

}  // namespace lrmoe
