"""The machine constants (``planning/machine.py``): the calibration file's round trip, its
errors, and the quick measurement without one."""

from __future__ import annotations

import pytest

from megatron_lrmoe.planning.machine import MachineConstants, default_machine_constants
from tests.planning.test_layer_memory import MACHINE


def test_machine_constants_json_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    MACHINE.to_json(path, details={"note": "x"})
    assert MachineConstants.from_json(path) == MACHINE
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]     # no temporary left


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ('{"alltoall_bytes_per_s": 1.0}', "gemm_flops_per_s"),
    ('{"gemm_flops_per_s": -1, "alltoall_bytes_per_s": 1.0}', "gemm_flops_per_s"),
    ('{"gemm_flops_per_s": 1, "alltoall_bytes_per_s": "fast"}', "alltoall_bytes_per_s"),
    ('{"gemm_flops_per_s": 1, "alltoall_bytes_per_s": 1, "alltoall_latency": 0}',
     "alltoall_latency"),
    ("[1, 2]", "JSON object"),
])
def test_bad_calibration_file_names_file_and_key(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle) as info:
        MachineConstants.from_json(path)
    assert str(path) in str(info.value)


def test_default_machine_constants_measure_and_say_so():
    constants = default_machine_constants("cpu")
    assert constants.gemm_flops_per_s > 0 and constants.alltoall_bytes_per_s > 0
    assert "default_machine_constants" in constants.source
    assert "no calibration file" in constants.source
