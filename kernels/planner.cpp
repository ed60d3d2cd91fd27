// The compiled per-call planner: instance assignment with receive limits, uniform retention
// quotas, the cost model's rank memory, and the region's per-call host layout.
//
// Each function computes exactly what its Python counterpart does (the Python code is
// the specification and the oracle of the property tests):
//   assign            planning/instance_assignment.py  _assign, _balance, _Flow,
//                                                      _overflow_home, _fill_replicated
//   retain            planning/retention.py            plan_retention (integer rules)
//   rank memory       planning/cost_model.py           CostModel.rank_memory with
//                                                      per-instance rows (planner._memory)
//   call_layout       layer/region_layout.py           CallLayout, and the layer's
//                                                      instance-order chunk tables
// The float arithmetic repeats numpy's operation by operation, in the same order and
// without FMA contraction (setup.py passes -ffp-contract=off), so the doubles are equal
// bit for bit; the one reduction whose order matters (a float row sum in _balance)
// repeats numpy's pairwise summation.
//
// Plain host code on numpy arrays: no tensor op is dispatched, so a call costs
// microseconds, not a dispatch per step.

#include "planner.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace lrmoe {
namespace {

using i64 = int64_t;
using i128 = __int128;
constexpr i64 kInf = std::numeric_limits<i64>::max();
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Python's -(-a // b) for b > 0.
i64 ceil_div(i64 a, i64 b) {
  i64 q = a / b;
  if (a % b > 0) ++q;
  return q;
}

i64 ceil_div128(i128 a, i128 b) {
  i128 q = a / b;
  if (a % b > 0) ++q;
  return static_cast<i64>(q);
}

// numpy's pairwise summation of n contiguous doubles (add.reduce along a contiguous
// axis: numpy/_core/src/umath/loops_utils.h.src, pairwise_sum).
double pairwise_sum(const double* a, i64 n) {
  if (n < 8) {
    double res = 0.;
    for (i64 i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    i64 i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  i64 n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

// Least integer M with sum_r min(M, limit_r) >= total, or -1 for none (Python None).
i64 least_level(i64 total, std::vector<i64> limits) {
  if (limits.empty()) return 0;
  std::sort(limits.begin(), limits.end());
  i64 used = 0;
  const i64 n = static_cast<i64>(limits.size());
  for (i64 i = 0; i < n; ++i) {
    const i64 lim = limits[i];
    const i64 level = ceil_div(total - used, n - i);
    if (level <= lim) return std::max<i64>(level, 0);
    used += lim;  // finite here: an infinite limit always admits the level
  }
  return -1;
}

// The cost model's per-rank constants (CostModel._layout, _held_weight_grads,
// _grouped_terms, returned_gradient_bytes and the shape's byte counts), computed in Python
// once per placement.
struct MemoryModel {
  bool grouped = false, fr = false;
  double xc = 0, conv = 0, row = 0, sr = 0, p = 0, pss = 0, meta = 0, f_b = 0, f1_b = 0,
         hb = 0, fac = 0, ob = 0, pbb = 0, wgt_tmp = 0, ib = 0, kappa_mif = 0, kappa = 0,
         rerun = 0, lyr = 1, replica_dw = 0, replica_dw2 = 0;
  i64 row_i = 0, sr_i = 0, p_i = 0, f_b_i = 0, f1_b_i = 0, hb_i = 0, fac_i = 0, mif_i = 1,
      lyr_i = 1;
  std::vector<double> nrep, rc, w1, w2, held_dw2, held_dw, returned;  // [R]
};

double get_double(const py::dict& d, const char* key) { return d[key].cast<double>(); }
i64 get_int(const py::dict& d, const char* key) { return d[key].cast<i64>(); }
std::vector<double> get_vector(const py::dict& d, const char* key) {
  F64Array a = d[key].cast<F64Array>();
  return std::vector<double>(a.data(), a.data() + a.size());
}

// The placement's index structure (instance_assignment._AssignmentLayout and the
// retention layout), the per-instance rank, and the memory model when there is one.
class NativePlanner {
 public:
  NativePlanner(i64 num_ranks, i64 num_experts, std::vector<i64> instance_rank,
                std::vector<i64> instance_expert, std::vector<i64> home_instance,
                py::object memory)
      : R_(num_ranks), E_(num_experts), I_(static_cast<i64>(instance_rank.size())),
        instance_rank_(std::move(instance_rank)), instance_expert_(std::move(instance_expert)),
        home_instance_(std::move(home_instance)) {
    rank_starts_.assign(R_ + 1, 0);
    for (i64 r : instance_rank_) rank_starts_[r + 1] += 1;
    for (i64 r = 0; r < R_; ++r) rank_starts_[r + 1] += rank_starts_[r];
    // instances of each expert: home first, then replicas in instance (= rank) order
    std::vector<std::vector<i64>> instances_of(E_);
    for (i64 e = 0; e < E_; ++e) instances_of[e].push_back(home_instance_[e]);
    for (i64 i = 0; i < I_; ++i) {
      const i64 e = instance_expert_[i];
      if (i != home_instance_[e]) instances_of[e].push_back(i);
    }
    incidence_.assign(R_, {});
    for (i64 e = 0; e < E_; ++e) {
      cell_instances_.insert(cell_instances_.end(), instances_of[e].begin(),
                             instances_of[e].end());
      if (instances_of[e].size() > 1) {
        const i64 k = static_cast<i64>(replicated_.size());
        replicated_.push_back(e);
        std::vector<i64> ranks;
        for (size_t j = 0; j < instances_of[e].size(); ++j) {
          const i64 r = instance_rank_[instances_of[e][j]];
          ranks.push_back(r);
          incidence_[r].push_back({k, static_cast<i64>(j)});
        }
        ranks_of_.push_back(std::move(ranks));
        inst_of_.push_back(instances_of[e]);
      } else {
        single_.push_back(e);
      }
    }
    for (i64 r = 0; r < R_; ++r)
      if (!incidence_[r].empty()) involved_.push_back(r);
    width_ = 1;
    for (const auto& v : ranks_of_) width_ = std::max<i64>(width_, static_cast<i64>(v.size()));
    if (!memory.is_none()) {
      const py::dict d = memory.cast<py::dict>();
      MemoryModel& m = memory_;
      m.grouped = d["grouped"].cast<bool>();
      m.fr = d["forward_retention"].cast<bool>();
      m.xc = get_double(d, "xc");
      m.conv = get_double(d, "conv");
      m.row_i = get_int(d, "row");
      m.sr_i = get_int(d, "sr");
      m.p_i = get_int(d, "p");
      m.f_b_i = get_int(d, "f_b");
      m.f1_b_i = get_int(d, "f1_b");
      m.hb_i = get_int(d, "hb");
      m.fac_i = get_int(d, "fac");
      m.row = double(m.row_i);
      m.sr = double(m.sr_i);
      m.p = double(m.p_i);
      m.f_b = double(m.f_b_i);
      m.f1_b = double(m.f1_b_i);
      m.hb = double(m.hb_i);
      m.fac = double(m.fac_i);
      m.pss = double(get_int(d, "pss"));
      m.meta = double(get_int(d, "meta"));
      m.ob = double(get_int(d, "ob"));
      m.pbb = double(get_int(d, "pbb"));
      m.wgt_tmp = double(get_int(d, "wgt_tmp"));
      m.ib = double(get_int(d, "ib"));
      m.kappa_mif = get_double(d, "kappa_mif");
      m.kappa = get_double(d, "kappa");
      m.rerun = double(get_int(d, "rerun"));
      m.lyr_i = get_int(d, "lyr");
      m.lyr = double(m.lyr_i);
      m.mif_i = get_int(d, "mif");
      m.nrep = get_vector(d, "nrep");
      m.rc = get_vector(d, "rc");
      m.w1 = get_vector(d, "w1");
      m.w2 = get_vector(d, "w2");
      m.held_dw2 = get_vector(d, "held_dw2");
      m.held_dw = get_vector(d, "held_dw");
      m.returned = get_vector(d, "returned");
      m.replica_dw = get_double(d, "replica_dw");
      m.replica_dw2 = get_double(d, "replica_dw2");
      has_memory_ = true;
    }
  }

  // (assignment [R, I], load [R]) of counts [R, E] with receive limits [R] or None.
  std::pair<I64Array, I64Array> assign(const I64Array& counts, py::object limit) const {
    check_counts(counts, E_, "counts");
    std::vector<i64> cap;
    const bool capped = !limit.is_none();
    if (capped) {
      I64Array c = limit.cast<I64Array>();
      if (c.ndim() != 1 || c.shape(0) != R_)
        throw py::value_error("limit must have one entry per rank");
      cap.assign(c.data(), c.data() + R_);
    }
    I64Array out({R_, I_});
    I64Array load(R_);
    {
      py::gil_scoped_release release;
      assign_into(counts.data(), capped ? &cap : nullptr, out.mutable_data(),
                  load.mutable_data());
    }
    return {out, load};
  }

  // The uniform retention plan of assignment counts [R, I]: (quotas [R, I], water
  // level [R]) at backward capacity ``cap`` (kInf: gamma = inf) and min retention
  // p / q (p = 0: none).
  std::pair<I64Array, I64Array> retain(const I64Array& cells, i64 cap, i64 p, i64 q) const {
    check_counts(cells, I_, "assignment counts");
    if (p < 0 || q <= 0 || p > q) throw py::value_error("min_retention must be p / q in [0, 1]");
    I64Array quotas({R_, I_});
    I64Array level(R_);
    {
      py::gil_scoped_release release;
      retain_into(cells.data(), cap, p, q, quotas.mutable_data(), level.mutable_data());
    }
    return {quotas, level};
  }

  // [R] CostModel.rank_memory of a planned micro-batch (planner._memory).
  F64Array memory(const I64Array& cells, const I64Array& quotas, const I64Array& load) const {
    if (!has_memory_) throw py::value_error("this planner has no cost model");
    check_counts(cells, I_, "assignment counts");
    check_counts(quotas, I_, "quotas");
    if (load.ndim() != 1 || load.shape(0) != R_)
      throw py::value_error("load must have one entry per rank");
    F64Array out(R_);
    {
      py::gil_scoped_release release;
      memory_into(cells.data(), quotas.data(), load.data(), out.mutable_data());
    }
    return out;
  }


  // [6, R] rank loads of an assignment's counts [R, I] and its quotas [R, I]
  // (CostModel.rank_loads of its [R, R] routed and kept matrices): pairs each rank
  // receives routed and kept, sends and keeps as a source, and the two diagonals.
  I64Array rank_loads(const I64Array& cells, const I64Array& quotas) const {
    check_counts(cells, I_, "assignment counts");
    check_counts(quotas, I_, "quotas");
    I64Array out({i64{6}, R_});
    {
      py::gil_scoped_release release;
      const i64* c = cells.data();
      const i64* q = quotas.data();
      i64* o = out.mutable_data();
      std::fill(o, o + 6 * R_, i64{0});
      for (i64 s = 0; s < R_; ++s)
        for (i64 r = 0; r < R_; ++r) {
          i64 a = 0, b = 0;
          for (i64 i = rank_starts_[r]; i < rank_starts_[r + 1]; ++i) {
            a += c[s * I_ + i];
            b += q[s * I_ + i];
          }
          o[r] += a;
          o[R_ + r] += b;
          o[2 * R_ + s] += a;
          o[3 * R_ + s] += b;
          if (r == s) {
            o[4 * R_ + r] = a;
            o[5 * R_ + r] = b;
          }
        }
    }
    return out;
  }

  // The region's per-call host layout on rank s (layer/region_layout.CallLayout) and
  // the layer's instance-order chunk tables (moe_layer._instance_order): one tuple.
  py::tuple layout(const I64Array& cells, const I64Array& quotas, i64 s) const {
    check_counts(cells, I_, "assignment counts");
    check_counts(quotas, I_, "quotas");
    if (s < 0 || s >= R_) throw py::value_error("rank out of range");
    const i64* c = cells.data();
    const i64* q = quotas.data();
    const i64 a = rank_starts_[s], b = rank_starts_[s + 1], L = b - a;
    std::vector<i64> send_fwd(R_, 0), recv_fwd(R_, 0), send_bwd(R_, 0), recv_bwd(R_, 0);
    for (i64 r = 0; r < R_; ++r) {
      for (i64 i = rank_starts_[r]; i < rank_starts_[r + 1]; ++i) {
        send_fwd[r] += c[s * I_ + i];
        send_bwd[r] += q[s * I_ + i];
      }
      for (i64 i = a; i < b; ++i) {
        recv_fwd[r] += c[r * I_ + i];
        recv_bwd[r] += q[r * I_ + i];
      }
    }
    i64 num_pairs = 0, num_kept = 0;
    for (i64 i = 0; i < I_; ++i) {
      num_pairs += c[s * I_ + i];
      num_kept += q[s * I_ + i];
    }
    std::vector<char> drops(R_, 0);
    std::vector<i64> routed_i(I_, 0), above(I_, 0);  // above: sources before s
    for (i64 r = 0; r < R_; ++r) {
      for (i64 i = 0; i < I_; ++i) {
        const i64 v = c[r * I_ + i];
        routed_i[i] += v;
        if (r < s) above[i] += v;
        if (q[r * I_ + i] != v) drops[instance_rank_[i]] = 1;
      }
    }
    bool all_keep = true;
    for (i64 r = 0; r < R_; ++r) all_keep = all_keep && !drops[r];
    std::vector<i64> send_pos(R_), recv_pos(R_);
    for (i64 r = 0; r < R_; ++r) {
      send_pos[r] = drops[r] ? send_bwd[r] : 0;
      recv_pos[r] = drops[s] ? recv_bwd[r] : 0;
    }
    const i64 LR = L * R_;
    // Each direction's two reorders as their deltas then their sizes (the layout's
    // ``chunk_permutations``), then the grouped GEMMs' int32 offsets two to an int64 word.
    std::vector<i64> sizes = {I_ + 1, I_, I_, 2 * LR, 2 * LR, 2 * LR, 2 * LR, L};
    I64Array packed(std::accumulate(sizes.begin(), sizes.end(), i64(0)));
    i64* out = packed.mutable_data();
    // cell offsets of this source, its quotas, and the shift to each cell's
    // destination exp-major rows
    i64* cell_off = out;
    i64* pos_delta = out + 2 * I_ + 1;
    cell_off[0] = 0;
    for (i64 i = 0; i < I_; ++i) cell_off[i + 1] = cell_off[i] + c[s * I_ + i];
    std::copy(q + s * I_, q + (s + 1) * I_, out + I_ + 1);
    i64 before = 0, rank_before = 0, current = -1;
    for (i64 i = 0; i < I_; ++i) {
      if (instance_rank_[i] != current) {
        current = instance_rank_[i];
        rank_before = before;
      }
      pos_delta[i] = before - rank_before + above[i] - cell_off[i];
      before += routed_i[i];
    }
    i64* cursor = out + 3 * I_ + 1;
    std::vector<i64> rows_fwd(L), rows_bwd(L);
    i64 received = 0, received_kept = 0;
    bool fwd_identity = true, bwd_identity = true;
    for (int pass = 0; pass < 2; ++pass) {
      const i64* m = pass == 0 ? c : q;
      auto& rows = pass == 0 ? rows_fwd : rows_bwd;
      // src-major [R, L] chunk sizes and starts; exp-major [L, R]
      std::vector<i64> start_src(LR), start_exp(LR);
      i64 acc = 0, last = -1;
      bool identity = true;
      for (i64 r = 0; r < R_; ++r)
        for (i64 l = 0; l < L; ++l) {
          const i64 v = m[r * I_ + a + l];
          start_src[r * L + l] = acc;
          acc += v;
          if (v) {
            if (l < last) identity = false;
            last = l;
          }
        }
      acc = 0;
      for (i64 l = 0; l < L; ++l) {
        rows[l] = 0;
        for (i64 r = 0; r < R_; ++r) {
          const i64 v = m[r * I_ + a + l];
          start_exp[l * R_ + r] = acc;
          acc += v;
          rows[l] += v;
        }
      }
      i64* delta_exp = cursor;
      i64* delta_src = cursor + LR;
      i64* sizes_exp = cursor + 2 * LR;
      i64* sizes_src = cursor + 3 * LR;
      for (i64 l = 0; l < L; ++l)
        for (i64 r = 0; r < R_; ++r) {
          const i64 d = start_src[r * L + l] - start_exp[l * R_ + r];
          delta_exp[l * R_ + r] = d;
          sizes_exp[l * R_ + r] = m[r * I_ + a + l];
          delta_src[r * L + l] = -d;
          sizes_src[r * L + l] = m[r * I_ + a + l];
        }
      cursor += 4 * LR;
      (pass == 0 ? received : received_kept) = acc;
      (pass == 0 ? fwd_identity : bwd_identity) = identity;
    }
    if (received >= (i64(1) << 31))
      throw py::value_error("rank " + std::to_string(s) + " receives " +
                            std::to_string(received) +
                            " rows: the grouped GEMMs' int32 offsets hold at most 2**31 - 1");
    // int32 in memory order, as numpy's astype(int32).view(int64) packs them
    int32_t* offs = reinterpret_cast<int32_t*>(cursor);
    for (int pass = 0; pass < 2; ++pass) {
      const auto& rows = pass == 0 ? rows_fwd : rows_bwd;
      i64 acc = 0;
      for (i64 l = 0; l < L; ++l) {
        acc += rows[l];
        *offs++ = static_cast<int32_t>(acc);
      }
    }
    py::object order = py::none();
    if (!replicated_.empty()) {  // [2, I]: shift of each instance's chunk, its size
      I64Array tables({i64(2), I_});
      i64* t = tables.mutable_data();
      const i64* row = c + s * I_;
      i64 now = 0;
      for (i64 i : cell_instances_) {
        t[i] = now;  // start in expert-major order
        now += row[i];
      }
      i64 start_new = 0;
      for (i64 i = 0; i < I_; ++i) {
        t[i] -= start_new;
        t[I_ + i] = row[i];
        start_new += row[i];
      }
      order = std::move(tables);
    }
    std::vector<bool> keeps(R_);
    for (i64 r = 0; r < R_; ++r) keeps[r] = !drops[r];
    return py::make_tuple(
        py::make_tuple(send_fwd, recv_fwd, send_bwd, recv_bwd, num_pairs, num_kept,
                       static_cast<bool>(!drops[s]), !all_keep, send_pos, recv_pos),
        py::make_tuple(rows_fwd, rows_bwd, received, received_kept, fwd_identity,
                       bwd_identity, sizes, packed),
        order);
  }


  // [R] CostModel.retained_limit(share, replicas, load, largest routed instance per
  // rank) of assignment counts [R, I] with loads ``load`` [R].
  I64Array retained_limit(double share, const I64Array& cells, const I64Array& load) const {
    if (!has_memory_) throw py::value_error("this planner has no cost model");
    check_counts(cells, I_, "assignment counts");
    if (load.ndim() != 1 || load.shape(0) != R_)
      throw py::value_error("load must have one entry per rank");
    I64Array out(R_);
    {
      py::gil_scoped_release release;
      limit_into(share, cells.data(), load.data(), out.mutable_data());
    }
    return out;
  }

  const std::vector<i64>& cell_instances() const { return cell_instances_; }
  i64 num_ranks() const { return R_; }
  i64 num_instances() const { return I_; }
  const std::vector<i64>& rank_starts() const { return rank_starts_; }

 private:
  void check_counts(const I64Array& a, i64 columns, const char* name) const {
    if (a.ndim() != 2 || a.shape(0) != R_ || a.shape(1) != columns)
      throw py::value_error(std::string(name) + " must have shape [R, " +
                            std::to_string(columns) + "]");
  }

  // ---------------------------------------------------------------- assignment
  void assign_into(const i64* n, const std::vector<i64>* cap, i64* out, i64* load) const {
    std::vector<i64> routed(E_, 0);
    for (i64 s = 0; s < R_; ++s)
      for (i64 e = 0; e < E_; ++e) routed[e] += n[s * E_ + e];
    if (replicated_.empty()) {  // instance i = expert i
      std::copy(n, n + R_ * E_, out);
      const i64 per = E_ / R_;
      for (i64 r = 0; r < R_; ++r) {
        i64 sum = 0;
        for (i64 e = r * per; e < (r + 1) * per; ++e) sum += routed[e];
        load[r] = sum;
      }
      return;
    }
    std::fill(out, out + R_ * I_, 0);
    std::vector<i64> column(I_, 0);
    for (i64 e : single_) {
      const i64 i = home_instance_[e];
      for (i64 s = 0; s < R_; ++s) out[s * I_ + i] = n[s * E_ + e];
      column[i] = routed[e];
    }
    std::vector<i64> base(R_, 0);
    for (i64 r = 0; r < R_; ++r)
      for (i64 i = rank_starts_[r]; i < rank_starts_[r + 1]; ++i) base[r] += column[i];
    const i64 K = static_cast<i64>(replicated_.size());
    std::vector<i64> totals(K);
    for (i64 k = 0; k < K; ++k) totals[k] = routed[replicated_[k]];
    std::vector<std::vector<i64>> x;
    std::vector<i64> ld;
    balance(base, cap, totals, x, ld);
    fill_replicated(out, n, x);
    std::copy(ld.begin(), ld.end(), load);
  }

  // instance_assignment._balance: per-instance totals x[k][j] and the rank loads.
  void balance(const std::vector<i64>& base, const std::vector<i64>* cap,
               const std::vector<i64>& totals, std::vector<std::vector<i64>>& x,
               std::vector<i64>& load) const {
    const i64 K = static_cast<i64>(replicated_.size());
    i64 bound = 0;
    for (i64 k = 0; k < K; ++k) {
      i64 own = totals[k];
      for (i64 r : ranks_of_[k]) own += base[r];
      bound = std::max(bound, ceil_div(own, static_cast<i64>(ranks_of_[k].size())));
    }
    {
      i64 sum = 0;
      for (i64 r : involved_) sum += base[r];
      for (i64 k = 0; k < K; ++k) sum += totals[k];
      bound = std::max(bound, ceil_div(sum, static_cast<i64>(involved_.size())));
    }
    // The even start, as numpy computes it (room, weight, ideal in float64).
    std::vector<double> room(R_);
    for (i64 r = 0; r < R_; ++r) {
      const double over = std::max(static_cast<double>(bound - base[r]), 1.0);
      room[r] = over / std::max(static_cast<double>(incidence_[r].size()), 1.0);
    }
    x.assign(K, {});
    load = base;
    std::vector<double> weight(width_);
    for (i64 k = 0; k < K; ++k) {
      const auto& ranks = ranks_of_[k];
      const i64 J = static_cast<i64>(ranks.size());
      std::fill(weight.begin(), weight.end(), 0.0);
      for (i64 j = 0; j < J; ++j) weight[j] = room[ranks[j]];
      const double wsum = pairwise_sum(weight.data(), width_);
      const double total = static_cast<double>(totals[k]);
      auto& xk = x[k];
      xk.assign(J, 0);
      i64 sum = 0;
      for (i64 j = 0; j < J; ++j) {
        xk[j] = static_cast<i64>(std::floor(total * weight[j] / wsum));
        sum += xk[j];
      }
      xk[0] += totals[k] - sum;
      for (i64 j = 0; j < J; ++j) load[ranks[j]] += xk[j];
    }
    Flow flow(*this, x, load);
    std::vector<i64> limit(R_, kInf);
    std::vector<char> stuck(R_, 0);
    if (cap != nullptr) {
      limit = *cap;
      flow.set_ceiling(limit);
      for (i64 u : involved_)
        if (load[u] > limit[u]) flow.drain(u, limit[u], nullptr);
      overflow_home(x, load, limit);
      for (i64 r = 0; r < R_; ++r) {
        stuck[r] = load[r] > limit[r];
        limit[r] = std::max(limit[r], load[r]);
      }
    }
    std::vector<char> is_involved(R_, 0);
    for (i64 r : involved_) is_involved[r] = 1;
    i64 level = bound;
    for (i64 r = 0; r < R_; ++r)
      if (!is_involved[r] || stuck[r]) level = std::max(level, load[r]);
    {
      i64 total = 0;
      std::vector<i64> lims;
      for (i64 r : involved_) {
        total += load[r];
        lims.push_back(limit[r]);
      }
      level = std::max(level, least_level(total, lims));
    }
    std::vector<i64> ceiling(R_);
    std::vector<i64> found;
    while (true) {
      std::vector<i64> over;
      for (i64 r : involved_)
        if (load[r] > level) over.push_back(r);
      if (over.empty()) return;
      for (i64 r = 0; r < R_; ++r) ceiling[r] = std::min(level, limit[r]);
      flow.set_ceiling(ceiling);
      for (i64 u : over) {
        if (flow.drain(u, level, &found)) {  // the ranks u reaches: all full
          i64 total = 0;
          std::vector<i64> lims;
          for (i64 r : found) {
            total += load[r];
            lims.push_back(limit[r]);
          }
          const i64 next = least_level(total, lims);
          if (next < 0 || next <= level) return;  // no certificate: stop here
          level = next;
          break;
        }
      }
    }
  }

  // instance_assignment._Flow: augmenting paths in the transfer graph, the same
  // breadth-first search in the same order (a resumable search, as the generator).
  class Flow {
   public:
    Flow(const NativePlanner& layout, std::vector<std::vector<i64>>& x, std::vector<i64>& load)
        : L_(layout), x_(x), load_(load), seen_(layout.R_, 0),
          done_(layout.ranks_of_.size(), 0), first_(layout.ranks_of_.size(), 0) {}

    void set_ceiling(const std::vector<i64>& ceiling) {
      ceiling_ = ceiling;
      for (size_t k = 0; k < L_.ranks_of_.size(); ++k) {
        const auto& ranks = L_.ranks_of_[k];
        i64 f = 0;
        for (i64 r : ranks) {
          if (load_[r] < ceiling_[r]) break;
          ++f;
        }
        first_[k] = f;
      }
    }

    // Move load from u to targets until load[u] <= stop. False when done; true when
    // no target is reachable, with the ranks u reaches in ``found``.
    bool drain(i64 u, i64 stop, std::vector<i64>* found) {
      const auto& own = L_.incidence_[u];
      size_t i = 0;
      bool searching = false;
      while (load_[u] > stop) {
        i64 k = 0, j = 0, f = 0;
        while (i < own.size()) {
          k = own[i].first;
          j = own[i].second;
          f = first_[k];
          if (f < count(k) && x_[k][j]) break;
          ++i;
        }
        i64 end, delta;
        if (i < own.size()) {  // one hop: k from j to f
          end = L_.ranks_of_[k][f];
          auto& xk = x_[k];
          delta = std::min({load_[u] - stop, ceiling_[end] - load_[end], xk[j]});
          xk[j] -= delta;
          xk[f] += delta;
        } else {
          if (!searching) {
            start_search(u);
            searching = true;
          }
          end = next_target();
          if (end < 0) {
            if (found != nullptr) *found = queue_;
            return true;
          }
          delta = std::min(load_[u] - stop, ceiling_[end] - load_[end]);
          for (const auto& h : hops_) delta = std::min(delta, x_[h.k][h.from]);
          for (const auto& h : hops_) {
            x_[h.k][h.from] -= delta;
            x_[h.k][h.to] += delta;
            if (!x_[h.k][h.from]) searching = false;  // a search tree edge is gone
          }
        }
        load_[u] -= delta;
        load_[end] += delta;
        if (load_[end] >= ceiling_[end]) {  // end is full now
          for (const auto& [kk, jj] : L_.incidence_[end]) {
            if (first_[kk] == jj) {
              const auto& ranks = L_.ranks_of_[kk];
              i64 ff = jj + 1;
              const i64 size = count(kk);
              while (ff < size && load_[ranks[ff]] >= ceiling_[ranks[ff]]) ++ff;
              first_[kk] = ff;
            }
          }
        } else {
          searching = false;
        }
      }
      return false;
    }

   private:
    struct Hop {
      i64 k, from, to;
    };
    struct Parent {
      i64 node, k, j, j2;
    };
    i64 count(i64 k) const { return static_cast<i64>(L_.ranks_of_[k].size()); }

    void start_search(i64 start) {
      ++stamp_;
      start_ = start;
      seen_[start] = stamp_;
      parent_.assign(L_.R_, Parent{-1, -1, -1, -1});
      queue_.assign(1, start);
      qi_ = 0;
      ii_ = 0;
      in_expert_ = false;
    }

    // The generator's next yield: the rank of the next target found (hops_ set), or
    // -1 when the search is exhausted (queue_ holds the ranks reached).
    i64 next_target() {
      while (qi_ < queue_.size()) {
        const i64 r = queue_[qi_];
        const auto& inc = L_.incidence_[r];
        if (!in_expert_) {
          while (ii_ < inc.size()) {
            const auto [k, j] = inc[ii_];
            if (!x_[k][j] || done_[k] == stamp_) {
              ++ii_;
              continue;
            }
            done_[k] = stamp_;
            cur_k_ = k;
            cur_j_ = j;
            position_ = 0;
            in_expert_ = true;
            break;
          }
          if (!in_expert_) {
            ++qi_;
            ii_ = 0;
            continue;
          }
        }
        const i64 k = cur_k_, j = cur_j_;
        const auto& ranks = L_.ranks_of_[k];
        const i64 f = first_[k];
        for (i64 j2 = position_; j2 < f; ++j2) {
          const i64 r2 = ranks[j2];
          if (seen_[r2] != stamp_) {
            seen_[r2] = stamp_;
            parent_[r2] = Parent{r, k, j, j2};
            queue_.push_back(r2);
          }
        }
        if (f >= count(k)) {  // this expert has no target: the next incidence
          in_expert_ = false;
          ++ii_;
          continue;
        }
        hops_.assign(1, Hop{k, j, f});
        i64 node = r;
        while (node != start_) {
          const Parent& p = parent_[node];
          hops_.push_back(Hop{p.k, p.j, p.j2});
          node = p.node;
        }
        position_ = f;  // resumed: ranks[f] is full by then
        return ranks[f];
      }
      return -1;
    }

    const NativePlanner& L_;
    std::vector<std::vector<i64>>& x_;
    std::vector<i64>& load_;
    std::vector<i64> ceiling_;
    std::vector<i64> seen_, done_, first_;
    i64 stamp_ = 0;
    // search state
    i64 start_ = 0;
    std::vector<Parent> parent_;
    std::vector<i64> queue_;
    size_t qi_ = 0, ii_ = 0;
    bool in_expert_ = false;
    i64 cur_k_ = 0, cur_j_ = 0, position_ = 0;
    std::vector<Hop> hops_;
  };

  // instance_assignment._overflow_home.
  void overflow_home(std::vector<std::vector<i64>>& x, std::vector<i64>& load,
                     const std::vector<i64>& limit) const {
    std::vector<i64> work;
    for (i64 r = 0; r < R_; ++r)
      if (load[r] > limit[r]) work.push_back(r);
    while (!work.empty()) {
      const i64 u = work.back();
      work.pop_back();
      for (const auto& [k, j] : incidence_[u]) {
        if (load[u] <= limit[u]) break;
        if (j == 0 || !x[k][j]) continue;
        const i64 delta = std::min(x[k][j], load[u] - limit[u]);
        const i64 home = ranks_of_[k][0];
        x[k][j] -= delta;
        x[k][0] += delta;
        load[u] -= delta;
        load[home] += delta;
        work.push_back(home);
      }
    }
  }

  // instance_assignment._fill_replicated: local pairs first, then a north-west-corner
  // fill of each expert's remaining sources (rank order) into its remaining instance
  // totals (instance order).
  void fill_replicated(i64* out, const i64* n, const std::vector<std::vector<i64>>& x) const {
    std::vector<i64> source_left(R_);
    std::vector<i64> instance_left;
    for (size_t k = 0; k < replicated_.size(); ++k) {
      const i64 e = replicated_[k];
      const auto& ranks = ranks_of_[k];
      const auto& inst = inst_of_[k];
      const i64 J = static_cast<i64>(ranks.size());
      for (i64 s = 0; s < R_; ++s) source_left[s] = n[s * E_ + e];
      instance_left = x[k];
      for (i64 j = 0; j < J; ++j) {
        const i64 s = ranks[j];
        const i64 local = std::min(n[s * E_ + e], x[k][j]);
        source_left[s] -= local;
        instance_left[j] -= local;
        out[s * I_ + inst[j]] += local;
      }
      i64 s = 0, j = 0;
      while (s < R_ && j < J) {
        const i64 m = std::min(source_left[s], instance_left[j]);
        out[s * I_ + inst[j]] += m;
        source_left[s] -= m;
        instance_left[j] -= m;
        if (source_left[s] == 0) ++s;
        if (j < J && instance_left[j] == 0) ++j;
      }
    }
  }

  // ----------------------------------------------------------------- retention
  void retain_into(const i64* cells, i64 cap, i64 p, i64 q, i64* quotas, i64* level) const {
    std::vector<i64> routed(I_, 0);
    for (i64 s = 0; s < R_; ++s)
      for (i64 i = 0; i < I_; ++i) routed[i] += cells[s * I_ + i];
    std::copy(cells, cells + R_ * I_, quotas);
    std::vector<i64> kept(routed);
    std::vector<i64> floors(I_, 0);
    if (p > 0 && cap != kInf)
      for (i64 i = 0; i < I_; ++i) floors[i] = ceil_div128(i128(p) * routed[i], i128(q));
    std::vector<i64> room;
    for (i64 r = 0; r < R_; ++r) {
      const i64 a = rank_starts_[r], b = rank_starts_[r + 1];
      i64 load = 0, floor_sum = 0, top = 0;
      for (i64 i = a; i < b; ++i) {
        load += routed[i];
        floor_sum += floors[i];
        top = std::max(top, routed[i]);
      }
      level[r] = top;
      if (cap == kInf) continue;
      const i64 target = std::min(load, std::max(cap, floor_sum));
      if (target >= load) continue;
      // The largest integer t with S(t) = sum_i clamp(t, f_i, N_i) <= T: S(0) = sum f
      // <= T and S(max N) = L > T.
      auto S = [&](i64 t) {
        i64 sum = 0;
        for (i64 i = a; i < b; ++i) sum += std::max(floors[i], std::min(routed[i], t));
        return sum;
      };
      i64 lo = 0, hi = top;  // S(lo) <= T < S(hi)
      while (hi - lo > 1) {
        const i64 mid = lo + (hi - lo) / 2;
        if (S(mid) <= target) lo = mid;
        else hi = mid;
      }
      const i64 t = lo;
      i64 sum = 0;
      room.clear();
      for (i64 i = a; i < b; ++i) {
        kept[i] = std::max(floors[i], std::min(routed[i], t));
        sum += kept[i];
        if (floors[i] <= t && t < routed[i]) room.push_back(i);
      }
      // leftover units: one each, largest N_i first, ties by lower instance index
      const i64 leftover = target - sum;
      std::stable_sort(room.begin(), room.end(),
                       [&](i64 u, i64 v) { return routed[u] > routed[v]; });
      for (i64 m = 0; m < leftover && m < static_cast<i64>(room.size()); ++m) kept[room[m]] += 1;
      level[r] = t;
    }
    // Split Q_i over sources: floor of Q_i n / N_i, the remainder by largest
    // remainder, ties by lower source index.
    std::vector<i64> rem(R_), order(R_);
    for (i64 i = 0; i < I_; ++i) {
      if (kept[i] >= routed[i]) continue;
      i64 sum = 0;
      for (i64 s = 0; s < R_; ++s) {
        const i64 prod = cells[s * I_ + i] * kept[i];
        quotas[s * I_ + i] = prod / routed[i];
        rem[s] = prod % routed[i];
        sum += quotas[s * I_ + i];
      }
      const i64 leftover = kept[i] - sum;
      if (leftover <= 0) continue;
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](i64 u, i64 v) { return rem[u] > rem[v]; });
      for (i64 m = 0; m < leftover && m < R_; ++m) quotas[order[m] * I_ + i] += 1;
    }
  }


  // ----------------------------------------------------------- retained limit
  // _solve: the largest x with coef x <= rhs (coef >= 0): +inf / -inf when coef is 0.
  static double solve(double rhs, double coef) {
    if (coef > 0) return rhs / coef;
    return rhs >= 0 ? std::numeric_limits<double>::infinity()
                    : -std::numeric_limits<double>::infinity();
  }
  // _solve_piecewise: the largest K with b K + c min(K, bend) <= rhs.
  static double solve_piecewise(double rhs, double b, double c, double bend) {
    const double below = solve(rhs, b + c);
    return below < bend ? below : solve(rhs - c * bend, b);
  }

  void limit_into(double share, const i64* cells, const i64* load, i64* out) const {
    const MemoryModel& m = memory_;
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<i64> inst(I_, 0);
    for (i64 s = 0; s < R_; ++s)
      for (i64 i = 0; i < I_; ++i) inst[i] += cells[s * I_ + i];
    const bool fr = m.fr;
    const double sk = fr ? m.sr : 0.0;
    const double extra = (m.kappa * sk) * double(m.mif_i * m.lyr_i - 1);
    const double a_s = m.xc * m.p, b_s = 1.0 - m.xc;
    for (i64 r = 0; r < R_; ++r) {
      i64 top = inst[rank_starts_[r]];
      for (i64 i = rank_starts_[r]; i < rank_starts_[r + 1]; ++i) top = std::max(top, inst[i]);
      const double routed = static_cast<double>(load[r]);
      const double largest = std::min(static_cast<double>(top), routed);
      const double saved = (fr ? 0.0 : routed * m.sr) + m.pss;
      const double fixed = m.nrep[r] * m.ib;
      const double room =
          (share - fixed - m.kappa_mif * saved) * m.lyr + m.kappa * saved - m.rerun;
      const double act_f = (double(m.fac_i - 1) * largest + routed) * m.f_b;
      const double base = saved + m.ob + m.pbb;
      const double rc = m.rc[r], w1 = m.w1[r], w2 = m.w2[r];
      const double held_dw = m.held_dw[r], held_dw2 = m.held_dw2[r];
      const double experts_f =
          m.grouped ? std::max({w1, m.fac * routed * m.f_b, routed * double(m.f_b_i + m.row_i) + w2})
                    : routed * m.row + act_f;
      const double meta = m.meta;
      // CostModel._forward_levels' (a, b) at scalar drops
      auto forward_levels = [&](double drops, std::vector<std::pair<double, double>>& levels) {
        levels.clear();
        levels.push_back({meta + m.xc * (m.p + routed) * m.row, 0.0});
        levels.push_back({meta + (1 + rc) * routed * m.row, 0.0});
        levels.push_back({meta + routed * m.sr + experts_f, 0.0});
        if (!fr) {
          levels.push_back({meta + rc * routed * double(m.sr_i + 2 * m.row_i), 0.0});
          levels.push_back({meta + m.xc * (routed * double(m.sr_i + m.row_i) +
                                           double(m.p_i * m.row_i)), 0.0});
        } else {
          levels.push_back({drops * (meta + routed * double(m.row_i + m.f1_b_i + m.hb_i)),
                            drops * m.hb});
          levels.push_back({drops * (meta + routed * double(m.row_i + m.f1_b_i)),
                            drops * double(m.hb_i + m.f1_b_i)});
          levels.push_back({meta + rc * 2 * routed * m.row, rc * m.sr});
          levels.push_back({meta + m.xc * (routed + m.p) * m.row, m.xc * m.sr});
        }
      };
      std::vector<std::pair<double, double>> levels;
      double limits[2];
      for (int d = 0; d < 2; ++d) {
        const double drop = d;
        const double gathered = fr ? 0.0 : drop;
        double lim = inf;
        bool first = true;
        auto phase = [&](double a, double b, double c) {
          const double v = solve_piecewise(room - a, b + extra, c, largest);
          lim = first ? v : std::min(lim, v);
          first = false;
        };
        phase(base + a_s * m.row, (m.xc + b_s) * m.row + sk, 0.0);
        phase(base, (1 + rc) * m.row + sk, 0.0);
        phase(base + m.xc * a_s * m.row + held_dw, (1 + m.xc * b_s) * m.row + sk, 0.0);
        phase(base + a_s * m.row + m.ob + held_dw, b_s * m.row + sk, 0.0);
        phase(base + m.ob + held_dw + m.returned[r], sk, 0.0);
        if (fr) {
          forward_levels(drop, levels);
          for (const auto& [a, b] : levels) phase(a, b, 0.0);
        }
        if (m.grouped) {
          const double rows = m.row + gathered * m.sr;
          phase(base + w2, rows + double(2 * m.f1_b_i) + sk, 0.0);
          phase(base, rows + double(3 * m.f1_b_i) + sk, 0.0);
          phase(base + w1 + m.conv + held_dw2,
                rows + double(2 * m.f_b_i) + m.f1_b + m.row + sk, 0.0);
        } else {
          const double g = gathered, held = double(m.f_b_i + m.f1_b_i);
          const double alpha[5] = {g * m.row, g * m.sr, g * m.sr + double(m.fac_i * m.f_b_i),
                                   g * m.sr + double(3 * m.f1_b_i), g * m.sr + held};
          const double beta[5] = {g * m.sr + held, g * m.f1_b + held, held, m.f1_b, 0.0};
          const double cst[5] = {0.0, 0.0, 0.0, 0.0, m.wgt_tmp};
          for (int l = 0; l < 5; ++l)
            phase(base + cst[l] + held_dw2, 2 * m.row + std::min(alpha[l], beta[l]) + sk,
                  std::abs(alpha[l] - beta[l]));
        }
        limits[d] = lim;
      }
      const double limit = limits[0] >= routed ? limits[0] : limits[1];
      bool fits = fr;
      if (!fr) {
        forward_levels(0.0, levels);
        double top_level = levels[0].first;
        for (const auto& lv : levels) top_level = std::max(top_level, lv.first);
        fits = top_level <= room;
      }
      // _to_count: floor(clip(limit, 0, 2^62))
      const double clipped = std::min(std::max(limit, 0.0), 4611686018427387904.0);
      out[r] = fits ? static_cast<i64>(std::floor(clipped)) : 0;
    }
  }

  // -------------------------------------------------------------------- memory
  void memory_into(const i64* cells, const i64* quotas, const i64* load, double* out) const {
    const MemoryModel& m = memory_;
    std::vector<double> n_f(I_, 0.0), n_b(I_, 0.0);
    std::vector<i64> inst_r(I_, 0), inst_q(I_, 0), sent(R_, 0);
    for (i64 s = 0; s < R_; ++s) {
      for (i64 i = 0; i < I_; ++i) {
        inst_r[i] += cells[s * I_ + i];
        inst_q[i] += quotas[s * I_ + i];
        sent[s] += quotas[s * I_ + i];
      }
    }
    for (i64 i = 0; i < I_; ++i) {
      n_f[i] = static_cast<double>(inst_r[i]);
      n_b[i] = static_cast<double>(inst_q[i]);
    }
    i64 last = -1;  // the last instance before i with forward rows
    for (i64 r = 0; r < R_; ++r) {
      const i64 a = rank_starts_[r], b = rank_starts_[r + 1];
      i64 retained_i = 0;
      for (i64 i = a; i < b; ++i) retained_i += inst_q[i];
      const double routed = static_cast<double>(load[r]);
      const double retained = static_cast<double>(retained_i);
      const double kept = static_cast<double>(sent[r]);
      const double drops = retained < routed ? 1.0 : 0.0;
      const double gathered = m.fr ? 0.0 * drops : drops;
      double act_f = 0.0, act_b = 0.0;
      if (!m.grouped) {  // CostModel._loop_activation over the rank's instances
        const double g = gathered;
        const double held = double(m.f_b_i + m.f1_b_i);
        bool first = true;
        for (i64 i = a; i < b; ++i) {
          const double before = i > a ? n_b[i - 1] : 0.0;
          const i64 prev = last;
          const double before_f = prev >= a ? n_f[prev] : 0.0;
          if (n_f[i] > 0) last = i;
          const double fwd = (m.fac * n_f[i] + before_f) * m.f_b;
          const double nb = n_b[i];
          const double l1 = ((g * m.row) * nb + (g * m.sr + held) * before) + 0.0;
          const double l2 = ((g * m.sr) * nb + (g * m.f1_b + held) * before) + 0.0;
          const double l3 = ((g * m.sr + double(m.fac_i * m.f_b_i)) * nb + held * before) + 0.0;
          const double l4 = ((g * m.sr + double(3 * m.f1_b_i)) * nb + m.f1_b * before) + 0.0;
          // The dW of the rank's earlier replicas, held for the layer's hook (a
          // replica's own dW2 also through its dW1 GEMM).
          const i64 replica = i - a - E_ / R_;
          const double own_dw2 = replica >= 0 ? m.replica_dw2 : 0.0;
          const double l5 = ((g * m.sr + held) * nb + 0.0 * before) + (m.wgt_tmp + own_dw2);
          const double held_q = double(std::max<i64>(replica, 0)) * m.replica_dw;
          const double bwd = held_q + std::max({l1, l2, l3, l4, l5});
          act_f = first ? fwd : std::max(act_f, fwd);
          act_b = first ? bwd : std::max(act_b, bwd);
          first = false;
        }
      }
      const double rc = m.rc[r], w1 = m.w1[r], w2 = m.w2[r];
      const double saved = (m.fr ? retained : routed) * m.sr + m.pss;
      double experts_bwd;
      if (m.grouped) {
        experts_bwd = gathered * retained * m.sr +
                      std::max({2 * retained * m.f1_b + w2, 3 * retained * m.f1_b,
                                retained * double(2 * m.f_b_i + m.f1_b_i + m.row_i) + w1 +
                                    m.conv + m.held_dw2[r]});
      } else {
        experts_bwd = retained * m.row + act_b;
      }
      // CostModel._forward_levels, each a + b * retained
      const double experts_f =
          m.grouped ? std::max({w1, m.fac * routed * m.f_b, routed * double(m.f_b_i + m.row_i) + w2})
                    : routed * m.row + act_f;
      const double meta = m.meta;
      double forward = std::max({meta + m.xc * (m.p + routed) * m.row + 0.0 * retained,
                                 meta + (1 + rc) * routed * m.row + 0.0 * retained,
                                 meta + routed * m.sr + experts_f + 0.0 * retained});
      if (!m.fr) {
        forward = std::max({forward,
                            meta + rc * routed * double(m.sr_i + 2 * m.row_i) + 0.0 * retained,
                            meta + m.xc * (routed * double(m.sr_i + m.row_i) +
                                           double(m.p_i * m.row_i)) + 0.0 * retained});
      } else {
        forward = std::max(
            {forward,
             drops * (meta + routed * double(m.row_i + m.f1_b_i + m.hb_i)) +
                 drops * m.hb * retained,
             drops * (meta + routed * double(m.row_i + m.f1_b_i)) +
                 drops * double(m.hb_i + m.f1_b_i) * retained,
             meta + rc * 2 * routed * m.row + rc * m.sr * retained,
             meta + m.xc * (routed + m.p) * m.row + m.xc * m.sr * retained});
      }
      const double base = saved + m.ob + m.pbb;
      const double backward =
          base + std::max({(m.xc * retained + kept) * m.row, (1 + rc) * retained * m.row,
                           retained * m.row + experts_bwd,
                           (retained + m.xc * kept) * m.row + m.held_dw[r],
                           kept * m.row + m.ob + m.held_dw[r],
                           m.ob + m.held_dw[r] + m.returned[r]});
      const double peak = std::max(forward, backward);
      out[r] = m.nrep[r] * m.ib + m.kappa_mif * saved + (peak - m.kappa * saved + m.rerun) / m.lyr;
    }
  }

  i64 R_, E_, I_;
  std::vector<i64> instance_rank_, instance_expert_, home_instance_, rank_starts_;
  std::vector<i64> replicated_, single_, involved_, cell_instances_;
  std::vector<std::vector<i64>> ranks_of_, inst_of_;
  std::vector<std::vector<std::pair<i64, i64>>> incidence_;
  i64 width_ = 1;
  MemoryModel memory_;
  bool has_memory_ = false;
};

using Hosts = std::vector<std::pair<i64, double>>;  // rank -> pairs, in insertion order

// An expert's pairs on ``rank`` of its hosts (0 where it is not a host).
double host_share(const Hosts& hosts, i64 rank) {
  for (const auto& [r, value] : hosts)
    if (r == rank) return value;
  return 0.0;
}

bool hosts_rank(const Hosts& hosts, i64 rank) {
  for (const auto& h : hosts)
    if (h.first == rank) return true;
  return false;
}

// placement_policies._spread_to_level(amount, others)
std::vector<double> spread_to_level(double amount, const std::vector<double>& others) {
  const size_t n = others.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return others[a] < others[b]; });
  double prefix = 0.0, level = 0.0;
  for (size_t m = 0; m < n; ++m) {
    prefix += others[order[m]];
    level = (amount + prefix) / static_cast<double>(m + 1);
    if (m + 1 == n || level <= others[order[m + 1]]) break;
  }
  std::vector<double> out(n);
  for (size_t j = 0; j < n; ++j) out[j] = std::max(level - others[j], 0.0);
  return out;
}

