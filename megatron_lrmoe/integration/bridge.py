"""LRMoE in Megatron-Bridge recipes: ``enable_lrmoe(cfg)`` on a ``ConfigContainer``.

The order of use::

    cfg = qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config()      # a Bridge GPT or hybrid recipe
    changes = enable_lrmoe(cfg, adapt=True, moe_lrmoe_bwd_capacity_factor=0.75)
    cfg = process_config_with_overrides(cfg, yaml, ["model.moe_lrmoe_min_retention=0.1"])
    pretrain(cfg, gpt_step, callbacks=[LRMoECallback()])

``enable_lrmoe`` converts the recipe's model provider into an LRMoE provider
(``lrmoe_provider_class``: the provider's class with ``LRMoETransformerConfig``'s fields,
every field value kept), sets the LRMoE options given by their config field names
(``options.OPTIONS``: the same defaults and checks as the ``--moe-lrmoe*`` flags), and
deals with the recipe settings LRMoE cannot run, taken from the table of Megatron's
options (``options/megatron.py``, ``MEGATRON_OPTIONS``): refused by default, each
named with the value it would need; with ``adapt=True`` set to that value when the table
marks it adaptable (an implementation choice: dispatcher, fusions, overlaps, CUDA graphs),
one printed line and one returned ``Change`` each. Settings that change the model, its
parallel layout or its precision, Megatron-FSDP, torch FSDP2 and PEFT are refused either
way. Overrides may follow (the ``model.moe_lrmoe*`` fields exist by then); Bridge's
``ConfigContainer.validate`` calls the provider's ``finalize()``, which runs every LRMoE
check on the final values, errors naming the field (``model.<field>: problem``).

At run time:

* the provider's ``provide`` puts whatever ``transformer_layer_spec`` is set then (a
  ModuleSpec, a block spec, or a function of the config, TE or local) through
  ``to_lrmoe_spec``; Bridge's MTP block spec is made from that layer spec, so MTP layers
  are converted too. A hybrid (Mamba) provider's ``hybrid_stack_spec`` goes the same way:
  its ``moe_layer`` builds every MoE layer of the pattern, MTP layers' included;
* its ``provide_distributed_model`` runs ``lrmoe_pre_wrap_hook`` first of the pre-wrap
  hooks (Bridge's hook mechanism), before any checkpoint load: it refuses a model with an
  unconverted MoE layer and builds the LRMoE planners (``step_hooks.setup_lrmoe_layers``);
* ``LRMoECallback`` (a Bridge training ``Callback``) ends the LRMoE step after every
  training step (``step_hooks.finish_lrmoe_step``) and writes the LRMoE statistics to
  Bridge's TensorBoard and W&B writers at ``moe_lrmoe_log_interval`` (default: the logger's
  interval). The first training forward refuses to run without it;
* the step state goes into Bridge's checkpoints as each layer's extra state: Bridge's
  private ``_build_sharded_state_dict_metadata`` is wrapped (``megatron_privates``) to add
  the step-state flag while an LRMoE model trains. The step state is serialized when the
  save is made, before an asynchronous save is handed to its worker, so asynchronous saves
  carry it too (tested bitwise, as synchronous ones).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from megatron_lrmoe.integration.runtime.compat import stub_bridge_imports_of_absent_modules

# Bridge imports modules that cannot be installed everywhere (runtime/compat.py).
stub_bridge_imports_of_absent_modules()

from megatron.bridge.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron.bridge.models.hybrid.hybrid_provider import (  # noqa: E402
    HybridModelProvider,
    get_default_hybrid_stack_spec,
)
from megatron.bridge.training.callbacks import Callback, CallbackContext  # noqa: E402
from megatron.core.num_microbatches_calculator import (  # noqa: E402
    get_micro_batch_size,
    get_num_microbatches,
)
from megatron.core.transformer import ModuleSpec  # noqa: E402
from megatron.core.transformer.heterogeneous.heterogeneous_config import (  # noqa: E402
    HeterogeneousTransformerConfig,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_config import (  # noqa: E402
    TransformerConfig as MCoreConfig,
)

from megatron_lrmoe.config.flags import tokens_per_rank  # noqa: E402
from megatron_lrmoe.config.transformer_config import (  # noqa: E402
    LRMoEMLATransformerConfig,
    LRMoETransformerConfig,
)
from megatron_lrmoe.integration.step_hooks import (  # noqa: E402
    STEP_STATE_FLAG,
    chain_to_rerun_state_machine,
    finish_lrmoe_step,
    lrmoe_layers,
    machine_constants_line,
    print_on_last_rank,
    setup_lrmoe_layers,
    unconverted_moe_layers,
    write_lrmoe_stats,
)
from megatron_lrmoe.layer.spec import to_lrmoe_spec  # noqa: E402
from megatron_lrmoe.megatron_privates import wrap_bridge_sharded_state_dict_metadata  # noqa: E402
from megatron_lrmoe.options.lrmoe import (  # noqa: E402
    AUTO,
    OPTIONS,
    RECOMPUTE_MODULES,
    LRMoEConfigError,
    option,
)
from megatron_lrmoe.options.megatron import (  # noqa: E402
    MEGATRON_OPTIONS,
    NO_FIX,
    megatron_option,
)

__all__ = ["BridgeConfigError", "Change", "LRMoECallback", "LRMoEGPTModelProvider",
           "LRMoEHybridModelProvider", "bridge_tokens_per_rank", "enable_lrmoe",
           "lrmoe_pre_wrap_hook", "lrmoe_provider_class", "refused_settings"]


class BridgeConfigError(LRMoEConfigError):
    """An LRMoE refusal of a Bridge config, in the words ``<path>: problem``, where path is
    the field as an override names it (``model.moe_token_dispatcher_type``); ``message``
    replaces those words where one error names several fields."""

    def __init__(self, path: str, problem: str, message: str | None = None):
        ValueError.__init__(self, message or f"{path}: {problem}")
        self.field = path.rpartition(".")[2]
        self.flag = path
        self.problem = problem


def _model_error(exc: LRMoEConfigError) -> BridgeConfigError:
    return exc if isinstance(exc, BridgeConfigError) else BridgeConfigError(
        f"model.{exc.field}", exc.problem)


def _show(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value.__name__ if isinstance(value, type) else str(value)


# -----------------------------------------------------------------------------
# The provider
# -----------------------------------------------------------------------------


class _LRMoECheckView:
    """The provider as LRMoE's checks read it. Bridge copies its mixed-precision config's
    FP8 and FP4 knobs onto every model (``fp8_recipe`` "tensorwise" with FP8 off); with
    FP8 (FP4) off they act on nothing, so the view hides them. Everything else is the
    provider's."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        for knob in ("fp8", "fp4"):
            if name.startswith(knob + "_") and getattr(self._provider, knob, None) is None:
                raise AttributeError(name)
        return getattr(self._provider, name)


