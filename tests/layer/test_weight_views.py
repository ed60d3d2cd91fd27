"""Grouped GEMMs read the experts' weights without copying them.

``stacked_view`` against ``torch.stack`` (the copy it replaces) on every layout it meets;
the layer's grouped results against the same layer with the weights stacked per call,
as built, under Megatron's DistributedDataParallel with and without the distributed
optimizer's parameter buffer, through an optimizer step and a dist_checkpointing save
and load; and, on fake CUDA at Qwen3-30B-A3B's shape, the weight bytes one layer call
copies (a dispatch mode recording every copy op that reads a weight's storage).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lrmoe.layer.expert_gemms import stacked_view, weight_stack

ROOT = Path(__file__).resolve().parents[2]


def _buffer_views(buffer: torch.Tensor, starts: list[int], shape: tuple[int, ...]):
    numel = math.prod(shape)
    return [buffer[s:s + numel].view(shape) for s in starts]


def test_uniform_ascending_layout_is_a_view_equal_to_the_stack():
    buffer = torch.randn(4 * 80)
    weights = _buffer_views(buffer, [0, 80, 160, 240], (6, 8))
    view, descending = stacked_view(weights)
    assert not descending
    assert torch.equal(view, torch.stack(weights))
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    buffer.add_(1.0)            # a view: it sees the weights' later values
    assert torch.equal(view, torch.stack(weights))


def test_descending_layout_is_a_view_of_the_weights_last_first():
    """Megatron's distributed optimizer lays its buffer out last parameter first."""
    buffer = torch.randn(3 * 64)
    weights = _buffer_views(buffer, [128, 64, 0], (4, 8))
    view, descending = stacked_view(weights)
    assert descending
    assert torch.equal(view, torch.stack(weights[::-1]))
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout,reason", [
    ("separate", "separate storages"),
    ("uneven", "uneven spacing"),
    ("overlap", "overlap"),
    ("misaligned", "16-byte aligned"),
    ("transposed", "not contiguous"),
])
def test_layouts_without_a_view_say_why(layout, reason):
    shape = (4, 8)
    if layout == "separate":
        weights = [torch.randn(shape) for _ in range(3)]
    elif layout == "transposed":
        weights = [w.t() for w in _buffer_views(torch.randn(96), [0, 32, 64], (8, 4))]
    else:
        starts = {"uneven": [0, 32, 96], "overlap": [0, 16, 32], "misaligned": [2, 34, 66]}
        weights = _buffer_views(torch.randn(200), starts[layout], shape)
    got = stacked_view(weights)
    assert isinstance(got, str) and reason in got, got


def test_projections_in_opposite_orders_have_no_stack():
    buffer = torch.randn(256)
    w1 = _buffer_views(buffer, [0, 32], (4, 8))
    w2 = _buffer_views(buffer, [128, 96], (4, 8))
    assert weight_stack(w1, w2) == "W1 and W2 lie in opposite orders"


def test_a_grouped_mm_that_ignores_the_batch_stride_fails_the_views_probe(monkeypatch):
    """The views go to grouped_mm only where it reads them as it reads a stack."""
    from megatron_lrmoe.layer import expert_gemms

    real = expert_gemms._GROUPED_MM
    assert expert_gemms._probe_views.__wrapped__(torch.device("cpu"), torch.float32) is None

    def dense_batches(a, b, offs=None):      # reads b as if its batches were adjacent
        if b.dim() == 3:
            b = torch.as_strided(b, b.shape, (b[0].numel(), *b.stride()[1:]),
                                 b.storage_offset())
        return real(a, b, offs=offs)

    monkeypatch.setattr(expert_gemms, "_GROUPED_MM", dense_batches)
    why = expert_gemms._probe_views.__wrapped__(torch.device("cpu"), torch.float32)
    assert why is not None and "misreads strided weights" in why


def _one_buffer_after_conversion() -> dict:
    from tests.layer.test_lrmoe_layer import _build

    _, lrmoe = _build(1, math.inf)
    experts = lrmoe.experts
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    built = experts.weight_stack()
    experts.to(torch.float64)      # converts parameter by parameter; _apply shares again
    after = experts.weight_stack()
    w = experts.local_experts[0].linear_fc1.weight
    return {"built": not isinstance(built, str), "converted": not isinstance(after, str),
            "dtype": str(after.w1.dtype) if not isinstance(after, str) else after,
            "values": all(torch.equal(p.float(), before[n])
                          for n, p in experts.named_parameters()),
            "is_parameter": isinstance(w, torch.nn.Parameter) and w.requires_grad}


