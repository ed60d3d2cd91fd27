"""GPU clusters the simulator prices the MoE layers on: one node type's vendor figures and
assumed efficiencies (``ClusterSpec``, ``CLUSTERS``), and the cost model's machine
constants for one rank of an EP group on it (``cluster_machine_constants``). Pure: no
torch, no file. docs/simulate.md says where each figure comes from."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_lrmoe.planning.machine import MachineConstants

__all__ = ["CLUSTERS", "ClusterSpec", "cluster_machine_constants"]


@dataclass(frozen=True)
class ClusterSpec:
    """One node type of a GPU cluster: vendor peak figures and achieved-over-peak
    efficiencies (the efficiencies are assumptions; a calibration file overrides any
    field, or the derived ``MachineConstants`` directly)."""

    name: str
    gpu: str
    peak_flops: float
    """Dense bf16 peak FLOP/s of one GPU."""
    memory_gib: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU inside a node, one direction: half the datasheet's
    bidirectional total (an all-to-all's rank sends and receives at once)."""
    network_bytes_per_s: float
    """InfiniBand bandwidth per GPU between nodes, one direction (one NIC per GPU)."""
    gpus_per_node: int = 8
    gemm_efficiency: float = 0.6
    """Achieved over peak for the grouped expert GEMMs (assumption: an 8192^3 bf16 GEMM
    reached ~0.80 of peak on one H200; expert GEMMs of a few thousand rows by 2048 x
    768 are smaller and grouped, so less)."""
    nvlink_efficiency: float = 0.7
    """Achieved over peak of an all-to-all inside a node (assumption)."""
    network_efficiency: float = 0.8
    """Achieved over peak of an all-to-all between nodes (assumption)."""
    nvlink_latency_s: float = 15e-6
    """Fixed cost of one all-to-all call inside a node (assumption)."""
    network_latency_s: float = 30e-6
    """Fixed cost of one all-to-all call that crosses nodes (assumption)."""
    memory_efficiency: float = 0.7
    """Achieved over the HBM peak for the memory-bound row work (gathers, reorders,
    combine, activation): assumption; a plain device copy reached ~0.9 (4.3 of 4.8 TB/s)
    on one H200, indexed gathers and small elementwise kernels reach less."""
    layer_forward_fixed_s: float = 200e-6
    """Fixed cost of a layer's forward besides the all-to-all latencies (assumption: the
    one host read of the routed counts drains the device, then ~40 kernel launches of
    ~5 us each run ahead of little device work)."""
    layer_backward_fixed_s: float = 100e-6
    """Fixed cost of a layer's backward besides the all-to-all latencies (assumption:
    ~20 kernel launches not hidden behind device work; no host read)."""


# Datasheet figures (NVIDIA H100 Tensor Core GPU datasheet, SXM column; H200 datasheet,
# SXM column; A100 datasheet, 40 GB SXM column; DGX H100/H200 and DGX A100 user guides
# for the compute fabric):
# - peak_flops: dense BF16 Tensor Core (the datasheets' 1,979 / 624 TFLOPS are with
#   sparsity): H100/H200 SXM 989 TFLOPS, A100 312 TFLOPS.
# - hbm_bytes_per_s: H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 40 GB 1,555 GB/s (1.6e12).
# - nvlink_bytes_per_s: the datasheets give the bidirectional total per GPU, H100/H200
#   900 GB/s (18 NVLink 4 links x 25 GB/s each way), A100 600 GB/s (12 NVLink 3 links x
#   25 GB/s each way); one direction is half (the totals taken as one
#   direction would price NVLink bytes at twice the rate).
# - network_bytes_per_s: one ConnectX-7 400 Gb/s NDR port per GPU on DGX H100/H200,
#   one ConnectX-6 200 Gb/s HDR port per GPU on DGX A100; Gb/s per direction / 8.
CLUSTERS: dict[str, ClusterSpec] = {
    "h100": ClusterSpec("h100", "8 x H100 SXM 80 GB", peak_flops=989e12, memory_gib=80,
                        hbm_bytes_per_s=3.35e12, nvlink_bytes_per_s=900e9 / 2,
                        network_bytes_per_s=400e9 / 8),
    "h200": ClusterSpec("h200", "8 x H200 141 GB", peak_flops=989e12, memory_gib=141,
                        hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=900e9 / 2,
                        network_bytes_per_s=400e9 / 8),
    "a100-40": ClusterSpec("a100-40", "8 x A100 40 GB SXM", peak_flops=312e12,
                           memory_gib=40, hbm_bytes_per_s=1.6e12,
                           nvlink_bytes_per_s=600e9 / 2, network_bytes_per_s=200e9 / 8),
}


def cluster_machine_constants(cluster: ClusterSpec, ep_size: int,
                      calibration: dict | None = None) -> MachineConstants:
    """The cost model's constants for one rank of an EP group of ``ep_size`` GPUs.

    GEMM rate: peak x efficiency. All-to-all: with traffic spread evenly over the other
    ranks, a share (g - 1) / (R - 1) of a rank's bytes stays inside its node of g GPUs
    (NVLink) and the rest crosses the network; both links carry their share at once,
    so one byte costs max(intra share / NVLink rate, inter share / network rate). The
    latency is the network's once the group spans nodes. ``calibration``: fields of
    ``ClusterSpec`` to replace, and/or ``MachineConstants`` fields that replace the
    derived values.
    """
    calibration = dict(calibration or {})
    calibration.pop("details", None)          # a calibration file's measurement settings
    calibrated_by = calibration.pop("source", "")
    cluster_fields = {k: calibration.pop(k) for k in list(calibration)
                      if k in ClusterSpec.__dataclass_fields__}
    c = replace(cluster, **cluster_fields)
    gemm = c.peak_flops * c.gemm_efficiency
    if ep_size <= 1:
        bandwidth, latency = math.inf, 0.0
    else:
        in_node = min(ep_size, c.gpus_per_node)
        intra = (in_node - 1) / (ep_size - 1)
        per_byte = max(intra / (c.nvlink_bytes_per_s * c.nvlink_efficiency),
                       (1 - intra) / (c.network_bytes_per_s * c.network_efficiency))
        bandwidth = 1.0 / per_byte
        latency = c.nvlink_latency_s if ep_size <= c.gpus_per_node else c.network_latency_s
    machine = MachineConstants(gemm_flops_per_s=gemm, alltoall_bytes_per_s=bandwidth,
                               alltoall_latency_s=latency,
                               source=f"{c.gpu}, EP={ep_size}: derived (docs/simulate.md)",
                               memory_bytes_per_s=c.hbm_bytes_per_s * c.memory_efficiency,
                               layer_forward_fixed_s=c.layer_forward_fixed_s,
                               layer_backward_fixed_s=c.layer_backward_fixed_s)
    unknown = set(calibration) - set(MachineConstants.__dataclass_fields__)
    if unknown:
        raise ValueError(f"--calibration: unknown field(s) {sorted(unknown)}; use fields of "
                         f"ClusterSpec or MachineConstants")
    if calibration:
        machine = replace(machine, **calibration,
                          source=f"{machine.source}; overridden by the calibration file"
                          + (f" ({calibrated_by})" if calibrated_by else ""))
    return machine
