"""The "parallelism" ``--help`` group: the parallel layout and gradient/parameter
communication (Megatron-LM's "distributed"), and their checks against the world size."""

from __future__ import annotations

import argparse

from megatron_lrmoe.config.flags import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default --tensor-model-parallel-size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default nccl on CUDA, gloo on CPU")


def check(args: argparse.Namespace, world_size: int) -> None:
    """TP/PP/EP/ETP against the world size and the model, sequence parallelism, and the
    distributed optimizer's overlap."""
    tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.expert_model_parallel_size)
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} must be divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp})"
        )
    expert_ranks = ep * args.expert_tensor_parallel_size
    if (world_size // pp) % expert_ranks:
        raise ConfigError(
            f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size "
            f"({args.expert_tensor_parallel_size}) must divide the ranks of a pipeline stage "
            f"({world_size // pp}); launch more processes or lower them"
        )
    if args.num_layers % pp:
        raise ConfigError(
            f"--num-layers ({args.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp})"
        )
    if args.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel:
        raise ConfigError(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel "
            "(Megatron-Core requires it)"
        )
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(
            f"--seq-length ({args.seq_length}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}) with --sequence-parallel"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