class _LRMoEProvider:
    """What the LRMoE provider adds to a Bridge GPT provider (first base of the classes
    ``lrmoe_provider_class`` makes; the provider's and LRMoETransformerConfig's fields
    come from the other bases)."""

    # The provider field ``provide`` converts (not a dataclass field: no annotation).
    _lrmoe_spec_field = "transformer_layer_spec"

    def _lrmoe_spec(self, spec: Any) -> Any:
        return lrmoe_layer_spec(spec)

    def finalize(self) -> None:
        """Bridge's deferred ``__post_init__`` with LRMoE's checks before and after it
        (as ``LRMoETransformerConfig.__post_init__`` runs them around Megatron's)."""
        view = _LRMoECheckView(self)
        try:
            self.check_lrmoe(view)
            super().finalize()
            self.check_lrmoe(view)
        except LRMoEConfigError as exc:
            raise _model_error(exc) from None

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        """Bridge's ``provide`` with the layer spec set now put through ``to_lrmoe_spec``
        (restored after: the field keeps what the recipe or an override set)."""
        if not self.moe_lrmoe:
            return super().provide(pre_process, post_process, vp_stage)
        field = self._lrmoe_spec_field
        spec = getattr(self, field)
        setattr(self, field, self._lrmoe_spec(spec))
        try:
            return super().provide(pre_process, post_process, vp_stage)
        finally:
            setattr(self, field, spec)

    def provide_distributed_model(self, *args: Any, **kwargs: Any):
        """Bridge's, with ``lrmoe_pre_wrap_hook`` first of the pre-wrap hooks; refuses the
        data-parallel wrappers LRMoE does not support."""
        if not self.moe_lrmoe:
            return super().provide_distributed_model(*args, **kwargs)
        for name, path in (("use_megatron_fsdp", "ddp.use_megatron_fsdp"),
                           ("use_torch_fsdp2", "dist.use_torch_fsdp2")):
            if kwargs.get(name):
                raise BridgeConfigError(path, _FSDP_PROBLEM)
        given = kwargs.get("pre_wrap_hook")
        if given is None:
            given = self.pre_wrap_hook        # the registered ones, composed
        rest = [] if given is None else (list(given) if isinstance(given, list) else [given])
        kwargs["pre_wrap_hook"] = [lrmoe_pre_wrap_hook, *rest]
        return super().provide_distributed_model(*args, **kwargs)