// placement_policies._spread_move: the expert's ``routed`` pairs water-filled over its
// hosts and rank v; false unless that lowers u's share and lifts no rank above ``top``.
bool spread_move(const std::vector<double>& load, const Hosts& hosts, double routed, i64 u,
                 i64 v, double top, std::vector<i64>& ranks, std::vector<double>& others,
                 std::vector<double>& fresh) {
  ranks.clear();
  others.clear();
  for (const auto& [r, h] : hosts) {
    ranks.push_back(r);
    others.push_back(load[r] - h);
  }
  ranks.push_back(v);
  others.push_back(load[v]);
  fresh = spread_to_level(routed, others);
  double new_u = 0.0;
  for (size_t j = 0; j < ranks.size(); ++j)
    if (ranks[j] == u) new_u = fresh[j];
  if (new_u >= host_share(hosts, u) - 1e-9) return false;
  for (size_t j = 0; j < ranks.size(); ++j)
    if (ranks[j] != u && !(others[j] + fresh[j] <= top)) return false;
  return true;
}

// placement_policies.greedy_replicas' moves (_greedy_move, _spread_to_level) on the fluid
// load estimate, in the same float operations and tie-breaks; the pricing of the
// prefixes stays in Python (the cost model).
class GreedyReplicas {
 public:
  GreedyReplicas(std::vector<i64> routed, i64 num_ranks, i64 num_experts)
      : R_(num_ranks), E_(num_experts), per_rank_(num_experts / num_ranks),
        routed_(std::move(routed)), load_(num_ranks, 0.0), spread_(num_experts),
        on_rank_(num_ranks), sent_(num_ranks, 0), recv_(num_ranks, 0) {
    if (static_cast<i64>(routed_.size()) != E_)
      throw py::value_error("routed must have one entry per expert");
    for (i64 e = 0; e < E_; ++e) {
      const i64 home = e / per_rank_;
      spread_[e].push_back({home, static_cast<double>(routed_[e])});
      load_[home] += static_cast<double>(routed_[e]);
      on_rank_[home].push_back(e);
    }
  }

