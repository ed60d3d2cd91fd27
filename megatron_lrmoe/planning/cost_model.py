"""The planner's cost model: memory (bytes) and time (seconds) of one LRMoE layer on one
rank, specified in docs/design.md, "Cost model" (notation in "Notation").

Pure: a model shape (``shapes.MoEShape``) and measured machine constants
(``machine.MachineConstants``) in, bytes and seconds out. No timing constant lives here:
GEMM rate, memory rate and all-to-all bandwidth come from a calibration file
(``python -m megatron_lrmoe.tools.calibrate``) or, without one, from
``machine.default_machine_constants``, which measures quickly. The memory half is
``layer_memory.LayerMemory``, the time half ``layer_time.LayerTime``; Megatron's own
layer is modelled in ``megatron_baseline``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lrmoe.planning.layer_memory import LayerMemory
from megatron_lrmoe.planning.layer_time import LayerTime
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.shapes import MoEShape

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel(LayerMemory, LayerTime):
    """Memory (bytes) and time (seconds) of one MoE layer, per rank; see the module doc."""

    shape: MoEShape
    machine: MachineConstants
