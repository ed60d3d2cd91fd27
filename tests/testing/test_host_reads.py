"""No host reads of device data in the LRMoE region (docs/design.md, "Region", "Host reads").

A GPU stalls the CPU on every device-to-host read; the region is written to make none
but the counts exchange, once per layer forward. On this CPU-only machine
``lrmoe_testing.host_reads.HostReadDetector`` finds such reads by data flow
(what would be device data on a GPU, and which ops would read it on the host); these
tests check the detector itself, then run one training step of an EP=2 model under it.
The compiled kernels are opaque to it: scripts/gpu_check.sh runs the region under
``torch.cuda.set_sync_debug_mode("error")`` on a GPU for those.
"""

from __future__ import annotations

import pytest
import torch

from lrmoe_testing.host_reads import HostReadDetector
from tests.launcher.test_launcher import TINY


def test_detector_sees_every_kind_of_read_of_device_data_only():
    weight = torch.nn.Parameter(torch.randn(6))
    host = torch.tensor([1, 2, 3])
    with HostReadDetector() as det:
        det.taint(weight)
        t = weight.detach() * 2                       # derived: device data
        counts = t.abs().long() + 1
        t.tolist()
        int(t.sum())
        t.nonzero()
        t[t > 0]
        torch.repeat_interleave(counts, counts)        # output size read from the device
        torch.bincount(counts)
        t.cpu()
        t[0].item()                                    # counted once (not again as the
        assert len(det.reads) == 8, [r.op for r in det.reads]  # _local_scalar_dense behind it)
        det.clear()
        # Not reads: host data, the result of a read, sizes given by the host.
        host.tolist()
        int(host.sum())
        moved = t.cpu()
        det.clear()
        moved.tolist()
        ones = (t * 0).long() + 1                      # device data, sum known: 6
        torch.repeat_interleave(counts, ones, output_size=int(host.sum()))
        torch.nonzero_static(t > 0, size=2)
        assert det.reads == [], [r.op for r in det.reads]
        # Gradients the autograd engine computes are device data.
        (weight * weight).sum().backward()
        weight.grad.tolist()
        assert [r.op for r in det.reads] == ["tolist"]


def _one_step_under_detector(argv: list[str]) -> dict:
    """One training step of the launcher under the detector; the LRMoE layers' inputs
    and weights are the sources (output gradients come from the autograd engine)."""
    from megatron_lrmoe.integration.runtime.cpu import enable_cpu_runtime
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train
    from megatron_lrmoe.layer import counts_exchange, region
    from megatron_lrmoe.layer import moe_layer as layer
    from megatron_lrmoe.layer.moe_layer import LRMoELayer

    enable_cpu_runtime()  # its process-wide mode goes below the detector's
    det = HostReadDetector()
    forwards = []

    def taint_layer(module, args):
        if isinstance(module, LRMoELayer):
            det.taint(*args, *module.parameters())
            forwards.append(module.layer_number)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(taint_layer)
    try:
        with det:
            train(parse_args(argv))
    finally:
        handle.remove()
    forward = [r for r in det.reads if r.inside(layer.__file__, "routed_output")]
    backward = [r for r in det.reads if r.inside(region.__file__, "backward")]
    return {
        "forwards": len(forwards),
        "forward": [(r.op, r.where()) for r in forward],
        "counts_exchange": sum(r.inside(counts_exchange.__file__, "gather_counts")
                               for r in forward),
        "backward": [(r.op, r.where()) for r in backward],
        "all": len(det.reads),
    }


# two-stage's region (its stored set drawn in forward, the rest in backward) is held to
# the same on fake CUDA: tests/layer/test_region_fake_cuda.py.
@pytest.mark.parametrize("selection", ["uniform", "topk"])
def test_training_step_reads_nothing_in_the_region_but_the_counts(gloo2, corpus, selection):
    argv = TINY + ["--data-path", corpus, "--train-iters", "1", "--lr-warmup-iters", "0",
                   "--expert-model-parallel-size",
                   "2", "--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75",
                   "--moe-lrmoe-selection", selection, "--log-interval", "1"]
    for rank, r in enumerate(gloo2.run(_one_step_under_detector, argv, timeout=300)):
        assert r["forwards"] == 2, r  # two MoE layers, one micro-batch
        assert r["backward"] == [], (rank, r["backward"])
        # Forward: exactly the documented read, the counts exchange, once per layer call.
        assert r["counts_exchange"] == r["forwards"], (rank, r["forward"])
        assert len(r["forward"]) == r["forwards"], (rank, r["forward"])
        # The detector saw device data at all (Megatron's own loss reporting reads it).
        assert r["all"] > len(r["forward"]), r