  double top() const { return *std::max_element(load_.begin(), load_.end()); }

  // Moves until ``target`` moves exist in all or none is allowed: (the new moves
  // (expert, rank), the top load after each, the busiest sender or receiver after
  // each, exhausted).
  py::tuple advance(i64 target) {
    std::vector<std::pair<i64, i64>> moves;
    std::vector<double> tops;
    std::vector<i64> syncs;
    bool exhausted = false;
    {
      py::gil_scoped_release release;
      while (count_ < target) {
        if (!move()) {
          exhausted = true;
          break;
        }
        const auto& [e, v] = last_;
        busiest_ = std::max({busiest_, sent_[e / per_rank_], recv_[v]});
        moves.push_back(last_);
        tops.push_back(top());
        syncs.push_back(busiest_);
        ++count_;
      }
    }
    return py::make_tuple(moves, tops, syncs, exhausted);
  }

 private:
  // _greedy_move
  bool move() {
    const double top_load = top();
    const i64 u = std::max_element(load_.begin(), load_.end()) - load_.begin();  // first max
    std::vector<i64> candidates = on_rank_[u];
    std::stable_sort(candidates.begin(), candidates.end(), [&](i64 a, i64 b) {
      const double sa = host_share(spread_[a], u), sb = host_share(spread_[b], u);
      return sa != sb ? sa > sb : a < b;
    });
    if (candidates.size() > 4) candidates.resize(4);
    i64 least = -1;
    for (i64 e : candidates) {
      const Hosts& hosts = spread_[e];
      if (static_cast<i64>(hosts.size()) >= R_) continue;
      if (least < 0) least = std::min_element(load_.begin(), load_.end()) - load_.begin();
      i64 v = least;
      if (hosts_rank(hosts, least)) {
        v = -1;
        for (i64 r = 0; r < R_; ++r)
          if (!hosts_rank(hosts, r) && (v < 0 || load_[r] < load_[v])) v = r;
      }
      std::vector<i64> ranks;
      std::vector<double> others, fresh;
      if (!spread_move(load_, hosts, static_cast<double>(routed_[e]), u, v, top_load, ranks,
                       others, fresh))
        continue;
      Hosts updated;
      for (size_t j = 0; j < ranks.size(); ++j) {
        load_[ranks[j]] = others[j] + fresh[j];
        updated.push_back({ranks[j], fresh[j]});
      }
      spread_[e] = std::move(updated);
      on_rank_[v].push_back(e);
      sent_[e / per_rank_] += 1;
      recv_[v] += 1;
      last_ = {e, v};
      return true;
    }
    return false;
  }

