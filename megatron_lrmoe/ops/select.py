"""select_rows: choose, per cell, which pairs keep their gradient in backward.

This is the "select" kernel (docs/design.md, "Selection rules"; "Region",
backward step 1): given a per-pair metric and a quota per (source, instance)
cell, return the kept rows, grouped by cell and in forward order, with the
scale that multiplies each kept pair's output gradient.

Notation
  P  pairs (rows of the per-pair arrays), in forward-dispatch order
  C  cells; cell c is the contiguous rows [cell_offsets[c], cell_offsets[c + 1])
  n  a cell's size; q its quota; m the metric (larger = more important)
  K  kept rows, K = sum over cells of min(q, n)

Shapes and dtypes
  metric       [P]      float32, finite and >= 0
  cell_offsets [C + 1]  int64, 0 = off[0] <= off[1] <= ... <= off[C] = P
  quotas       [C]      int64, >= 0 (a quota above the cell size keeps the cell)
  -> kept_index  [K]  int64, kept row positions: cells in order, ascending inside a cell
     scale       [K]  float32, 1 for "topk" and for rows with pi = 1; 1/pi otherwise
                      (n / q for "uniform"; see "hybrid")
     kept_counts [C]  int64, min(quota, cell size)

Rules
  "topk"    keep the q rows of largest metric; ties go to the lower position.
  "sample"  systematic sampling with inclusion probability pi proportional to
            the metric, capped at 1, and sum of pi = q exactly, so exactly q
            rows are kept and sum over kept rows of x_i / pi_i is an unbiased
            estimate of sum over the cell of x_i (Horvitz-Thompson).
  "uniform" a uniform random subset of exactly q rows (each of the C(n, q)
            subsets equally likely), every kept row scaled by n / q. The
            metric is ignored (but still validated).
  "hybrid"  with f = ``hybrid_fraction`` in [0, 1]: the q_top = floor(f * q)
            first rows of TopK order (below) are kept with scale 1, and the
            other r = q - q_top kept rows are a uniform subset of the n - q_top
            remaining rows, each scaled by (n - q_top) / r, so the estimate of
            the cell's sum stays unbiased. f = 0 is "uniform" and f = 1 is
            "topk", bitwise (scale 1 everywhere).
  All: q >= n keeps the whole cell (scale 1), q = 0 keeps nothing.

The "sample" recipe. Every backend follows it operation for operation, in
double precision and in the summation orders named here, so results are
bitwise identical on every backend for the same inputs and seed. "TopK order"
is metric descending, then position ascending; v_(j) is the j-th metric in it
(from 0). For a cell with 0 < q < n:
  1. n_pos = rows with m > 0.
     If n_pos <= q: the positive rows are capped (pi = 1) and the remaining
     quota r = q - n_pos is spread uniformly: pi = r / (n - n_pos) on each
     zero row; k* = n_pos.
     Else: B = sum of the metrics of TopK ranks >= q, in position order;
     T_q = B and T_k = T_(k+1) + v_(k) for k = q-1 down to 0 (T_k is the sum
     of ranks >= k). k* = the smallest k in [0, q) with (q - k) * v_(k) < T_k,
     or q if none (the top q then have pi = 1 in double). The ranks < k* are
     capped; lambda = (q - k*) / T_(k*) and pi = min(lambda * m, 1) for the
     others. This is the fixed point of the iterative capping "rows with
     lambda * m >= 1 get pi = 1, the rest share the remaining quota".
  2. u = the cell's uniform draw in [0, 1) (below). Systematic sampling over
     the uncapped rows in position order: S = running sum of their pi,
     b = min(floor(S - u), floor(-u) + r), starting from b = floor(-u); a
     row is drawn iff its b exceeds the previous row's. The capped rows are
     kept and left out of S: in exact arithmetic each would add exactly 1 to
     S and the same rows would be drawn; leaving them out keeps rounding away
     from them. The clamp caps the draws at r = q - k*.
  3. If rounding left fewer than r rows drawn (S ends a hair under r and u
     lies within that hair of 1: a chance of order n * r * 1e-16 per cell),
     the first undrawn uncapped rows in TopK order are drawn (largest pi
     first; never a row with pi = 0).
  4. scale = float32(1 / pi) of each drawn row (1 for capped rows).

The "uniform" and "hybrid" recipe (uniform is hybrid with f = 0), for a cell
c with 0 < q < n, again identical on every backend:
  1. q_top = floor(f * q), the product rounded once in double (f = 0.29 and
     q = 100 give 28, since 0.29 * 100 = 28.999999999999996 in double);
     0 <= q_top <= q. The q_top first rows of TopK order are kept, scale 1.
  2. Every row gets the 64-bit key k_j = splitmix64(h_c + j) (j = position in
     the cell, from 0; h_c = splitmix64(splitmix64(seed) + c); all mod 2^64).
     splitmix64 is a bijection and h_c + j differ within a cell, so keys
     within a cell are distinct: no ties. Among the rows not kept in step 1,
     the r = q - q_top of smallest key (as unsigned integers) are kept, with
     scale float32((n - q_top) / r), the quotient rounded once in double and
     then to float32 (for "uniform": float32 of the double n / q).
  Which rows are kept, given q_top, is a uniform subset as far as splitmix64
  is indistinguishable from a random function; the keys do not depend on the
  metric, so the rows kept in step 1 never bias the draw among the others.

Random numbers: u = (splitmix64(splitmix64(seed) + c) >> 11) * 2^-53 for cell
c, and the row keys above: a counter-based generator (a pure function of
seed, cell index and row position, defined once in kernels/select_rows.h and
repeated in ``cell_uniform`` and ``row_keys`` here), so every backend and
thread layout draws the same numbers. ``seed`` is any int; only seed mod 2^64
matters. Callers vary it per layer and micro-batch.

Invalid input is refused, never silently kept: a NaN, +inf, -inf or negative
metric raises ValueError naming the first offending row (-0.0 counts as 0);
so do negative quotas, cell offsets that do not run from 0 to P without
decreasing, and a ``hybrid_fraction`` outside [0, 1] (checked for every
rule). Strided inputs are accepted and copied to contiguous memory (the
compiled binding itself refuses them).

Backends ("auto", "cpu", "cuda", "torch"; megatron_lrmoe.ops.backend): "cpu"
and "cuda" are kernels/select_rows.{cpp,cu}; "torch" validates and runs
``select_rows_reference``, which computes on the host (CPU cumsum is the
sequential sum the recipe needs) and returns tensors on the input's device.
The CUDA backend reads nothing on the host when the caller gives K
(``n_kept``, which the LRMoE region knows from its plan) and the debug checks
are off (``megatron_lrmoe.ops.backend.debug_checks``); otherwise it syncs once
per call to validate the values and learn K. Without the checks, invalid
values on a GPU give an undefined (but in-bounds) selection instead of an
error. No gradient flows through the selection. The compiled backends run the
torch op ``lrmoe::select_rows`` (kernels/bindings.cpp), whose fake implementation,
registered here, needs ``n_kept``: K depends on values a fake tensor lacks.

``metric`` may be None for "uniform", which ignores it (the LRMoE region then
skips computing it); ``num_rows`` gives P.
"""

