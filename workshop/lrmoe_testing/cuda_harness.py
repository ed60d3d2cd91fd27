"""Run the LRMoE region's CUDA path at real size on fake CUDA tensors (no GPU needed).

Test harness only. It is the one module that touches torch's
private and testing-only pieces used for this: ``FakeTensorMode``, the fake process group
(``torch.testing._internal.distributed.fake_pg.FakeStore``), the memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``) and the autograd graph's nodes;
it is pinned to torch 2.13 (``TORCH_PIN``, checked on use). Run it in its own process
(``python -m lrmoe_testing.cuda_harness``, as tests/layer/test_region_fake_cuda.py
does): the process group and the modes are process-wide.

What ``fake_cuda_session`` sets up, and why:

- **Fake CUDA, real host.** ``FakeTensorMode`` makes device="cuda" tensors without
  data; ``_HostReal``, above it, runs every op whose tensors are all real host tensors
  for real (the planner, the plan's numpy layout, ``torch.from_numpy``), so the host
  computes on values as on a GPU machine and the device sees only shapes. A pinned
  staging buffer cannot exist without a driver, so it is fake too (a fake CPU tensor).
- **Shadows** (for the rows each grouped GEMM receives): small integer tensors that
  reach the device from host data (the region's packed tables: offsets, split tables)
  keep a real CPU copy computed alongside, op by op, as long as every input has one.
  Fake tensors have no values; the shadows are the values a GPU would hold.
- **Process group**: ``init_process_group("fake")`` over a ``FakeStore``, rank r of R;
  its all-to-alls accept fake CUDA tensors and move nothing.
- **Autograd**: the engine cannot run on fake CUDA tensors without a driver
  ("hasPrimaryContext expects a valid device index"), so the region's backward is called
  through its node (``backward_through_node``), and ``torch.autograd.grad`` (the
  experts' activation recompute inside that backward) is replaced, for fake tensors
  only, by ``node_grad``: the same chain rule, walking the graph's nodes and calling
  each one, in topological order; the tensors a node saved are freed once it ran
  (``releasing_saved_tensors``), as the engine frees them without ``retain_graph``, so
  that the memory levels after the recompute are the engine's.
- **Grouped GEMMs**: the region is given ``grouped_gemm=True``; ``use_grouped_mm`` takes
  the grouped path for fake CUDA bf16 without its value-comparing probe.
- **Value checks** (``MEGATRON_LRMOE_DEBUG_CHECKS``) are off, as in training on a GPU:
  on CUDA they read device values on the host.
- **Not set up**: the CPU runtime (``enable_cpu_runtime``, which maps CUDA to the CPU) is
  never enabled. For the region (``run_case``) Megatron's ``parallel_state``, RNG tracker
  and model initialisation are not used: the region is called directly. The whole layer
  (``run_layer_case``, tests/layer/test_moe_layer_fake_cuda.py) sets them up on top of
  this session (``megatron_fake_cuda``; the section "The layer at size" says how and
  what had to be worked around).

- **Memory** (``device_memory``): torch's ``MemTracker``, as is, on top of the modes. It
  tracks fake tensors the way it tracks real ones: the untyped storages of every op's
  outputs, by weak reference (freed when the storage is), bytes rounded up to the CUDA
  caching allocator's 512-byte blocks. A subclass records the device level after every
  op (frees only lower it, so the largest of these is the peak) with the phase and the
  op that reached it. The tensors that exist before the forward (input, weights, their
  gradient buffers as Megatron's ``main_grad`` are, replicas, the router's outputs, dy)
  are registered first (``track_external``), so that an in-place op on one is not
  counted as new memory; levels are measured above them. The pair metadata the layer
  makes from the router's outputs (``_expert_major_pairs``: the [P, 2] pairs the token
  index is a view of, the probability gather's index and result) is made inside the
  measured span, as in the layer. Saved bytes: ``saved_tensors_hooks`` over the
  forward, distinct storages, without the weights and the input
  (``layer_bench.measure_memory``'s definition).

Counts come from a recorded routing trace (benchmarks/results/routing_traces/qwen3),
formed into R sources and resampled to the model's pairs per rank exactly as the
simulator forms them (``tools.simulate.source_batches``). ``TraceCountsExchange``
stands in for the layer's ``RoutedCountsExchange``: a fake all-gather has no counts to
give, so it takes them from the trace, after the same device reduction and the same
host read (``.cpu()``) as the real exchange: the forward's one documented read.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from lrmoe_testing.host_reads import HostReadDetector
from megatron_lrmoe.data.routing_traces import read_routing_trace
from megatron_lrmoe.integration.runtime.cpu import cpu_runtime_active
from megatron_lrmoe.layer.region import (
    PARAM_KINDS,
    ExpertWeights,
    RegionContext,
    _LRMoERegion,
    lrmoe_region,
)
from megatron_lrmoe.megatron_privates import (
    installed_cuda_rng_tracker,
    model_parallel_rng_tracker_name,
    swapped_dispatcher_dtoh_stream,
)
from megatron_lrmoe.ops import set_debug_checks
from megatron_lrmoe.planning.models import MODELS
from megatron_lrmoe.planning.plan_types import PlannerSettings
from megatron_lrmoe.planning.planner import LayerPlanner
from megatron_lrmoe.planning.retention import RetentionPlan
from megatron_lrmoe.planning.shapes import InstanceRows
from megatron_lrmoe.tools.simulate import source_batches

__all__ = ["TORCH_PIN", "Case", "CaseResult", "DeviceRun", "GemmCall", "LayerCaseResult",
           "TraceCountsExchange", "backward_through_node", "case_counts", "case_planner",
           "check_device_record", "check_torch_pin", "compare_values", "device_memory",
           "fake_cuda_session", "megatron_fake_cuda", "memory_record",
           "move_parameters_to_fake_cuda", "node_grad", "qwen3_layer_config", "rank_view_plan",
           "region_node", "releasing_saved_tensors", "run_case", "run_case_on_device",
           "run_cases", "run_layer_case", "run_weight_copy_case", "trace_counts"]

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "benchmarks" / "results" / "routing_traces" / "qwen3" / "trace"
_SHADOW_MAX = 1 << 20          # elements: shadows are kept for index tables, not rows
TORCH_PIN = "2.13"             # FakeStore, MemTracker, FakeTensorMode: private / testing APIs


def check_torch_pin() -> None:
    """This harness uses torch's private and testing-only APIs (``FakeStore``,
    ``MemTracker``, ``FakeTensorMode``, autograd nodes' ``_input_metadata``): pinned."""
    assert torch.__version__.startswith(TORCH_PIN), (
        f"lrmoe_testing.cuda_harness is pinned to torch {TORCH_PIN} (it uses torch's "
        f"private FakeStore, MemTracker and FakeTensorMode); found torch {torch.__version__}: "
        f"re-check those APIs, then move TORCH_PIN")


# -----------------------------------------------------------------------------
# What the device saw
# -----------------------------------------------------------------------------


@dataclass
class GemmCall:
    """One grouped GEMM: its phase, operand shapes, the grouped dimension's size and the
    rows of each group (from the offsets' shadow; None without one)."""

    phase: str
    a: tuple[int, ...]
    b: tuple[int, ...]
    grouped_rows: int
    group_rows: list[int] | None
    offs_dtype: str | None


@dataclass
class MadeTensor:
    """A tensor an op made on the fake device (or a fake host buffer)."""

    phase: str
    op: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    pinned_staging: bool = False


