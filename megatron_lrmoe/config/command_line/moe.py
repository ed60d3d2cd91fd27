"""The "mixture of experts" ``--help`` group: Megatron-Core's MoE flags (Megatron-LM's
"moe"), and their checks. The ``--moe-lrmoe*`` flags are the option table's
(``config.flags.add_lrmoe_args``)."""

from __future__ import annotations

import argparse

from megatron_lrmoe.config.flags import ConfigError, moe_layer_freq


def _str2float_or_none(value: str) -> float | None:
    return None if value.lower() in ("none", "null") else float(value)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="default --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1)
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   help="allgather or alltoall (flex needs DeepEP and is not supported)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"])
    g.add_argument("--moe-expert-capacity-factor", type=_str2float_or_none, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-permute-fusion", action="store_true")


def check(args: argparse.Namespace) -> None:
    """Megatron-Core's MoE flags (the ``--moe-lrmoe*`` ones are the option table's)."""
    if args.num_experts is not None:
        if args.moe_router_topk > args.num_experts:
            raise ConfigError(
                f"--moe-router-topk ({args.moe_router_topk}) exceeds --num-experts "
                f"({args.num_experts})"
            )
        if args.num_experts % args.expert_model_parallel_size:
            raise ConfigError(
                f"--num-experts ({args.num_experts}) must be divisible by "
                f"--expert-model-parallel-size ({args.expert_model_parallel_size})"
            )
        if args.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ConfigError(
                f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type!r} is not "
                f"supported by this launcher; use allgather or alltoall (flex needs DeepEP "
                f"on GPUs: use Megatron-LM's pretrain_gpt.py)"
            )
        if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
            raise ConfigError(
                f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers but --num-layers is "
                f"{args.num_layers}"
            )
        # With --moe-lrmoe the flag means grouped GEMMs inside the LRMoE region (torch's
        # grouped_mm, on every device); without it, Megatron's TEGroupedMLP.
        if (args.moe_grouped_gemm and args.transformer_impl != "transformer_engine"
                and not args.moe_lrmoe):
            raise ConfigError(
                "--moe-grouped-gemm needs Transformer Engine on CUDA (TEGroupedMLP); drop the "
                "flag to use SequentialMLP (with --moe-lrmoe it selects the LRMoE region's "
                "grouped GEMMs on any device)"
            )
        if args.moe_permute_fusion and args.transformer_impl != "transformer_engine":
            raise ConfigError("--moe-permute-fusion needs Transformer Engine on CUDA")
    elif args.expert_model_parallel_size > 1 and not args.moe_lrmoe:
        raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")
