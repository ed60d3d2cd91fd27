"""The "model" ``--help`` group: the model's shape and layer options (Megatron-LM's
"network size", with its dropout and initialisation flags), and their checks."""

from __future__ import annotations

import argparse

from megatron_lrmoe.config.flags import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="bias in the QKV projection only (e.g. GLM-4.5)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="default: transformer_engine when installed and on CUDA, else local")


def check_shape(args: argparse.Namespace) -> None:
    """Heads, query groups and positions against the hidden size and sequence."""
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ConfigError(
            f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
            f"({args.num_attention_heads}), or give --kv-channels (as Megatron-LM)"
        )
    if args.num_query_groups is not None:
        if not args.group_query_attention:
            raise ConfigError("--num-query-groups needs --group-query-attention (Megatron-LM)")
        if args.num_attention_heads % args.num_query_groups:
            raise ConfigError(
                f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({args.num_query_groups})"
            )
    if args.position_embedding_type == "learned_absolute" and (
        args.seq_length > args.max_position_embeddings
    ):
        raise ConfigError(
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings}); raise it or use --position-embedding-type rope"
        )