@dataclasses.dataclass
class LRMoEGPTModelProvider(_LRMoEProvider, GPTModelProvider, LRMoETransformerConfig):
    """Bridge's ``GPTModelProvider`` with the LRMoE options (``LRMoETransformerConfig``'s
    fields); ``finalize()`` runs LRMoE's checks, ``provide`` builds LRMoE layers."""


_HYBRID_AUTO_BUDGET = (
    "auto is not supported for hybrid (Mamba) models: LRMoE's memory account covers "
    "Transformer layers only, not the Mamba layers' weights, states and activations; give "
    "the MoE layers' budget in GiB")


class _LRMoEHybridProvider(_LRMoEProvider):
    """The LRMoE provider of a Bridge hybrid (Mamba) provider: ``provide`` converts the
    hybrid stack spec, whose ``moe_layer`` builds the pattern's MoE layers (``E``), those
    of its MTP layers too; Mamba, attention and dense MLP layers stay Megatron's."""

    _lrmoe_spec_field = "hybrid_stack_spec"

    def _lrmoe_spec(self, spec: Any) -> Any:
        # None is Bridge's default stack spec, chosen from the config when provide() runs.
        return lrmoe_layer_spec(get_default_hybrid_stack_spec if spec is None else spec)

    def check_lrmoe(self, view: Any = None) -> None:
        """LRMoE's checks; ``auto`` budgets refused by a hybrid model's own reason."""
        if self.moe_lrmoe_memory_budget_gb == AUTO:
            raise LRMoEConfigError("moe_lrmoe_memory_budget_gb", _HYBRID_AUTO_BUDGET)
        super().check_lrmoe(view)


@dataclasses.dataclass
class LRMoEHybridModelProvider(_LRMoEHybridProvider, HybridModelProvider,
                               LRMoETransformerConfig):
    """Bridge's ``HybridModelProvider`` (Mamba-hybrid models, Nemotron-3) with the LRMoE
    options; its MoE layers are LRMoE's."""


_PROVIDER_CLASSES: dict[type, type] = {GPTModelProvider: LRMoEGPTModelProvider,
                                       HybridModelProvider: LRMoEHybridModelProvider}


def lrmoe_provider_class(cls: type) -> type:
    """The LRMoE provider class of Bridge provider class ``cls``: ``LRMoEGPTModelProvider``
    for ``GPTModelProvider``, ``LRMoEHybridModelProvider`` for ``HybridModelProvider``, a
    dataclass made once per class for their subclasses (the recipe's own class stays a
    base, so its fields, defaults and methods apply). Refuses, by name, the providers
    LRMoE does not support."""
    if issubclass(cls, _LRMoEProvider):
        return cls
    if not issubclass(cls, GPTModelProvider | HybridModelProvider):
        raise BridgeConfigError("model", f"{cls.__name__} is not a GPTModelProvider or "
                                         "HybridModelProvider; LRMoE converts Bridge's GPT and "
                                         "hybrid (Mamba) providers only")
    unsupported = {HeterogeneousTransformerConfig: "heterogeneous layers"}
    for base, what in unsupported.items():
        if issubclass(cls, base):
            raise BridgeConfigError(
                "model", f"{cls.__name__} uses {what}, which LRMoE does not support yet "
                         f"(its config class, {base.__name__}, has no LRMoE fields)")
    if cls not in _PROVIDER_CLASSES:
        lrmoe = _LRMoEHybridProvider if issubclass(cls, HybridModelProvider) else _LRMoEProvider
        # An MLA provider (DeepSeek, Kimi, Moonlight: Bridge's MLAModelProvider) keeps
        # Megatron's MLA config class among its bases, so the LRMoE fields come with it.
        config_cls = (LRMoEMLATransformerConfig if issubclass(cls, MLATransformerConfig)
                      else LRMoETransformerConfig)
        made = dataclasses.dataclass(type(f"LRMoE{cls.__name__}",
                                          (lrmoe, cls, config_cls),
                                          {"__module__": __name__}))
        globals()[made.__name__] = made       # importable by its name in this process
        _PROVIDER_CLASSES[cls] = made
    return _PROVIDER_CLASSES[cls]


