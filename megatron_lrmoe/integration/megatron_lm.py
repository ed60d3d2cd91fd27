"""LRMoE inside Megatron-LM's ``pretrain_gpt.py`` (tag core_v0.19.0).

Two entry points use this module and nothing else: ``scripts/pretrain_gpt_lrmoe.py``
(a wrapper that runs pretrain_gpt.py's ``__main__`` steps with pretrain_gpt.py's own
functions) and the lines that ``patches/megatron_lm_core_v0.19.0.patch`` adds to
pretrain_gpt.py. At core_v0.19.0 pretrain_gpt.py's ``__main__`` parses the arguments
itself (``parse_and_validate_args``), describes the model as a ``GPTModelConfig``
(``gpt_config_from_args``) and hands ``pretrain`` a config container holding it; the
model is built by the builder class that config names (``GPTModelConfig.builder`` ->
``GPTModelBuilder``). Both entry points hand over the same two things:

* ``lrmoe_args_provider(inner)``: the ``extra_args_provider`` of
  ``parse_and_validate_args``. Adds every ``--moe-lrmoe*`` flag (composed with
  modelopt's provider when that is installed) and checks the parsed flags before any
  process group or GPU is touched, failing with argparse's one-line ``error:`` naming
  the flag.
* ``lrmoe_model_config(args, model_cfg)``: the model config of the run. With
  ``--moe-lrmoe`` absent it *is* ``model_cfg`` (same config, same builder, same model).
  With it, the same GPT settings (``gpt_config_from_args``) around an
  ``LRMoETransformerConfig`` (``core_transformer_config_from_args(args,
  LRMoETransformerConfig)``; with ``--multi-latent-attention`` the MLATransformerConfig it
  builds, made an ``LRMoEMLATransformerConfig``), in an ``LRMoEGPTModelConfig``: a
  ``GPTModelConfig`` with no new fields whose builder, ``LRMoEGPTModelBuilder``, is
  ``GPTModelBuilder`` with every spec it hands to ``GPTModel`` (layer or decoder-block
  spec, ``--spec``, the MTP block) put through ``to_lrmoe_spec``. Megatron-LM keeps
  choosing the spec flavour (TE or local, ``--moe-layer-freq``, shared experts, MLA,
  experimental attention variants) and the plugin only swaps the MoE positions; a model
  with an unconverted MoE layer is refused.

``lrmoe_builder(gpt_builder)`` does the same for the older model-provider path that
core_v0.19.0's ``pretrain(..., model_provider=...)`` still accepts (``gpt_builders.py``,
``model_provider.py``), for scripts that build through it.

Every LRMoE model, whichever way it is built, gets LRMoE's step state (docs/design.md,
"Step state"): the planners are built right after the model (machine constants from
``--moe-lrmoe-calibration`` or one measurement, printed with their figures); the step
boundary is ``training_log``, which Megatron-LM's loop calls once per iteration after
the optimizer step (Megatron has no per-iteration hook outside the pipeline schedule);
the re-run state machine snapshots and restores the LRMoE state through its public
``state_save_func`` / ``state_restore_func`` (chained to Megatron-LM's own); and the
step state goes into ``torch_dist`` checkpoints as each layer's extra state, flagged in
the sharded state dict metadata that Megatron-LM builds and saves as the checkpoint's
content metadata (on load Megatron-LM hands back the checkpoint's own). After each
``training_log`` call, at ``--moe-lrmoe-log-interval`` (default ``--log-interval``), the
per-layer statistics are reduced over all ranks and written as ``lrmoe/...`` scalars
to Megatron's TensorBoard / W&B writers and as one line on the last rank.

Everything of Megatron-LM this module uses directly is its public API
(``parse_and_validate_args``, ``core_transformer_config_from_args``,
``gpt_config_from_args``, ``pretrain_cfg_container_from_args``, ``GPTModelConfig`` /
``GPTModelBuilder``, ``pretrain``, ``get_args`` and the writers). The internals it
needs go through ``megatron_privates``, which lists them with the version each was read
from: ``training.training_log`` (wrapped: the step boundary and statistics),
``checkpointing._build_sharded_state_dict_metadata`` (wrapped: the step-state flag),
``ModelBuilder._model_config`` (read by the LRMoE builder), and the module global
``GPTModel`` of ``megatron.training.models.gpt`` / ``gpt_builders``
(swapped for a spec-converting call while one LRMoE model is being built, then restored).

The module imports neither torch nor Megatron at import time: ``find_megatron_lm``
must be able to put the checkout first on ``sys.path`` before ``megatron`` loads. The
two classes ``LRMoEGPTModelConfig`` and ``LRMoEGPTModelBuilder`` subclass Megatron-LM's
and are therefore made on first access (``__getattr__`` of this module), which is how
``GPTModelConfig.get_builder_cls`` finds the builder by its import path.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import yaml

from megatron_lrmoe.config.command_line import build_parser
from megatron_lrmoe.config.command_line.yaml_config import load_yaml_config
from megatron_lrmoe.config.flags import (
    ConfigError,
    add_lrmoe_args,
    lrmoe_view,
    tokens_per_rank,
    validate_lrmoe_flags,
)
from megatron_lrmoe.integration.runtime.compat import (
    fp8_off_in_checkpoint_without_output_when_te_absent,
)
from megatron_lrmoe.megatron_privates import (
    GPTModelNotFound,
    builder_model_config,
    mark_datasets_provider_distributed,
    swap_gpt_model_class,
    wrap_sharded_state_dict_metadata,
    wrap_training_log,
)
from megatron_lrmoe.options.lrmoe import AUTO, OPTIONS, LRMoEConfigError
from megatron_lrmoe.options.megatron_support import (
    MEGATRON_LM_TAG,
    line,
    megatron_lm_version,
    supported,
)

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
Builder = Callable[..., Any]


# -----------------------------------------------------------------------------
# Finding Megatron-LM
# -----------------------------------------------------------------------------


def find_megatron_lm(path: str | None = None) -> str:
    """Put a Megatron-LM checkout first on ``sys.path`` and return its directory.

    ``path`` or ``$MEGATRON_LM`` names the checkout; without either, an importable
    ``pretrain_gpt`` module is used. Refuses a checkout whose megatron-core is not of
    the supported line (``megatron_support``).
    """
    path = path or os.environ.get("MEGATRON_LM")
    if path:
        root = os.path.abspath(path)
        if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
            raise ConfigError(f"MEGATRON_LM={path}: no pretrain_gpt.py there; point it at a "
                              f"Megatron-LM checkout ({MEGATRON_LM_TAG})")
    else:
        spec = importlib.util.find_spec("pretrain_gpt")
        if spec is None or spec.origin is None:
            raise ConfigError("Megatron-LM not found: set MEGATRON_LM=/path/to/Megatron-LM "
                              f"(a {MEGATRON_LM_TAG} checkout) or put it on PYTHONPATH")
        root = os.path.dirname(os.path.abspath(spec.origin))
    version = megatron_lm_version(root)
    if version is None or not supported(version):
        raise ConfigError(f"{root}: megatron-core {version}, but megatron-lrmoe supports "
                          f"{line()}.x only; git -C {root} checkout {MEGATRON_LM_TAG}")
    if root not in sys.path:
        sys.path.insert(0, root)
    return root


# -----------------------------------------------------------------------------
# Arguments
# -----------------------------------------------------------------------------


def lrmoe_args_provider(inner: ArgsProvider | None = None) -> ArgsProvider:
    """``extra_args_provider`` for Megatron-LM's ``parse_and_validate_args``: ``inner``'s
    flags (e.g. modelopt's), the ``--moe-lrmoe*`` flags, and a check of them right after
    parsing."""

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
    the run before Megatron initializes CUDA and the process groups, and before
    ``--yaml-cfg`` replaces the parsed namespace."""
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
    config's checks, ``flags.validate_lrmoe_flags``); Megatron-LM paths that bypass
    the LRMoE config, and the combinations, only with it. What depends on values
    Megatron derives later (recompute, FP8, CUDA graphs, context parallelism ...) is
    refused by ``LRMoETransformerConfig`` when the config is built
    (``lrmoe_config_from_args``).
    """
    if getattr(args, "moe_lrmoe", False):
        _refuse_bypassing_paths(args)
    validate_lrmoe_flags(lrmoe_view(args))


def _refuse_bypassing_paths(args: argparse.Namespace) -> None:
    """Megatron-LM options under which the LRMoE config or spec would not be used."""
    if getattr(args, "yaml_cfg", None) is not None:
        raise ConfigError(
            "--yaml-cfg builds a plain TransformerConfig and would drop the --moe-lrmoe* "
            "settings; give the model as flags instead (a flat flag YAML such as "
            "configs/qwen3_30b_a3b.yaml turns into flags with "
            "`python -m megatron_lrmoe.integration.megatron_lm flags FILE.yaml`)")
    refused = {
        "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path: Megatron-LM "
                                            "then builds a HeterogeneousTransformerConfig, "
                                            "which has no --moe-lrmoe* fields; drop one of "
                                            "the two",
        "export_kd_teacher_load": "--export-kd-teacher-load: ModelOpt's model builder "
                                  "would bypass the LRMoE spec conversion; drop one of the two",
    }
    for dest, why in refused.items():
        if getattr(args, dest, None):
            raise ConfigError(why)


def lrmoe_config_from_args(args: argparse.Namespace) -> Any:
    """``LRMoETransformerConfig`` from Megatron-LM's args, the way Megatron-LM builds
    its TransformerConfig; with ``--multi-latent-attention`` an ``LRMoEMLATransformerConfig``
    (Megatron-LM then builds its own MLATransformerConfig whatever class it is asked for:
    that config with the LRMoE options added). LRMoE's refusals come back as
    ``ConfigError`` naming the flag; Megatron's own errors pass through unchanged."""
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.core.transformer import MLATransformerConfig
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_lrmoe.config.transformer_config import (
        LRMoEMLATransformerConfig,
        LRMoETransformerConfig,
    )
    from megatron_lrmoe.integration.planner_inputs import AUTO_STAND_IN_GIB

    auto = _auto_budget(args)
    source = args
    if auto:
        if _vocab_size(args) is None:
            raise ConfigError("--moe-lrmoe-memory-budget-gb auto: the memory account needs the "
                              "padded vocabulary (args.padded_vocab_size), which Megatron-LM "
                              "sets with the tokenizer; build the LRMoE config after it")
        # Megatron-LM fills a config from args alone: a copy carries the stand-in budget,
        # and ``args`` keeps auto.
        source = argparse.Namespace(**vars(args))
        source.moe_lrmoe_memory_budget_gb = AUTO_STAND_IN_GIB
    try:
        config = core_transformer_config_from_args(source, LRMoETransformerConfig)
        if isinstance(config, MLATransformerConfig) and not isinstance(
                config, LRMoETransformerConfig):
            config = LRMoEMLATransformerConfig.from_mla_config(config, **{
                o.field: getattr(source, o.field) for o in OPTIONS if hasattr(source, o.field)})
    except LRMoEConfigError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(config, LRMoETransformerConfig):
        raise ConfigError(f"Megatron-LM built a {type(config).__name__} for these flags, which "
                          "cannot carry --moe-lrmoe")
    if auto:
        _resolve_auto_budget(args, config)
    _check_memory_budget(args, config)
    _print_memory_account(args, config)
    return config


def _check_memory_budget(args: argparse.Namespace, config) -> None:
    """Refuse a --moe-lrmoe-memory-budget-gb below the floor (nothing fits even with nothing
    retained: ``planning.plan_types.budget_floor``, by ``check_memory_budget``), at start-up
    (after ``parse_and_validate_args``, which makes Megatron's micro-batch calculator)."""
    if config.moe_lrmoe_memory_budget_gb is None:
        return
    # deferred: torch loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.integration.planner_inputs import check_memory_budget

    microbatches = _microbatches_per_step()
    try:
        import torch  # deferred: as above

        fit = check_memory_budget(config, args.expert_model_parallel_size,
                                  tokens_per_rank(args), microbatches,
                                  "cuda" if torch.cuda.is_available() else "cpu",
                                  args.micro_batch_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if fit:
        from megatron.training.utils import print_rank_0  # deferred: Megatron (module doc)

        print_rank_0(fit)


def _microbatches_per_step() -> int:
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    try:
        return get_num_microbatches()
    except AttributeError as exc:  # the calculator is None before set_global_variables
        raise ConfigError("--moe-lrmoe-memory-budget-gb: checked against the micro-batches "
                          "of a step, which Megatron-LM knows only after "
                          "megatron.training.arguments.parse_and_validate_args; build the "
                          "LRMoE config after it") from exc


def _vocab_size(args: argparse.Namespace) -> int | None:
    """Megatron-LM's padded vocabulary (``args.padded_vocab_size``, set with the
    tokenizer), or None before it is known."""
    return getattr(args, "padded_vocab_size", None)


def _memory_account(args: argparse.Namespace, config) -> Any:
    """The run's memory account (``planner_inputs.memory_account``). The micro-batches
    per step set no byte of it (only the replica refresh's time): 1 where Megatron-LM's
    calculator is not set up yet."""
    # deferred: torch loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.integration.planner_inputs import device_memory_bytes, memory_account

    return memory_account(config, args, _vocab_size(args) or 0, _microbatches_or_one(),
                          device_memory_bytes(getattr(args, "device_memory_gb", None)))


def _microbatches_or_one() -> int:
    try:
        return _microbatches_per_step()
    except ConfigError:
        return 1


def _auto_budget(args: argparse.Namespace) -> bool:
    return getattr(args, "moe_lrmoe_memory_budget_gb", None) == AUTO


def _resolve_auto_budget(args: argparse.Namespace, config) -> None:
    """``--moe-lrmoe-memory-budget-gb auto``: the GiB the memory account leaves, into the
    run's one ``config`` (``planner_inputs.set_auto_budget``); refused naming both flags
    below the floor or without a device size."""
    # deferred: torch loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.integration.planner_inputs import set_auto_budget

    try:
        set_auto_budget(config, _memory_account(args, config), args, _microbatches_or_one())
    except ValueError as exc:      # LRMoEConfigError included: both name the flag
        raise ConfigError(str(exc)) from exc


def _print_memory_account(args: argparse.Namespace, config) -> None:
    """The memory account, its parts in GiB, the device's size and the MoE budget the
    planner uses, once (rank 0, Megatron-LM's print_rank_0)."""
    if _ACCOUNT["account"] is not None:
        return
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.training.utils import print_rank_0

    from megatron_lrmoe.integration.planner_inputs import AUTO_BUDGET_SOURCE, account_gap
    from megatron_lrmoe.planning.memory_account import GIB, account_line

    account = _memory_account(args, config)
    budget = config.moe_lrmoe_memory_budget_gb
    budget_bytes = None if budget is None else budget * GIB
    source = AUTO_BUDGET_SOURCE if _auto_budget(args) else "--moe-lrmoe-memory-budget-gb"
    line = account_line(account, budget_bytes, source)
    if _vocab_size(args) is None:
        line += " (vocabulary not known yet: embeddings and logits not counted)"
    gap = account_gap(config)
    if gap is not None:
        line += f" ({gap})"
    print_rank_0(" [LRMoE] " + line)
    _ACCOUNT.update(account=account, budget_bytes=budget_bytes)


# The printed account (once per process), for the allocator check after the second step.
_ACCOUNT: dict[str, Any] = {"account": None, "budget_bytes": None, "steps": 0}


def check_allocator_once() -> None:
    """Called after every iteration (the ``training_log`` wrapper); after this process's
    second, on CUDA, once: the caching allocator's peak against the memory account
    (``planner_inputs.allocator_check``; one host read). The planner keeps the account's
    budget."""
    if _ACCOUNT["account"] is None or _ACCOUNT["steps"] >= 2:
        return
    _ACCOUNT["steps"] += 1
    import torch  # deferred: torch loads only after find_megatron_lm (module doc)

    if _ACCOUNT["steps"] != 2 or not torch.cuda.is_available():
        return
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.training.utils import print_rank_0

    from megatron_lrmoe.integration.planner_inputs import allocator_check

    print_rank_0(" [LRMoE] " + allocator_check(
        _ACCOUNT["account"], torch.cuda.max_memory_allocated(), _ACCOUNT["budget_bytes"]))


# -----------------------------------------------------------------------------
# Model: the model config and its builder (pretrain_gpt.py at core_v0.19.0)
# -----------------------------------------------------------------------------


def lrmoe_model_config(args: argparse.Namespace, model_cfg: Any) -> Any:
    """The model config pretrain_gpt.py hands to ``pretrain`` (in its config container).

    Without ``--moe-lrmoe``: ``model_cfg`` itself. With it: an ``LRMoEGPTModelConfig``
    made by Megatron-LM's ``gpt_config_from_args`` from the same args around
    ``lrmoe_config_from_args(args)``, so every GPT setting (vocabulary, rope, ``--spec``
    ...) is what pretrain_gpt.py would have set. Refuses a ``model_cfg`` of another
    class (ModelOpt's, chosen when ``--load`` holds ModelOpt state): its builder would
    bypass the LRMoE spec conversion.
    """
    if not getattr(args, "moe_lrmoe", False):
        return model_cfg
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models import GPTModelConfig

    if type(model_cfg) is not GPTModelConfig:
        raise ConfigError(
            f"--moe-lrmoe: pretrain_gpt.py chose a {type(model_cfg).__name__}, whose builder "
            "would bypass the LRMoE spec conversion (ModelOpt is enabled when --load holds "
            "a ModelOpt checkpoint); train LRMoE from a plain Megatron checkpoint, or drop "
            "--moe-lrmoe")
    # As the lean launcher does: selective recompute (layernorm, moe_act) without
    # Transformer Engine otherwise raises NameError in Megatron's CheckpointWithoutOutput.
    fp8_off_in_checkpoint_without_output_when_te_absent()
    config_cls, _ = _model_classes()
    return gpt_config_from_args(args, config=lrmoe_config_from_args(args),
                                model_config_cls=config_cls)


_MODEL_CLASSES: tuple[type, type] | None = None


def _model_classes() -> tuple[type, type]:
    """``(LRMoEGPTModelConfig, LRMoEGPTModelBuilder)``, made on first use: they
    subclass Megatron-LM's classes, which must not load before ``find_megatron_lm``."""
    global _MODEL_CLASSES
    if _MODEL_CLASSES is not None:
        return _MODEL_CLASSES
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.training import get_args
    from megatron.training.models import GPTModelBuilder, GPTModelConfig

    class LRMoEGPTModelConfig(GPTModelConfig):
        """A ``GPTModelConfig`` (no new fields) whose builder is ``LRMoEGPTModelBuilder``;
        the same pattern as ModelOpt's ``ModelOptModelConfig``. Its ``transformer`` is
        an ``LRMoETransformerConfig`` with ``moe_lrmoe`` (``lrmoe_model_config``)."""

        # Resolved by GPTModelConfig.get_builder_cls through this module's __getattr__.
        builder = f"{__name__}.LRMoEGPTModelBuilder"

    class LRMoEGPTModelBuilder(GPTModelBuilder):
        """``GPTModelBuilder`` that builds the LRMoE model of an ``LRMoEGPTModelConfig``:
        Megatron-LM's own ``build_model`` (and through it ``build_distributed_models``)
        with the specs converted, then the LRMoE step state set up per model chunk."""

        def build_model(self, pg_collection: Any, pre_process: bool | None = None,
                        post_process: bool | None = None, vp_stage: int | None = None):
            # deferred: Megatron (module doc)
            from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

            config = builder_model_config(self).transformer
            if not (isinstance(config, LRMoETransformerConfig) and config.moe_lrmoe):
                raise ConfigError("--moe-lrmoe: LRMoEGPTModelBuilder got a model config "
                                  f"whose transformer is a {type(config).__name__} without "
                                  "moe_lrmoe; make it with "
                                  "megatron_lrmoe.integration.megatron_lm.lrmoe_model_config")
            with _specs_converted(GPTModelBuilder.build_model):
                model = super().build_model(pg_collection, pre_process, post_process,
                                            vp_stage)
            _finish_build(get_args(), model, config)
            return model

    # Named as this module's attributes, so that Megatron-LM's config serialization
    # (ModelConfig.as_dict / from_dict: module + qualified name) finds them again.
    for cls in (LRMoEGPTModelConfig, LRMoEGPTModelBuilder):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    _MODEL_CLASSES = (LRMoEGPTModelConfig, LRMoEGPTModelBuilder)
    return _MODEL_CLASSES


def __getattr__(name: str) -> Any:
    """``LRMoEGPTModelConfig`` and ``LRMoEGPTModelBuilder`` (PEP 562), made on access."""
    if name in ("LRMoEGPTModelConfig", "LRMoEGPTModelBuilder"):
        config_cls, builder_cls = _model_classes()
        return config_cls if name == "LRMoEGPTModelConfig" else builder_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Models built with LRMoE layers, in build order (the same on every rank: the step
# boundary pools counts over ranks layer by layer).
_BUILT: list[weakref.ref] = []


def built_models() -> list[Any]:
    """The live LRMoE model chunks built by this module, in build order."""
    _BUILT[:] = [ref for ref in _BUILT if ref() is not None]
    return [model for model in (ref() for ref in _BUILT) if model is not None]


def lrmoe_builder(base: Builder) -> Builder:
    """A model builder with ``gpt_builder``'s signature (the ``model_provider`` path,
    ``partial(model_provider, lrmoe_builder(gpt_builder))``) that builds LRMoE models
    under ``--moe-lrmoe`` and is ``base`` itself otherwise."""

    @functools.wraps(base)
    def builder(args, pre_process=True, post_process=True, vp_stage=None, config=None,
                pg_collection=None):
        if not getattr(args, "moe_lrmoe", False):
            return base(args, pre_process, post_process, vp_stage, config=config,
                        pg_collection=pg_collection)
        # deferred: Megatron (module doc)
        from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

        if config is None:
            config = lrmoe_config_from_args(args)
        elif not (isinstance(config, LRMoETransformerConfig) and config.moe_lrmoe):
            raise ConfigError("--moe-lrmoe: the caller passed a config without the LRMoE "
                              "fields; build it with megatron_lrmoe.integration.megatron_lm."
                              "lrmoe_config_from_args")
        with _specs_converted(base):
            model = base(args, pre_process, post_process, vp_stage, config=config,
                         pg_collection=pg_collection)
        _finish_build(args, model, config)
        return model

    return builder


@contextmanager
def _specs_converted(owner: Callable[..., Any]) -> Iterator[None]:
    """While ``owner`` runs, the ``GPTModel`` it calls (its module's global) converts the
    specs it is given.

    GPTModelBuilder.build_model and gpt_builder pick the spec (TE or local, decoder block
    with --moe-layer-freq, --spec, MTP block) and pass it straight to GPTModel:
    converting there covers every flavour without repeating Megatron-LM's choice.
    """
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    def converting(real: Any) -> Callable[..., Any]:
        def gpt_model(*args: Any, **kwargs: Any):
            if "transformer_layer_spec" in kwargs:
                kwargs["transformer_layer_spec"] = to_lrmoe_spec(
                    kwargs["transformer_layer_spec"])
            elif len(args) > 1:
                args = (args[0], to_lrmoe_spec(args[1]), *args[2:])
            if kwargs.get("mtp_block_spec") is not None:
                kwargs["mtp_block_spec"] = to_lrmoe_spec(kwargs["mtp_block_spec"])
            return real(*args, **kwargs)

        return gpt_model

    with ExitStack() as stack:
        try:
            stack.enter_context(swap_gpt_model_class(owner, converting))
        except GPTModelNotFound as exc:
            name = getattr(owner, "__qualname__", repr(owner))
            raise ConfigError(f"--moe-lrmoe: cannot convert the specs of {name} ({exc})") \
                from None
        yield


def _finish_build(args: argparse.Namespace, model: Any, config: Any) -> None:
    """After an LRMoE model chunk is built: refuse unconverted MoE layers, set up its
    step state, remember it for the step boundary and install the hooks."""
    _check_converted(model)
    _setup_step_state(args, model, config)
    _BUILT.append(weakref.ref(model))
    install_lrmoe_hooks()


def _check_converted(model: Any) -> None:
    """Every MoE layer of the built model must be LRMoE's (no silent fallback)."""
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.integration.step_hooks import unconverted_moe_layers

    missed = unconverted_moe_layers([model])
    if missed:
        raise ConfigError(f"--moe-lrmoe: these MoE layers were not converted: {missed[:3]}")


# -----------------------------------------------------------------------------
# Step state, hooks and logging
# -----------------------------------------------------------------------------


def _setup_step_state(args: argparse.Namespace, model: Any, config: Any) -> None:
    """Build the LRMoE planners of a model chunk at model setup (docs/design.md, "Step
    state"), before Megatron-LM loads a checkpoint into it or trains."""
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training.utils import print_rank_0

    from megatron_lrmoe.integration.step_hooks import machine_constants_line, setup_lrmoe_layers

    machine = setup_lrmoe_layers([model], tokens_per_rank(args), get_num_microbatches, config)
    if machine is not None and not built_models():
        print_rank_0(machine_constants_line(machine))


def install_lrmoe_hooks() -> None:
    """Once per process: the step boundary and statistics after Megatron-LM's
    ``training_log``, the step-state flag in its checkpoint metadata, and the LRMoE
    state in its re-run state machine's snapshots."""
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.integration.step_hooks import chain_to_rerun_state_machine

    chain_to_rerun_state_machine(built_models)
    wrap_training_log(_training_log_wrapper)
    wrap_sharded_state_dict_metadata(_sharded_state_dict_metadata_wrapper)


def _training_log_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``training_log`` with the LRMoE step boundary before it and the LRMoE
    statistics after it (``megatron_privates.wrap_training_log``)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def training_log(*a: Any, **kw: Any):
        # deferred: Megatron (module doc)
        from megatron_lrmoe.integration.step_hooks import (
            chain_to_rerun_state_machine,
            finish_lrmoe_step,
        )

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
        check_allocator_once()
        return result

    return training_log


def _sharded_state_dict_metadata_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's builder of a save's sharded state dict metadata (its checkpoint
    content metadata, handed back on load) with the LRMoE step-state flag under
    ``--moe-lrmoe`` (``megatron_privates.wrap_sharded_state_dict_metadata``)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def sharded_state_dict_metadata(*a: Any, **kw: Any) -> dict:
        # deferred: Megatron (module doc)
        from megatron_lrmoe.integration.step_hooks import STEP_STATE_FLAG

        # An LRMoE checkpoint says it holds the step state, a plain one does not.
        metadata = original(*a, **kw)
        if getattr(signature.bind(*a, **kw).arguments["args"], "moe_lrmoe", False):
            metadata[STEP_STATE_FLAG] = True
        return metadata

    return sharded_state_dict_metadata


def log_lrmoe_stats(iteration: int) -> dict[str, float]:
    """Reduce and write the LRMoE statistics at the LRMoE log interval (collective:
    every rank calls it at the same iteration, as Megatron-LM's training loop does)."""
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer

    from megatron_lrmoe.integration.step_hooks import write_lrmoe_stats

    args = get_args()
    num_layers = args.num_layers + (getattr(args, "mtp_num_layers", None) or 0)
    return write_lrmoe_stats(built_models(), iteration,
                             args.moe_lrmoe_log_interval or args.log_interval, num_layers,
                             args.num_experts, get_tensorboard_writer(), get_wandb_writer())


def format_lrmoe_line(iteration: int, stats: dict[str, float]) -> str:
    """The one-line summary (``step_hooks.format_lrmoe_line``)."""
    # deferred: Megatron loads only after find_megatron_lm (module doc)
    from megatron_lrmoe.integration.step_hooks import format_lrmoe_line as line

    return line(iteration, stats)


# -----------------------------------------------------------------------------
# The wrapper's main and the flag-YAML helper
# -----------------------------------------------------------------------------


def run_pretrain_gpt() -> None:
    """pretrain_gpt.py's ``__main__`` (core_v0.19.0) with the LRMoE argument provider and
    model config, calling pretrain_gpt.py's own functions (the body of
    ``scripts/pretrain_gpt_lrmoe.py``); Megatron parses ``sys.argv`` itself."""
    start = time.time()
    find_megatron_lm()
    # deferred: Megatron-LM's modules, from the checkout find_megatron_lm put first
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    set_startup_timestamps(program_start=start, main_entry=time.time())
    datasets = pretrain_gpt.train_valid_test_datasets_provider
    mark_datasets_provider_distributed(datasets)
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    modelopt = pretrain_gpt.has_nvidia_modelopt
    args = parse_and_validate_args(
        extra_args_provider=lrmoe_args_provider(pretrain_gpt.add_modelopt_args if modelopt
                                                else None),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    if modelopt:
        pretrain_gpt.maybe_enable_modelopt(args)
    if modelopt and getattr(args, "modelopt_enabled", False):
        model_cfg = gpt_config_from_args(args, model_config_cls=pretrain_gpt.ModelOptModelConfig)
    else:
        model_cfg = gpt_config_from_args(args)
    pretrain(
        pretrain_cfg_container_from_args(args, lrmoe_model_config(args, model_cfg)),
        datasets,
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        store=store,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


def config_to_flags(path: str, lrmoe: bool = True) -> list[str]:
    """A launcher config (flat YAML of flag names) as a Megatron-LM argument list.

    The file is first read by the launcher's own parser, so it stays valid for both
    entry points. ``lrmoe=False`` leaves out every ``moe-lrmoe*`` key (the baseline).
    """
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
    """``python -m megatron_lrmoe.integration.megatron_lm flags FILE.yaml [--no-lrmoe]``: print the
    config's Megatron-LM flags, one per line (what the launch scripts read)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_lrmoe.integration.megatron_lm")
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