  i64 R_, E_, per_rank_;
  std::vector<i64> routed_;
  std::vector<double> load_;
  std::vector<Hosts> spread_;
  std::vector<std::vector<i64>> on_rank_;
  std::vector<i64> sent_, recv_;
  i64 busiest_ = 0, count_ = 0;
  std::pair<i64, i64> last_{-1, -1};
};


// placement_policies._place_popularity: the popularity placement's loop over replicas, from
// the numpy-computed instance counts, per-instance loads and rank loads; with ``local`` the
// locality-aware rank choice (its [R, E] table, off-rank pairs received and sent, and the
// compute and network weights). Returns (replicas, skipped).
py::tuple popularity_replicas(const std::vector<i64>& experts, const std::vector<i64>& extra_of,
                              const std::vector<double>& per_instance,
                              std::vector<double> load, i64 free_slots, i64 per_rank,
                              i64 num_ranks, py::object local) {
  if (experts.size() != extra_of.size() || static_cast<i64>(load.size()) != num_ranks)
    throw py::value_error("popularity_replicas: inconsistent sizes");
  const bool aware = !local.is_none();
  F64Array table;
  std::vector<double> received_off, sent_off;
  double compute = 0.0, network = 0.0;
  i64 num_experts = static_cast<i64>(per_instance.size());
  if (aware) {
    py::tuple t = local.cast<py::tuple>();
    table = t[0].cast<F64Array>();
    received_off = t[1].cast<std::vector<double>>();
    sent_off = t[2].cast<std::vector<double>>();
    compute = t[3].cast<double>();
    network = t[4].cast<double>();
    if (table.ndim() != 2 || table.shape(0) != num_ranks || table.shape(1) != num_experts)
      throw py::value_error("popularity_replicas: local table must be [R, E]");
  }
  std::vector<std::pair<i64, i64>> replicas;
  i64 skipped = 0;
  {
    const double* tab = aware ? table.data() : nullptr;
    py::gil_scoped_release release;
    std::vector<i64> free(num_ranks, free_slots);
    std::vector<char> hosts(num_ranks, 0);
    for (size_t k = 0; k < experts.size(); ++k) {
      const i64 e = experts[k], extra = extra_of[k];
      std::fill(hosts.begin(), hosts.end(), 0);
      hosts[e / per_rank] = 1;
      const double p = per_instance[e];
      for (i64 placed = 0; placed < extra; ++placed) {
        i64 best = -1;
        double best_key = 0.0;
        for (i64 r = 0; r < num_ranks; ++r) {
          if (free[r] <= 0 || hosts[r]) continue;
          double key;
          if (aware) {
            const double g = tab[r * num_experts + e];
            key = compute * (load[r] + p) +
                  network * std::max(sent_off[r] - g, received_off[r] + p - g);
          } else {
            key = load[r];
          }
          if (best < 0 || key < best_key) {   // the first of equal keys: lower rank
            best = r;
            best_key = key;
          }
        }
        if (best < 0) {
          skipped += extra - placed;
          break;
        }
        if (aware) {
          const double g = tab[best * num_experts + e];
          received_off[best] += p - g;
          sent_off[best] -= g;
        }
        replicas.push_back({e, best});
        hosts[best] = 1;
        free[best] -= 1;
        load[best] += p;
      }
    }
  }
  return py::make_tuple(replicas, skipped);
}