class _LRMoESpecFunction:
    """A layer-spec function of the config (Bridge's ``default_layer_spec``, a partial of
    ``get_gpt_decoder_block_spec``, a hybrid stack spec function ...) whose result goes
    through ``to_lrmoe_spec``."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        parameters = inspect.signature(inner).parameters
        # Bridge calls a hybrid stack spec function without the config when it takes none.
        self.takes_config = len(parameters) > 0
        self.takes_vp_stage = "vp_stage" in parameters

    def __call__(self, config: Any, vp_stage: int | None = None) -> Any:
        if not self.takes_config:
            spec = self.inner()
        elif self.takes_vp_stage:
            spec = self.inner(config, vp_stage=vp_stage)
        else:
            spec = self.inner(config)
        return to_lrmoe_spec(spec)


def lrmoe_layer_spec(spec: Any) -> Any:
    """``spec`` (a ModuleSpec, block spec, or function of the config) with LRMoE layers in
    its MoE positions."""
    if isinstance(spec, ModuleSpec) or not callable(spec):
        return to_lrmoe_spec(spec)
    return spec if isinstance(spec, _LRMoESpecFunction) else _LRMoESpecFunction(spec)


# -----------------------------------------------------------------------------
# Recipe settings LRMoE does not run
# -----------------------------------------------------------------------------

_FSDP_PROBLEM = ("Megatron-FSDP and torch FSDP2 are not supported with LRMoE (its replicas "
                 "and region read whole expert weights); use the distributed optimizer "
                 "(ddp.use_distributed_optimizer=true)")


@dataclasses.dataclass(frozen=True)
class Change:
    """One recipe setting ``enable_lrmoe(adapt=True)`` changed: ``path`` as an override
    names it, the recipe's value and the one LRMoE needs."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


@dataclasses.dataclass(frozen=True)
class _Refusal:
    owner: Any
    path: str
    value: Any
    needs: Any
    adaptable: bool
    problem: str

    def words(self) -> str:
        return f"{self.path}={_show(self.value)} (needs {_show(self.needs)}: {self.problem})"


@functools.cache
def _megatron_default(name: str) -> Any:
    for f in dataclasses.fields(MCoreConfig):
        if f.name == name:
            return f.default_factory() if f.default is dataclasses.MISSING else f.default
    raise KeyError(name)


def _model_refusals(model: Any) -> list[_Refusal]:
    out = []
    view = _LRMoECheckView(model)
    for row in MEGATRON_OPTIONS:
        if row.args_only or row.refuse is None:
            continue
        try:
            value = getattr(view, row.name)
        except AttributeError:
            continue
        if not row.refuse(value):
            continue
        needs = row.fix_for(value)
        needs = _megatron_default(row.name) if needs is NO_FIX else needs
        out.append(_Refusal(model, f"model.{row.name}", value, needs, row.adaptable,
                            row.problem_for(value)))
    if getattr(model, "recompute_granularity", None) == "selective":
        modules = model.recompute_modules or []
        kept = [m for m in modules if m in RECOMPUTE_MODULES]
        if kept != list(modules):
            out.append(_Refusal(model, "model.recompute_modules", modules, kept, True,
                                f"LRMoE implements {', '.join(RECOMPUTE_MODULES)}"))
    return out


def _container_refusals(cfg: Any) -> list[_Refusal]:
    """What of the container outside the model LRMoE cannot run."""
    out = []
    for owner, name, path in ((cfg.ddp, "use_megatron_fsdp", "ddp.use_megatron_fsdp"),
                              (cfg.dist, "use_megatron_fsdp", "dist.use_megatron_fsdp"),
                              (cfg.dist, "use_torch_fsdp2", "dist.use_torch_fsdp2")):
        if getattr(owner, name, False):
            out.append(_Refusal(owner, path, True, False, False, _FSDP_PROBLEM))
    if getattr(cfg, "peft", None) is not None:
        out.append(_Refusal(cfg, "peft", type(cfg.peft).__name__, None, False,
                            "PEFT/LoRA recipes are not supported with LRMoE (adapters on "
                            "Megatron's expert linears, which the LRMoE region computes "
                            "itself); use a pretrain or SFT recipe"))
    overlap = getattr(cfg, "comm_overlap", None)
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
        if overlap is not None and getattr(overlap, name, None):
            out.append(_Refusal(overlap, f"comm_overlap.{name}", True, False, True,
                                megatron_option(name).problem_for(True)))
    return out


