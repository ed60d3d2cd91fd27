"""The selection rules "uniform" and "hybrid" of select_rows (docs/design.md, "Selection rules").

Oracles: ``brute_select`` of tests/ops/test_compaction_kernels.py (per cell in
plain Python from the documented recipe, with its own splitmix64; every CPU
backend must equal it bitwise), the same file's ``brute_keys`` (for the
keys themselves), a naive top-k and plain statistics (uniformity and
unbiasedness over many independent cells; every draw is a pure function of
(seed, cell, row), so these tests are deterministic and their bounds are
checked once, not flaky).

The generic layouts (empty cells, q = 0, q >= n, large cells, strided input,
the compact/scatter round trip) run for every rule in
tests/ops/test_compaction_kernels.py; this file covers what is specific to the
two rules and to ``hybrid_fraction``.
"""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_lrmoe.ops import select_rows
from megatron_lrmoe.ops.select import row_key, row_keys
from tests.ops.test_compaction_kernels import MASK64, brute_keys, brute_select, f32, offsets_of

CPU_BACKENDS = ["cpu", "torch"]
FRACTIONS = [0.0, 0.1, 0.29, 0.5, 0.75, 1.0]


def assert_same(a, b) -> None:
    for name, x, y in zip(("kept_index", "scale", "kept_counts"), a, b, strict=True):
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def cells_of(result, off: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Per cell: (kept positions within the cell, their scales)."""
    kept, scale, counts = result
    out, at = [], 0
    for c, k in enumerate(counts.tolist()):
        rows = (kept[at : at + k] - off[c]).tolist()
        out.append((rows, scale[at : at + k].tolist()))
        at += k
    return out


def naive_top(metric: list[float], k: int) -> set[int]:
    """The k first positions of TopK order (metric descending, position ascending)."""
    return set(sorted(range(len(metric)), key=lambda i: (-metric[i], i))[:k])


# ---------------------------------------------------------------------------
# The keys
# ---------------------------------------------------------------------------


def test_row_keys_match_the_documented_generator():
    sizes = [3, 0, 17, 1]
    for seed in (0, 1, -1, 2**63 + 12345):
        expected = [k for c, n in enumerate(sizes) for k in brute_keys(seed, c, n)]
        keys = [k & MASK64 for k in row_keys(seed, offsets_of(sizes)).tolist()]
        assert keys == expected
        assert [row_key(seed, c, j) for c, n in enumerate(sizes) for j in range(n)] == expected
    assert row_key(-1, 2, 0) == row_key(2**64 - 1, 2, 0), "only seed mod 2^64 matters"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_uniform_keeps_the_smallest_keys(kernels, backend):
    """With q rows kept per cell, they are the q smallest row keys (unsigned),
    the keys computed by the test's own splitmix64."""
    n, q, cells, seed = 50, 3, 200, 2**64 - 99
    metric = torch.rand(n * cells)
    off = offsets_of([n] * cells)
    result = select_rows(metric, off, torch.full((cells,), q), "uniform", seed, backend)
    for c, (rows, scales) in enumerate(cells_of(result, off)):
        keys = brute_keys(seed, c, n)
        assert len(set(keys)) == n, "keys are distinct within a cell"
        assert rows == sorted(sorted(range(n), key=keys.__getitem__)[:q])
        assert scales == [f32(n / q)] * q


# ---------------------------------------------------------------------------
# Every CPU backend == brute force, bitwise, over fractions
# ---------------------------------------------------------------------------


@st.composite
def problems(draw):
    n_cells = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 60), min_size=n_cells, max_size=n_cells))
    quotas = [draw(st.integers(0, n + 2)) for n in sizes]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p = sum(sizes)
    kind = draw(st.sampled_from(["continuous", "ties", "zeros"]))
    if kind == "continuous":
        metric = torch.rand(p, generator=g)
    elif kind == "ties":
        metric = torch.randint(0, 3, (p,), generator=g).float()
    else:
        metric = torch.zeros(p)
    return metric, sizes, quotas


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    problem=problems(),
    rule=st.sampled_from(["uniform", "hybrid"]),
    fraction=st.one_of(st.sampled_from(FRACTIONS), st.floats(0.0, 1.0)),
    seed=st.integers(-(2**63), 2**64),
)
def test_backends_match_brute_force(kernels, problem, rule, fraction, seed):
    metric, sizes, quotas = problem
    off, q = offsets_of(sizes), torch.tensor(quotas, dtype=torch.int64)
    expected = brute_select(metric, sizes, quotas, rule, seed, fraction)
    for backend in CPU_BACKENDS:
        assert_same(select_rows(metric, off, q, rule, seed, backend, hybrid_fraction=fraction),
                    expected)
    kept, scale, counts = expected
    assert counts.tolist() == [min(a, b) for a, b in zip(quotas, sizes, strict=True)]
    assert bool((kept[1:] > kept[:-1]).all()), "grouped by cell, ascending inside a cell"
    assert bool((scale >= 1.0).all())