// placement_policies.local_greedy_replicas' moves (_local_move and the state update) on
// the [R, E] counts, in the same float operations and tie-breaks; the pricing of the
// prefixes stays in Python (the cost model).
class LocalGreedyReplicas {
 public:
  LocalGreedyReplicas(F64Array counts, i64 num_ranks, i64 num_experts)
      : R_(num_ranks), E_(num_experts), per_rank_(num_experts / num_ranks),
        n_(static_cast<size_t>(num_ranks * num_experts)), routed_(num_experts, 0.0),
        row_total_(num_ranks, 0.0), load_(num_ranks, 0.0), kept_(num_ranks, 0.0),
        spread_(num_experts), on_rank_(num_ranks), sent_(num_ranks, 0), recv_(num_ranks, 0) {
    if (counts.ndim() != 2 || counts.shape(0) != R_ || counts.shape(1) != E_)
      throw py::value_error("counts must be [R, E]");
    std::copy(counts.data(), counts.data() + R_ * E_, n_.begin());
    for (i64 e = 0; e < E_; ++e)          // Python's sum over r, from 0 (0 + x == x)
      for (i64 r = 0; r < R_; ++r) routed_[e] += n(r, e);
    for (i64 r = 0; r < R_; ++r)
      for (i64 e = 0; e < E_; ++e) row_total_[r] += n(r, e);
    for (i64 e = 0; e < E_; ++e) {
      const i64 home = e / per_rank_;
      spread_[e].push_back({home, routed_[e]});
      load_[home] += routed_[e];
      kept_[home] += n(home, e);
      on_rank_[home].push_back(e);
    }
  }

