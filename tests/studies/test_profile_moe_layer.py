"""benchmarks/profile_moe_layer.py's bookkeeping (lrmoe_studies.moe_layer_profile)
on hand-made calls: ms per step of each part, the achieved expert rate, and what the
calibration's GEMM tables give for the recorded rows (the timers themselves run only
inside a training run)."""

from __future__ import annotations

import pytest

from lrmoe_studies import moe_layer_profile as prof
from megatron_lrmoe.planning.machine import MachineConstants

# One instance's forward GEMMs: 2 rows in 2 us, 8 rows in 4 us (48 FLOP per row), so
# t(n) = 2 + (n - 2) / 3 us between them.
MACHINE = MachineConstants(
    gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e8, source="test", gemm_rows=(2, 8),
    gemm_forward_flops_per_s=(48e6, 96e6), gemm_backward_flops_per_s=(96e6, 128e6))


def test_table_gemm_seconds_each_and_even_by_hand():
    each, even = prof.table_gemm_seconds([[6, 0], [3, 7]], MACHINE, 48.0, forward=True)
    # Each: t(6) + 0 + t(3) + t(7) = 10/3 + 7/3 + 11/3 us; even: 2 t(3) + 2 t(5).
    assert each == pytest.approx(28 / 3 * 1e-6, rel=1e-12)
    assert even == pytest.approx((14 / 3 + 6) * 1e-6, rel=1e-12)
    assert prof.table_gemm_seconds([[0, 0]], MACHINE, 48.0, forward=True) == (0.0, 0.0)


def _call(total: float, experts: float, first: float, other: float, rows: list[int]) -> dict:
    call = prof.new_call(1)
    call.update({"fwd_total_s": total, "fwd_experts_s": experts, "fwd_instance_rows": [rows],
                 "fwd_first_collective_s": first, "fwd_other_collectives_s": other,
                 "bwd_total_s": 2 * total})
    return call


def test_summarise_per_step_after_skip():
    # 3 steps of 2 calls on one rank; the first step is skipped.
    calls = [_call(9.0, 9.0, 9.0, 0.0, [1]), _call(9.0, 9.0, 9.0, 0.0, [1]),
             _call(0.010, 0.006, 0.001, 0.002, [6, 0]), _call(0.020, 0.008, 0.002, 0.003, [3, 7]),
             _call(0.030, 0.010, 0.001, 0.001, [8, 8]), _call(0.040, 0.012, 0.002, 0.002, [2, 2])]
    [row] = prof.summarise([calls], steps=3, skip=1, flops_per_row=48.0, phase="fwd",
                           machine=MACHINE)
    assert row["calls_per_step"] == 2
    assert row["total"] == pytest.approx(1e3 * 0.100 / 2)
    assert row["experts"] == pytest.approx(1e3 * 0.036 / 2)
    assert row["arrival_wait"] == pytest.approx(1e3 * 0.006 / 2)
    assert row["other_collectives"] == pytest.approx(1e3 * 0.008 / 2)
    assert row["rest"] == pytest.approx(1e3 * (0.100 - 0.036 - 0.006 - 0.008) / 2)
    assert row["rows_per_step"] == pytest.approx(36 / 2)
    assert row["expert_gflops"] == pytest.approx(48.0 * 36 / 0.036 / 1e9)
    assert row["median_call_ms"] == pytest.approx(25.0)
    each, even = prof.table_gemm_seconds([[6, 0], [3, 7], [8, 8], [2, 2]], MACHINE, 48.0, True)
    assert row["table_each"] == pytest.approx(1e3 * each / 2)
    assert row["table_even"] == pytest.approx(1e3 * even / 2)
    # A call whose backward never closed (a broken mark) is an error, not a zero.
    calls[-1]["bwd_total_s"] = None
    with pytest.raises(RuntimeError, match="bwd span"):
        prof.summarise([calls], steps=3, skip=1, flops_per_row=96.0, phase="bwd")
    with pytest.raises(RuntimeError, match="training calls"):
        prof.summarise([calls[:5]], steps=3, skip=1, flops_per_row=48.0, phase="fwd")