@pytest.mark.parametrize("rule", ["uniform", "hybrid"])
def test_large_cells_and_thread_count(kernels, rule):
    g = torch.Generator().manual_seed(3)
    sizes = [20000, 1, 0, 7000, 300]
    quotas = [4999, 1, 3, 6999, 0]
    metric = torch.exp(torch.randn(sum(sizes), generator=g) * 3)
    off, q = offsets_of(sizes), torch.tensor(quotas)
    expected = brute_select(metric, sizes, quotas, rule, 5, 0.3)
    assert_same(select_rows(metric, off, q, rule, 5, "torch", hybrid_fraction=0.3), expected)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            assert_same(select_rows(metric, off, q, rule, 5, "cpu", hybrid_fraction=0.3),
                        expected)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------
# Semantics
# ---------------------------------------------------------------------------


def _mixed_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sizes = [40, 0, 7, 100, 13, 5, 64]
    quotas = [10, 3, 7, 33, 0, 9, 63]
    metric = torch.randint(0, 6, (sum(sizes),), generator=g).float()  # ties
    return metric, sizes, quotas


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_hybrid_fraction_zero_is_uniform_and_one_is_topk(kernels, backend):
    metric, sizes, quotas = _mixed_problem()
    off, q = offsets_of(sizes), torch.tensor(quotas)
    for seed in (0, 1, 2**40):
        assert_same(select_rows(metric, off, q, "hybrid", seed, backend, hybrid_fraction=0.0),
                    select_rows(metric, off, q, "uniform", seed, backend))
        assert_same(select_rows(metric, off, q, "hybrid", seed, backend, hybrid_fraction=1.0),
                    select_rows(metric, off, q, "topk", seed, backend))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_hybrid_keeps_the_top_share_unscaled(kernels, backend, fraction):
    metric, sizes, quotas = _mixed_problem(1)
    off = offsets_of(sizes)
    for seed in range(3):
        result = select_rows(metric, off, torch.tensor(quotas), "hybrid", seed, backend,
                             hybrid_fraction=fraction)
        for c, (rows, scales) in enumerate(cells_of(result, off)):
            n, k = sizes[c], min(quotas[c], sizes[c])
            assert len(rows) == k
            if k == n:
                assert scales == [1.0] * n
                continue
            q_top = math.floor(fraction * k)
            top = naive_top(metric[off[c] : off[c + 1]].tolist(), q_top)
            assert top <= set(rows), "the top floor(f * q) rows are always kept"
            scale_of = dict(zip(rows, scales, strict=True))
            assert all(scale_of[i] == 1.0 for i in top)
            rest = [scale_of[i] for i in rows if i not in top]
            if rest:
                assert rest == [float(torch.tensor((n - q_top) / (k - q_top)).float())] * len(rest)


def test_hybrid_top_count_is_the_floor_of_the_double_product(kernels):
    # 0.29 * 100 = 28.999999999999996 in double: 28 top rows, not 29.
    assert 0.29 * 100 < 29
    n, q = 1000, 100
    metric = torch.arange(n, dtype=torch.float32)  # distinct: top rows are n-1, n-2, ...
    for backend in CPU_BACKENDS:
        kept, scale, _ = select_rows(metric, offsets_of([n]), torch.tensor([q]), "hybrid", 4,
                                     backend, hybrid_fraction=0.29)
        assert int((scale == 1.0).sum()) == 28
        assert set(range(n - 28, n)) <= set(kept.tolist())
        assert bool((scale[scale != 1.0] == float(torch.tensor(972 / 72).float())).all())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_uniform_ignores_the_metric_and_follows_the_seed(kernels, backend):
    metric, sizes, quotas = _mixed_problem(2)
    off, q = offsets_of(sizes), torch.tensor(quotas)
    a = select_rows(metric, off, q, "uniform", 17, backend)
    assert_same(a, select_rows(torch.rand(metric.numel()), off, q, "uniform", 17, backend))
    assert_same(a, select_rows(metric, off, q, "uniform", 17, backend))
    assert not torch.equal(a[0], select_rows(metric, off, q, "uniform", 18, backend)[0])
    # The fraction is validated for every rule but only "hybrid" uses it.
    assert_same(a, select_rows(metric, off, q, "uniform", 17, backend, hybrid_fraction=0.9))


