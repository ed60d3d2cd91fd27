"""The process group and Megatron's parallel state: set up before the model is built,
taken down after the run (or its out-of-memory stop)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core import rerun_state_machine as rsm

from megatron_lrmoe.config.flags import ConfigError
from megatron_lrmoe.integration.runtime.compat import (
    fp8_off_in_checkpoint_without_output_when_te_absent,
)
from megatron_lrmoe.launcher.logger import log0

__all__ = ["initialize_distributed", "setup_parallel_state", "take_down_parallel_state"]


def initialize_distributed(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """Process group (gloo on CPU), Megatron's parallel state and RNG tracker.

    Returns the device and whether this call created the process group (a caller
    that already has one, such as the test harness, keeps it after training).
    """
    fp8_off_in_checkpoint_without_output_when_te_absent()  # Megatron's layernorm recompute
    cuda = torch.cuda.is_available()
    # Single-process runs without torchrun get a loopback rendezvous.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend=args.distributed_backend or ("nccl" if cuda else "gloo"))
    if dist.get_world_size() != args.world_size:
        raise ConfigError(
            f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE says "
            f"{args.world_size}"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    # Explicitly, as Megatron-LM's initialize_megatron does (its default --rerun-mode
    # disabled); otherwise the schedule's first call warns of an implicit initialization.
    # Fresh for each run (a process that trains twice, like the test harness, re-creates it).
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, created


def setup_parallel_state(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """Process group, parallel state and Megatron's micro-batch calculator; one log line."""
    device, owns_process_group = initialize_distributed(args)
    if ps.get_data_parallel_world_size() != args.data_parallel_size:
        raise RuntimeError(
            f"the data-parallel group has {ps.get_data_parallel_world_size()} ranks, the "
            f"flags derived {args.data_parallel_size} (fill_derived_args): "
            f"args.num_microbatches ({args.num_microbatches}) would be wrong")
    # Megatron's own micro-batch bookkeeping, as Megatron-LM sets it up: LRMoE layers are
    # told its get_num_microbatches to find a step's last backward (replica gradients).
    num_microbatches_calculator.init_num_microbatches_calculator(
        dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
        ps.get_data_parallel_world_size())
    log0(
        f"megatron_lrmoe.launcher.pretrain: world {dist.get_world_size()} ({dist.get_backend()}), "
        f"TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} "
        f"EP {args.expert_model_parallel_size} DP {ps.get_data_parallel_world_size()}, "
        f"{torch.get_num_threads()} thread(s)/rank, {args.num_microbatches} micro-batch(es)/step"
    )
    return device, owns_process_group


def take_down_parallel_state(owns_process_group: bool) -> None:
    """Megatron's state (micro-batch calculator, parallel state) after a barrier, and the
    process group if this run created it."""
    dist.barrier()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    ps.destroy_model_parallel()
    if owns_process_group:
        dist.destroy_process_group()
