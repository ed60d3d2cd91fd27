"""Count the device ops a MoE layer call dispatches, on fake CUDA at real size.

Test harness and benchmark tool: runs in the fake-CUDA session of
``lrmoe_testing.cuda_harness`` (its own process: ``python -m
lrmoe_testing.device_ops``), for LRMoE's layer and for Megatron's own
``MoELayer`` with the all-to-all dispatcher, built from Megatron's local GPT spec, at the
same shape, config and routing counts. What counts as a device op: ``op_kind``. Each op is
attributed to the stage of the layer that issued it (``Stages``): by the Python frames
that led to it, and in the backward, for the autograd nodes the forward made, by the
stage that made the node.

Megatron's baseline is its ``SequentialMLP`` (one fc1, activation and fc2 per local
expert): megatron-core 0.19.2 has no grouped-GEMM experts without Transformer Engine
(``TEGroupedMLP`` is built from TE's ``GroupedLinear``; ``InferenceGroupedMLP`` subclasses
it and is inference-only; the local spec's ``moe_grouped_gemm`` builds ``SequentialMLP``).

Values: a fake all-gather has no counts, and Megatron's dispatcher reads its split sizes
on the host (``_maybe_dtoh_and_synchronize``). ``_TraceSplits`` replaces that method on
the one dispatcher instance (``megatron_privates.replaced_dispatcher_dtoh``): the same
device-to-host copies at the same point, then the split sizes the trace's counts give
(the counts the LRMoE layer plans from: its own counts exchange, whose all-gather
returns the trace's counts, ``_trace_counts_exchange``). Stream events and the
sync they wait on need a driver and are left out (they launch no kernel).

The counting reads only tensor metadata (device, storage identity, the op's schema),
never a value: it adds no host read or sync (tests/layer/test_device_ops.py checks that
under the ``HostReadDetector``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lrmoe_testing.cuda_harness import (
    Case,
    case_counts,
    megatron_fake_cuda,
    move_parameters_to_fake_cuda,
    node_grad,
    qwen3_layer_config,
    releasing_saved_tensors,
)
from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
from megatron_lrmoe.layer.counts_exchange import RoutedCountsExchange
from megatron_lrmoe.layer.region import _LRMoERegion
from megatron_lrmoe.layer.spec import to_lrmoe_spec
from megatron_lrmoe.megatron_privates import replaced_dispatcher_dtoh
from megatron_lrmoe.planning.models import MODELS

__all__ = ["DeviceOpCounter", "LayerOps", "Stages", "count_layer_ops", "op_kind"]

# -----------------------------------------------------------------------------
# What a device op is
# -----------------------------------------------------------------------------

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                                   "_c10d_functional_autograd"})
# Factories that only reserve memory: the caching allocator, no kernel, nothing written.
ALLOCATIONS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided",
                         "empty_like", "empty_permuted"})
# Ops that return a device value to the host (a sync on a GPU).
HOST_READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero", "allclose"})
KINDS = ("device", "collective", "to_host", "alloc", "metadata", "host")


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def op_kind(func, args: tuple, kwargs: dict, out: object, device_type: str = "cuda") -> str:
    """The kind of one dispatched (aten or custom) op, from its schema and its tensors'
    metadata only (no values read):

    - ``collective``: an op of the c10d namespaces (all-to-all, all-gather, ...), counted
      apart from the device ops whatever it writes;
    - ``device``: writes memory of ``device_type``: an output on it that is not a view,
      or an input on it that the schema marks written (in-place and ``out=`` ops,
      host-to-device copies into it); one kernel launch or memcpy on a GPU;
    - ``alloc``: a factory that only reserves memory there (``empty``, ``new_empty``,
      ...): no kernel;
    - ``metadata``: every output aliases an input's storage and nothing is written
      (``view``, ``t``, ``_unsafe_view``, ``detach``, ``as_strided``, ...), or no tensor
      comes out (``prim::device``, size queries): no kernel;
    - ``to_host``: writes nothing there but reads a tensor of it: device-to-host copies
      and ``HOST_READS`` (``item``, ``equal``, ...); counted apart;
    - ``host``: no tensor of ``device_type`` involved (the planner's host ops).
    """
    if func.namespace in COLLECTIVE_NAMESPACES:
        return "collective"
    name = func._schema.name.split("::")[-1]
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    written = list(outs)
    for arg, spec in zip(args, func._schema.arguments, strict=False):
        if spec.alias_info is not None and spec.alias_info.is_write:
            written.extend(t for t in tree_flatten(arg)[0] if isinstance(t, torch.Tensor))
    for key, value in kwargs.items():
        spec = next((a for a in func._schema.arguments if a.name == key), None)
        if spec is not None and spec.alias_info is not None and spec.alias_info.is_write:
            written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    on_device = [t for t in written if t.device.type == device_type]
    if not on_device:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(t.device.type == device_type for t in inputs):
            return "host"
        return "to_host" if outs or name in HOST_READS else "metadata"
    if name in ALLOCATIONS:
        return "alloc"
    if len(written) == len(outs):          # nothing written in place
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        if all(_storage(t) in inputs and _storage(t) is not None for t in outs):
            return "metadata"
    return "device"


# -----------------------------------------------------------------------------
# Stages
# -----------------------------------------------------------------------------

_MCORE_MOE = "megatron/core/transformer/moe/"
_LRMOE = "megatron_lrmoe/"


def _region_experts_line() -> int:
    """The line of ``_LRMoERegion.forward`` that calls the experts: the region's forward
    ops above it are its dispatch, those below its combine."""
    lines, first = inspect.getsourcelines(_LRMoERegion.forward)
    for offset, line in enumerate(lines):
        if "experts_forward(" in line:
            return first + offset
    raise RuntimeError("_LRMoERegion.forward no longer calls experts_forward")


@dataclass(frozen=True)
class Stages:
    """Stage of an op: the innermost Python frame (file suffix, function) found in
    ``frames`` names it. ``region_forward``: the LRMoE region's forward, split by line
    (``_region_experts_line``). ``weight_stack``: the frames of the grouped GEMMs'
    weight stacking (reported as its own stage)."""

    frames: dict[tuple[str, str], str] = field(default_factory=lambda: {
        # Megatron's MoELayer and its all-to-all dispatcher
        (_MCORE_MOE + "moe_layer.py", "route"): "router",
        (_MCORE_MOE + "moe_layer.py", "preprocess"): "dispatch",
        (_MCORE_MOE + "moe_layer.py", "dispatch"): "dispatch",
        (_MCORE_MOE + "token_dispatcher.py", "dispatch_postprocess"): "dispatch",
        (_MCORE_MOE + "experts.py", "forward"): "experts",
        (_MCORE_MOE + "token_dispatcher.py", "combine_preprocess"): "combine",
        (_MCORE_MOE + "moe_layer.py", "combine"): "combine",
        (_MCORE_MOE + "moe_layer.py", "postprocess"): "combine",
        # LRMoE's layer
        (_LRMOE + "layer/counts_exchange.py", "gather_counts"): "plan",
        (_LRMOE + "layer/moe_layer.py", "_plan_micro_batch"): "plan",
        (_LRMOE + "layer/region_layout.py", "device_tables"): "plan",
        (_LRMOE + "layer/moe_layer.py", "_pairs_in_send_order"): "dispatch",
        (_LRMOE + "layer/moe_layer.py", "_start_refresh"): "replicas",
        (_LRMOE + "layer/moe_layer.py", "_region_experts"): "replicas",
        (_LRMOE + "layer/moe_layer.py", "routed_output"): "combine",
        (_LRMOE + "layer/expert_gemms.py", "experts_forward"): "experts",
        (_LRMOE + "layer/region.py", "_retain_in_forward"): "select",
        # LRMoE's region backward
        (_LRMOE + "layer/region.py", "_select_kept_pairs"): "select",
        (_LRMOE + "layer/region.py", "_combine_backward"): "combine",
        (_LRMOE + "layer/region.py", "_experts_backward"): "experts",
        (_LRMOE + "layer/region.py", "_dispatch_backward"): "dispatch",
        (_LRMOE + "layer/region.py", "_record_backward"): "statistics",
        (_LRMOE + "layer/region.py", "_home_weight_grads"): "experts",
        (_LRMOE + "layer/moe_layer.py", "_after_backward"): "replicas",
        (_LRMOE + "layer/region.py", "backward"): "combine",
    })
    region_forward: tuple[str, str] = (_LRMOE + "layer/region.py", "forward")
    weight_stack: tuple[str, ...] = ("experts_forward", "experts_backward")


@dataclass
class OpRecord:
    phase: str
    stage: str
    op: str
    kind: str


class _NodeStages(TorchFunctionMode):
    """Forward only: the stage of every autograd node the forward made, by sequence
    number: torch calls' nodes as this mode sees them, custom autograd Functions' nodes
    through ``Function.apply`` (which torch function modes do not see), wrapped while the
    mode is active."""

    def __init__(self, stage: Callable[[], str]) -> None:
        super().__init__()
        self.stage = stage
        self.by_seq: dict[int, str] = {}
        self._apply = None

    def record(self, out: object) -> None:
        for t in tree_flatten(out)[0]:
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is not None and node._sequence_nr() not in self.by_seq:
                self.by_seq[node._sequence_nr()] = self.stage()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.record(out)
        return out

    def __enter__(self):
        apply = self._apply = torch.autograd.Function.apply.__func__
        nodes = self

        def recorded_apply(cls, *args, **kwargs):
            out = apply(cls, *args, **kwargs)
            nodes.record(out)
            return out

        torch.autograd.Function.apply = classmethod(recorded_apply)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd.Function.apply = classmethod(self._apply)
        return super().__exit__(*exc)

    def stage_of(self, node) -> str | None:
        return self.by_seq.get(node._sequence_nr())


class DeviceOpCounter(TorchDispatchMode):
    """Records every dispatched op with its phase, stage and kind (``op_kind``). Enter it
    above the fake-CUDA session's modes; ``phase`` labels the ops that follow ("" : not
    recorded). ``nodes``: the forward's node stages, for the backward's attribution."""

    def __init__(self, stages: Stages | None = None, device_type: str = "cuda") -> None:
        super().__init__()
        self.stages = stages or Stages()
        self.device_type = device_type
        self.phase = ""
        self.records: list[OpRecord] = []
        self.nodes = _NodeStages(self.stage)
        self._split = _region_experts_line()

    def stage(self) -> str:
        """The current stage, from the Python frames (innermost first)."""
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            path = code.co_filename.replace("\\", "/")
            if path.endswith("cuda_harness.py") and code.co_name == "node_grad":
                node = frame.f_locals.get("node")
                found = self.nodes.stage_of(node) if node is not None else None
                if found is not None:
                    return found
            elif (path.endswith(self.stages.region_forward[0])
                  and code.co_name == self.stages.region_forward[1]):
                return "dispatch" if frame.f_lineno < self._split else "combine"
            else:
                for (suffix, function), stage in self.stages.frames.items():
                    if code.co_name == function and path.endswith(suffix):
                        return stage
            frame = frame.f_back
        return "other"

    def _is_weight_stack(self, name: str) -> bool:
        if name not in ("stack", "cat"):
            return False
        frame = sys._getframe(2)
        while frame is not None and ("/torch/" in frame.f_code.co_filename
                                     or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_name in self.stages.weight_stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase:
            name = func._schema.name.split("::")[-1]
            kind = op_kind(func, args, kwargs, out, self.device_type)
            if kind != "host":
                stage = "weight stack" if self._is_weight_stack(name) else self.stage()
                self.records.append(OpRecord(self.phase, stage, name, kind))
        return out

    def summary(self) -> dict:
        """{phase: {"kinds": {kind: n}, "stages": {stage: device ops},
        "collectives": {stage: n}, "ops": {op: device ops}}}."""
        out: dict[str, dict] = {}
        for phase in dict.fromkeys(r.phase for r in self.records):
            rs = [r for r in self.records if r.phase == phase]
            device = [r for r in rs if r.kind == "device"]
            out[phase] = {
                "kinds": dict(Counter(r.kind for r in rs)),
                "stages": dict(Counter(r.stage for r in device)),
                "collectives": dict(Counter(r.stage for r in rs if r.kind == "collective")),
                "ops": dict(Counter(r.op for r in device).most_common()),
                "stage_ops": {s: dict(Counter(r.op for r in device if r.stage == s)
                                      .most_common())
                              for s in dict.fromkeys(r.stage for r in device)},
            }
        return out


# -----------------------------------------------------------------------------
# Megatron's split sizes from the trace
# -----------------------------------------------------------------------------


class _TraceSplits:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` for fake CUDA: at the
    dispatcher's device-to-host point the same copies as Megatron's (each device tensor
    it moves, non-blocking), then the host values the trace's [R, E] ``counts`` give;
    no stream or event (they need a driver and launch nothing)."""

    def __init__(self, dispatcher, counts: torch.Tensor, rank: int) -> None:
        self.d, self.counts, self.rank = dispatcher, counts, rank

    def __call__(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        d = self.d
        if point != d.cuda_dtoh_point:
            return tokens_per_expert
        for t in (tokens_per_expert, d.input_splits, d.output_splits, d.output_splits_tp,
                  d.num_out_tokens, d.num_global_tokens_per_local_expert):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                t.to("cpu", non_blocking=True)
        ep, local = d.ep_size, d.num_local_experts
        counts = self.counts
        mine = counts[:, self.rank * local:(self.rank + 1) * local]       # [R, L] received
        d.input_splits = counts[self.rank].reshape(ep, local).sum(1).numpy()
        d.output_splits = mine.sum(1).numpy()
        d.output_splits_tp = np.array([int(mine.sum())])
        d.num_global_tokens_per_local_expert = mine.clone()
        return mine.sum(0)


def _trace_counts_exchange(counts: torch.Tensor, ep_group):
    """The layer's own counts exchange (its device ops, all-gather and host read), returning
    the trace's counts: a fake all-gather has none."""
    class TraceCounts(RoutedCountsExchange):
        def gather_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
            super().gather_counts(routing_map)
            return counts.clone()

    return TraceCounts(ep_group)


# -----------------------------------------------------------------------------
# One layer call
# -----------------------------------------------------------------------------


@dataclass
class LayerOps:
    """One layer call's ops (plain data: it crosses a process)."""

    layer: str
    case: str
    experts: str
    local_instances: int
    summary: dict
    seconds: float


def _megatron_config(case, model: str):
    """Megatron's TransformerConfig with every field of the LRMoE layer's config
    (``qwen3_layer_config``) but the LRMoE ones."""
    lrmoe = qwen3_layer_config(case, model)
    names = {f.name for f in dataclasses.fields(TransformerConfig) if f.init}
    return TransformerConfig(**{n: getattr(lrmoe, n) for n in names})


def count_layer_ops(layer_kind: str, case, rank: int, model: str = "qwen3-30b-a3b",
                    batch: int = 2) -> LayerOps:
    """The device ops of one training call (forward, then the whole backward from the
    output to the input and parameters) of ``layer_kind``: "lrmoe" (LRMoELayer, as
    ``run_layer_case`` builds it) or "megatron" (Megatron's MoELayer from the local spec:
    SequentialMLP experts, all-to-all dispatcher), as rank ``rank`` of a fake EP group of
    ``case.ep``. One unmeasured forward first (with ``finish_step`` for LRMoE: the
    measured call is a step's first, with its replica refresh)."""
    spec = MODELS[model]
    h, e = spec.hidden_size, spec.num_experts
    t = spec.shape(case.ep).tokens_per_rank
    counts = case_counts(case, model)
    with megatron_fake_cuda(rank, case.ep):
        mlp = get_gpt_layer_local_spec(num_experts=e, moe_grouped_gemm=True).submodules.mlp
        if layer_kind == "lrmoe":
            layer = to_lrmoe_spec(mlp)(config=qwen3_layer_config(case, model), layer_number=1)
        elif layer_kind == "megatron":
            layer = mlp(config=_megatron_config(case, model), layer_number=1)
            replaced_dispatcher_dtoh(layer.token_dispatcher,
                                     _TraceSplits(layer.token_dispatcher, counts, rank))
        else:
            raise ValueError(f"layer_kind {layer_kind!r}: 'lrmoe' or 'megatron'")
        layer.set_layer_number(1)
        move_parameters_to_fake_cuda(layer)
        if layer_kind == "lrmoe":
            setup_lrmoe_layers([layer], t, 1)
            layer.counts_exchange = _trace_counts_exchange(counts, layer.ep_group)
        x = torch.empty(t // batch, batch, h, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        layer(x)
        if layer_kind == "lrmoe":
            layer.finish_step()
        params = [p for p in layer.parameters() if p.requires_grad]
        # Megatron's training step sets the aux losses' gradient scale before each step
        # (else the first backward of the process makes it: one more op, once).
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones((), device="cuda"))
        counter = DeviceOpCounter()
        started = time.perf_counter()
        with counter, counter.nodes:
            counter.phase = "forward"
            out, _ = layer(x)
            counter.phase = ""
        dy = torch.empty_like(out)
        with counter, torch.no_grad(), releasing_saved_tensors():
            counter.phase = "backward"
            grads = node_grad(out, [x, *params], dy)
            counter.phase = ""
        if grads[0] is None or tuple(grads[0].shape) != tuple(x.shape):
            raise RuntimeError(f"{layer_kind}: no input gradient from the backward")
        seconds = time.perf_counter() - started
        experts = type(layer.experts).__name__
        local = (sum(1 for r in layer.last_plan.retention.instance_rank if r == rank)
                 if layer_kind == "lrmoe" else layer.num_local_experts)
        return LayerOps(layer_kind, case.name, experts, local, counter.summary(), seconds)


def main(argv: list[str] | None = None) -> int:
    """``python -m lrmoe_testing.device_ops RANK KIND:EP:GAMMA:SELECTION:REPLICAS
    ...``: one JSON list of ``LayerOps`` on stdout (KIND: lrmoe or megatron)."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(argv[0])
    results = []
    for spec in argv[1:]:
        kind, ep, gamma, selection, replicas = spec.split(":")
        case = Case(int(ep), math.inf if gamma == "inf" else float(gamma), selection,
                    replicas == "1")
        results.append(asdict(count_layer_ops(kind, case, rank)))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