def test_uniform_draws_every_subset_equally_often(kernels):
    """n = 6, q = 2 over 30,000 independent cells (150 seeds x 200 cells): each
    of the 15 subsets and each row's inclusion (1/3) at their expected rates."""
    n, q, cells = 6, 2, 200
    metric = torch.rand(n * cells)
    off = offsets_of([n] * cells)
    subsets = {s: 0 for s in combinations(range(n), q)}
    for seed in range(150):
        kept, scale, _ = select_rows(metric, off, torch.full((cells,), q), "uniform", seed)
        assert bool((scale == 3.0).all())
        rows = (kept - torch.repeat_interleave(off[:-1], q)).view(cells, q)
        for pair in rows.tolist():
            subsets[tuple(pair)] += 1
    draws = 150 * cells
    expected = draws / len(subsets)
    chi2 = sum((count - expected) ** 2 / expected for count in subsets.values())
    # 14 degrees of freedom: P(chi2 > 50) ~ 1e-5 for a uniform draw.
    assert chi2 < 50, (chi2, subsets)
    freq = [sum(c for s, c in subsets.items() if i in s) / draws for i in range(n)]
    se = math.sqrt((1 / 3) * (2 / 3) / draws)
    assert all(abs(f - 1 / 3) < 5 * se for f in freq), freq


@pytest.mark.parametrize("rule,fraction", [("uniform", 0.5), ("hybrid", 0.5), ("hybrid", 0.25)])
def test_estimate_of_the_cell_sum_is_unbiased(kernels, rule, fraction):
    """Mean over 20,000 cells of sum over kept rows of x * scale -> sum of x."""
    g = torch.Generator().manual_seed(9)
    n, q, cells = 12, 5, 10000
    metric = torch.exp(torch.randn(n, generator=g))
    x = metric * 2 + torch.randn(n, generator=g)  # correlated with the metric: hybrid's case
    x64 = x.double()
    off = offsets_of([n] * cells)
    estimates = []
    for seed in (0, 1):
        kept, scale, _ = select_rows(metric.repeat(cells), off, torch.full((cells,), q), rule,
                                     seed, hybrid_fraction=fraction)
        contrib = x64.repeat(cells)[kept] * scale.double()
        cell = torch.div(kept, n, rounding_mode="floor")
        estimates.append(torch.zeros(cells, dtype=torch.float64).index_add(0, cell, contrib))
    est = torch.cat(estimates)
    mean, se = float(est.mean()), float(est.std()) / math.sqrt(est.numel())
    assert abs(mean - float(x64.sum())) < 5 * se, (mean, float(x64.sum()), se)
    if rule == "hybrid":  # the top rows are not random: less spread than uniform
        kept, _, _ = select_rows(metric.repeat(cells), off, torch.full((cells,), q), "uniform",
                                 0)
        u_contrib = x64.repeat(cells)[kept] * (n / q)
        u_est = torch.zeros(cells, dtype=torch.float64).index_add(
            0, torch.div(kept, n, rounding_mode="floor"), u_contrib)
        assert float(est.std()) < float(u_est.std())


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_bad_fraction_raises(kernels, backend, bad):
    m, off, q = torch.rand(4), offsets_of([4]), torch.tensor([2])
    with pytest.raises(ValueError, match=r"select_rows: hybrid_fraction must be in \[0, 1\]"):
        select_rows(m, off, q, "hybrid", backend=backend, hybrid_fraction=bad)
    with pytest.raises(ValueError, match="hybrid_fraction"):
        select_rows(m, off, q, "topk", backend=backend, hybrid_fraction=bad)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fraction_must_be_a_number_and_a_keyword(kernels, backend):
    m, off, q = torch.rand(4), offsets_of([4]), torch.tensor([2])
    with pytest.raises(TypeError, match="hybrid_fraction must be a float"):
        select_rows(m, off, q, "hybrid", backend=backend, hybrid_fraction="0.5")
    with pytest.raises(TypeError):
        select_rows(m, off, q, "hybrid", 0, backend, 0.5)  # keyword only
    assert_same(select_rows(m, off, q, "hybrid", 3, backend, hybrid_fraction=1),
                select_rows(m, off, q, "topk", 3, backend))


def test_binding_refuses_a_bad_fraction(kernels):
    m, off, q = torch.rand(4), offsets_of([4]), torch.tensor([2])
    with pytest.raises(ValueError, match=r"hybrid_fraction must be in \[0, 1\]"):
        kernels.select_rows(m, off, q, "hybrid", 0, 1.01)
    with pytest.raises(ValueError, match="rule must be one of"):
        kernels.select_rows(m, off, q, "random", 0, 0.5)