class _HostReal(TorchDispatchMode):
    """Above FakeTensorMode: host ops run for real, device ops are faked and recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.staging: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.phase = ""
        self.made: list[MadeTensor] = []
        self.gemms: list[GemmCall] = []

    def _shadow(self, t: object) -> torch.Tensor | None:
        if isinstance(t, FakeTensor):
            return self.shadows.get(t)
        return t if isinstance(t, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = kwargs.get("device")
        fake = (any(isinstance(t, FakeTensor) for t in flat) or bool(kwargs.get("pin_memory"))
                or (device is not None and torch.device(device).type != "cpu"))
        if not fake:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name == "_grouped_mm":
            self._record_gemm(args, kwargs)
        out = func(*args, **kwargs)
        if name == "empty" and kwargs.get("pin_memory"):
            self.staging[out] = True
        self._propagate_shadow(func, name, flat, args, kwargs, out)
        if self.phase:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.made.append(MadeTensor(self.phase, name, t.device.type,
                                                str(t.dtype).removeprefix("torch."),
                                                tuple(t.shape), t in self.staging))
        return out

    def _propagate_shadow(self, func, name, flat, args, kwargs, out) -> None:
        """Keep a real copy of small integer tensors computed only from host data."""
        if name == "copy_" and self._shadow(args[1]) is not None:
            with unset_fake_temporarily():
                self.shadows[out] = self._shadow(args[1]).clone()
            return
        if not flat or any(self._shadow(t) is None for t in flat):
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or any(t.is_floating_point() or t.numel() > _SHADOW_MAX for t in outs):
            return
        real_args, real_kwargs = tree_map(
            lambda t: self._shadow(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        if "device" in real_kwargs:
            real_kwargs["device"] = torch.device("cpu")
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        for fake_t, real_t in zip(outs, [t for t in tree_flatten(real_out)[0]
                                          if isinstance(t, torch.Tensor)], strict=True):
            self.shadows[fake_t] = real_t

    def _record_gemm(self, args, kwargs) -> None:
        a, b = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        # 2D x 3D: groups split a's rows; 2D x 2D (the dW GEMMs, a = g^T): a's columns.
        grouped = a.shape[0] if b.dim() == 3 else a.shape[1]
        shadow = self._shadow(offs) if offs is not None else None
        rows = None
        if shadow is not None:
            with unset_fake_temporarily():
                ends = shadow.tolist()
            rows = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
        self.gemms.append(GemmCall(self.phase, tuple(a.shape), tuple(b.shape), grouped, rows,
                                   None if offs is None else str(offs.dtype).removeprefix(
                                       "torch.")))


# -----------------------------------------------------------------------------
# Autograd without the engine
# -----------------------------------------------------------------------------


def backward_through_node(output, grad: torch.Tensor) -> tuple:
    """The gradients ``output``'s autograd node (or ``output``, a node) returns for
    ``grad`` (grad mode off, as under the engine): how a custom Function's backward runs
    on fake CUDA tensors. The graphs it builds inside (the experts' activation recompute)
    save their tensors in boxes, which ``node_grad`` empties as it runs each node (the
    engine's release)."""
    node = output.grad_fn if isinstance(output, torch.Tensor) else output
    with torch.no_grad(), releasing_saved_tensors():
        return node.apply(grad)


class _SavedBoxes:
    """Saved-tensor hooks that let ``node_grad`` free what a node saved once it ran, as
    the engine does without ``retain_graph`` (``release_variables``, which Python cannot
    call): each saved tensor is packed in a box; ``of(node)`` collects the boxes of the
    node's saved tensors (reading its ``_saved_*`` attributes unpacks them), and
    ``release`` empties them. Without the hooks active, nothing is boxed or released."""

    def __init__(self) -> None:
        self.unpacked: list[list] | None = None

    @staticmethod
    def pack(t: torch.Tensor) -> list:
        return [t]

    def unpack(self, box: list) -> torch.Tensor:
        if box[0] is None:
            raise RuntimeError("node_grad: a saved tensor was read after its node ran")
        if self.unpacked is not None:
            self.unpacked.append(box)
        return box[0]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def of(self, node) -> list[list]:
        self.unpacked = []
        try:
            for name in dir(node):
                if name.startswith("_saved_"):
                    getattr(node, name)
            return self.unpacked
        finally:
            self.unpacked = None

    @staticmethod
    def release(boxes: list[list]) -> None:
        for box in boxes:
            box[0] = None


_SAVED = _SavedBoxes()


def releasing_saved_tensors():
    """Context: graphs built inside save their tensors so that ``node_grad`` frees them
    as it runs each node, as the engine does (``backward_through_node`` enters it)."""
    return _SAVED.hooks()


def node_grad(outputs, inputs, grad_outputs=None, **kwargs):
    """``torch.autograd.grad`` for one output and inputs that are leaves, by calling the
    graph's nodes in topological order (the engine's chain rule, without the engine)."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    grad_outputs = grad_outputs if isinstance(grad_outputs, (tuple, list)) else (grad_outputs,)
    if len(outputs) != 1 or kwargs.get("create_graph"):
        raise NotImplementedError("the fake-CUDA autograd.grad takes one output, no graph")
    root = outputs[0].grad_fn
    order, seen = [], set()

    def visit(node) -> None:       # iterative post-order DFS
        stack = [(node, False)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
                continue
            if n is None or n in seen:
                continue
            seen.add(n)
            stack.append((n, True))
            stack.extend((nxt, False) for nxt, _ in n.next_functions)

    visit(root)
    pending: dict = {root: [grad_outputs[0]]}
    found: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for node in reversed(order):          # outputs before their inputs
            grads = pending.pop(node, None)
            if grads is None:
                continue
            if type(node).__name__ == "AccumulateGrad":
                found[id(node.variable)] = grads[0]
                continue
            held = _SAVED.of(node)
            edges = node.next_functions
            if callable(node):
                results = node(*grads)
            else:
                # A custom Function's node runs through apply and returns one gradient
                # per forward argument; the edges are those of the arguments that
                # needed one (the engine drops the rest).
                results = node.apply(*grads)
                results = results if isinstance(results, tuple) else (results,)
                results = [g for g, need in zip(results, node.needs_input_grad, strict=True)
                           if need]
                edges = [edge for edge in edges if edge[0] is not None]
            _SAVED.release(held)          # as the engine does without retain_graph
            results = results if isinstance(results, (tuple, list)) else (results,)
            for (nxt, index), g in zip(edges, results, strict=True):
                if nxt is None or g is None:
                    continue
                # One gradient per output of the forward op (None: that output unused),
                # reduced over broadcast dimensions to that output's shape, as the
                # engine's validate_outputs does.
                metadata = nxt._input_metadata
                if metadata and tuple(g.shape) != tuple(metadata[index].shape):
                    g = g.sum_to_size(tuple(metadata[index].shape))
                acc = pending.setdefault(nxt, [None] * max(len(metadata), 1))
                acc[index] = g if acc[index] is None else acc[index] + g
    return tuple(found.get(id(t)) for t in inputs)


# -----------------------------------------------------------------------------
# Device memory
# -----------------------------------------------------------------------------


def device_memory(device_type: str = "cuda"):
    """A ``MemTracker`` (torch's, as is) that also records the level of ``device_type``
    after every op: ``phase`` labels the ops that follow, ``timeline`` holds (phase, op,
    bytes after the op), ``level()`` the bytes now. Made on use: importing ``MemTracker``
    imports torch's fake collectives, which only this harness's subprocess needs."""
    check_torch_pin()
    from torch.distributed._tools.mem_tracker import MemTracker

    class DeviceMemory(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self.phase = ""
            self.timeline: list[tuple[str, str, int]] = []

        def level(self) -> int:
            """Bytes of the live storages on ``device_type`` the tracker knows of."""
            return sum(snap["Total"] for dev, snap in self.get_tracker_snapshot().items()
                       if dev.type == device_type)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.phase:
                self.timeline.append((self.phase, func._schema.name.split("::")[-1],
                                      self.level()))
            return out

    return DeviceMemory()


def memory_record(mem, base: int, at_backward: int, saved: int) -> dict:
    """The measured figures, above ``base`` (the level before the forward): saved bytes,
    the level at backward, each phase's peak and the op that reached it, and the overall
    peak; ``levels``: the timeline's running maxima, where the peak rose."""
    peaks: dict[str, list] = {}
    rises: list[list] = []
    top = 0
    for phase, op, level in mem.timeline:
        if level - base > peaks.get(phase, [-1])[0]:
            peaks[phase] = [level - base, op]
        if level - base > top:
            top = level - base
            rises.append([phase, op, top])
    return {"saved": saved, "at_backward": at_backward - base, "peak": top,
            "phase_peaks": peaks, "rises": rises[-12:], "ops": len(mem.timeline)}


# -----------------------------------------------------------------------------
# Session
# -----------------------------------------------------------------------------


@contextlib.contextmanager
def fake_cuda_session(rank: int, world_size: int) -> Iterator[_HostReal]:
    """Fake CUDA device, real host, fake process group of ``world_size`` (this is rank
    ``rank``); see the module docstring. Yields the recorder of what the device saw."""
    # deferred: importing it registers torch's fake process-group backend process-wide
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check_torch_pin()
    if cpu_runtime_active():
        raise RuntimeError("the CPU runtime maps CUDA to the CPU: run this in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    grad = torch.autograd.grad

    def grad_on_fake(outputs, inputs, *args, **kwargs):
        flat = tree_flatten((outputs, inputs))[0]
        if any(isinstance(t, FakeTensor) for t in flat):
            return node_grad(outputs, inputs, *args, **kwargs)
        return grad(outputs, inputs, *args, **kwargs)

    previous_checks = set_debug_checks(False)
    torch.autograd.grad = grad_on_fake
    recorder = _HostReal()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), recorder:
            yield recorder
    finally:
        torch.autograd.grad = grad
        set_debug_checks(previous_checks)
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Counts from the trace
# -----------------------------------------------------------------------------


def trace_counts(ep_size: int, pairs_per_rank: int, call: int = 0, seed: int = 0,
                 layer_index: int = 0) -> torch.Tensor:
    """[R, E] int64 counts of one micro-batch at ``ep_size`` sources, from the qwen3 trace,
    formed and resampled to ``pairs_per_rank`` as the simulator does (call ``call`` of its
    sequence for the trace's ``layer_index``-th MoE layer)."""
    trace = read_routing_trace(TRACE)
    layer = trace.layer(trace.layers[layer_index])
    batches = source_batches(layer, ep_size, pairs_per_rank,
                             np.random.default_rng([seed, layer_index]))
    for _ in range(call):
        next(batches)
    return torch.from_numpy(next(batches))


class TraceCountsExchange:
    """The layer's counts exchange with a test hook for the counts (a fake all-gather
    has none): the same device reduction and host read as ``RoutedCountsExchange``,
    then the trace's counts for every source."""

    def __init__(self, counts: torch.Tensor, ep_rank: int) -> None:
        self.counts, self.ep_rank = counts, ep_rank
        self.ep_size = counts.shape[0]

    def gather_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        local = routing_map.sum(dim=0).to(torch.int64)
        gathered = local.new_empty(self.ep_size * local.numel())
        gathered.view(self.ep_size, -1).copy_(local.expand(self.ep_size, -1))
        gathered.view(self.ep_size, -1).cpu()        # the one host read, as on a GPU
        return self.counts.clone()


# -----------------------------------------------------------------------------
# One region call at size
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    ep: int
    gamma: float
    selection: str
    replicas: bool
    bias: bool = False
    """The experts have biases (Megatron's ``add_bias_linear``): b1 [F1] and b2 [H] each."""

    @property
    def name(self) -> str:
        return (f"ep{self.ep}-gamma{self.gamma:g}-{self.selection}-"
                f"{'replicas' if self.replicas else 'static'}{'-bias' if self.bias else ''}")


@dataclass
class CaseResult:
    """What one case did, for the test to judge (plain data: it crosses a process)."""

    case: str
    rank: int
    hidden: int
    ffn: int
    tokens: int
    counts: list[list[int]]
    plan_counts: list[list[int]]
    plan_quotas: list[list[int]]
    instance_rank: list[int]
    instance_expert: list[int]
    local_instances: int
    home_instances: int
    grouped_gemm: bool
    forward_retention: bool
    forward_reads: list[list]
    backward_reads: list[list]
    made: list[dict] = field(default_factory=list)
    gemms: list[dict] = field(default_factory=list)
    outputs: dict[str, list] = field(default_factory=dict)
    replica_grads: list[list] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    """Device bytes (``memory_record``): saved for backward, peaks above the level
    before the forward."""
    seconds: dict[str, float] = field(default_factory=dict)


def _swiglu(z: torch.Tensor) -> torch.Tensor:
    """Qwen3's expert activation as LRMoESequentialMLP computes it (--swiglu)."""
    z_glu, z_linear = torch.chunk(z, 2, dim=-1)
    return torch.nn.functional.silu(z_glu) * z_linear


def case_planner(case: Case, counts: torch.Tensor, num_experts: int):
    """The case's planner, before the call's counts are observed: ``static`` (Megatron's
    layout), or ``popularity`` with two more slots per rank after one step observed
    ``counts`` (replicas of the hottest experts)."""
    per_rank = num_experts // case.ep
    settings = PlannerSettings("popularity" if case.replicas else "static", case.ep,
                               num_experts, capacity_factor=case.gamma,
                               slots_per_rank=per_rank + 2 if case.replicas else None)
    planner = LayerPlanner(settings)
    if case.replicas:       # one step observed: the next placement replicates hot experts
        planner.observe(counts)
        planner.next_step()
    return planner


def _read(read) -> list:
    """A host read as plain data: [op, ["file:function", ... innermost first]]."""
    return [read.op, [f"{Path(f).name}:{name}" for f, name in read.frames]]


def case_counts(case: Case, model: str = "qwen3-30b-a3b") -> torch.Tensor:
    """The case's [R, E] counts: the trace at ``model``'s pairs per rank."""
    shape = MODELS[model].shape(case.ep)
    return trace_counts(case.ep, shape.source_pairs)


def _dims(t: torch.Tensor | None) -> list | None:
    return None if t is None else [list(t.shape), str(t.dtype).removeprefix("torch."),
                                   t.device.type]


def run_case(case: Case, rank: int, model: str = "qwen3-30b-a3b") -> CaseResult:
    """The region of ``model``'s shape as rank ``rank`` of a fake EP group of ``case.ep``:
    counts exchange (trace hook), plan, forward, then backward through the node."""
    spec = MODELS[model]
    shape = spec.shape(case.ep)
    h, f, t, e = spec.hidden_size, spec.ffn_hidden_size, shape.tokens_per_rank, spec.num_experts
    f1 = 2 * f if spec.gated else f
    counts = case_counts(case, model)
    planner = case_planner(case, counts, e)
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    with fake_cuda_session(rank, case.ep) as device:
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        placement = planner.placement
        local = [i for i, r in enumerate(placement.instance_rank) if r == rank]
        homes = sum(1 for i in local if placement.instance_expert[i] // (e // case.ep) == rank)
        w1 = tuple(torch.empty(f1, h, **bf16, requires_grad=j < homes) for j in range(len(local)))
        w2 = tuple(torch.empty(h, f, **bf16, requires_grad=j < homes) for j in range(len(local)))
        b1 = tuple(torch.empty(f1, **bf16, requires_grad=j < homes)
                   for j in range(len(local) if case.bias else 0))
        b2 = tuple(torch.empty(h, **bf16, requires_grad=j < homes)
                   for j in range(len(local) if case.bias else 0))
        home_params = (*w1[:homes], *w2[:homes], *b1[:homes], *b2[:homes])
        # The home parameters' gradient buffers exist before the call, as Megatron's are.
        buffers = [torch.zeros_like(w) for w in home_params]
        for w, g in zip(home_params, buffers, strict=True):
            w.grad = g
        experts = ExpertWeights(w1[:homes], w2[:homes], _swiglu, b1=b1[:homes],
                                b2=b2[:homes])
        if len(local) > homes:
            experts = experts.with_replicas(w1[homes:], w2[homes:], b1[homes:], b2[homes:])
        x = torch.empty(t, h, **bf16, requires_grad=True)
        routing_map = torch.empty(t, e, device="cuda", dtype=torch.bool)
        probs = torch.empty(t, e, device="cuda", dtype=torch.float32, requires_grad=True)
        dy = torch.empty(t, h, **bf16)
        exchange = TraceCountsExchange(counts, rank)
        replica_grads: list[list] = []
        pre_existing = (x, *w1, *w2, *b1, *b2, *buffers)
        keep = {p.untyped_storage()._cdata for p in pre_existing}
        saved: dict[int, int] = {}

        def on_replica_grads(grads):
            replica_grads.extend([_dims(g) for kind in grads for g in kind])
            return ()

        def pack(saved_tensor: torch.Tensor) -> torch.Tensor:
            storage = saved_tensor.untyped_storage()
            if storage._cdata not in keep:
                saved[storage._cdata] = storage.nbytes()
            return saved_tensor

        mem = device_memory()
        with HostReadDetector() as detector:
            detector.taint(x, routing_map, probs, dy, *w1, *w2, *b1, *b2)
            gathered = exchange.gather_counts(routing_map)
            planner.observe(gathered)
            plan = planner.plan(gathered).retention
            num_pairs = int(plan.counts[rank].sum())
            with mem:
                mem.track_external(*pre_existing, routing_map, probs, dy)
                base = mem.level()
                mem.phase = "forward"
                # The layer's pair metadata (moe_layer._expert_major_pairs) from the
                # router's outputs: [P, 2] (expert, token) pairs, the token index a view
                # of them, the probabilities a differentiable gather.
                pairs = torch.empty(num_pairs, 2, device="cuda", dtype=torch.int64)
                detector.taint(pairs)
                pair_token = pairs[:, 1]
                flat = pair_token * e + pairs[:, 0]
                pair_prob = probs.reshape(-1).index_select(0, flat)
                device.phase = "forward"
                rc = RegionContext(plan=plan, group=dist.group.WORLD, rank=rank,
                                   selection=case.selection, grouped_gemm=True,
                                   on_replica_grads=on_replica_grads)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = lrmoe_region(x, pair_token, pair_prob, rc, experts)
                seconds["forward"] = time.perf_counter() - started
                forward_reads = [_read(r) for r in detector.reads]
                detector.clear()
                at_backward = mem.level()
                device.phase = mem.phase = "backward"
                started = time.perf_counter()
                grads = backward_through_node(y, dy)
                seconds["backward"] = time.perf_counter() - started
                backward_reads = [_read(r) for r in detector.reads]
                device.phase = mem.phase = ""
            memory = memory_record(mem, base, at_backward, sum(saved.values()))
        names = ["dx", "dpair_token", "dpair_prob", "drc", "dexperts"] + [
            f"d{kind}[{j}]" for kind in PARAM_KINDS[:len(experts.params)]
            for j in range(homes)]
        outputs = {"y": _dims(y), **{n: _dims(g) for n, g in zip(names, grads, strict=True)}}
        return CaseResult(
            case=case.name, rank=rank, hidden=h, ffn=f, tokens=t, counts=counts.tolist(),
            plan_counts=plan.counts.tolist(), plan_quotas=plan.quotas.tolist(),
            instance_rank=list(plan.instance_rank), instance_expert=list(plan.instance_expert),
            local_instances=len(local), home_instances=homes,
            grouped_gemm=rc.stats.grouped_gemm, forward_retention=rc.forward_retention,
            forward_reads=forward_reads, backward_reads=backward_reads,
            made=[asdict(m) for m in device.made], gemms=[asdict(g) for g in device.gemms],
            outputs=outputs, replica_grads=replica_grads, memory=memory, seconds=seconds)


def run_cases(cases: list[Case], rank: int) -> list[dict]:
    return [asdict(run_case(case, rank)) for case in cases]


# -----------------------------------------------------------------------------
# The layer at size: Megatron's set-up and router on fake CUDA
# -----------------------------------------------------------------------------
#
# What a training run sets up before the layer exists, and what each needs here:
#
# - ``parallel_state.initialize_model_parallel(expert_model_parallel_size=R)`` over the
#   fake group, with ``create_gloo_process_groups=False``: gloo cannot be built on a
#   fake store ("INTERNAL ASSERT FAILED ... Not implemented"); the layer uses no gloo group.
# - The RNG tracker: Megatron's ``CudaRNGStatesTracker.add`` and ``fork`` read and set
#   the CUDA generator (``torch.cuda.get_rng_state``: "Found no NVIDIA driver"; with
#   ``use_cudagraphable_rng`` ``torch.cuda.default_generators`` fails the same way). A
#   subclass keeping its bookkeeping without a generator (``_fake_rng_tracker``; fake
#   tensors draw no values) is installed as Megatron's tracker (its module globals: no
#   public hook), then Megatron's own ``model_parallel_cuda_manual_seed`` adds the
#   data-, tensor- and expert-parallel states; ``torch.cuda.manual_seed`` in it is
#   queued by torch until CUDA initialises, which never happens. Megatron's
#   ``inference_rng_tracker=True`` also runs, but its ``fork`` records nothing.
# - ``torch.cuda.current_device()`` (every device-side parameter Megatron makes with
#   ``use_cpu_initialization=False``) initialises CUDA: it returns 0 here.
# - ``MoELayer.__init__`` builds the all-to-all dispatcher, which LRMoELayer drops at
#   once; its first construction makes a process-wide ``torch.cuda.Stream()`` (class
#   attribute ``cuda_dtoh_stream``), which needs a driver: a placeholder is set first.
# - Initialisation (``perform_initialization=True``): the experts' weights are made on
#   the device and drawn under ``tracker.fork(expert-parallel-rng)`` (recorded); the
#   router's weight is made and drawn on the host (Megatron 0.19 always does), for real
#   (``_HostReal``), from ``torch.manual_seed``, then moved as ``Module.cuda()`` would.
#   ``Module.cuda()`` itself cannot run: ``_apply`` swaps fake parameters
#   (``swap_tensors``), which refuses tensors with weak references, and ``.data =`` of a
#   real parameter with a fake tensor leaves a real parameter with meta storage; so
#   ``move_parameters_to_fake_cuda`` replaces each host parameter by a fake CUDA one.

_NO_STREAM = object()     # MoEAlltoAllTokenDispatcher.cuda_dtoh_stream: never used by LRMoE


def _fake_rng_tracker():
    """Megatron's ``CudaRNGStatesTracker`` without the CUDA generator (which needs a
    driver): ``add`` keeps the checks (unique seeds and names), the seed standing for
    the state; ``fork`` checks the name, switches the current name and records it in
    ``forks``, so a test sees under which state each weight was initialised."""
    # deferred: Megatron-Core, for the layer cases only (the region's processes skip it)
    from megatron.core.tensor_parallel import random as megatron_random

    class FakeCudaRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        def __init__(self) -> None:
            super().__init__()
            self.forks: list[str] = []

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"rng state {name} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = seed

        @contextlib.contextmanager
        def fork(self, name: str = model_parallel_rng_tracker_name()):
            if name not in self.states_:
                raise RuntimeError(f"cuda rng state {name} is not added")
            self.forks.append(name)
            outer, self._current_state_name = self._current_state_name, name
            try:
                yield
            finally:
                self._current_state_name = outer

    return FakeCudaRNGStatesTracker()


@contextlib.contextmanager
def megatron_fake_cuda(rank: int, ep_size: int, seed: int = 123):
    """``fake_cuda_session`` plus Megatron's process-wide set-up as a training run makes
    it (the section comment above says what each needs): yields (recorder, tracker)."""
    # deferred: Megatron-Core, for the layer cases only (the region's processes skip it)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    with fake_cuda_session(rank, ep_size) as device:
        current_device = torch.cuda.current_device
        tracker = _fake_rng_tracker()
        try:
            torch.cuda.current_device = lambda: 0
            with swapped_dispatcher_dtoh_stream(_NO_STREAM), \
                    installed_cuda_rng_tracker(tracker):
                parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size,
                                                         create_gloo_process_groups=False)
                try:
                    megatron_random.model_parallel_cuda_manual_seed(seed)
                    torch.manual_seed(seed)    # Megatron's _set_random_seed: host draws
                    yield device, tracker
                finally:
                    destroy_moe_metrics_tracker()    # it holds the aux losses' fake tensors
                    parallel_state.destroy_model_parallel()
        finally:
            torch.cuda.current_device = current_device


def move_parameters_to_fake_cuda(module: torch.nn.Module) -> list[str]:
    """``Module.cuda()`` for fake CUDA (which ``_apply`` cannot do, see above): each host
    parameter replaced by a fake CUDA one with its attributes (Megatron's
    ``sequence_parallel``, ...). Returns the names moved."""
    moved = []
    target = f"cuda:{torch.cuda.current_device()}"
    for prefix, mod in module.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.device.type != "cpu":
                continue
            fake = torch.nn.Parameter(p.detach().to(target), requires_grad=p.requires_grad)
            for key, value in vars(p).items():
                setattr(fake, key, value)
            setattr(mod, name, fake)
            moved.append(f"{prefix}.{name}" if prefix else name)
    return moved


def region_node(output: torch.Tensor) -> tuple[object, list[str]]:
    """The LRMoE region's autograd node below the layer's ``output``, and the names of
    the nodes on the way (each with one input: the layer's output is a view of the
    region's)."""
    chain, node = [], output.grad_fn
    while getattr(node, "_forward_cls", None) is not _LRMoERegion:
        if node is None:
            raise RuntimeError(f"no LRMoE region below the output (passed {chain})")
        chain.append(type(node).__name__)
        below = [n for n, _ in node.next_functions if n is not None]
        if len(below) != 1:
            raise RuntimeError(f"{chain[-1]} has {len(below)} inputs on the way to the region")
        node = below[0]
    return node, chain


def qwen3_layer_config(case: Case, model: str = "qwen3-30b-a3b"):
    """The LRMoE config of ``model``'s MoE layer as configs/qwen3_30b_a3b.yaml and
    scripts/qwen3_30b_a3b_lrmoe.sh set it (bf16, grouped GEMMs, the all-to-all
    dispatcher, softmax top-k router in fp32 with the aux loss), for ``case``."""
    # deferred: Megatron-Core, for the layer cases only (the region's processes skip it)
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    spec = MODELS[model]
    per_rank = spec.num_experts // case.ep
    return LRMoETransformerConfig(
        num_layers=1, hidden_size=spec.hidden_size, num_attention_heads=32,
        num_query_groups=4, kv_channels=128, ffn_hidden_size=6144,
        moe_ffn_hidden_size=spec.ffn_hidden_size, num_moe_experts=spec.num_experts,
        moe_router_topk=spec.topk, moe_router_score_function="softmax",
        moe_router_dtype="fp32", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
        expert_model_parallel_size=case.ep, add_bias_linear=False,
        gated_linear_unit=spec.gated, activation_func=F.silu, bias_activation_fusion=False,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=False,
        perform_initialization=True, init_method_std=0.02,
        moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=case.gamma,
        moe_lrmoe_selection=case.selection,
        moe_lrmoe_placement="popularity" if case.replicas else "static",
        moe_lrmoe_slots_per_rank=per_rank + 2 if case.replicas else None)


@dataclass
class LayerCaseResult:
    """What one layer case did (plain data: it crosses a process)."""

    case: str
    rank: int
    hidden: int
    ffn: int
    tokens: int
    input: list
    parameters: dict[str, list]
    moved: list[str]
    rng_seeds: dict[str, int]
    rng_forks: list[str]
    plan_counts: list[list[int]]
    plan_quotas: list[list[int]]
    instance_rank: list[int]
    local_instances: int
    home_instances: int
    grouped_gemm: bool
    region_chain: list[str]
    forward_reads: list[list]
    backward_reads: list[list]
    made: list[dict] = field(default_factory=list)
    gemms: list[dict] = field(default_factory=list)
    outputs: dict[str, list] = field(default_factory=dict)
    aux_losses: dict[str, list] = field(default_factory=dict)
    """Megatron's MoE metrics tracker after the forward: the router's aux loss, kept on
    the device for logging."""
    seconds: dict[str, float] = field(default_factory=dict)


def run_layer_case(case: Case, rank: int, model: str = "qwen3-30b-a3b",
                   batch: int = 2) -> LayerCaseResult:
    """An LRMoELayer of ``model``'s MoE shape built from the converted Megatron spec as
    rank ``rank`` of a fake EP group of ``case.ep`` (``megatron_fake_cuda``): the
    forward of [T / batch, batch, H] with Megatron's router, the counts from the trace
    (``TraceCountsExchange``), then the backward through the region's node. With
    replicas, one forward and ``finish_step`` first: the next step's placement has them
    and the measured forward refreshes them (``case_planner``'s sequence). Phases of
    the ops the device saw: "router" (Megatron's router), "forward" (the rest of the
    layer's forward), "backward" (the region's node)."""
    # deferred: Megatron-Core, for the layer cases only (the region's processes skip it)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    spec = MODELS[model]
    h, f, e = spec.hidden_size, spec.ffn_hidden_size, spec.num_experts
    t = spec.shape(case.ep).tokens_per_rank
    counts = case_counts(case, model)
    seconds: dict[str, float] = {}
    with megatron_fake_cuda(rank, case.ep) as (device, tracker):
        started = time.perf_counter()
        mlp = get_gpt_layer_local_spec(num_experts=e, moe_grouped_gemm=True).submodules.mlp
        layer = to_lrmoe_spec(mlp)(config=qwen3_layer_config(case, model), layer_number=1)
        layer.set_layer_number(1)        # as TransformerLayer does: the router's, for its logs
        forks = list(tracker.forks)
        moved = move_parameters_to_fake_cuda(layer)
        seconds["build"] = time.perf_counter() - started
        setup_lrmoe_layers([layer], t, 1)
        layer.counts_exchange = TraceCountsExchange(counts, rank)
        x = torch.empty(t // batch, batch, h, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        if case.replicas:
            layer(x)
            layer.finish_step()

        def enter_router(module, args) -> None:
            device.phase = "router"

        def leave_router(module, args, out) -> None:
            device.phase = "forward"

        hooks = [layer.router.register_forward_pre_hook(enter_router),
                 layer.router.register_forward_hook(leave_router)]
        device.made.clear()
        device.gemms.clear()
        with HostReadDetector() as detector:
            detector.taint(x, *layer.parameters())
            started = time.perf_counter()
            device.phase = "forward"
            out, _ = layer(x)
            device.phase = ""
            seconds["forward"] = time.perf_counter() - started
            forward_reads = [_read(r) for r in detector.reads]
            detector.clear()
            node, chain = region_node(out)
            dy = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
            started = time.perf_counter()
            device.phase = "backward"
            grads = backward_through_node(node, dy)
            device.phase = ""
            seconds["backward"] = time.perf_counter() - started
            backward_reads = [_read(r) for r in detector.reads]
        for hook in hooks:
            hook.remove()
        aux_losses = {name: _dims(entry.values)
                      for name, entry in get_moe_metrics_tracker().metrics.items()}
        plan = layer.last_plan.retention
        homes = layer.num_local_experts
        local = sum(1 for r in plan.instance_rank if r == rank)
        names = ["dx", "dpair_token", "dpair_prob", "drc", "dexperts"] + [
            f"dw1[{j}]" for j in range(homes)] + [f"dw2[{j}]" for j in range(homes)]
        outputs = {"y": _dims(out), **{n: _dims(g) for n, g in zip(names, grads, strict=True)}}
        return LayerCaseResult(
            case=case.name, rank=rank, hidden=h, ffn=f, tokens=t, input=_dims(x),
            parameters={n: _dims(p) for n, p in layer.named_parameters()}, moved=moved,
            rng_seeds=dict(tracker.states_), rng_forks=forks,
            plan_counts=plan.counts.tolist(), plan_quotas=plan.quotas.tolist(),
            instance_rank=list(plan.instance_rank), local_instances=local,
            home_instances=homes, grouped_gemm=layer.lrmoe_stats.calls[-1].grouped_gemm,
            region_chain=chain, forward_reads=forward_reads, backward_reads=backward_reads,
            made=[asdict(m) for m in device.made], gemms=[asdict(g) for g in device.gemms],
            outputs=outputs, aux_losses=aux_losses, seconds=seconds)


# -----------------------------------------------------------------------------
# Expert weight bytes copied per layer call
# -----------------------------------------------------------------------------

# Ops that write new memory from their inputs' values: a copy of an expert weight when
# an input aliases one (``torch.stack`` reaches the dispatcher as ``cat`` of views or as
# ``stack``; ``.to``, ``.contiguous`` as ``_to_copy``, ``clone``). GEMMs read weights
# without copying them and are not in it.
_COPY_OPS = frozenset({"stack", "cat", "clone", "_to_copy", "copy_", "copy", "index_select",
                       "index", "gather", "take", "flip", "roll", "repeat", "narrow_copy",
                       "as_strided_copy", "expand_copy", "view_copy", "slice_copy",
                       "unbind_copy", "split_copy", "select_copy", "permute_copy",
                       "transpose_copy", "t_copy", "_unsafe_view", "constant_pad_nd"})


class WeightCopyCounter(TorchDispatchMode):
    """Bytes that copy ops (``_COPY_OPS``) write from tensors aliasing the given weights'
    storages, per phase; an in-place copy into a weight is a write to it, not counted."""

    def __init__(self, weights) -> None:
        super().__init__()
        self.storages = {w.untyped_storage()._cdata for w in weights}
        self.phase = ""
        self.bytes: dict[str, int] = {}
        self.ops: dict[str, list[str]] = {}

    def _aliases(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _COPY_OPS:
            sources = args[1:2] if name == "copy_" else tree_flatten((args, kwargs))[0]
            written = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                       and not self._aliases(t)]
            if any(self._aliases(t) for t in sources) and written:
                self.bytes[self.phase] = self.bytes.get(self.phase, 0) + sum(
                    t.numel() * t.element_size() for t in written)
                self.ops.setdefault(self.phase, []).append(name)
        return out


def _wrap_experts(layer, wrap: str):
    """The layer as a training run holds it: ``module`` as built; ``ddp`` / ``distopt``
    wrapped in Megatron's DistributedDataParallel without / with the distributed
    optimizer's parameter buffer; ``separate`` each expert weight in a storage of its
    own (as every parameter was before the layer shared one buffer)."""
    # deferred: Megatron-Core, for the layer cases only (the region's processes skip it)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if wrap in ("ddp", "distopt"):
        return DistributedDataParallel(
            config=layer.config, module=layer, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=wrap == "distopt"))
    if wrap == "separate":
        for expert in layer.experts.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                linear.weight.data = linear.weight.data.clone()
    elif wrap != "module":
        raise ValueError(f"wrap {wrap!r}: module, ddp, distopt or separate")
    return layer


def run_weight_copy_case(case: Case, rank: int, wrap: str,
                         model: str = "qwen3-30b-a3b") -> dict:
    """Bytes of expert weights copied in one LRMoELayer call, forward and backward, at
    ``model``'s shape as rank ``rank`` of a fake EP group (``megatron_fake_cuda``), the
    experts held as ``wrap`` says (``_wrap_experts``)."""
    # deferred: Megatron-Core, for the layer cases only (the region's processes skip it)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    spec = MODELS[model]
    t = spec.shape(case.ep).tokens_per_rank
    counts = case_counts(case, model)
    with megatron_fake_cuda(rank, case.ep):
        mlp = get_gpt_layer_local_spec(num_experts=spec.num_experts,
                                       moe_grouped_gemm=True).submodules.mlp
        layer = to_lrmoe_spec(mlp)(config=qwen3_layer_config(case, model), layer_number=1)
        layer.set_layer_number(1)
        move_parameters_to_fake_cuda(layer)
        module = _wrap_experts(layer, wrap)
        setup_lrmoe_layers([layer], t, 1)
        layer.counts_exchange = TraceCountsExchange(counts, rank)
        x = torch.empty(t // 2, 2, spec.hidden_size, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        if case.replicas:
            module(x)
            layer.finish_step()
        weights = [w for e in layer.experts.local_experts
                   for w in (e.linear_fc1.weight, e.linear_fc2.weight)]
        counter = WeightCopyCounter(weights)
        with counter:
            counter.phase = "forward"
            out, _ = module(x)
            counter.phase = "backward"
            node, _ = region_node(out)
            backward_through_node(node, torch.empty(t, spec.hidden_size, device="cuda",
                                                    dtype=torch.bfloat16))
        stats = layer.lrmoe_stats.calls[-1]
        return {"case": case.name, "wrap": wrap, "bytes": counter.bytes, "ops": counter.ops,
                "weight_bytes": sum(w.numel() * w.element_size() for w in weights),
                "grouped_gemm": stats.grouped_gemm,
                "weight_bytes_copied": stats.weight_bytes_copied}


# -----------------------------------------------------------------------------
# The same cases on a real device (scripts/dev/region_at_scale_check.py)
# -----------------------------------------------------------------------------
#
# Process group: one process cannot be rank r of a real group of 8 (NCCL needs the other
# seven), and the project's GPU machine has one GPU (EP = visible GPUs would be EP 1, a
# different plan from the trace's). So the real-device mode runs rank r's share of the
# EP-R plan as a 1-rank region (``group=None``, no exchange): ``rank_view_plan`` keeps
# rank r's instances (homes, then replicas) and gives the one source every row rank r
# receives from all R sources, with the same quotas. Rank r's grouped GEMMs then get
# exactly the rows, per instance, that they get in the EP-R run; what it leaves out are
# the all-to-alls (exchange traffic), which one GPU cannot measure anyway.


def rank_view_plan(plan, rank: int):
    """A 1-rank ``RetentionPlan`` of what rank ``rank`` computes in ``plan``: its
    instances, each with the rows (counts and quotas summed over the sources) it
    receives; the GEMMs' rows per instance are the EP plan's for that rank."""
    local = [i for i, r in enumerate(plan.instance_rank) if r == rank]
    return RetentionPlan(
        counts=plan.counts[:, local].sum(0, keepdim=True),
        quotas=plan.quotas[:, local].sum(0, keepdim=True),
        capacity=plan.capacity[rank:rank + 1].clone(),
        water_level=plan.water_level[rank:rank + 1].clone(),
        instance_rank=(0,) * len(local),
        instance_expert=tuple(plan.instance_expert[i] for i in local),
        capacity_factor=plan.capacity_factor, min_retention=plan.min_retention)


class _DeviceRecorder(TorchDispatchMode):
    """What the region made on a real device (device, dtype, shape, pinned) and the
    grouped GEMMs' operands; offsets are cloned on the device (no host read) and read
    after the call (``gemm_calls``)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.made: list[MadeTensor] = []
        self._gemms: list[tuple[str, tuple, tuple, int, torch.Tensor | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name == "_grouped_mm":
            a, b = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            grouped = a.shape[0] if b.dim() == 3 else a.shape[1]
            self._gemms.append((self.phase, tuple(a.shape), tuple(b.shape), grouped,
                                None if offs is None else offs.clone()))
        out = func(*args, **kwargs)
        if self.phase:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    pinned = t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()
                    self.made.append(MadeTensor(self.phase, name, t.device.type,
                                                str(t.dtype).removeprefix("torch."),
                                                tuple(t.shape), pinned))
        return out

    def gemm_calls(self) -> list[GemmCall]:
        calls = []
        for phase, a, b, grouped, offs in self._gemms:
            rows = None
            if offs is not None:
                ends = offs.cpu().tolist()
                rows = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
            calls.append(GemmCall(phase, a, b, grouped, rows, None if offs is None else
                                  str(offs.dtype).removeprefix("torch.")))
        return calls


@contextlib.contextmanager
def _sync_debug(device: torch.device, errors: dict[str, str | None], phase: str):
    """``torch.cuda.set_sync_debug_mode("error")`` over the block on CUDA: a sync inside
    the region's ops or kernels raises; the message is kept in ``errors[phase]``."""
    errors[phase] = None
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        errors[phase] = str(exc).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _timer(device: torch.device):
    """() -> stop() -> milliseconds: CUDA events on CUDA, the wall clock elsewhere."""
    if device.type == "cuda":
        def start():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()

            def stop() -> float:
                end.record()
                end.synchronize()
                return begin.elapsed_time(end)
            return stop
        return start

    def start_wall():
        t0 = time.perf_counter()
        return lambda: (time.perf_counter() - t0) * 1e3
    return start_wall


@dataclass
class DeviceRun:
    """One region call on a real device (``run_case_on_device``): ``record`` is plain
    data (``check_device_record`` judges it); ``values`` the outputs and gradients, for
    the numerics comparison; ``plan`` the EP-R plan, ``view`` rank r's 1-rank share."""

    record: dict
    values: dict[str, torch.Tensor]
    plan: object
    view: object


def run_case_on_device(case: Case, rank: int, device: str | torch.device = "cuda", *,
                       tokens: int | None = None, dtype: torch.dtype = torch.bfloat16,
                       kernels: str = "auto", grouped_gemm: bool | None = True,
                       hidden: int | None = None, ffn: int | None = None,
                       reps: int = 0, warmup: int = 1, seed: int = 0,
                       model: str = "qwen3-30b-a3b") -> DeviceRun:
    """``run_case``'s case on real tensors of ``device``: the same plan from the trace's
    counts (at ``tokens`` per rank x top-k pairs), rank ``rank``'s share run as a 1-rank
    region (``rank_view_plan``), forward then backward through autograd, each under
    ``torch.cuda.set_sync_debug_mode("error")`` on CUDA and the ``HostReadDetector``.
    Inputs are drawn in fp32 from ``seed`` and rounded to bf16 first, so that a run in
    another dtype (the CPU fp32 reference) sees the same values. ``reps`` > 0: then
    forward and backward timed (CUDA events), median of ``reps`` after ``warmup``."""
    device = torch.device(device)
    spec = MODELS[model]
    h, f, e = hidden or spec.hidden_size, ffn or spec.ffn_hidden_size, spec.num_experts
    t = tokens or spec.shape(case.ep).tokens_per_rank
    f1 = 2 * f if spec.gated else f
    counts = trace_counts(case.ep, t * spec.topk)
    planner = case_planner(case, counts, e)
    planner.observe(counts)
    plan = planner.plan(counts).retention
    view = rank_view_plan(plan, rank)
    local = [i for i, r in enumerate(plan.instance_rank) if r == rank]
    homes = sum(1 for i in local if plan.instance_expert[i] // (e // case.ep) == rank)
    routed = view.counts[0].tolist()
    pairs = sum(routed)

    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, rand=False):
        v = torch.rand(*shape, generator=gen) if rand else torch.randn(*shape, generator=gen)
        return (v * scale).to(torch.bfloat16).to(device=device, dtype=dtype)

    w1 = tuple(draw(f1, h, scale=h ** -0.5).requires_grad_(j < homes) for j in range(len(local)))
    w2 = tuple(draw(h, f, scale=f ** -0.5).requires_grad_(j < homes) for j in range(len(local)))
    biased = len(local) if case.bias else 0
    b1 = tuple(draw(f1, scale=0.5).requires_grad_(j < homes) for j in range(biased))
    b2 = tuple(draw(h, scale=0.5).requires_grad_(j < homes) for j in range(biased))
    home_params = (*w1[:homes], *w2[:homes], *b1[:homes], *b2[:homes])
    for w in home_params:
        w.grad = torch.zeros_like(w)          # Megatron's gradient buffers exist before
    experts = ExpertWeights(w1[:homes], w2[:homes], _swiglu, b1=b1[:homes], b2=b2[:homes])
    if len(local) > homes:
        experts = experts.with_replicas(w1[homes:], w2[homes:], b1[homes:], b2[homes:])
    kinds = PARAM_KINDS[:len(experts.params)]
    x0 = draw(t, h)
    # Each instance's rows: distinct tokens where it has at most T rows, sorted
    # (instance-major, then token, as the layer sends them).
    chunks = []
    for n in routed:
        pick = (torch.randperm(t, generator=gen)[:n] if n <= t
                else torch.randint(0, t, (n,), generator=gen))
        chunks.append(pick.sort().values)
    pair_token = torch.cat(chunks).to(device) if chunks else torch.zeros(0, dtype=torch.int64,
                                                                          device=device)
    prob0 = torch.rand(pairs, generator=gen).to(device)
    dy = draw(t, h)
    replica_grads: list[torch.Tensor] = []

    def on_replica_grads(grads):
        replica_grads[:] = [g for kind in grads for g in kind]
        return ()

    def call(recorder=None, errors=None, detector=None):
        x = x0.detach().clone().requires_grad_(True)
        pair_prob = prob0.detach().clone().requires_grad_(True)
        rc = RegionContext(plan=view, group=None, rank=0, selection=case.selection,
                           kernels=kernels, grouped_gemm=grouped_gemm,
                           on_replica_grads=on_replica_grads)
        modes = contextlib.ExitStack()
        if recorder is not None:
            modes.enter_context(recorder)
            recorder.phase = "forward"
        y = None
        with modes:
            with _sync_debug(device, errors if errors is not None else {}, "forward"):
                y = lrmoe_region(x, pair_token, pair_prob, rc, experts)
            reads_fwd = list(detector.reads) if detector is not None else []
            if detector is not None:
                detector.clear()
            if recorder is not None:
                recorder.phase = "backward"
            if y is not None:
                with _sync_debug(device, errors if errors is not None else {}, "backward"):
                    y.backward(dy)
            if recorder is not None:
                recorder.phase = ""
        return rc, x, pair_prob, y, reads_fwd

    # A warm-up call outside the records (the grouped GEMM's start-up probe, first-call
    # set-up), then the gradient buffers zeroed for the checked call.
    call()
    for w in home_params:
        w.grad.zero_()
    recorder, errors = _DeviceRecorder(), {}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with HostReadDetector() as detector:
        detector.taint(x0, prob0, dy, *w1, *w2, *b1, *b2)
        rc, x, pair_prob, y, reads_fwd = call(recorder, errors, detector)
        reads_bwd = list(detector.reads)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    names = [f"d{kind}[{j}]" for kind in kinds for j in range(homes)]
    values: dict[str, torch.Tensor] = {}
    if y is not None:
        values = {"y": y.detach(), "dx": x.grad, "dpair_prob": pair_prob.grad}
        values.update(zip(names, [w.grad.clone() for w in home_params], strict=True))
        r = len(local) - homes
        held = list(replica_grads)         # the timed calls below replace the hook's list
        for k, kind in enumerate(kinds):    # the hook's list is kind-major
            values.update({f"replica d{kind}[{j}]": g
                           for j, g in enumerate(held[k * r:(k + 1) * r])})
    seconds: dict[str, float] = {}
    if reps > 0 and y is not None:
        timer, times = _timer(device), {"forward": [], "backward": []}
        for k in range(warmup + reps):
            xt = x0.detach().clone().requires_grad_(True)
            pt = prob0.detach().clone().requires_grad_(True)
            rct = RegionContext(plan=view, group=None, rank=0, selection=case.selection,
                                kernels=kernels, grouped_gemm=grouped_gemm,
                                on_replica_grads=on_replica_grads)
            stop = timer()
            yt = lrmoe_region(xt, pair_token, pt, rct, experts)
            fwd = stop()
            stop = timer()
            yt.backward(dy)
            bwd = stop()
            if k >= warmup:
                times["forward"].append(fwd)
                times["backward"].append(bwd)
        seconds = {phase: float(np.median(v)) / 1e3 for phase, v in times.items()}
    record = {
        "case": case.name, "rank": rank, "device": device.type,
        "dtype": str(dtype).removeprefix("torch."), "hidden": h, "ffn": f, "tokens": t,
        "pairs": pairs, "local_instances": len(local), "home_instances": homes,
        "bias": case.bias, "grouped_gemm": rc.stats.grouped_gemm,
        "forward_retention": rc.forward_retention,
        "routed": routed, "retained": view.quotas[0].tolist(),
        "sync_errors": errors, "forward_reads": [_read(r) for r in reads_fwd],
        "backward_reads": [_read(r) for r in reads_bwd],
        "made": [asdict(m) for m in recorder.made],
        "gemms": [asdict(g) for g in recorder.gemm_calls()],
        "outputs": {n: _dims(v) for n, v in values.items()},
        "peak_bytes": peak if cuda else None, "seconds": seconds}
    return DeviceRun(record, values, plan, view)


def check_device_record(record: dict, plan) -> list[str]:
    """What a real-device run must show, as the fake-CUDA test checks it (empty: all
    held): outputs' shapes, dtypes and device; every tensor the region made on the device
    (on CUDA: the pinned staging buffer aside) in the design's dtypes; no host read and
    no sync in the region; each grouped GEMM got rank r's routed rows (forward) and
    retained rows (backward) of ``plan`` (``InstanceRows.of_plan``)."""
    bad: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            bad.append(what)

    dev, dt = record["device"], record["dtype"]
    t, h, f, rank = record["tokens"], record["hidden"], record["ffn"], record["rank"]
    out = record["outputs"]
    need(out.get("y") == [[t, h], dt, dev], f"y {out.get('y')}")
    need(out.get("dx") == [[t, h], dt, dev], f"dx {out.get('dx')}")
    need(out.get("dpair_prob") == [[record["pairs"]], "float32", dev],
         f"dpair_prob {out.get('dpair_prob')}")
    kinds = {"w1": [2 * f, h], "w2": [h, f]}
    if record["bias"]:
        kinds.update(b1=[2 * f], b2=[h])
    replicas = record["local_instances"] - record["home_instances"]
    for kind, dims in kinds.items():
        for name in ([f"d{kind}[{j}]" for j in range(record["home_instances"])]
                     + [f"replica d{kind}[{j}]" for j in range(replicas)]):
            need(out.get(name) == [dims, dt, dev], f"{name} {out.get(name)}")
    made = [m for m in record["made"] if m["phase"] in ("forward", "backward")]
    need({m["phase"] for m in made} == {"forward", "backward"}, "no ops recorded")
    off = [m for m in made if m["device"] != dev]
    need(all(m["pinned_staging"] and m["phase"] == "forward" for m in off),
         f"off-device tensors {off[:3]}")
    wide = ("bfloat16", "float16") if dt != "float32" else ()
    for m in made:
        ok = m["dtype"] in (dt, *wide, "float32", "int64", "int32", "bool")
        if m["dtype"] == "float32" and dt != "float32":
            ok = ok and len(m["shape"]) <= 1
        need(ok, f"made {m}")
    for phase, err in record["sync_errors"].items():
        need(err is None, f"sync in {phase}: {err}")
    need(not any(fr.startswith("region.py:") for _, fs in record["forward_reads"] for fr in fs),
         f"host read in the region's forward {record['forward_reads']}")
    need(record["backward_reads"] == [], f"host reads in backward {record['backward_reads']}")
    rows = InstanceRows.of_plan(plan)
    local = np.flatnonzero(rows.rank == rank)
    routed, retained = rows.routed[local].tolist(), rows.retained[local].tolist()
    need(record["routed"] == routed, "rank view's routed rows differ from the plan's")
    need(record["retained"] == retained, "rank view's retained rows differ from the plan's")
    if record["grouped_gemm"]:
        gemms = record["gemms"]
        # Backward: dH, dX, dW2, dW1 and, with biases, their gradients' row sums.
        backward = 6 if record["bias"] else 4
        need([g["phase"] for g in gemms] == ["forward"] * 2 + ["backward"] * backward,
             f"grouped GEMM phases {[g['phase'] for g in gemms]}")
        for g in gemms:
            want = routed if g["phase"] == "forward" else retained
            need(g["offs_dtype"] == "int32" and g["group_rows"] == want
                 and g["grouped_rows"] == sum(want), f"{g['phase']} GEMM rows {g['a']}x{g['b']}")
    return bad


def compare_values(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                   names: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Per tensor: (relative Frobenius error ||got - ref|| / ||ref||, max |got - ref| /
    max |ref|), both in float64 on the CPU."""
    out = {}
    for name in names if names is not None else list(ref):
        a, b = got[name].detach().double().cpu(), ref[name].detach().double().cpu()
        scale = float(b.norm()) or 1.0
        top = float(b.abs().max()) if b.numel() else 1.0
        out[name] = (float((a - b).norm()) / scale,
                     float((a - b).abs().max()) / (top or 1.0) if b.numel() else 0.0)
    return out


def _parse_case(spec: str) -> Case:
    """``EP:GAMMA:SELECTION:REPLICAS[:BIAS]`` (flags 0 or 1) as a ``Case``."""
    ep, gamma, selection, replicas, *bias = spec.split(":")
    return Case(int(ep), math.inf if gamma == "inf" else float(gamma), selection,
                replicas == "1", bias == ["1"])


def main(argv: list[str] | None = None) -> int:
    """``python -m lrmoe_testing.cuda_harness [layer] RANK
    EP:GAMMA:SELECTION:REPLICAS[:BIAS] ...``: one JSON list of case results (``layer``: of
    the whole layer) on stdout."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "weights":       # ``... weights RANK WRAP CASE ...``
        json.dump([run_weight_copy_case(_parse_case(c), int(argv[1]), argv[2])
                   for c in argv[3:]], sys.stdout)
        return 0
    layer = bool(argv) and argv[0] == "layer"     # ``... layer RANK CASE ...``: the layer
    argv = argv[1:] if layer else argv
    rank = int(argv[0])
    cases = [_parse_case(spec) for spec in argv[1:]]
    json.dump([asdict(run_layer_case(c, rank)) for c in cases] if layer
              else run_cases(cases, rank), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