  double top() const { return *std::max_element(load_.begin(), load_.end()); }

  double network() const {
    double out = 0.0;
    for (i64 r = 0; r < R_; ++r) {
      const double v = std::max(load_[r], row_total_[r]) - kept_[r];
      if (r == 0 || v > out) out = v;
    }
    return out;
  }

  // Moves until ``target`` moves exist in all or none is allowed: (the new moves, the top
  // load after each, the network estimate after each, the busiest sender or receiver
  // after each, exhausted).
  py::tuple advance(i64 target) {
    std::vector<std::pair<i64, i64>> moves;
    std::vector<double> tops, nets;
    std::vector<i64> syncs;
    bool exhausted = false;
    {
      py::gil_scoped_release release;
      while (count_ < target) {
        if (!move()) {
          exhausted = true;
          break;
        }
        const auto& [e, v] = last_;
        busiest_ = std::max({busiest_, sent_[e / per_rank_], recv_[v]});
        moves.push_back(last_);
        tops.push_back(*std::max_element(load_.begin(), load_.end()));
        nets.push_back(network());
        syncs.push_back(busiest_);
        ++count_;
      }
    }
    return py::make_tuple(moves, tops, nets, syncs, exhausted);
  }

 private:
  double n(i64 r, i64 e) const { return n_[static_cast<size_t>(r * E_ + e)]; }

