"""The "data" ``--help`` group: datasets and tokenizer (Megatron-LM's "data and
dataloader" and "tokenizer"), their checks, and ``--data-path``'s prefixes and weights."""

from __future__ import annotations

import argparse
import math
import os

from megatron_lrmoe.config.flags import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes of Megatron indexed datasets, optionally with weights")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--data-cache-path", default=None)


def check(args: argparse.Namespace) -> None:
    """Dataset prefixes on disk, and ``--split`` (with the validation share it needs)."""
    if not args.mock_data and not args.data_path:
        raise ConfigError(
            "--data-path is required (or --mock-data); prepare one with "
            "python -m megatron_lrmoe.data.prepare"
        )
    if args.data_path:
        for prefix in _data_prefixes(args.data_path):
            if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
                raise ConfigError(
                    f"--data-path {prefix}: {prefix}.bin/.idx not found; prepare it with "
                    f"python -m megatron_lrmoe.data.prepare --output-prefix {prefix}"
                )
    try:
        split = [float(s) for s in args.split.replace("/", ",").split(",")]
    except ValueError as exc:
        raise ConfigError(f"--split {args.split!r}: expected e.g. 969,30,1") from exc
    if len(split) != 3 or min(split) < 0 or sum(split) <= 0:
        raise ConfigError(f"--split {args.split!r}: expected three non-negative weights")
    if args.eval_iters > 0 and split[1] == 0 and not args.mock_data:
        raise ConfigError("--eval-iters > 0 needs a validation share in --split (e.g. 969,30,1)")


def check_tokenizer(args: argparse.Namespace) -> None:
    if args.tokenizer_type == "SentencePieceTokenizer" and not args.tokenizer_model:
        raise ConfigError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")


def _data_prefixes(data_path: list[str]) -> list[str]:
    """Prefixes of ``--data-path``, which may interleave weights: ``0.3 a 0.7 b``."""
    if len(data_path) % 2 == 0 and all(_is_number(w) for w in data_path[0::2]):
        return list(data_path[1::2])
    return list(data_path)


def data_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Split ``--data-path`` into prefixes and weights (None: equal weights)."""
    prefixes = _data_prefixes(data_path)
    if prefixes == list(data_path):
        return prefixes, None
    return prefixes, [float(w) for w in data_path[0::2]]


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