from __future__ import annotations

import operator

import torch

from megatron_lrmoe.ops.backend import (
    debug_checks,
    is_fake,
    kernels_available,
    needs_value_check,
    registered_ops,
    resolve_backend,
)

RULES: tuple[str, ...] = ("topk", "sample", "uniform", "hybrid")

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------
# The counter-based generator (same constants as kernels/select_rows.h)
# ---------------------------------------------------------------------------


def splitmix64(x: int) -> int:
    """SplitMix64's output function of x + golden gamma, on Python ints mod 2^64."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def cell_uniform(seed: int, cell: int) -> float:
    """The systematic-sampling offset u in [0, 1) of ``cell`` under ``seed``."""
    z = splitmix64((splitmix64(seed & _MASK64) + cell) & _MASK64)
    return (z >> 11) * 2.0**-53  # 53 random bits, exact in double


def row_key(seed: int, cell: int, j: int) -> int:
    """The uniform/hybrid key (an unsigned 64-bit int) of row ``j`` of ``cell``."""
    h = splitmix64((splitmix64(seed & _MASK64) + cell) & _MASK64)
    return splitmix64((h + j) & _MASK64)


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mul64(z: torch.Tensor, m: int) -> torch.Tensor:
    """z * m mod 2^64 on int64 bit patterns.

    In int64, not uint64: torch's CUDA ``mul`` has lacked uint64 kernels, and the low 64
    bits of a product do not depend on signedness, so the wrapping int64 product of the
    same bit patterns is the uint64 product's bits.
    """
    return z * _signed(m)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """``splitmix64`` of every int64 bit pattern in ``x`` (two's-complement wrap-around)."""
    z = x + _signed(0x9E3779B97F4A7C15)
    z = _mul64(z ^ _lsr(z, 30), 0xBF58476D1CE4E5B9)
    z = _mul64(z ^ _lsr(z, 27), 0x94D049BB133111EB)
    return z ^ _lsr(z, 31)


def row_keys(seed: int, cell_offsets: torch.Tensor) -> torch.Tensor:
    """Keys [P] of every row (``row_key``), as int64 tensors holding the uint64 bits."""
    off = cell_offsets.to("cpu", torch.int64)
    sizes = off[1:] - off[:-1]
    n_cells = sizes.numel()
    cell = torch.repeat_interleave(torch.arange(n_cells), sizes)
    base = torch.full((n_cells,), _signed(splitmix64(seed & _MASK64)), dtype=torch.int64)
    h = splitmix64_tensor(base + torch.arange(n_cells))  # [C]
    return splitmix64_tensor(h[cell] + (torch.arange(cell.numel()) - off[:-1][cell]))


# ---------------------------------------------------------------------------
# The "torch" backend (after validation); not an oracle: the tests check every
# backend against a brute force written from the docstring above
# ---------------------------------------------------------------------------


def _topk_rank(m: torch.Tensor, off: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rank [P] of every row within its cell in TopK order (0 = largest metric)."""
    n_rows = m.numel()
    cell = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # [P]
    # Two stable sorts: by metric (ties keep position order), then by cell.
    by_metric = torch.sort(m, descending=True, stable=True).indices
    order = by_metric[torch.sort(cell[by_metric], stable=True).indices]
    rank = torch.empty(n_rows, dtype=torch.int64)
    rank[order] = torch.arange(n_rows) - off[:-1][cell[order]]
    return rank


def _sample_cell(v: torch.Tensor, q: int, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [n] bool, scale [n] float32) of one cell with 0 < q < n: the recipe above."""
    n = v.numel()
    vd = v.double()
    order = torch.sort(v, descending=True, stable=True).indices  # TopK order
    rank = torch.empty(n, dtype=torch.int64)
    rank[order] = torch.arange(n)
    n_pos = int((v > 0).sum())
    if n_pos <= q:
        k_star = n_pos
        pi = torch.full((n,), (q - n_pos) / (n - n_pos), dtype=torch.float64)
    else:
        top = vd[order[:q]]
        # torch.cumsum on CPU adds sequentially in index order: the recipe's
        # sums, bitwise. Masked rows add 0, which leaves a sum unchanged.
        rest = torch.cumsum(torch.where(rank >= q, vd, 0.0), 0)[-1:]
        tail = torch.cumsum(torch.cat([rest, top.flip(0)]), 0).flip(0)  # tail[k] = T_k
        ks = torch.arange(q)
        hits = ((q - ks).double() * top < tail[:q]).nonzero()
        k_star = int(hits[0]) if hits.numel() else q
        lam = (q - k_star) / float(tail[k_star])
        pi = torch.clamp(vd * lam, max=1.0)

    capped = rank < k_star
    keep = capped.clone()
    scale = torch.ones(n, dtype=torch.float32)
    r = q - k_star
    if r > 0:
        cum = torch.cumsum(torch.where(capped, 0.0, pi), 0)
        b_start = -1.0 if u > 0.0 else 0.0
        b = torch.clamp(torch.floor(cum - u), max=b_start + r)
        b_prev = torch.cat([torch.tensor([b_start], dtype=torch.float64), b[:-1]])
        drawn = ~capped & (b > b_prev)
        missing = r - int(drawn.sum())
        if missing > 0:  # rounding fix-up, step 3
            tail_rows = order[k_star:]
            drawn[tail_rows[~drawn[tail_rows]][:missing]] = True
        keep |= drawn
        scale[drawn] = (1.0 / pi[drawn]).float()
    return keep, scale


def _uniform_keep(m: torch.Tensor, off: torch.Tensor, sizes: torch.Tensor,
                  kept_counts: torch.Tensor, fraction: float,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [P] bool, scale [P] float32) of "hybrid" with ``fraction`` (0: "uniform")."""
    n_rows = m.numel()
    cell = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # [P]
    # q_top = floor(f * q): one double product per cell, like the compiled backends.
    q_top = torch.floor(kept_counts.double() * fraction).to(torch.int64)
    if bool((q_top > 0).any()):
        is_top = _topk_rank(m, off, sizes) < q_top[cell]
    else:
        is_top = torch.zeros(n_rows, dtype=torch.bool)
    # Order rows by (cell, not top, key): flipping the sign bit makes signed
    # int64 order the keys' unsigned order. Keys are distinct within a cell.
    keys = row_keys(seed, off) ^ (-(1 << 63))
    by_key = torch.sort(keys, stable=True).indices
    group = cell * 2 + (~is_top).to(torch.int64)
    order = by_key[torch.sort(group[by_key], stable=True).indices]
    rank = torch.empty(n_rows, dtype=torch.int64)
    rank[order] = torch.arange(n_rows) - off[:-1][cell[order]]
    keep = rank < kept_counts[cell]
    # Scale per cell: (n - q_top) / (q - q_top) in double, then float32; 1 for
    # whole cells and for the top rows.
    r = kept_counts - q_top
    partial = (kept_counts < sizes) & (r > 0)
    cell_scale = torch.ones(sizes.numel(), dtype=torch.float64)
    cell_scale[partial] = (sizes - q_top)[partial].double() / r[partial].double()
    scale = torch.where(is_top, 1.0, cell_scale.float()[cell])
    return keep, scale


def select_rows_reference(
    metric: torch.Tensor,
    cell_offsets: torch.Tensor,
    quotas: torch.Tensor,
    rule: str = "topk",
    seed: int = 0,
    *,
    hybrid_fraction: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "torch" backend of ``select_rows``, without its checks.

    Expects valid input (see the module docstring). Computes on the host,
    returns (kept_index, scale, kept_counts) on ``metric``'s device. ``topk``,
    ``uniform`` and ``hybrid`` are vectorised; ``sample`` loops over the cells
    in Python.
    """
    device = metric.device
    m = metric.detach().to("cpu", torch.float32)
    off = cell_offsets.to("cpu", torch.int64)
    sizes = off[1:] - off[:-1]
    kept_counts = torch.minimum(quotas.to("cpu", torch.int64), sizes)
    if rule == "topk":
        keep = _topk_rank(m, off, sizes) < torch.repeat_interleave(kept_counts, sizes)
        scale_rows = torch.ones(m.numel(), dtype=torch.float32)
    elif rule in ("uniform", "hybrid"):
        fraction = float(hybrid_fraction) if rule == "hybrid" else 0.0
        keep, scale_rows = _uniform_keep(m, off, sizes, kept_counts, fraction, seed)
    else:
        keep = torch.zeros(m.numel(), dtype=torch.bool)
        scale_rows = torch.ones(m.numel(), dtype=torch.float32)
        cells = zip(off[:-1].tolist(), sizes.tolist(), kept_counts.tolist(), strict=True)
        for c, (a, n, k) in enumerate(cells):
            if k == n:
                keep[a : a + n] = True
            elif k > 0:
                keep[a : a + n], scale_rows[a : a + n] = _sample_cell(
                    m[a : a + n], k, cell_uniform(seed, c)
                )
    kept_index = keep.nonzero().flatten()  # ascending: grouped by cell, forward order
    scale = scale_rows[kept_index]
    return kept_index.to(device), scale.to(device), kept_counts.to(device)


# ---------------------------------------------------------------------------
# Checks (the messages of kernels/bindings.cpp and kernels/select_rows.cpp)
# ---------------------------------------------------------------------------


def _check_args(metric: torch.Tensor, cell_offsets: torch.Tensor, quotas: torch.Tensor) -> None:
    if metric.dim() != 1:
        raise ValueError(f"select_rows: metric must be 1-D [P], got shape {tuple(metric.shape)}")
    if cell_offsets.dim() != 1 or cell_offsets.shape[0] < 1:
        raise ValueError(
            "select_rows: cell_offsets must be 1-D [C + 1] with at least one entry, got shape "
            f"{tuple(cell_offsets.shape)}"
        )
    n_cells = cell_offsets.shape[0] - 1
    if quotas.dim() != 1 or quotas.shape[0] != n_cells:
        raise ValueError(
            f"select_rows: quotas must be 1-D [C] with C = {n_cells} (len(cell_offsets) - 1), "
            f"got shape {tuple(quotas.shape)}"
        )
    if metric.dtype != torch.float32:
        raise TypeError(f"select_rows: metric must be float32, got {metric.dtype}")
    if cell_offsets.dtype != torch.int64:
        raise TypeError(f"select_rows: cell_offsets must be int64, got {cell_offsets.dtype}")
    if quotas.dtype != torch.int64:
        raise TypeError(f"select_rows: quotas must be int64, got {quotas.dtype}")
    if cell_offsets.device != metric.device or quotas.device != metric.device:
        raise ValueError(
            f"select_rows: all tensors must be on one device; metric is on {metric.device}, "
            f"cell_offsets on {cell_offsets.device}, quotas on {quotas.device}"
        )


def _first(mask: torch.Tensor) -> int | None:
    """Index of the first True of a 1-D bool tensor, or None."""
    hits = mask.nonzero()
    return int(hits[0]) if hits.numel() else None


def _check_values(metric: torch.Tensor, cell_offsets: torch.Tensor, quotas: torch.Tensor) -> None:
    """ValueError naming the first invalid offset, quota or metric row (host sync)."""
    off = cell_offsets.cpu()
    n_cells = off.numel() - 1
    if int(off[0]) != 0:
        raise ValueError(f"select_rows: cell_offsets[0] = {int(off[0])} but must be 0")
    c = _first(off[1:] < off[:-1])
    if c is not None:
        raise ValueError(
            f"select_rows: cell_offsets[{c + 1}] = {int(off[c + 1])} is less than "
            f"cell_offsets[{c}] = {int(off[c])} (offsets must be non-decreasing)"
        )
    if int(off[-1]) != metric.numel():
        raise ValueError(
            f"select_rows: cell_offsets[{n_cells}] = {int(off[-1])} but metric has "
            f"P = {metric.numel()} rows (the last offset must be P)"
        )
    q = quotas.cpu()
    c = _first(q < 0)
    if c is not None:
        raise ValueError(f"select_rows: quotas[{c}] = {int(q[c])} is negative")
    m = metric.detach().cpu()
    i = _first(~((m >= 0) & (m <= _FLOAT32_MAX)))  # NaN fails both comparisons
    if i is not None:
        raise ValueError(
            f"select_rows: metric[{i}] = {float(m[i])} is not finite and non-negative "
            "(NaN, inf and negative metrics are refused)"
        )


def _seed_bits(seed: int) -> int:
    """``seed`` mod 2^64 as a signed int64 (the binding's argument type)."""
    bits = operator.index(seed) & _MASK64
    return bits - (1 << 64) if bits >= 1 << 63 else bits


# ---------------------------------------------------------------------------
# Fake implementation of the compiled op
# ---------------------------------------------------------------------------


def _select_rows_fake(metric: torch.Tensor, cell_offsets: torch.Tensor, quotas: torch.Tensor,
                      rule: str, seed: int, hybrid_fraction: float = 0.5, n_kept: int = -1,
                      check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake implementation of ``lrmoe::select_rows``: outputs from metadata and n_kept.

    K is a sum over the quotas' and offsets' values, which a fake tensor does not
    have: the caller passes it (``n_kept``, from the plan); -1 is refused, not guessed.
    """
    _check_args(metric, cell_offsets, quotas)
    if rule not in RULES:
        raise ValueError("select_rows: rule must be one of 'topk', 'sample', 'uniform', "
                         f"'hybrid', got {rule!r}")
    if n_kept < 0:
        raise ValueError(f"select_rows: n_kept = {n_kept}: the number of kept rows depends on "
                         "the quotas' and offsets' values, which fake tensors do not have; pass "
                         "n_kept (the plan's K)")
    return (cell_offsets.new_empty((n_kept,)), metric.new_empty((n_kept,)),
            quotas.new_empty((quotas.shape[0],)))


if kernels_available():
    torch.library.register_fake("lrmoe::select_rows", _select_rows_fake)


# ---------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------


def _check_fraction(hybrid_fraction: float) -> float:
    """The op's precondition on its ``hybrid_fraction`` argument (the compiled binding
    checks it too). Not the ``--moe-lrmoe-hybrid-fraction`` option check, which the
    option table owns (options/lrmoe.py): ops sit below lrmoe and do not import it."""
    if isinstance(hybrid_fraction, bool) or not isinstance(hybrid_fraction, (int, float)):
        raise TypeError(
            f"select_rows: hybrid_fraction must be a float, got {type(hybrid_fraction).__name__}"
        )
    f = float(hybrid_fraction)
    if not 0.0 <= f <= 1.0:  # NaN fails too
        raise ValueError(f"select_rows: hybrid_fraction must be in [0, 1], got {f}")
    return f


def select_rows(
    metric: torch.Tensor | None,
    cell_offsets: torch.Tensor,
    quotas: torch.Tensor,
    rule: str = "topk",
    seed: int = 0,
    backend: str = "auto",
    *,
    hybrid_fraction: float = 0.5,
    n_kept: int | None = None,
    num_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept rows of every cell: (kept_index [K] int64, scale [K] float32, kept_counts [C] int64).

    Shapes, rules, the sampling recipes, the generator and the error policy:
    see the module docstring. ``backend`` is a ``--moe-lrmoe-kernels`` value
    ("auto", "cpu", "cuda", "torch"); ``hybrid_fraction`` is the share f of
    the quota that "hybrid" keeps by top metric (validated for every rule,
    used by "hybrid" only). ``n_kept``: K = sum of min(quota, cell size), when the
    caller knows it (spares the CUDA backend its host sync; a wrong value raises
    where it is checked). ``metric`` None (rule "uniform" only) stands for
    ``num_rows`` zeros. Raises ValueError for an unknown rule, invalid
    values (naming the first offending entry), a fraction outside [0, 1],
    wrong shapes or mixed devices, TypeError for wrong dtypes, a non-integer
    seed or a non-numeric fraction.
    """
    if rule not in RULES:
        raise ValueError(
            "select_rows: rule must be one of 'topk', 'sample', 'uniform', 'hybrid', "
            f"got {rule!r}"
        )
    seed64 = _seed_bits(seed)
    fraction = _check_fraction(hybrid_fraction)
    if metric is None:
        if rule != "uniform" or num_rows is None:
            raise ValueError("select_rows: metric may be None only for rule 'uniform', with "
                             "num_rows given")
        # The rule never reads it; zeros are valid input for every backend's checks.
        metric = torch.zeros(num_rows, dtype=torch.float32, device=cell_offsets.device)
    metric = metric.detach()
    fake = is_fake(metric)
    chosen = resolve_backend(backend, metric.device, fake=fake)
    if chosen == "torch":
        _check_args(metric, cell_offsets, quotas)
        if needs_value_check(metric.device):
            _check_values(metric, cell_offsets, quotas)
        result = select_rows_reference(
            metric, cell_offsets, quotas, rule, seed64, hybrid_fraction=fraction
        )
        if n_kept is not None and result[0].numel() != n_kept:
            raise ValueError(f"select_rows: n_kept = {n_kept} but the quotas keep "
                             f"{result[0].numel()} rows")
        return result
    return registered_ops().select_rows(
        metric.contiguous(), cell_offsets.contiguous(), quotas.contiguous(), rule, seed64,
        fraction, -1 if n_kept is None else int(n_kept), debug_checks() and not fake,
    )