def test_dtype_conversion_keeps_one_buffer(gloo1):
    (got,) = gloo1.run(_one_buffer_after_conversion)
    assert got == {"built": True, "converted": True, "dtype": "torch.float64",
                   "values": True, "is_parameter": True}


# -----------------------------------------------------------------------------
# The layer under Megatron's DDP, optimizer and dist_checkpointing (gloo, 2 ranks)
# -----------------------------------------------------------------------------

RTOL, ATOL = 1e-5, 1e-6


def _stacked_twin(lrmoe, twin):
    """``twin`` (a layer of the same config) with ``lrmoe``'s weights, each expert weight
    in a storage of its own: its grouped GEMMs stack them per call (the reference)."""
    twin.load_state_dict(lrmoe.state_dict())
    for expert in twin.experts.local_experts:
        for linear in (expert.linear_fc1, expert.linear_fc2):
            linear.weight.data = linear.weight.data.clone()
    return twin


def _expert_grads(layer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in layer.named_parameters():
        if ".local_experts." in name:
            grad = getattr(p, "main_grad", None)
            out[name] = (grad if grad is not None else p.grad).detach().clone()
    return out


def _call(layer, x, dy, ddp=None):
    if ddp is not None:
        ddp.zero_grad_buffer()
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(dy)
    return out.detach(), x.grad.clone(), _expert_grads(layer), layer.lrmoe_stats.calls[-1]


def _agree(layer, twin, x, dy, ddp) -> dict:
    """The layer (zero-copy views) and its stacked twin on the same input."""
    out, dx, grads, stats = _call(layer, x, dy, ddp)
    out_t, dx_t, grads_t, stats_t = _call(twin, x, dy)
    return {"grouped": stats.grouped_gemm and stats_t.grouped_gemm,
            "dropped": 0 < stats.retained_pairs < stats.routed_pairs,
            "copied": stats.weight_bytes_copied, "twin-copied": stats_t.weight_bytes_copied,
            "forward": torch.allclose(out, out_t, rtol=RTOL, atol=ATOL),
            "dx": torch.allclose(dx, dx_t, rtol=RTOL, atol=ATOL),
            "grads": sorted(grads) == sorted(grads_t) and all(
                torch.allclose(grads[n], grads_t[n], rtol=RTOL, atol=ATOL) for n in grads)}


def _views_under_ddp(distributed_optimizer: bool, metric: str, ckpt_dir: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec
    from tests.layer.test_lrmoe_layer import EXPERTS, _build, _inputs

    # topk drops deterministically (the twin's calls draw nothing of their own); the
    # metric "prob" draws the retained set in forward, "grad_act" in backward.
    _, lrmoe = _build(2, 0.6, selection="topk", aux=0.0, metric=metric)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp
    layer = to_lrmoe_spec(spec)(config=lrmoe.config)
    setup_lrmoe_layers([layer], None, 1)
    lrmoe.grouped_gemm = layer.grouped_gemm = True
    result = {"built": lrmoe.experts.weight_stack().reversed}
    ddp = DistributedDataParallel(
        config=lrmoe.config, module=lrmoe, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=distributed_optimizer))
    stack = lrmoe.experts.weight_stack()
    result["wrapped"] = stack if isinstance(stack, str) else stack.reversed
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed_optimizer,
                        params_dtype=torch.float32), [ddp])
    x, dy = _inputs(14)
    result["wrap"] = _agree(lrmoe, _stacked_twin(lrmoe, layer), x, dy, ddp)

    # An optimizer step writes the weights in place (through the buffers under the
    # distributed optimizer): the views read the new values.
    _call(lrmoe, x, dy, ddp)
    ddp.finish_grad_sync()
    updated, _, _ = optimizer.step()
    result["stepped"] = bool(updated)
    result["step"] = _agree(lrmoe, _stacked_twin(lrmoe, layer), x, dy, ddp)

    # dist_checkpointing: save, scramble the weights, load; the views read what loaded.
    saved = {n: p.detach().clone() for n, p in lrmoe.named_parameters()}
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(lrmoe.sharded_state_dict(), ckpt_dir)
    with torch.no_grad():
        for p in lrmoe.parameters():
            p.mul_(-3.0)
    lrmoe.load_state_dict(dist_checkpointing.load(lrmoe.sharded_state_dict(), ckpt_dir))
    result["loaded"] = all(torch.equal(p, saved[n]) for n, p in lrmoe.named_parameters())
    result["load"] = _agree(lrmoe, _stacked_twin(lrmoe, layer), x, dy, ddp)
    return result


