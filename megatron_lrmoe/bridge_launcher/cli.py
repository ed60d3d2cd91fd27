"""The Bridge recipe launcher: a recipe, ``enable_lrmoe``, overrides, Bridge's ``pretrain``.

Run on every rank (``torchrun --nproc-per-node 8 -m megatron_lrmoe.bridge_launcher ...``)::

    --recipe NAME          a recipe function megatron.bridge.recipes exports, e.g.
                           qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config
    --config-file FILE     an optional YAML merged onto the recipe (Bridge's format)
    --adapt                set the recipe settings LRMoE cannot run to what it needs
                           (printed, one line each) instead of refusing them
    --no-lrmoe             the same (adapted) recipe with Megatron's MoE layer: a baseline
    --dry-run              build and check the final config, print it, do not train
                           (without Transformer Engine, its kernels' switches are checked
                           off: TE_KERNEL_SWITCHES)
    KEY=VALUE ...          Hydra-style overrides, through Bridge's own
                           process_config_with_overrides (model.moe_lrmoe_bwd_capacity_factor=0.75)

The order is the one ``enable_lrmoe`` documents: the recipe, ``enable_lrmoe``, the YAML and
the overrides, then Bridge's ``pretrain`` with its ``gpt_step`` (``finetune`` for SFT
recipes) and ``LRMoECallback``; Bridge's ``finalize`` runs LRMoE's checks on the final
values. Without CUDA the CPU/gloo runtime is enabled first (``enable_bridge_cpu_runtime``).
A configuration error is one ``error:`` line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from megatron_lrmoe.integration.runtime.compat import stub_bridge_imports_of_absent_modules
from megatron_lrmoe.options.lrmoe import OPTIONS, LRMoEConfigError

# Every function here imports megatron.bridge, which imports modules that cannot be
# installed everywhere (Transformer Engine: megatron_lrmoe/integration/runtime/compat.py);
# stubbed for Bridge's own importers, before the first Bridge import, only where the
# module is absent.
stub_bridge_imports_of_absent_modules()

__all__ = ["TE_KERNEL_SWITCHES", "build_config", "build_parser", "check_final_values", "main",
           "recipe_function"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lrmoe.bridge_launcher",
        description="Train a Megatron-Bridge recipe with LRMoE (Bridge's own pretrain).")
    parser.add_argument("--recipe", required=True,
                        help="recipe function exported by megatron.bridge.recipes")
    parser.add_argument("--config-file", default=None, help="YAML merged onto the recipe")
    parser.add_argument("--adapt", action="store_true",
                        help="set the recipe settings LRMoE cannot run to what it needs")
    parser.add_argument("--no-lrmoe", action="store_true",
                        help="Megatron's MoE layer, the recipe otherwise as with LRMoE")
    parser.add_argument("--dry-run", action="store_true",
                        help="check and print the final config, do not train")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra-style overrides (model.moe_lrmoe_bwd_capacity_factor=0.75)")
    return parser


class LaunchError(ValueError):
    """A launch the launcher refuses (unknown recipe, bad override ...)."""


def recipe_function(name: str) -> Callable[[], Any]:
    """The recipe function ``name`` of ``megatron.bridge.recipes``."""
    # deferred: Megatron-Bridge is optional, and --help needs none of it
    from megatron.bridge import recipes

    function = getattr(recipes, name, None)
    if not callable(function) or name.startswith("_"):
        names = [n for n in dir(recipes) if n.endswith("_config") and not n.startswith("_")]
        near = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise LaunchError(f"--recipe {name}: not a recipe of megatron.bridge.recipes{hint}")
    return function


def build_config(args: argparse.Namespace,
                 customize: Callable[[Any], None] | None = None) -> Any:
    """The final config of a launch: the recipe, ``enable_lrmoe`` (``--adapt``), then
    ``customize(cfg)`` (what a test harness swaps in, e.g. the local spec on CPU), the
    YAML and the overrides."""
    # deferred: Megatron-Bridge is optional, and --help needs none of it
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_lrmoe.integration.bridge import enable_lrmoe

    cfg = recipe_function(args.recipe)()
    enable_lrmoe(cfg, adapt=args.adapt)
    if args.no_lrmoe:
        cfg.model.moe_lrmoe = False
    if customize is not None:
        customize(cfg)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise LaunchError(f"{bad[0]}: an override is KEY=VALUE (model.moe_lrmoe_min_retention=0.1)")
    return process_config_with_overrides(cfg, args.config_file, args.overrides)


#: Switches of Transformer Engine kernels that Megatron-Core's config check refuses where
#: TE is not installed (TransformerConfig.__post_init__ in 0.19.2: "apply_rope_fusion is
#: not available", "fused permutation is not available"). That says where the check runs,
#: not what the config is: a dry run there checks them off, and says so.
TE_KERNEL_SWITCHES: tuple[str, ...] = ("apply_rope_fusion", "moe_permute_fusion")


def check_final_values(model: Any) -> list[str]:
    """Run Bridge's and LRMoE's checks of the final values (``finalize()``, what Bridge
    runs when training starts) on a copy of ``model``; raises what they raise. Where
    Transformer Engine is absent, those of ``TE_KERNEL_SWITCHES`` that are on are checked
    as False; returns one line naming each (none where TE is installed)."""
    checked = copy.deepcopy(model)
    notes: list[str] = []
    if importlib.util.find_spec("transformer_engine") is None:
        for name in TE_KERNEL_SWITCHES:
            if getattr(checked, name, False):
                setattr(checked, name, False)
                notes.append(f"dry run: model.{name}={getattr(model, name)} checked as False "
                             "(a Transformer Engine kernel; TE is not installed here)")
    checked.finalize()
    return notes


def _describe(cfg: Any, recipe: str) -> str:
    model = cfg.model
    lines = [f"recipe: {recipe} ({type(model).__name__})"]
    lines += [f"model.{o.field}: {getattr(model, o.field)}" for o in OPTIONS]
    for name in ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "context_parallel_size", "seq_length",
                 "moe_token_dispatcher_type"):
        lines.append(f"model.{name}: {getattr(model, name, None)}")
    lines += [f"train.train_iters: {cfg.train.train_iters}",
              f"train.global_batch_size: {cfg.train.global_batch_size}",
              f"train.micro_batch_size: {cfg.train.micro_batch_size}",
              f"checkpoint.save: {cfg.checkpoint.save}"]
    return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def main(argv: list[str] | None = None,
         customize: Callable[[Any], None] | None = None) -> int:
    """Build the launch's config and train it with Bridge's ``pretrain`` (``finetune`` for
    an SFT recipe); returns the exit status."""
    args = build_parser().parse_intermixed_args(argv)
    # deferred: it imports torch, which --help and a bad flag do without
    from megatron_lrmoe.integration.runtime.cpu import (
        enable_bridge_cpu_runtime,
        skip_torch_compile_of_functions,
    )

    skip_torch_compile_of_functions()   # before Bridge imports megatron.core (no CUDA only)

    try:
        cfg = build_config(args, customize)
        if args.dry_run:
            for line in check_final_values(cfg.model):
                print(line)
            print(_describe(cfg, args.recipe))
            return 0
    except Exception as exc:  # noqa: BLE001 - a config error is one line, whatever raised it
        print(f"error: {_first_line(exc)}", file=sys.stderr)
        return 2
    # deferred: Megatron-Bridge is optional, and --help needs none of it
    from megatron.bridge.training.gpt_step import forward_step

    from megatron_lrmoe.integration.bridge import LRMoECallback

    enable_bridge_cpu_runtime()       # without CUDA only (the CPU/gloo runtime)

    if "_sft_" in args.recipe:     # deferred: Bridge's, as above
        from megatron.bridge.training.finetune import finetune as run
    else:
        from megatron.bridge.training.pretrain import pretrain as run
    try:
        run(cfg, forward_step, callbacks=[LRMoECallback()])
    except LRMoEConfigError as exc:
        print(f"error: {_first_line(exc)}", file=sys.stderr)
        return 2
    return 0