  // _local_move, then the state update of local_greedy_replicas
  bool move() {
    const double top_load = *std::max_element(load_.begin(), load_.end());
    const i64 u = std::max_element(load_.begin(), load_.end()) - load_.begin();  // first max
    std::vector<i64> candidates = on_rank_[u];
    std::stable_sort(candidates.begin(), candidates.end(), [&](i64 a, i64 b) {
      const double sa = host_share(spread_[a], u), sb = host_share(spread_[b], u);
      return sa != sb ? sa > sb : a < b;
    });
    if (candidates.size() > 4) candidates.resize(4);
    for (i64 e : candidates) {
      const Hosts& hosts = spread_[e];
      if (static_cast<i64>(hosts.size()) >= R_) continue;
      i64 nearest = -1, least = -1;
      for (i64 r = 0; r < R_; ++r) {
        if (hosts_rank(hosts, r)) continue;
        // min over (-n[r][e], load[r], r) and over (load[r], r): the first of equals
        if (nearest < 0 || -n(r, e) < -n(nearest, e) ||
            (-n(r, e) == -n(nearest, e) && load_[r] < load_[nearest]))
          nearest = r;
        if (least < 0 || load_[r] < load_[least]) least = r;
      }
      const i64 choices[2] = {nearest, least};
      const int tries = nearest == least ? 1 : 2;
      for (int c = 0; c < tries; ++c) {
        const i64 v = choices[c];
        std::vector<i64> ranks;
        std::vector<double> others, fresh;
        if (!spread_move(load_, hosts, routed_[e], u, v, top_load, ranks, others, fresh))
          continue;
        Hosts updated;
        for (size_t j = 0; j < ranks.size(); ++j) {
          const i64 r = ranks[j];
          const double x = fresh[j], old = host_share(hosts, r);
          load_[r] += x - old;
          kept_[r] += std::min(n(r, e), x) - std::min(n(r, e), old);
          updated.push_back({r, x});
        }
        spread_[e] = std::move(updated);
        on_rank_[v].push_back(e);
        sent_[e / per_rank_] += 1;
        recv_[v] += 1;
        last_ = {e, v};
        return true;
      }
    }
    return false;
  }

