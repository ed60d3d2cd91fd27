"""``--record-routing DIR``: every MoE layer's routed counts per micro-batch and source.

Works for Megatron's MoELayer and for LRMoELayer alike, because both route through
Megatron's router module: a forward hook on the router keeps a reference to the
routing map [T, E] of each training call, and a forward hook on the MoE layer,
registered after the timer's (``attach`` must run after ``attach_moe_timer``), reduces
it to its column sums [E] once the timed forward span has closed. Maps are reduced per
call rather than kept for the step because a step can hold many (layers x
micro-batches x T x E bytes).

Once per step, after the optimizer step and outside every timed span, ``end_step``
moves the step's counts to the host, gathers them from every rank (one all_gather of
[layers, M, E] integers per rank), and rank 0 appends them to the trace (numbered
``.npz`` chunks every ``flush_every`` steps and at ``close``; the format, the reader
and the load arithmetic are in ``megatron_lrmoe/data/routing_traces.py``). It also returns,
for the step's log record, each layer's routed load max/mean over the EP ranks under
Megatron's expert layout (the maximum over the step's micro-batches and EP groups,
as ``lrmoe/layer<N>/load-max-over-mean`` takes the maximum over calls).

Megatron's MoELayer also has its experts' input counted: a forward pre-hook on
``layer.experts`` keeps the ``tokens_per_expert`` the dispatcher handed them (rows per
local expert, after any capacity drop). ``end_step(..., interval_end=True)`` gathers
their sums since the last interval end as ``routing/layer<N>/instance-rows`` ([W][L]
by global rank): what the dispatch delivered, which the simulator's
replay of the recorded counts must reproduce exactly
(``lrmoe_studies.simulator_counts``). LRMoE's layer does not call its experts
module; its dispatch is counted by its own statistics (``lrmoe/layer<N>/instance-rows``).

Without a trace directory (``start_recording(args, model, path=None)``) nothing is
written: the launcher holds a run with Megatron's own MoE layer to its device
(``--device-memory-gb``) from each step's gathered counts (``last_step``).

Only training calls are recorded (module in training mode, autograd on): evaluation
passes are not, nor the first pass of a recomputed layer, which runs without autograd;
its recomputed pass in backward is recorded (docs/design.md, "Recompute"). Under
Megatron's selective ``moe`` recompute that pass runs inside the layer's backward,
without the layer's forward hook, so its map waits until the layer's next forward or
the step's end. A layer routing other than once per micro-batch in a step is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_layer import BaseMoELayer

from megatron_lrmoe.config.flags import tokens_per_rank
from megatron_lrmoe.data import routing_traces as rt

__all__ = ["RoutingRecorder", "RoutingRecordError", "start_recording"]


class RoutingRecordError(ValueError):
    """A trace directory this run cannot write to (the message names the flag)."""


class RoutingRecorder:
    """Records routed counts of the MoE layers of this rank's model chunks."""

    def __init__(self, path: str | None, header: dict,
                 local_layers: dict[int, torch.nn.Module], flush_every: int = 50) -> None:
        self.path = path
        """The trace directory; None: gather the counts (``last_step``), write nothing."""
        self.header = header
        self.layers: list[int] = list(header["model"]["moe_layers"])
        self.microbatches = int(header["parallel"]["microbatches_per_step"])
        self.num_experts = int(header["model"]["num_experts"])
        self.ep = int(header["parallel"]["ep"])
        self.flush_every = flush_every
        self._modules = local_layers
        self._pending: dict[int, list[torch.Tensor]] = {n: [] for n in local_layers}
        self._calls: dict[int, list[torch.Tensor]] = {n: [] for n in local_layers}
        self._expert_rows: dict[int, list[torch.Tensor]] = {n: [] for n in local_layers}
        self._interval_rows: np.ndarray | None = None   # [L, local experts], this interval
        self._buffer_iterations: list[int] = []
        self._buffer_counts: list[np.ndarray] = []
        self._chunk = rt.next_chunk_number(path) if path and dist.get_rank() == 0 else 0
        self._handles: list = []
        self.last_step: np.ndarray | None = None
        """[L, M, S, E] counts of the step ``end_step`` last gathered (every rank)."""

    # ---------------------------------------------------------------- hooks
    def attach(self) -> None:
        """Hook every local MoE layer (after ``attach_moe_timer``, see the module doc)."""
        for number, layer in self._modules.items():
            self._handles.append(layer.router.register_forward_hook(self._router_hook(number)))
            self._handles.append(layer.register_forward_hook(self._layer_hook(number)))
            self._handles.append(
                layer.experts.register_forward_pre_hook(self._experts_hook(number)))

    def _router_hook(self, number: int):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled():
                self._pending[number].append(output[1])   # routing map [T, E] bool
        return hook

    def _experts_hook(self, number: int):
        def hook(module, args):
            if module.training and torch.is_grad_enabled():
                self._expert_rows[number].append(torch.as_tensor(args[1]))  # tokens_per_expert
        return hook

    def _layer_hook(self, number: int):
        def hook(module, args, output):
            self._reduce_pending(number)
        return hook

    def _reduce_pending(self, number: int) -> None:
        for routing_map in self._pending[number]:
            self._calls[number].append(routing_map.sum(dim=0, dtype=torch.int64))
        self._pending[number].clear()

    # ------------------------------------------------------------ per step
    def end_step(self, iteration: int, interval_end: bool = False) -> dict[str, object]:
        """Gather this step's counts from every rank (kept in ``last_step``), buffer them
        (rank 0, with a trace directory) and return ``routing/layer<N>/load-max-over-mean``
        for the log record; at ``interval_end`` also the experts' input rows since the
        last (``routing/layer<N>/instance-rows``, Megatron's layer only). Collective."""
        m, e = self.microbatches, self.num_experts
        local = torch.zeros(len(self.layers), m, e, dtype=torch.int64)
        for number, calls in self._calls.items():
            self._reduce_pending(number)     # a last map recomputed in backward
            if len(calls) != m:
                raise RuntimeError(
                    f"--record-routing: MoE layer {number} routed {len(calls)} time(s) in "
                    f"iteration {iteration}, expected {m} (one per micro-batch)")
            # The host sync of the step's counts: here, after every timed span.
            local[self.layers.index(number)] = torch.stack(calls).cpu()
            calls.clear()
        if dist.get_backend() == "nccl":   # NCCL gathers device tensors only
            local = local.to(torch.device("cuda", torch.cuda.current_device()))
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        table = torch.stack(gathered).cpu().numpy()                 # [W, L, M, E]
        step = np.stack([
            np.stack([table[row["rank"], index] for row in self.header["sources"][str(n)]],
                     axis=1)                                          # [M, S, E]
            for index, n in enumerate(self.layers)])                  # [L, M, S, E]
        self.last_step = step
        if self.path and dist.get_rank() == 0:
            self._buffer_iterations.append(iteration)
            self._buffer_counts.append(step)
            if len(self._buffer_iterations) >= self.flush_every:
                self.flush()
        self._add_expert_rows()
        out: dict[str, object] = self.step_load(step)
        return out | self._gather_expert_rows() if interval_end else out

    def _add_expert_rows(self) -> None:
        """This step's experts' input rows, summed per layer (a host read, after every
        timed span), into the interval's sums."""
        width = self.num_experts // self.ep
        rows = np.zeros((len(self.layers), width), dtype=np.int64)
        for number, calls in self._expert_rows.items():
            if calls:
                rows[self.layers.index(number)] = torch.stack(calls).sum(0).cpu().numpy()
            calls.clear()
        self._interval_rows = rows if self._interval_rows is None else self._interval_rows + rows

    def _gather_expert_rows(self) -> dict[str, list]:
        """The interval's experts' input rows from every rank: [W][L] per layer, for the
        layers whose experts ran (Megatron's layer); then a new interval."""
        local = torch.from_numpy(self._interval_rows)
        if dist.get_backend() == "nccl":   # NCCL gathers device tensors only
            local = local.to(torch.device("cuda", torch.cuda.current_device()))
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        table = torch.stack(gathered).cpu().numpy()                 # [W, L, local experts]
        self._interval_rows = None
        out = {}
        for index, number in enumerate(self.layers):
            if table[:, index].any():
                out[f"routing/layer{number}/instance-rows"] = table[:, index].tolist()
        return out

    def step_load(self, step: np.ndarray) -> dict[str, float]:
        """Per layer: max over micro-batches and EP groups of the routed load max/mean over
        the EP ranks of the group (Megatron's contiguous expert layout)."""
        out = {}
        for index, number in enumerate(self.layers):
            groups = rt.ep_groups(self.header["sources"][str(number)])
            ratio = max(float(rt.load_max_over_mean(step[index][:, group], self.ep).max())
                        for group in groups)
            out[f"routing/layer{number}/load-max-over-mean"] = ratio
        return out

    def flush(self) -> None:
        """Write the buffered steps as the next chunk (rank 0; no-op elsewhere)."""
        if not self.path or dist.get_rank() != 0 or not self._buffer_iterations:
            return
        rt.write_chunk(self.path, self._chunk, np.asarray(self._buffer_iterations),
                       np.stack(self._buffer_counts))
        self._chunk += 1
        self._buffer_iterations, self._buffer_counts = [], []

    def close(self) -> None:
        self.flush()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# -----------------------------------------------------------------------------