def refused_settings(cfg: Any) -> list[str]:
    """The settings of ``cfg`` (a ConfigContainer) LRMoE cannot run, each as
    ``path=value (needs value: why)``; empty when it runs them all."""
    return [r.words() for r in _container_refusals(cfg) + _model_refusals(cfg.model)]


# -----------------------------------------------------------------------------
# enable_lrmoe
# -----------------------------------------------------------------------------


def enable_lrmoe(cfg: Any, adapt: bool = False, **options: Any) -> list[Change]:
    """Turn LRMoE on in a Bridge ``ConfigContainer`` (in place); returns what ``adapt``
    changed.

    ``options``: LRMoE options by config field name (``moe_lrmoe_bwd_capacity_factor=0.75``;
    the ``--moe-lrmoe*`` flags' defaults and checks). The recipe's settings that LRMoE
    cannot run are refused in one error naming each field and the value it needs; with
    ``adapt=True`` the adaptable ones are set to it (one printed line each), the others
    still refused. Call it after building the recipe and before any override."""
    if not hasattr(cfg, "model"):
        raise BridgeConfigError("cfg", f"expected a Bridge ConfigContainer, got "
                                       f"{type(cfg).__name__}")
    if isinstance(cfg.model, _LRMoEProvider) and cfg.model.moe_lrmoe:
        raise BridgeConfigError("model.moe_lrmoe", "LRMoE is enabled on this config already")
    _check_option_names(options)
    provider_cls = lrmoe_provider_class(type(cfg.model))
    refusals = _container_refusals(cfg) + _model_refusals(cfg.model)
    blocking = [r for r in refusals if not (adapt and r.adaptable)]
    if blocking:
        first = blocking[0].path
        hint = ("" if adapt or not all(r.adaptable for r in blocking)
                else "; enable_lrmoe(cfg, adapt=True) sets them")
        words = "; ".join(r.words() for r in blocking)
        raise BridgeConfigError(first, words, "LRMoE cannot run these recipe settings: "
                                              + words + hint)
    changes = []
    for r in refusals:
        setattr(r.owner, r.path.rpartition(".")[2], r.needs)
        changes.append(Change(r.path, r.value, r.needs))
    model = provider_cls.__new__(provider_cls)
    model.__dict__.update(cfg.model.__dict__)    # every field and attribute of the recipe's
    for o in OPTIONS:
        setattr(model, o.field, o.default)
    model.moe_lrmoe = True
    for name, value in options.items():
        setattr(model, name, value)
    try:
        model.check_lrmoe(_LRMoECheckView(model))
    except LRMoEConfigError as exc:
        raise _model_error(exc) from None
    cfg.model = model
    if os.environ.get("RANK", "0") == "0":
        for change in changes:
            print(f"enable_lrmoe: {change}", flush=True)
    return changes


