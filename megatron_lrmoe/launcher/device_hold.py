"""The run's memory against its device.

At start the memory account (planning/memory_account.py) is printed once (with
``--moe-lrmoe`` or ``--device-memory-gb``). On CUDA, after this process's second step,
the caching allocator's peak is checked against it once. With ``--device-memory-gb`` the
run is held to that device size (``DeviceHold``): after every step each rank's predicted
peak (and on CUDA the allocator's) must fit, else every rank raises the same
``DeviceOutOfMemory`` at the same step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

from megatron_lrmoe.config.flags import tokens_per_rank
from megatron_lrmoe.data import routing_traces as rt
from megatron_lrmoe.integration.planner_inputs import (
    allocator_check,
    device_memory_bytes,
    memory_account,
    moe_shape,
)
from megatron_lrmoe.integration.step_hooks import lrmoe_step_memory
from megatron_lrmoe.launcher.logger import log0
from megatron_lrmoe.launcher.routing_record import RoutingRecorder
from megatron_lrmoe.launcher.run_config import budget_source
from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory, stage_moe_memory
from megatron_lrmoe.planning.memory_account import (
    GIB,
    MemoryAccount,
    account_line,
    check_device,
    megatron_layer_levels,
    step_peak,
)

__all__ = ["DeviceHold", "allocator_line", "held", "hold", "print_memory_account"]


def held(args: argparse.Namespace) -> bool:
    """Whether the run is held to its device: ``--device-memory-gb`` given."""
    return getattr(args, "device_memory_gb", None) is not None


def print_memory_account(args: argparse.Namespace, config: TransformerConfig,
                         vocab_size: int) -> MemoryAccount:
    """The run's memory account, printed once on rank 0: its parts in GiB, the device's
    size and the MoE budget the planner uses. ``vocab_size``: padded as the model is."""
    account = memory_account(config, args, vocab_size, args.num_microbatches,
                             device_memory_bytes(getattr(args, "device_memory_gb", None)))
    budget = config.moe_lrmoe_memory_budget_gb if args.moe_lrmoe else None
    line = account_line(account, None if budget is None else budget * GIB, budget_source(args))
    if held(args):
        line += "; held to the device: a step whose peak exceeds it stops the run"
    log0(f"megatron_lrmoe.launcher.pretrain: {line}")
    return account


def allocator_line(account: MemoryAccount, config: TransformerConfig,
                   device: torch.device) -> str:
    """On CUDA: the caching allocator's peak against the memory account (one host read;
    the planner keeps the account's budget), as one line."""
    budget = getattr(config, "moe_lrmoe_memory_budget_gb", None)
    peak = torch.cuda.max_memory_allocated(device)
    return "megatron_lrmoe.launcher.pretrain: " + allocator_check(
        account, peak, None if budget is None else budget * GIB)


@dataclass(frozen=True)
class MegatronMemory:
    """What Megatron's own MoE layers hold per rank, from their routed counts."""

    model: MegatronMoEMemory
    """The memory model of the layer's shape (its recompute fields: the run's, which the
    stage composes)."""
    capacity_factor: float | None
    pad: bool


@dataclass(frozen=True)
class DeviceHold:
    """A run held to its device (``--device-memory-gb``): what each step is checked with."""

    account: MemoryAccount
    lrmoe: bool
    megatron: MegatronMemory | None
    """With Megatron's own MoE layer: its layers' memory model (None with --moe-lrmoe,
    whose planners report their memory, or a dense model)."""
    device: torch.device

    def check_step(self, model: list, recorder: RoutingRecorder | None, iteration: int,
                   record: dict) -> None:
        """After each step: every rank's predicted peak (the account outside the MoE
        layers plus this step's MoE bytes: LRMoE's planners' per-call memory, or Megatron's
        layer memory of the gathered routed counts) and, on CUDA, the allocator's peak,
        against the device; one all_reduce of a [world, 2] table, so every rank raises the
        same ``DeviceOutOfMemory`` at the same step. The worst predicted peak goes into the
        record (``memory-predicted-peak-gib``)."""
        if self.lrmoe:
            moe = sum(lrmoe_step_memory(model))
        elif self.megatron is not None and recorder is not None:
            moe = _megatron_moe_bytes(self.megatron, recorder)
        else:
            moe = 0.0
        cuda = self.device.type == "cuda"
        measured = float(torch.cuda.max_memory_allocated(self.device)) if cuda else 0.0
        table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64, device=self.device)
        table[dist.get_rank()] = torch.tensor([moe, measured], dtype=torch.float64)
        dist.all_reduce(table)
        table = table.cpu().numpy()
        record["memory-predicted-peak-gib"] = float(
            step_peak(self.account.outside_moe, table[None, :, 0]).max()) / GIB
        if cuda:
            record["memory-allocator-peak-gib"] = float(table[:, 1].max()) / GIB
        check_device(iteration, self.account, table[:, 0], table[:, 1] if cuda else None,
                     lrmoe=self.lrmoe)


def hold(args: argparse.Namespace, config: TransformerConfig, account: MemoryAccount | None,
         device: torch.device) -> DeviceHold | None:
    """The run's hold with ``--device-memory-gb`` (None without it). Megatron's own MoE
    layer is priced by its memory model: the run's recompute is the shape's
    (``planner_inputs.recomputed_moe_layers``); ``--moe-expert-capacity-factor`` drops
    (or, with ``--moe-pad-expert-input-to-capacity``, pads) to capacity;
    ``--moe-grouped-gemm`` is TEGroupedMLP."""
    if not held(args) or account is None:
        return None
    megatron = None
    if not args.moe_lrmoe and config.num_moe_experts is not None:
        shape = moe_shape(config, tokens_per_rank(args), args.num_microbatches,
                          args.expert_model_parallel_size)
        megatron = MegatronMemory(
            model=MegatronMoEMemory(shape, grouped=bool(args.moe_grouped_gemm),
                                    padded=bool(args.moe_pad_expert_input_to_capacity)),
            capacity_factor=args.moe_expert_capacity_factor,
            pad=bool(args.moe_pad_expert_input_to_capacity))
    return DeviceHold(account=account, lrmoe=bool(args.moe_lrmoe), megatron=megatron,
                      device=device)


def _megatron_moe_bytes(memory: MegatronMemory, recorder: RoutingRecorder) -> float:
    """This rank's MoE bytes of the step the recorder last gathered: per MoE layer it
    holds, the most over the micro-batches of its EP group's levels
    (``planning.memory_account.megatron_layer_levels``), composed over those layers under
    the run's recompute (``megatron_baseline.stage_moe_memory``)."""
    step, me = recorder.last_step, dist.get_rank()      # step: [L, M, S, E]
    saved, peak = [], []
    for index, number in enumerate(recorder.layers):
        sources = recorder.header["sources"][str(number)]
        ranks = [row["rank"] for row in sources]
        if me not in ranks:
            continue
        mine = ranks.index(me)
        group = next(g for g in rt.ep_groups(sources) if mine in g)    # by EP rank
        s, p = megatron_layer_levels(memory.model, step[index][:, group],
                                     memory.capacity_factor, memory.pad)
        saved.append(s[group.index(mine)])
        peak.append(p[group.index(mine)])
    if not saved:
        return 0.0
    shape = memory.model.shape
    return float(stage_moe_memory(
        np.array(saved)[:, None], np.array(peak)[:, None], np.zeros((len(saved), 1)),
        shape.output_bytes, shape.microbatches_in_flight, shape.recompute_moe,
        shape.full_recompute_layers)[0])