# Set-up from the launcher's arguments
# -----------------------------------------------------------------------------


def _moe_layers_of(module_chunks) -> dict[int, torch.nn.Module]:
    found = {}
    for chunk in module_chunks:
        for module in chunk.modules():
            if isinstance(module, BaseMoELayer):
                found[int(module.layer_number)] = module
    return found


def model_description(args: argparse.Namespace, moe_layers: list[int]) -> dict:
    """The header's model section, from the launcher's flags."""
    return {
        "num_layers": args.num_layers, "hidden_size": args.hidden_size,
        "num_experts": args.num_experts, "topk": args.moe_router_topk,
        "score_function": args.moe_router_score_function,
        "load_balancing_type": args.moe_router_load_balancing_type,
        "aux_loss_coeff": args.moe_aux_loss_coeff,
        "expert_bias": bool(args.moe_router_enable_expert_bias),
        "shared_expert_size": args.moe_shared_expert_intermediate_size,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
        "capacity_factor": args.moe_expert_capacity_factor,
        "moe_lrmoe": bool(args.moe_lrmoe),
        "moe_layers": moe_layers,
    }


def start_recording(args: argparse.Namespace, model_chunks,
                    path: str | None = "") -> RoutingRecorder:
    """Build the header (every rank contributes its layers and EP coordinates), check or
    create the trace directory (``path``; "" for ``args.record_routing``, None for none:
    the counts are gathered each step but not written) and hook this rank's MoE layers.
    Collective."""
    path = args.record_routing if path == "" else path
    local = _moe_layers_of(model_chunks)
    ep_group = ps.get_expert_model_parallel_group()
    me = {"rank": dist.get_rank(), "ep_rank": ps.get_expert_model_parallel_rank(),
          "ep_group": min(dist.get_process_group_ranks(ep_group)) if ep_group is not None
          else dist.get_rank(), "layers": sorted(local)}
    everyone: list[dict] = [None] * dist.get_world_size()   # type: ignore[list-item]
    dist.all_gather_object(everyone, me)
    moe_layers = sorted({n for row in everyone for n in row["layers"]})
    sources = {n: [{k: row[k] for k in ("rank", "ep_rank", "ep_group")}
                   for row in everyone if n in row["layers"]] for n in moe_layers}
    parallel = {
        "world_size": dist.get_world_size(), "tp": args.tensor_model_parallel_size,
        "pp": args.pipeline_model_parallel_size, "ep": args.expert_model_parallel_size,
        "dp": ps.get_data_parallel_world_size(),
        "microbatches_per_step": args.num_microbatches,
        "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length,
        "tokens_per_source": tokens_per_rank(args),
    }
    header = rt.make_header(model_description(args, moe_layers), parallel, sources)
    header["command"] = " ".join(_command())
    if path:
        error = None
        if dist.get_rank() == 0:
            error = _prepare_directory(path, header)
        flag = [error]
        dist.broadcast_object_list(flag, src=0)
        if flag[0] is not None:
            raise RoutingRecordError(flag[0])
    recorder = RoutingRecorder(path, header, local)
    recorder.attach()
    return recorder


def _prepare_directory(path: str, header: dict) -> str | None:
    """Create the trace directory or check that an existing trace is this run's
    (a resumed run appends). Returns an error message naming the flag, or None."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        return f"--record-routing {path}: exists and is not a directory"
    existing = directory / rt.HEADER
    if existing.is_file():
        old = json.loads(existing.read_text())
        section = rt.header_mismatch(old, header)
        if section is not None:
            return (f"--record-routing {path}: holds a trace with another {section} "
                    f"(old {old.get(section)!r}, this run {header.get(section)!r}); give a "
                    f"new directory")
        return None
    if directory.is_dir() and any(directory.iterdir()):
        return f"--record-routing {path}: not empty and not a routing trace; give a new directory"
    rt.write_header(directory, header)
    return None


def _command() -> list[str]:
    return [os.path.basename(sys.executable), *sys.argv]