def _check_option_names(options: dict[str, Any]) -> None:
    for name in options:
        if name == "moe_lrmoe":
            raise BridgeConfigError("model.moe_lrmoe", "is what enable_lrmoe turns on; to run "
                                                      "without LRMoE, do not call it")
        try:
            option(name)
        except KeyError:
            near = difflib.get_close_matches(name, [o.field for o in OPTIONS], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise BridgeConfigError(f"model.{name}", "not an LRMoE option" + hint) from None


# -----------------------------------------------------------------------------
# Run time: the pre-wrap hook, the step callback, the checkpoint flag
# -----------------------------------------------------------------------------


class _Run:
    """The LRMoE model chunks of this process's current Bridge run (from the pre-wrap
    hook to the end of training), and whether the step callback started."""

    def __init__(self) -> None:
        self.models: list[weakref.ref] = []
        self.callback_started = False

    def live(self) -> list[Any]:
        return [m for m in (ref() for ref in self.models) if m is not None]

    def end(self) -> None:
        self.models, self.callback_started = [], False


_RUN = _Run()

_MISSING_CALLBACK = (
    "LRMoE in Megatron-Bridge needs its step callback: pretrain(cfg, forward_step, "
    "callbacks=[megatron_lrmoe.integration.bridge.LRMoECallback()]) (python -m "
    "megatron_lrmoe.bridge_launcher passes it)")


def lrmoe_pre_wrap_hook(model: list[Any]) -> list[Any]:
    """Bridge pre-wrap hook of an LRMoE provider (run before DDP wrapping and any
    checkpoint load): refuses unconverted MoE layers, builds the planners, and installs
    the step-state flag of Bridge's checkpoints and the re-run state machine's snapshot."""
    config = model[0].config
    if not getattr(config, "moe_lrmoe", False):
        return model
    missed = unconverted_moe_layers(model)
    if missed:
        raise BridgeConfigError("model.transformer_layer_spec",
                                f"these MoE layers were not converted to LRMoE: {missed[:3]}")
    machine = setup_lrmoe_layers(model, bridge_tokens_per_rank(config, get_micro_batch_size()),
                                 get_num_microbatches, config)
    if machine is not None:
        print_on_last_rank(machine_constants_line(machine))
    _RUN.models = [weakref.ref(m) for m in model]
    _RUN.callback_started = False
    wrap_bridge_sharded_state_dict_metadata(_sharded_state_dict_metadata_wrapper)
    chain_to_rerun_state_machine(_RUN.live)
    layers = lrmoe_layers(model)
    if layers:
        handle = layers[0].register_forward_pre_hook(
            lambda module, args: _require_callback(module, handle))
    return model


def bridge_tokens_per_rank(config: Any, micro_batch_size: int) -> int:
    """Tokens of one micro-batch on one rank of a Bridge model (its provider carries the
    sequence length and the parallel sizes): ``flags.tokens_per_rank``, S / CP (/ TP
    under sequence parallelism) x micro-batch."""
    return tokens_per_rank(SimpleNamespace(
        micro_batch_size=micro_batch_size, seq_length=config.seq_length,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        sequence_parallel=config.sequence_parallel))


def _require_callback(module: Any, handle: Any) -> None:
    if not module.training:
        return
    if not _RUN.callback_started:
        raise RuntimeError(_MISSING_CALLBACK)
    handle.remove()


def _sharded_state_dict_metadata_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Bridge's maker of a save's sharded state dict metadata with the LRMoE step-state
    flag while an LRMoE model trains (``megatron_privates``)."""

    @functools.wraps(original)
    def sharded_state_dict_metadata(*args: Any, **kwargs: Any) -> dict:
        metadata = original(*args, **kwargs)
        if _RUN.live():
            metadata[STEP_STATE_FLAG] = True
        return metadata

    return sharded_state_dict_metadata


class LRMoECallback(Callback):
    """The LRMoE step boundary and statistics in Bridge's training loop: pass it to
    ``pretrain(cfg, forward_step, callbacks=[LRMoECallback()])``."""

    def on_train_start(self, context: CallbackContext) -> None:
        cfg = context.state.cfg
        if not getattr(cfg.model, "moe_lrmoe", False):
            return
        refused = _container_refusals(cfg)
        if refused:
            words = "; ".join(r.words() for r in refused)
            raise BridgeConfigError(refused[0].path, words,
                                    "LRMoE cannot run these settings: " + words)
        # Bridge may have made a new re-run state machine since the model was built.
        chain_to_rerun_state_machine(_RUN.live)
        _RUN.callback_started = True

    def on_train_step_end(self, context: CallbackContext) -> None:
        config = context.state.cfg.model
        if not getattr(config, "moe_lrmoe", False):
            return
        # Every training step, taken or skipped; Bridge counts the step after this event.
        finish_lrmoe_step(context.model)
        iteration = context.state.train_state.step + 1
        interval = config.moe_lrmoe_log_interval or context.state.cfg.logger.log_interval
        write_lrmoe_stats(context.model, iteration, interval,
                          config.num_layers + (getattr(config, "mtp_num_layers", None) or 0),
                          config.num_moe_experts, context.state.tensorboard_logger,
                          context.state.wandb_logger)

    def on_train_end(self, context: CallbackContext) -> None:
        _RUN.end()
