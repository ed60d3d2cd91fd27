"""LRMoE inside Megatron-LM's ``pretrain_gpt.py`` (tag core_v0.16.1).

Two entry points use this module and nothing else: ``scripts/pretrain_gpt_lrmoe.py``
(a wrapper that imports pretrain_gpt.py's own functions) and the few lines that
``patches/megatron_lm_core_v0.16.1.patch`` adds to pretrain_gpt.py. Both hand over
the same three things:

* ``lrmoe_args_provider(inner)``: the ``extra_args_provider`` of Megatron's
  ``pretrain``. Adds every ``--moe-lrmoe*`` flag (composed with modelopt's provider
  when that is installed) and checks the parsed flags before any process group or
  GPU is touched, failing with argparse's one-line ``error:`` naming the flag.
* ``lrmoe_builder(gpt_builder)``: a model builder with gpt_builder's signature. With
  ``--moe-lrmoe`` absent it *is* gpt_builder (same call, same model). With it, the
  config is built as ``core_transformer_config_from_args(args,
  LRMoETransformerConfig)`` and every spec gpt_builder hands to ``GPTModel``
  (layer, decoder-block, MTP block, ``--spec``) goes through ``to_lrmoe_spec``, so
  Megatron-LM keeps choosing the spec flavour (TE or local, ``--moe-layer-freq``,
  shared experts) and the plugin only swaps the MoE positions.
* LRMoE's step state (docs/design.md, "Step state"), installed by the builder with
  ``--moe-lrmoe``: the planners are built right after the model (machine constants
  from ``--moe-lrmoe-calibration`` or one measurement, printed with their figures);
  the step boundary is ``training_log``, which Megatron-LM's loop calls once per
  iteration after the optimizer step (the plugin wraps
  ``megatron.training.training.training_log``: Megatron has no per-iteration hook
  outside the pipeline schedule); the re-run state machine snapshots and restores the
  LRMoE state through its public ``state_save_func`` / ``state_restore_func`` (chained
  to Megatron-LM's own); and the step state goes into ``torch_dist`` checkpoints as
  each layer's extra state, flagged in the sharded state dict metadata that
  Megatron-LM builds and saves as the checkpoint's content metadata (the plugin wraps
  ``megatron.training.checkpointing._build_sharded_state_dict_metadata``, the one
  place that metadata is made; on load Megatron-LM hands back the checkpoint's own).
* LRMoE statistics in Megatron-LM's logs: after each ``training_log`` call, at
  ``--moe-lrmoe-log-interval`` (default ``--log-interval``), the per-layer
  statistics are reduced over all ranks and written as ``lrmoe/...`` scalars to
  Megatron's TensorBoard / W&B writers and as one line on the last rank.

The module imports neither torch nor Megatron at import time: ``find_megatron_lm``
must be able to put the checkout first on ``sys.path`` before ``megatron`` loads.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from megatron_lrmoe.arguments import (
    ConfigError,
    add_lrmoe_args,
    build_parser,
    load_yaml_config,
    validate_lrmoe_flags,
)
from megatron_lrmoe.lrmoe.options import OPTIONS, LRMoEConfigError

MEGATRON_LM_TAG = "core_v0.16.1"
MEGATRON_LM_VERSION = "0.16.1"

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
Builder = Callable[..., Any]


# -----------------------------------------------------------------------------
# Finding Megatron-LM
# -----------------------------------------------------------------------------


def find_megatron_lm(path: str | None = None) -> str:
    """Put a Megatron-LM checkout first on ``sys.path`` and return its directory.

    ``path`` or ``$MEGATRON_LM`` names the checkout; without either, an importable
    ``pretrain_gpt`` module is used. Refuses a checkout whose megatron-core is not
    0.16.1, since the plugin is built and tested against that version only.
    """
    path = path or os.environ.get("MEGATRON_LM")
    if path:
        root = os.path.abspath(path)
        if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
            raise ConfigError(f"MEGATRON_LM={path}: no pretrain_gpt.py there; point it at a "
                              f"Megatron-LM checkout ({MEGATRON_LM_TAG})")
    else:
        import importlib.util

        spec = importlib.util.find_spec("pretrain_gpt")
        if spec is None or spec.origin is None:
            raise ConfigError("Megatron-LM not found: set MEGATRON_LM=/path/to/Megatron-LM "
                              f"(a {MEGATRON_LM_TAG} checkout) or put it on PYTHONPATH")
        root = os.path.dirname(os.path.abspath(spec.origin))
    version = megatron_lm_version(root)
    if version != MEGATRON_LM_VERSION:
        raise ConfigError(f"{root}: megatron-core {version}, but megatron-lrmoe supports "
                          f"{MEGATRON_LM_VERSION} only; git checkout {MEGATRON_LM_TAG}")
    if root not in sys.path:
        sys.path.insert(0, root)
    return root


def megatron_lm_version(root: str) -> str | None:
    """megatron-core version of a checkout, read from its package_info.py (no import)."""
    info = os.path.join(root, "megatron", "core", "package_info.py")
    if not os.path.isfile(info):
        return None
    with open(info) as f:
        text = f.read()
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None  # type: ignore[union-attr]


# -----------------------------------------------------------------------------
# Arguments
# -----------------------------------------------------------------------------


def lrmoe_args_provider(inner: ArgsProvider | None = None) -> ArgsProvider:
    """``extra_args_provider`` for Megatron's ``pretrain``: ``inner``'s flags (e.g.
    modelopt's), the ``--moe-lrmoe*`` flags, and a check of them right after parsing."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if inner is not None:
            parser = inner(parser)
        add_lrmoe_args(parser)
        _check_when_parsed(parser)
        return parser

    return provider


def _check_when_parsed(parser: argparse.ArgumentParser) -> None:
    """Run ``check_megatron_lm_args`` on what ``parser`` parses (argparse's
    ``parse_args`` goes through ``parse_known_args``), so a bad LRMoE flag stops
    the run before Megatron initializes CUDA and the process groups."""
    parse_known = parser.parse_known_args

    @functools.wraps(parse_known)
    def parse_known_args(*a: Any, **kw: Any):
        args, rest = parse_known(*a, **kw)
        try:
            check_megatron_lm_args(args)
        except ConfigError as exc:
            parser.error(str(exc))
        return args, rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def check_megatron_lm_args(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what Megatron-LM accepts but LRMoE cannot run.

    The ``--moe-lrmoe*`` values are checked with or without ``--moe-lrmoe`` (the
    config's checks, ``arguments.validate_lrmoe_flags``); Megatron-LM paths that bypass
    the LRMoE config, and the combinations, only with it. What depends on values
    Megatron derives later (recompute, FP8, CUDA graphs, context parallelism ...) is
    refused by ``LRMoETransformerConfig`` when the config is built
    (``lrmoe_config_from_args``).
    """
    if getattr(args, "moe_lrmoe", False):
        _refuse_bypassing_paths(args)
    validate_lrmoe_flags(_lrmoe_view(args))


def _refuse_bypassing_paths(args: argparse.Namespace) -> None:
    """Megatron-LM options under which the LRMoE config or spec would not be used."""
    if getattr(args, "yaml_cfg", None) is not None:
        raise ConfigError(
            "--yaml-cfg builds a plain TransformerConfig and would drop the --moe-lrmoe* "
            "settings; give the model as flags instead (a flat flag YAML such as "
            "configs/qwen3_30b_a3b.yaml turns into flags with "
            "`python -m megatron_lrmoe.megatron_lm flags FILE.yaml`)")
    refused = {
        "use_legacy_models": "--use-legacy-models: LRMoE needs the megatron.core GPTModel",
        "multi_latent_attention": "--multi-latent-attention: Megatron-LM then builds an "
                                  "MLATransformerConfig, which has no --moe-lrmoe* fields",
        "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path: not "
                                            "supported with --moe-lrmoe",
        "export_kd_teacher_load": "--export-kd-teacher-load: modelopt's model builder "
                                  "would bypass the LRMoE spec conversion",
    }
    for dest, why in refused.items():
        if getattr(args, dest, None):
            raise ConfigError(why)


def _lrmoe_view(args: argparse.Namespace) -> SimpleNamespace:
    """Megatron-LM's parsed args that LRMoE checks at parse time, under the config's
    field names (what the namespace lacks is left out, and checked on the config)."""
    names = [o.field for o in OPTIONS] + ["moe_token_dispatcher_type", "add_bias_linear",
                                          "moe_expert_capacity_factor"]
    view = {name: getattr(args, name) for name in names if hasattr(args, name)}
    view["num_moe_experts"] = getattr(args, "num_experts", None)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    # Megatron-LM's validate_args sets it to --tensor-model-parallel-size when not given.
    view["expert_tensor_parallel_size"] = (
        etp if etp is not None else getattr(args, "tensor_model_parallel_size", 1))
    return SimpleNamespace(**view)


def lrmoe_config_from_args(args: argparse.Namespace):
    """``LRMoETransformerConfig`` from Megatron-LM's args, the way Megatron-LM builds
    its TransformerConfig. LRMoE's refusals come back as ``ConfigError`` naming the
    flag; Megatron's own errors pass through unchanged."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_lrmoe.lrmoe.config import LRMoETransformerConfig

    try:
        config = core_transformer_config_from_args(args, LRMoETransformerConfig)
    except LRMoEConfigError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(config, LRMoETransformerConfig):
        raise ConfigError(f"Megatron-LM built a {type(config).__name__} for these flags, which "
                          "cannot carry --moe-lrmoe")
    _check_memory_budget(args, config)
    return config


def _check_memory_budget(args: argparse.Namespace, config) -> None:
    """Refuse a --moe-lrmoe-memory-budget-gb below the balanced dropless need, at start-up."""
    if getattr(args, "moe_lrmoe_memory_budget_gb", None) is None:
        return
    from megatron.core import num_microbatches_calculator as nmc

    from megatron_lrmoe.lrmoe.planner_config import check_memory_budget

    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    microbatches = (nmc.get_num_microbatches()
                    if nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None else 1)
    try:
        import torch

        fit = check_memory_budget(config, args.expert_model_parallel_size,
                                  args.micro_batch_size * args.seq_length // tp, microbatches,
                                  "cuda" if torch.cuda.is_available() else "cpu",
                                  args.micro_batch_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if fit:
        from megatron.training.utils import print_rank_0

        print_rank_0(fit)


# -----------------------------------------------------------------------------
# Model
# -----------------------------------------------------------------------------

# Models built with LRMoE layers, in build order (the same on every rank: the step
# boundary pools counts over ranks layer by layer).
_BUILT: list[weakref.ref] = []


def built_models() -> list[Any]:
    """The live models ``lrmoe_builder`` built, in build order."""
    _BUILT[:] = [ref for ref in _BUILT if ref() is not None]
    return [model for model in (ref() for ref in _BUILT) if model is not None]


def lrmoe_builder(base: Builder) -> Builder:
    """A model builder with ``gpt_builder``'s signature that builds LRMoE models
    under ``--moe-lrmoe`` and is ``base`` itself otherwise."""

    @functools.wraps(base)
    def builder(args, pre_process=True, post_process=True, vp_stage=None, config=None,
                pg_collection=None):
        if not getattr(args, "moe_lrmoe", False):
            return base(args, pre_process, post_process, vp_stage, config=config,
                        pg_collection=pg_collection)
        from megatron_lrmoe.lrmoe.config import LRMoETransformerConfig
        from megatron_lrmoe.runtime.compat import define_te_general_gemm_when_te_absent

        define_te_general_gemm_when_te_absent()
        if config is None:
            config = lrmoe_config_from_args(args)
        elif not (isinstance(config, LRMoETransformerConfig) and config.moe_lrmoe):
            raise ConfigError("--moe-lrmoe: the caller passed a config without the LRMoE "
                              "fields; build it with megatron_lrmoe.megatron_lm."
                              "lrmoe_config_from_args")
        with _specs_converted(base):
            model = base(args, pre_process, post_process, vp_stage, config=config,
                         pg_collection=pg_collection)
        _check_converted(model)
        _setup_step_state(args, model, config)
        _BUILT.append(weakref.ref(model))
        install_lrmoe_hooks()
        return model

    return builder


@contextmanager
def _specs_converted(base: Builder) -> Iterator[None]:
    """While ``base`` runs, its ``GPTModel`` converts the specs it is given.

    gpt_builder picks the spec (TE or local, decoder block with --moe-layer-freq,
    --spec, MTP block) and passes it straight to GPTModel: converting there covers
    every flavour without repeating Megatron-LM's choice.
    """
    namespace = getattr(base, "__globals__", {})
    real = namespace.get("GPTModel")
    if real is None:
        raise ConfigError(f"--moe-lrmoe: cannot convert the specs of {base!r} (it does not "
                          "build megatron.core's GPTModel)")
    from megatron_lrmoe.lrmoe.spec import to_lrmoe_spec

    def gpt_model(*args: Any, **kwargs: Any):
        if "transformer_layer_spec" in kwargs:
            kwargs["transformer_layer_spec"] = to_lrmoe_spec(kwargs["transformer_layer_spec"])
        elif len(args) > 1:
            args = (args[0], to_lrmoe_spec(args[1]), *args[2:])
        if kwargs.get("mtp_block_spec") is not None:
            kwargs["mtp_block_spec"] = to_lrmoe_spec(kwargs["mtp_block_spec"])
        return real(*args, **kwargs)

    namespace["GPTModel"] = gpt_model
    try:
        yield
    finally:
        namespace["GPTModel"] = real


def _check_converted(model: Any) -> None:
    """Every MoE layer of the built model must be LRMoE's (no silent fallback)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lrmoe.lrmoe.moe_layer import LRMoELayer

    missed = [name for name, m in model.named_modules()
              if isinstance(m, MoELayer) and not isinstance(m, LRMoELayer)]
    if missed:
        raise ConfigError(f"--moe-lrmoe: these MoE layers were not converted: {missed[:3]}")


# -----------------------------------------------------------------------------
# Logging
# -----------------------------------------------------------------------------


def _setup_step_state(args: argparse.Namespace, model: Any, config: Any) -> None:
    """Build the LRMoE planners of a model chunk at model setup (docs/design.md, "Step
    state"), before Megatron-LM loads a checkpoint into it or trains."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training.utils import print_rank_0

    from megatron_lrmoe.lrmoe.step import machine_constants_line, setup_lrmoe_layers

    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    machine = setup_lrmoe_layers([model], args.micro_batch_size * args.seq_length // tp,
                                 get_num_microbatches, config)
    if machine is not None and not _BUILT:
        print_rank_0(machine_constants_line(machine))


def install_lrmoe_hooks() -> None:
    """Once per process: the step boundary and statistics after Megatron-LM's
    ``training_log``, the step-state flag in its checkpoint metadata, and the LRMoE
    state in its re-run state machine's snapshots."""
    from megatron.training import checkpointing, training

    from megatron_lrmoe.lrmoe.step import chain_to_rerun_state_machine

    chain_to_rerun_state_machine(built_models)
    original = training.training_log
    if not getattr(original, "_lrmoe", False):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def training_log(*a: Any, **kw: Any):
            from megatron_lrmoe.lrmoe.step import finish_lrmoe_step

            # Megatron-LM's loop calls training_log once per iteration, right after
            # train_step (forward-backward, possibly re-run, and optimizer.step(), taken
            # or skipped): LRMoE's step boundary. Not called for an iteration that exits
            # inside train_step (a re-run asking for a checkpoint), whose state the
            # re-run state machine restored before that checkpoint.
            finish_lrmoe_step(built_models())
            # A re-created state machine (in-process restart) gets the chain again.
            chain_to_rerun_state_machine(built_models)
            result = original(*a, **kw)
            log_lrmoe_stats(int(signature.bind(*a, **kw).arguments["iteration"]))
            return result

        training_log._lrmoe = True  # type: ignore[attr-defined]
        training.training_log = training_log
    build_metadata = checkpointing._build_sharded_state_dict_metadata
    if not getattr(build_metadata, "_lrmoe", False):

        metadata_signature = inspect.signature(build_metadata)

        @functools.wraps(build_metadata)
        def sharded_state_dict_metadata(*a: Any, **kw: Any) -> dict:
            from megatron_lrmoe.lrmoe.step import PLANNER_STATE_FLAG

            # Saved as the checkpoint's content metadata and handed back on load: an
            # LRMoE checkpoint says it holds the step state, a plain one does not.
            metadata = build_metadata(*a, **kw)
            run_args = metadata_signature.bind(*a, **kw).arguments["args"]
            if getattr(run_args, "moe_lrmoe", False):
                metadata[PLANNER_STATE_FLAG] = True
            return metadata

        sharded_state_dict_metadata._lrmoe = True  # type: ignore[attr-defined]
        checkpointing._build_sharded_state_dict_metadata = sharded_state_dict_metadata


def log_lrmoe_stats(iteration: int) -> dict[str, float]:
    """Reduce and write the LRMoE statistics at the LRMoE log interval (collective:
    every rank calls it at the same iteration, as Megatron-LM's training loop does)."""
    from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer
    from megatron.training.utils import print_rank_last

    from megatron_lrmoe.lrmoe.telemetry import collect_lrmoe_stats

    args = get_args()
    interval = args.moe_lrmoe_log_interval or args.log_interval
    if not interval or iteration % interval:
        return {}
    num_layers = args.num_layers + (getattr(args, "mtp_num_layers", None) or 0)
    stats = collect_lrmoe_stats(built_models(), num_layers, args.num_experts)
    scalars = {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
    writer = get_tensorboard_writer()
    if writer is not None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, iteration)
    wandb = get_wandb_writer()
    if wandb is not None:
        wandb.log(scalars, iteration)
    if "lrmoe/retained-fraction" in scalars:
        print_rank_last(format_lrmoe_line(iteration, scalars))
    return scalars


def format_lrmoe_line(iteration: int, stats: dict[str, float]) -> str:
    """The one-line summary, the same words as the lean launcher's."""
    return (f" [LRMoE] iteration {iteration:8d} | retained {stats['lrmoe/retained-fraction']:.3f}"
            f" | dropped contribution {stats['lrmoe/dropped-contribution-fraction']:.3f}"
            f" | backward bytes saved {stats['lrmoe/backward-bytes-saved'] / 2**20:.2f} MiB"
            f" | routed load max/mean {stats['lrmoe/load-max-over-mean']:.2f}")


# -----------------------------------------------------------------------------
# The wrapper's main and the flag-YAML helper
# -----------------------------------------------------------------------------


def run_pretrain_gpt() -> None:
    """pretrain_gpt.py's ``__main__`` with the LRMoE provider and builder (the body
    of ``scripts/pretrain_gpt_lrmoe.py``); Megatron parses ``sys.argv`` itself."""
    start = time.time()
    find_megatron_lm()
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps

    set_startup_timestamps(program_start=start, main_entry=time.time())
    datasets = pretrain_gpt.train_valid_test_datasets_provider
    datasets.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    modelopt = pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None
    pretrain(
        datasets,
        functools.partial(pretrain_gpt.model_provider, lrmoe_builder(pretrain_gpt.gpt_builder)),
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=lrmoe_args_provider(modelopt),
        store=store,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


def config_to_flags(path: str, lrmoe: bool = True) -> list[str]:
    """A launcher config (flat YAML of flag names) as a Megatron-LM argument list.

    The file is first read by the launcher's own parser, so it stays valid for both
    entry points. ``lrmoe=False`` leaves out every ``moe-lrmoe*`` key (the baseline).
    """
    import yaml

    load_yaml_config(path, build_parser())  # same checks as --config
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    flags: list[str] = []
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("_", "-")
        if name.startswith("moe-lrmoe") and not lrmoe:
            continue
        if value is None or value is False:
            continue
        flags.append("--" + name)
        if value is True:
            continue
        if name == "data-path" and isinstance(value, list):
            flags.extend(str(v) for v in value)
        elif isinstance(value, list):
            flags.append("[" + ",".join(str(v) for v in value) + "]")
        else:
            flags.append(str(value))
    return flags


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_lrmoe.megatron_lm flags FILE.yaml [--no-lrmoe]``: print the
    config's Megatron-LM flags, one per line (what the launch scripts read)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_lrmoe.megatron_lm")
    sub = parser.add_subparsers(dest="command", required=True)
    flags = sub.add_parser("flags", help="a flat flag YAML as Megatron-LM flags")
    flags.add_argument("config")
    flags.add_argument("--no-lrmoe", action="store_true", help="leave out the moe-lrmoe* keys")
    ns = parser.parse_args(argv)
    try:
        print("\n".join(config_to_flags(ns.config, lrmoe=not ns.no_lrmoe)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
