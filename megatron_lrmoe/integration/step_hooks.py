"""LRMoE's step state at Megatron's step boundaries, for a whole model.

Every LRMoE layer keeps state across training steps (what it is: docs/design.md,
"Step state"; where it lives: ``layer/step_state.py``, ``LayerStepState``). The entry
points (``megatron_lrmoe/launcher/training.py`` and the Megatron-LM integration,
``megatron_lrmoe/integration/megatron_lm.py``) drive it through the functions here, at three
explicit points:

* ``setup_lrmoe_layers``: right after the model is built, before a checkpoint is
  loaded. Builds each layer's planner from the tokens of one micro-batch and, where
  the cost model needs them, machine constants from the calibration file or from one
  measurement averaged over all ranks (returned, for the caller to log with its
  figures). Tells every layer the micro-batches of a step (Megatron's
  ``get_num_microbatches``), which is how it finds a step's last backward.
* ``finish_lrmoe_step``: once per optimizer step (taken or skipped), after
  ``optimizer.step()``. Pools each layer's observed counts over its expert-data-parallel
  group (one all-reduce for all layers) so that every replica of a layer folds the same
  counts, then advances every planner, marks the replicas for refresh and moves the
  draws to the next step's seeds.
* ``lrmoe_step_memory``: after ``finish_lrmoe_step``, with a run held to its device
  (``setup_lrmoe_layers(..., hold_memory=True)``): this rank's bytes of each layer in the
  step just ended, from its planner's per-call memory (no communication); the launcher
  adds them to the memory account and stops a step over the device.
* ``snapshot_lrmoe_state`` / ``restore_lrmoe_state``: what a step changed, undone;
  ``chain_to_rerun_state_machine`` hands them to Megatron's ``RerunStateMachine``
  (its public ``state_save_func`` / ``state_restore_func``, chained to what is there),
  so a re-run step counts once.

Checkpoints need no launcher code: the state is each layer's module extra state
(``LRMoELayer.get_extra_state``, kept by ``layer/step_state.py``), present in the sharded
state dict when its metadata carries ``STEP_STATE_FLAG`` (``checkpoint_content_metadata``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_lrmoe.integration.planner_inputs import (
    agreed_machine_constants,
    needs_cost_model,
    planner_settings,
)
from megatron_lrmoe.layer.moe_layer import LRMoELayer
from megatron_lrmoe.layer.stats import lrmoe_layers
from megatron_lrmoe.layer.step_state import STEP_STATE_FLAG, MicrobatchesPerStep
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.planner import PRICED_MICROBATCHES

__all__ = ["STEP_STATE_FLAG", "chain_to_rerun_state_machine", "checkpoint_content_metadata",
           "finish_lrmoe_step", "format_lrmoe_line", "lrmoe_layers", "lrmoe_step_memory",
           "machine_constants_line", "print_on_last_rank", "restore_lrmoe_state",
           "setup_lrmoe_layers", "snapshot_lrmoe_state", "unconverted_moe_layers",
           "write_lrmoe_stats"]


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup_lrmoe_layers(model_chunks: Iterable[torch.nn.Module], tokens_per_rank: int | None,
                       microbatches_per_step: MicrobatchesPerStep,
                       config=None, hold_memory: bool = False) -> MachineConstants | None:
    """Build every LRMoE layer's planner at model setup (docs/design.md, "Step state"):
    the planner settings come from each layer's config here, and the layer is handed them
    (``LRMoELayer.setup_planner``); it never reads its config to plan.

    ``tokens_per_rank``: tokens of one micro-batch on one rank (micro-batch size x
    sequence length, divided by TP under sequence parallelism); may be None where no
    planner prices memory (no budget, not memory-aware, not held). ``microbatches_per_step``:
    an int or a function (Megatron's ``get_num_microbatches``, which follows a batch-size
    ramp-up). ``config``: the run's TransformerConfig, for ranks whose pipeline stage has
    no LRMoE layer (default: the first layer's). ``hold_memory``: the run is held to its
    device (``--device-memory-gb``): every planner reports the [R] memory of its plans,
    with a budget or without (``lrmoe_step_memory`` reads them at each step's end).

    Collective over all ranks when the cost model needs machine constants and no
    calibration file is given (one measurement per process, averaged, so that every
    rank plans from the same numbers). Returns those constants, or None when no
    layer's planner needs them.
    """
    layers = lrmoe_layers(model_chunks)
    config = config if config is not None else (layers[0].config if layers else None)
    machine = None
    if config is not None and getattr(config, "moe_lrmoe", False) and needs_cost_model(config):
        group = dist.group.WORLD if dist.is_initialized() else None
        machine = agreed_machine_constants(config.moe_lrmoe_calibration, _device(), group)
    # The count is read (once) only where a cost model amortises over it.
    count = (_microbatches(microbatches_per_step)
             if any(needs_cost_model(layer.config) for layer in layers) else 1)
    for layer in layers:
        settings = planner_settings(
            layer.config, layer.lrmoe_state.ep_size, tokens_per_rank,
            count if needs_cost_model(layer.config) else 1, machine, hold_memory=hold_memory)
        layer.setup_planner(settings, microbatches_per_step)
    # One layer per pipeline stage says where the planner state came from at a load.
    if layers and _is_first_rank_of_stage():
        layers[0].lrmoe_state.reports_checkpoint_state = True
    return machine


def _microbatches(microbatches_per_step: MicrobatchesPerStep) -> int:
    count = microbatches_per_step() if callable(microbatches_per_step) else microbatches_per_step
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"setup_lrmoe_layers: microbatches_per_step gave {count!r}, expected "
                         "a positive int")
    return count


def _is_first_rank_of_stage() -> bool:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    return (ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)


def finish_lrmoe_step(model_chunks: Iterable[torch.nn.Module]) -> None:
    """End of one training step for every LRMoE layer: call once per optimizer step,
    taken or skipped, on every rank (collective over each expert-data-parallel group).

    The layers of one rank share their expert-data-parallel group (the pipeline stage's
    ranks with the same expert-parallel position); their step's counts are summed over
    it in one all-reduce, so every replica of a layer folds the same counts and all
    replicas keep one planner state, which is what one checkpoint copy can restore.
    """
    layers = lrmoe_layers(model_chunks)
    if not layers:
        return
    pooled = _pooled_observations(layers)
    for layer, observations in zip(layers, pooled, strict=True):
        layer.finish_step(observations)


def lrmoe_step_memory(model_chunks: Iterable[torch.nn.Module]) -> list[float]:
    """This rank's bytes of each LRMoE layer in the step ``finish_lrmoe_step`` last ended:
    the most any of its training micro-batches planned for this rank (the planner's
    ``CostModel.rank_memory``, computed for the whole EP group on every rank of it; no
    communication). A layer whose planner reports no memory, or that ran no training
    micro-batch, gives 0. Summed over the layers: the rank's MoE part of the step's
    predicted peak (``planning.memory_account.step_peak``)."""
    out = []
    for layer in lrmoe_layers(model_chunks):
        memory = layer.lrmoe_state.last_step_memory
        out.append(0.0 if memory is None else float(memory[layer.counts_exchange.ep_rank]))
    return out


def _pooled_observations(layers: list[LRMoELayer]
                         ) -> list[tuple[torch.Tensor | None, int, list[torch.Tensor]] | None]:
    """Each layer's (counts sum, micro-batches, kept micro-batches' counts) pooled over its
    expert-data-parallel group: the sums summed, the k-th kept micro-batch's counts
    averaged over the ranks that kept a k-th; None where the group is a single rank (the
    layer's own observations stand)."""
    groups: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        group = layer.expert_data_parallel_group
        if group is not None and dist.get_world_size(group) > 1:
            groups.setdefault(id(group), []).append(i)
    out: list[tuple[torch.Tensor | None, int, list[torch.Tensor]] | None] = [None] * len(layers)
    for members in groups.values():
        rows = []
        for i in members:
            planner = layers[i].placement_planner
            counts, micro, kept = planner.observations()
            shape = (planner.settings.num_ranks, planner.settings.num_experts)
            zero = torch.zeros(shape, dtype=torch.float64)
            counts = zero if counts is None else counts
            # [micro, kept, counts, PRICED_MICROBATCHES kept matrices (zeros past kept)]
            slots = [*kept, *[zero] * (PRICED_MICROBATCHES - len(kept))]
            rows.append(torch.cat([torch.tensor([float(micro), float(len(kept))],
                                                dtype=torch.float64), counts.reshape(-1),
                                   *(c.reshape(-1) for c in slots)]))
        flat = torch.cat(rows).to(_device())
        # Integer-valued float64 sums: exact, hence bitwise identical on every rank.
        dist.all_reduce(flat, group=layers[members[0]].expert_data_parallel_group)
        flat = flat.cpu()
        group_size = dist.get_world_size(layers[members[0]].expert_data_parallel_group)
        offset = 0
        for i, row in zip(members, rows, strict=True):
            chunk = flat[offset:offset + row.numel()]
            offset += row.numel()
            planner = layers[i].placement_planner
            shape = (planner.settings.num_ranks, planner.settings.num_experts)
            micro, kept_sum = int(chunk[0]), int(chunk[1])
            matrices = chunk[2:].reshape(1 + PRICED_MICROBATCHES, *shape)
            # Every rank of the group runs the same micro-batches, so each kept the same
            # number: the sum is group size x that, and each slot's mean is exact enough
            # (the planner rounds priced counts to integers).
            kept_each = kept_sum // group_size
            kept = [matrices[1 + k] / group_size for k in range(kept_each)]
            out[i] = (matrices[0].clone() if micro else None, micro, kept)
    return out


def snapshot_lrmoe_state(model_chunks: Iterable[torch.nn.Module]) -> list[dict[str, Any]]:
    """A copy of every LRMoE layer's step state (see ``LRMoELayer.step_state``)."""
    return [layer.step_state() for layer in lrmoe_layers(model_chunks)]


def restore_lrmoe_state(model_chunks: Iterable[torch.nn.Module],
                        snapshot: list[dict[str, Any]]) -> None:
    """Undo what the layers did since ``snapshot_lrmoe_state`` returned ``snapshot``."""
    layers = lrmoe_layers(model_chunks)
    if len(layers) != len(snapshot):
        raise RuntimeError(f"LRMoE state snapshot of {len(snapshot)} layers, the model has "
                           f"{len(layers)}")
    for layer, state in zip(layers, snapshot, strict=True):
        layer.load_step_state(state)


def chain_to_rerun_state_machine(model_chunks: Callable[[], list[torch.nn.Module]]) -> bool:
    """Make Megatron's re-run state machine snapshot and restore the LRMoE state with the
    state it already saves (chained: its own functions still run first). Idempotent per
    machine instance; returns whether this call installed the chain.

    ``model_chunks``: returns the current model chunks when called (the machine saves
    at the start of every step and restores before a re-run).
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    if getattr(machine.state_save_func, "_lrmoe_chained", False):
        return False
    inner_save, inner_restore = machine.state_save_func, machine.state_restore_func

    def state_save_func() -> dict[str, Any]:
        return {"inner": inner_save() if inner_save is not None else None,
                "lrmoe": snapshot_lrmoe_state(model_chunks())}

    def state_restore_func(state: dict[str, Any]) -> None:
        if state.get("inner") and inner_restore is not None:
            inner_restore(state["inner"])
        restore_lrmoe_state(model_chunks(), state["lrmoe"])

    state_save_func._lrmoe_chained = True  # type: ignore[attr-defined]
    machine.state_save_func, machine.state_restore_func = state_save_func, state_restore_func
    return True


def machine_constants_line(machine: MachineConstants) -> str:
    """The planner's machine constants in one log line, with their figures and source,
    then the three exactly (``repr``), so that a replay of the run's placement choices
    (``tools.simulator_counts``) prices with the very numbers the run did: a choice
    between near-equal candidates can turn on the fifth figure."""
    return (f"LRMoE planner machine constants: expert GEMM {machine.gemm_flops_per_s / 1e9:.4g} "
            f"GFLOP/s, all-to-all {machine.alltoall_bytes_per_s / 1e9:.4g} GB/s, latency "
            f"{machine.alltoall_latency_s * 1e6:.4g} us ({machine.source}); exact: "
            f"{machine.gemm_flops_per_s!r} FLOP/s, {machine.alltoall_bytes_per_s!r} B/s, "
            f"{machine.alltoall_latency_s!r} s")


def checkpoint_content_metadata(config) -> dict[str, Any]:
    """What an LRMoE run adds to the sharded state dict metadata it saves with: the flag
    that puts every layer's step state in the checkpoint. Empty without ``moe_lrmoe``."""
    return {STEP_STATE_FLAG: True} if getattr(config, "moe_lrmoe", False) else {}


def unconverted_moe_layers(model_chunks: Iterable[torch.nn.Module]) -> list[str]:
    """Names of the MoE layers that are Megatron's, not LRMoE's (an LRMoE model has none:
    every entry point refuses one, never falls back silently)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [name for chunk in model_chunks for name, m in chunk.named_modules()
            if isinstance(m, MoELayer) and not isinstance(m, LRMoELayer)]


def write_lrmoe_stats(model_chunks: Iterable[torch.nn.Module], iteration: int,
                      interval: int | None, num_layers: int, num_experts: int,
                      tensorboard: Any = None, wandb: Any = None) -> dict[str, float]:
    """At every ``interval``-th iteration: reduce the LRMoE statistics over all ranks
    (collective: every rank calls it at the same iteration), write them as ``lrmoe/...``
    scalars to the TensorBoard writer and the W&B run given, and print one line on the
    last rank. ``num_layers`` counts the MTP layers too. Returns the scalars ({} off the
    interval)."""
    from megatron_lrmoe.layer.stats import collect_lrmoe_stats

    if not interval or iteration % interval:
        return {}
    stats = collect_lrmoe_stats(model_chunks, num_layers, num_experts)
    scalars = {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
    if tensorboard is not None:
        for key, value in scalars.items():
            tensorboard.add_scalar(key, value, iteration)
    if wandb is not None:
        wandb.log(scalars, iteration)
    if "lrmoe/retained-fraction" in scalars:
        print_on_last_rank(format_lrmoe_line(iteration, scalars))
    return scalars


def print_on_last_rank(line: str) -> None:
    """Print ``line`` on the last rank (Megatron's logging rank), as one write of the line
    and its newline: a print's text and newline are two writes on an unbuffered stdout,
    and another rank's output could land between them."""
    if (dist.is_initialized() and dist.get_backend() != "fake"
            and dist.get_rank() != dist.get_world_size() - 1):
        return
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def format_lrmoe_line(iteration: int, stats: dict[str, float]) -> str:
    """The one-line summary: Megatron's iteration prefix and the words of
    ``stats.format_lrmoe_stats``, which the lean launcher prints too."""
    from megatron_lrmoe.layer.stats import format_lrmoe_stats

    return f" [LRMoE] iteration {iteration:8d} | {format_lrmoe_stats(stats)}"