  i64 R_, E_, per_rank_;
  std::vector<double> n_, routed_, row_total_, load_, kept_;
  std::vector<Hosts> spread_;
  std::vector<std::vector<i64>> on_rank_;
  std::vector<i64> sent_, recv_;
  i64 busiest_ = 0, count_ = 0;
  std::pair<i64, i64> last_{-1, -1};
};
}  // namespace

void register_planner(py::module_& m) {
  py::class_<NativePlanner>(m, "NativePlanner",
                            "The per-call planner of one placement (kernels/planner.cpp)")
      .def(py::init<i64, i64, std::vector<i64>, std::vector<i64>, std::vector<i64>,
                    py::object>(),
           py::arg("num_ranks"), py::arg("num_experts"), py::arg("instance_rank"),
           py::arg("instance_expert"), py::arg("home_instance"), py::arg("memory"))
      .def("assign", &NativePlanner::assign, "(assignment [R, I], load [R])",
           py::arg("counts"), py::arg("limit"))
      .def("retain", &NativePlanner::retain, "(quotas [R, I], water level [R])",
           py::arg("cells"), py::arg("capacity"), py::arg("floor_num"), py::arg("floor_den"))
      .def("memory", &NativePlanner::memory, "[R] rank memory", py::arg("cells"),
           py::arg("quotas"), py::arg("load"))
      .def("retained_limit", &NativePlanner::retained_limit,
           "[R] CostModel.retained_limit at the plan's loads", py::arg("share"),
           py::arg("cells"), py::arg("load"))
      .def("rank_loads", &NativePlanner::rank_loads,
           "[6, R] CostModel.rank_loads of the plan's routed and kept matrices",
           py::arg("cells"), py::arg("quotas"))
      .def("layout", &NativePlanner::layout,
           "((split sizes...), (rows and tables...), order tables or None) on rank s",
           py::arg("cells"), py::arg("quotas"), py::arg("rank"));
  py::class_<GreedyReplicas>(m, "GreedyReplicas",
                             "placement_policies.greedy_replicas' moves (kernels/planner.cpp)")
      .def(py::init<std::vector<i64>, i64, i64>(), py::arg("routed"), py::arg("num_ranks"),
           py::arg("num_experts"))
      .def("top", &GreedyReplicas::top, "the current maximum load")
      .def("advance", &GreedyReplicas::advance,
           "(moves, top after each, busiest after each, exhausted) up to target moves",
           py::arg("target"));
  py::class_<LocalGreedyReplicas>(
      m, "LocalGreedyReplicas",
      "placement_policies.local_greedy_replicas' moves (kernels/planner.cpp)")
      .def(py::init<F64Array, i64, i64>(), py::arg("counts"), py::arg("num_ranks"),
           py::arg("num_experts"))
      .def("top", &LocalGreedyReplicas::top, "the current maximum load")
      .def("network", &LocalGreedyReplicas::network,
           "the busiest link's off-rank pairs of the current state")
      .def("advance", &LocalGreedyReplicas::advance,
           "(moves, top after each, network after each, busiest after each, exhausted)",
           py::arg("target"));
  m.def("popularity_replicas", &popularity_replicas,
        "placement_policies._place_popularity: (replicas, skipped)", py::arg("experts"),
        py::arg("extra_of"), py::arg("per_instance"), py::arg("load"), py::arg("free_slots"),
        py::arg("per_rank"), py::arg("num_ranks"), py::arg("local"));
}

}  // namespace lrmoe