@pytest.mark.parametrize("metric", ["grad_act", "prob"])
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
def test_grouped_views_survive_ddp_optimizer_and_checkpoint(gloo2, tmp_path,
                                                            distributed_optimizer, metric):
    for rank, r in enumerate(gloo2.run(_views_under_ddp, distributed_optimizer, metric,
                                       str(tmp_path / "ckpt"), timeout=300)):
        # Built: one buffer per layer, experts ascending. Plain DDP keeps it; the
        # distributed optimizer moves the weights into its buffer, last one first.
        assert r["built"] is False, (rank, r)
        assert r["wrapped"] is distributed_optimizer, (rank, r)
        assert r["stepped"] and r["loaded"], (rank, r)
        for stage in ("wrap", "step", "load"):
            got = r[stage]
            assert got["grouped"], (rank, stage, got)
            assert got["copied"] == 0 and got["twin-copied"] > 0, (rank, stage, got)
            assert got["forward"] and got["dx"] and got["grads"], (rank, stage, got)
            assert got["dropped"], (rank, stage, got)


def _descending_without_ddp(ep: int, metric: str) -> dict:
    """The weights moved, without DDP, into one buffer last expert first (the distributed
    optimizer's order), so the region's own weight gradients (autograd's ``.grad``, no
    ``main_grad`` to take them early) come back from GEMMs run in that order. On one rank
    the rows reach the experts without a reorder (reversed by a copy of the rows)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec
    from tests.layer.test_lrmoe_layer import EXPERTS, _build, _inputs

    _, lrmoe = _build(ep, 0.6 if ep > 1 else 0.5, selection="topk", aux=0.0, metric=metric)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp
    layer = to_lrmoe_spec(spec)(config=lrmoe.config)
    setup_lrmoe_layers([layer], None, 1)
    lrmoe.grouped_gemm = layer.grouped_gemm = True
    weights = [w for e in lrmoe.experts.local_experts[::-1]
               for w in (e.linear_fc2.weight, e.linear_fc1.weight)]
    buffer = torch.empty(sum(w.numel() for w in weights))
    start = 0
    for w in weights:
        view = buffer[start:start + w.numel()].view(w.shape)
        view.copy_(w.detach())
        w.data = view
        start += w.numel()
    stack = lrmoe.experts.weight_stack()
    x, dy = _inputs(14)
    return {"reversed": not isinstance(stack, str) and stack.reversed,
            **_agree(lrmoe, _stacked_twin(lrmoe, layer), x, dy, None)}


@pytest.mark.parametrize("metric", ["grad_act", "prob"])
@pytest.mark.parametrize("pool_name,ep", [("gloo1", 1), ("gloo2", 2)])
def test_descending_weights_without_ddp_equal_the_stacked_layer(request, pool_name, ep,
                                                                metric):
    pool = request.getfixturevalue(pool_name)
    for rank, got in enumerate(pool.run(_descending_without_ddp, ep, metric)):
        assert got["reversed"] and got["grouped"] and got["dropped"], (rank, got)
        assert got["copied"] == 0 and got["twin-copied"] > 0, (rank, got)
        assert got["forward"] and got["dx"] and got["grads"], (rank, got)


# -----------------------------------------------------------------------------
# Weight bytes copied per layer call, on fake CUDA at Qwen3-30B-A3B's shape (EP 8)
# -----------------------------------------------------------------------------

# 16 local experts x (W1 [1536, 2048] + W2 [2048, 768]) in bf16.
WEIGHT_BYTES = 16 * (1536 * 2048 + 2048 * 768) * 2
WRAPS = ("module", "ddp", "distopt", "separate")


@pytest.fixture(scope="module")
def copies() -> dict[str, dict]:
    out = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # One process per wrap (each its own fake group), started together: one thread each.
    runs = {wrap: subprocess.Popen(
        [sys.executable, "-m", "lrmoe_testing.cuda_harness", "weights", "3", wrap,
         "8:inf:uniform:0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for wrap in WRAPS}
    for wrap, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-6000:]
        (out[wrap],) = json.loads(stdout)
    return out


@pytest.mark.parametrize("wrap", WRAPS)
def test_weight_bytes_copied_per_layer_call(copies, wrap):
    record = copies[wrap]
    assert record["grouped_gemm"] and record["weight_bytes"] == WEIGHT_BYTES
    if wrap == "separate":
        # Weights in storages of their own (every parameter before the layer shared one
        # buffer): two stacks in forward, two in backward, all the local weights each.
        assert record["bytes"] == {"forward": WEIGHT_BYTES, "backward": WEIGHT_BYTES}
        assert record["ops"] == {"forward": ["stack"] * 2, "backward": ["stack"] * 2}
        assert record["weight_bytes_copied"] == 2 * WEIGHT_BYTES
    else:
        assert record["bytes"] == {} and record["weight_bytes_copied"] == 0, record
