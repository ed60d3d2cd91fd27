"""The one module through which megatron-lrmoe touches Megatron's internals.

Everything else in the package uses Megatron's public API only; where the plugin needs
more (a private function, a module global that Megatron looks up at call time, a method
it replaces), the access is one named function here, whose docstring names the Megatron
file:symbol and the version it was read from. ``PRIVATES`` lists them all, and
tests/test_megatron_privates.py checks both directions: no other module of
the package touches a Megatron private, and each entry still exists (installed
megatron-core, and the Megatron-LM checkout when ``$MEGATRON_LM`` names one), so a
Megatron upgrade fails there, loudly, before a run misbehaves.

The internals, each read from the version named (``MEGATRON_CORE``: megatron-core
0.19.2, ``MEGATRON_LM``: Megatron-LM core_v0.19.0):

* ``megatron.training.training:training_log`` (Megatron-LM core_v0.19.0; module
  attribute, wrapped by ``wrap_training_log``): ``train()`` looks it up in its module at
  every iteration; the Megatron-LM integration ends the LRMoE step before it and logs
  the LRMoE statistics after it.
* ``megatron.training.checkpointing:_build_sharded_state_dict_metadata`` (Megatron-LM
  core_v0.19.0; private, wrapped by ``wrap_sharded_state_dict_metadata``): the one place
  the sharded state dict metadata of a save is made; the wrapper adds the LRMoE
  step-state flag under ``--moe-lrmoe``.
* ``megatron.bridge.training.checkpointing:_build_sharded_state_dict_metadata``
  (Megatron-Bridge 0.6.2; private, wrapped by ``wrap_bridge_sharded_state_dict_metadata``):
  Bridge's one maker of the sharded state dict metadata of a save (and of local-checkpoint
  loads); the wrapper adds the LRMoE step-state flag while an LRMoE model trains.
* the module global ``GPTModel`` of ``megatron.training.models.gpt`` (looked up by
  ``GPTModelBuilder.build_model``) and of ``gpt_builders`` (``gpt_builder``)
  (Megatron-LM core_v0.19.0; swapped by ``swap_gpt_model_class`` while one LRMoE model
  is being built, then restored).
* the attribute ``is_distributed`` of the datasets provider, which
  ``megatron.training.training:build_train_valid_test_data_loaders`` reads off it
  (Megatron-LM core_v0.19.0; set by ``mark_datasets_provider_distributed``, as
  pretrain_gpt.py's ``__main__`` does for its own provider).
* ``megatron.training.models.base:ModelBuilder._model_config`` (Megatron-LM
  core_v0.19.0; private instance attribute, read by ``builder_model_config``): the model
  config a ``GPTModelBuilder`` builds from, which the LRMoE builder checks.
* ``megatron.core.tensor_parallel.random:_get_cuda_rng_state`` and
  ``_set_cuda_rng_state`` (megatron-core 0.19.2; private, replaced by
  ``replace_cuda_rng_state_functions``): the CPU runtime's RNG tracker swaps the CPU
  generator.
* ``megatron.core.tensor_parallel.random:CheckpointFunction.backward`` and
  ``CheckpointWithoutOutput._recompute`` (megatron-core 0.19.2; wrapped by
  ``run_recompute_under``): the CPU runtime's device mode during recompute.
* ``megatron.core.tensor_parallel.random:CheckpointWithoutOutput.__init__`` and the
  module global ``HAVE_TE`` (megatron-core 0.19.2; wrapped by
  ``wrap_checkpoint_without_output_init``, read by ``tensor_parallel_random_has_te``):
  no FP8 without Transformer Engine (integration/runtime/compat.py).
* the module global ``maybe_move_tensor_to_cpu`` of
  ``megatron.core.transformer.moe.token_dispatcher`` (megatron-core 0.19.2; looked up by
  ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``, replaced by
  ``replace_dispatcher_move_to_cpu``): numpy split sizes for gloo on the CPU runtime.
* the module globals ``_CUDA_RNG_STATE_TRACKER``, ``_CUDA_RNG_STATE_TRACKER_INITIALIZED``
  and ``_MODEL_PARALLEL_RNG_TRACKER_NAME`` of ``megatron.core.tensor_parallel.random``
  (megatron-core 0.19.2; swapped by ``installed_cuda_rng_tracker``, read by
  ``model_parallel_rng_tracker_name``): the fake-CUDA harness (lrmoe_testing/cuda_harness.py)
  installs a tracker without a CUDA generator, which needs a driver.
* the class attribute ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (megatron-core
  0.19.2; swapped by ``swapped_dispatcher_dtoh_stream``): its constructor makes a CUDA
  stream once per process, which needs a driver; the fake-CUDA harness presets it.
* ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (megatron-core 0.19.2;
  replaced on one instance by ``replaced_dispatcher_dtoh``): the device-op count
  (lrmoe_testing/device_ops.py) runs Megatron's own layer on fake CUDA, where the split sizes
  it reads on the host have no values and its stream and event need a driver.
* the module global ``initialize_megatron`` of ``megatron.bridge.training.setup`` (looked
  up by ``setup``), and ``compile_helpers`` and the private ``_set_random_seed`` of
  ``megatron.bridge.training.initialize`` (looked up by ``initialize_megatron`` and by
  ``torch_dist_init``'s inner ``finish_mpu_init``), Megatron-Bridge 0.6.2 (``BRIDGE``; wrapped by
  ``wrap_bridge_initialize_megatron``, ``wrap_bridge_compile_helpers`` and
  ``wrap_bridge_set_random_seed``): the CPU runtime's fixes for Bridge's training
  (integration/runtime/cpu.py, ``BRIDGE_FIXES``).
* the module global ``mtp_block_spec`` of ``megatron.bridge.models.gpt_provider`` (looked
  up by ``GPTModelProvider.provide``; Megatron-Bridge 0.6.2, which builds the MTP block
  with Transformer Engine hard-coded; swapped by ``swapped_bridge_mtp_block_spec``): the
  test harness's local MTP spec on CPU (lrmoe_testing/bridge.py).
* ``PersistentAsyncCaller.async_loop`` of
  ``megatron.core.dist_checkpointing.strategies.async_utils`` and
  ``FileSystemWriterAsync.preload_tensors`` of ``...strategies.filesystem_async``
  (megatron-core 0.19.2; static methods, replaced by ``replace_persistent_async_loop`` and
  ``replace_async_preload_tensors``, the originals read by ``persistent_async_loop`` and
  ``async_preload_tensors``): the worker process of asynchronous checkpoint saves and the
  copy it makes of the tensors to write, on the CPU runtime (integration/runtime/cpu.py,
  ``bridge_async_checkpoint_worker``).
* ``MTPLossLoggingHelper.tracker`` of ``megatron.core.transformer.multi_token_prediction``
  (megatron-core 0.19.2; a class-level dict, emptied by ``clear_mtp_loss_tracker``): its
  tensors are sized by the first model's MTP depth and never reset, so the test harness
  (lrmoe_testing/bridge.py) empties it before each of a worker's Bridge runs.
* ``torch.nn.Module._forward_pre_hooks`` of an expert linear (torch 2.13; read by
  ``forward_pre_hooks``): the hooks that megatron-core 0.19.2's
  ``DistributedDataParallel`` registers there (distributed_data_parallel.py:408,
  ``_make_forward_pre_hook``: the wait for the overlapped parameter all-gather), which
  the LRMoE region runs itself since it never calls the linears.

This module imports neither torch nor Megatron at import time (the Megatron-LM
integration must be able to put a checkout first on ``sys.path`` before ``megatron``
loads; each function imports what it touches), and nothing of the package above it:
the layer imports it too.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

MEGATRON_CORE = "megatron-core 0.19.2"
MEGATRON_LM = "Megatron-LM core_v0.19.0"
TORCH = "torch 2.13"
BRIDGE = "Megatron-Bridge 0.6.2"

# Set on every function this module puts into Megatron, so that a second call is a no-op.
_MARK = "_lrmoe"

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclasses.dataclass(frozen=True)
class MegatronPrivate:
    """One Megatron internal the plugin touches, and how."""

    module: str              # the module that holds it
    name: str                # dotted path inside the module
    version: str             # where it was read: MEGATRON_CORE, MEGATRON_LM, BRIDGE or TORCH
    access: str              # wrapped, replaced, swapped or read
    accessor: str            # the function of this module that touches it
    params: tuple[str, ...] = ()        # parameters the plugin binds by name
    looked_up_by: str | None = None     # a function of ``module`` that reads the global
    on_instance: bool = False           # an instance attribute set by ``__init__``
    # An attribute Megatron reads off an object the plugin hands it: checked in the
    # reader (``looked_up_by``) only.
    read_off_argument: bool = False

    def __str__(self) -> str:
        return f"{self.module}:{self.name} ({self.version})"


_RANDOM = "megatron.core.tensor_parallel.random"
_BRIDGE_INITIALIZE = "megatron.bridge.training.initialize"
_ASYNC_UTILS = "megatron.core.dist_checkpointing.strategies.async_utils"
_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"

#: Every Megatron internal touched by the package, in the order of the list above.
PRIVATES: tuple[MegatronPrivate, ...] = (
    MegatronPrivate("megatron.training.training", "training_log", MEGATRON_LM, "wrapped",
                    "wrap_training_log", params=("iteration",), looked_up_by="train"),
    MegatronPrivate("megatron.training.checkpointing", "_build_sharded_state_dict_metadata",
                    MEGATRON_LM, "wrapped", "wrap_sharded_state_dict_metadata",
                    params=("args",), looked_up_by="save_checkpoint"),
    MegatronPrivate("megatron.bridge.training.checkpointing", "_build_sharded_state_dict_metadata",
                    BRIDGE, "wrapped", "wrap_bridge_sharded_state_dict_metadata",
                    params=("use_distributed_optimizer", "cfg"), looked_up_by="save_checkpoint"),
    MegatronPrivate("megatron.training.models.gpt", "GPTModel", MEGATRON_LM, "swapped",
                    "swap_gpt_model_class", looked_up_by="GPTModelBuilder.build_model"),
    MegatronPrivate("gpt_builders", "GPTModel", MEGATRON_LM, "swapped",
                    "swap_gpt_model_class", looked_up_by="gpt_builder"),
    MegatronPrivate("megatron.training.training", "is_distributed", MEGATRON_LM, "set",
                    "mark_datasets_provider_distributed", read_off_argument=True,
                    looked_up_by="build_train_valid_test_data_loaders"),
    MegatronPrivate("megatron.training.models.base", "ModelBuilder._model_config",
                    MEGATRON_LM, "read", "builder_model_config", on_instance=True),
    MegatronPrivate(_RANDOM, "_get_cuda_rng_state", MEGATRON_CORE, "replaced",
                    "replace_cuda_rng_state_functions", params=("device", "clone", "graph_safe")),
    MegatronPrivate(_RANDOM, "_set_cuda_rng_state", MEGATRON_CORE, "replaced",
                    "replace_cuda_rng_state_functions",
                    params=("new_state", "device", "graph_safe")),
    MegatronPrivate(_RANDOM, "CheckpointFunction.backward", MEGATRON_CORE, "wrapped",
                    "run_recompute_under"),
    MegatronPrivate(_RANDOM, "CheckpointWithoutOutput._recompute", MEGATRON_CORE, "wrapped",
                    "run_recompute_under"),
    MegatronPrivate(_RANDOM, "CheckpointWithoutOutput.__init__", MEGATRON_CORE, "wrapped",
                    "wrap_checkpoint_without_output_init", params=("fp8",)),
    MegatronPrivate(_RANDOM, "HAVE_TE", MEGATRON_CORE, "read", "tensor_parallel_random_has_te"),
    MegatronPrivate("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
                    MEGATRON_CORE, "replaced", "replace_dispatcher_move_to_cpu",
                    params=("as_numpy", "record_stream"),
                    looked_up_by="MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"),
    MegatronPrivate(_RANDOM, "_CUDA_RNG_STATE_TRACKER", MEGATRON_CORE, "swapped",
                    "installed_cuda_rng_tracker"),
    MegatronPrivate(_RANDOM, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", MEGATRON_CORE, "swapped",
                    "installed_cuda_rng_tracker"),
    MegatronPrivate(_RANDOM, "_MODEL_PARALLEL_RNG_TRACKER_NAME", MEGATRON_CORE, "read",
                    "model_parallel_rng_tracker_name"),
    MegatronPrivate("megatron.core.transformer.moe.token_dispatcher",
                    "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream", MEGATRON_CORE, "swapped",
                    "swapped_dispatcher_dtoh_stream"),
    MegatronPrivate("megatron.core.transformer.moe.token_dispatcher",
                    "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", MEGATRON_CORE,
                    "replaced", "replaced_dispatcher_dtoh",
                    params=("point", "tokens_per_expert")),
    MegatronPrivate("megatron.bridge.training.setup", "initialize_megatron", BRIDGE, "wrapped",
                    "wrap_bridge_initialize_megatron", params=("allow_no_cuda",),
                    looked_up_by="setup"),
    MegatronPrivate(_BRIDGE_INITIALIZE, "compile_helpers", BRIDGE, "wrapped",
                    "wrap_bridge_compile_helpers", looked_up_by="initialize_megatron"),
    # Looked up by finish_mpu_init, a closure inside torch_dist_init (not reachable by name).
    MegatronPrivate(_BRIDGE_INITIALIZE, "_set_random_seed", BRIDGE, "wrapped",
                    "wrap_bridge_set_random_seed", params=("seed_", "pg_collection")),
    MegatronPrivate("megatron.bridge.models.gpt_provider", "mtp_block_spec", BRIDGE, "swapped",
                    "swapped_bridge_mtp_block_spec", params=("config", "vp_stage"),
                    looked_up_by="GPTModelProvider.provide"),
    MegatronPrivate(_ASYNC_UTILS, "PersistentAsyncCaller.async_loop", MEGATRON_CORE,
                    "replaced", "replace_persistent_async_loop",
                    params=("rank", "queue", "preload_q", "comp_q")),
    MegatronPrivate(_FILESYSTEM_ASYNC, "FileSystemWriterAsync.preload_tensors", MEGATRON_CORE,
                    "replaced", "replace_async_preload_tensors",
                    params=("write_buckets", "non_blocking")),
    MegatronPrivate("megatron.core.transformer.multi_token_prediction",
                    "MTPLossLoggingHelper.tracker", MEGATRON_CORE, "set",
                    "clear_mtp_loss_tracker"),
    MegatronPrivate("torch.nn", "Module._forward_pre_hooks", TORCH, "read",
                    "forward_pre_hooks", on_instance=True),
)


def _marked(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


def _wrap_attribute(owner: Any, name: str, make_wrapper: Wrapper) -> bool:
    """``owner.name = make_wrapper(owner.name)``, marked; False, changing nothing, when
    it is wrapped already."""
    original = getattr(owner, name)
    if _marked(original):
        return False
    setattr(owner, name, _mark(make_wrapper(original)))
    return True


# -----------------------------------------------------------------------------
# Megatron-LM (core_v0.19.0)
# -----------------------------------------------------------------------------


def wrap_training_log(make_wrapper: Wrapper) -> bool:
    """Replace ``megatron.training.training.training_log`` (megatron/training/training.py:
    training_log, Megatron-LM core_v0.19.0; ``train()`` looks it up in its module at every
    iteration) by ``make_wrapper(training_log)``.

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    from megatron.training import training

    return _wrap_attribute(training, "training_log", make_wrapper)


def wrap_sharded_state_dict_metadata(make_wrapper: Wrapper) -> bool:
    """Replace ``megatron.training.checkpointing._build_sharded_state_dict_metadata``
    (megatron/training/checkpointing.py:_build_sharded_state_dict_metadata, Megatron-LM
    core_v0.19.0, private: makes the content metadata of every save and of local-checkpoint
    loads) by ``make_wrapper(original)``.

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    from megatron.training import checkpointing

    return _wrap_attribute(checkpointing, "_build_sharded_state_dict_metadata", make_wrapper)


def wrap_bridge_sharded_state_dict_metadata(make_wrapper: Wrapper) -> bool:
    """Replace ``megatron.bridge.training.checkpointing._build_sharded_state_dict_metadata``
    (megatron/bridge/training/checkpointing.py:_build_sharded_state_dict_metadata,
    Megatron-Bridge 0.6.2, private: makes the content metadata of every save, looked up in
    its module by ``save_checkpoint``, and of local-checkpoint loads) by
    ``make_wrapper(original)``.

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    from megatron.bridge.training import checkpointing

    return _wrap_attribute(checkpointing, "_build_sharded_state_dict_metadata", make_wrapper)


class GPTModelNotFound(LookupError):
    """``swap_gpt_model_class`` was given something that does not build ``GPTModel``
    through a module global."""


@contextmanager
def swap_gpt_model_class(owner: Callable[..., Any], make_replacement: Wrapper) -> Iterator[None]:
    """While active, the module global ``GPTModel`` that ``owner`` calls (its module's
    globals) is ``make_replacement(GPTModel)``; restored on exit, also on error.

    ``owner`` is ``GPTModelBuilder.build_model`` (megatron/training/models/gpt.py:
    GPTModelBuilder.build_model, whose module imports ``GPTModel``) or ``gpt_builder``
    (gpt_builders.py:gpt_builder), both Megatron-LM core_v0.19.0. Raises
    ``GPTModelNotFound`` (before anything is swapped) when ``owner`` is not a Python
    function or its module has no ``GPTModel``."""
    namespace = getattr(owner, "__globals__", None)
    if namespace is None:
        raise GPTModelNotFound("not a Python function like gpt_builder")
    real = namespace.get("GPTModel")
    if real is None:
        raise GPTModelNotFound("it does not build megatron.core's GPTModel")
    namespace["GPTModel"] = make_replacement(real)
    try:
        yield
    finally:
        namespace["GPTModel"] = real


def mark_datasets_provider_distributed(provider: Callable[..., Any]) -> None:
    """Tell Megatron-LM that ``provider`` builds its datasets on every rank: the attribute
    ``is_distributed`` that megatron/training/training.py:build_train_valid_test_data_loaders
    reads off the provider (Megatron-LM core_v0.19.0; pretrain_gpt.py's ``__main__`` sets it
    on ``train_valid_test_datasets_provider``)."""
    provider.is_distributed = True  # type: ignore[attr-defined]


def builder_model_config(builder: Any) -> Any:
    """The model config a Megatron-LM model builder builds from: the private instance
    attribute ``_model_config`` that megatron/training/models/base.py:ModelBuilder.__init__
    sets (Megatron-LM core_v0.19.0; ``GPTModelBuilder.build_model`` reads it the same
    way)."""
    return builder._model_config


# -----------------------------------------------------------------------------
# megatron-core (0.19.2)
# -----------------------------------------------------------------------------


def replace_cuda_rng_state_functions(get_state: Callable[..., Any],
                                     set_state: Callable[..., Any]) -> None:
    """Make ``get_state`` / ``set_state`` the functions that Megatron's RNG tracker reads
    and swaps generator states with: megatron/core/tensor_parallel/random.py:
    ``_get_cuda_rng_state`` (random.py:104) and ``_set_cuda_rng_state`` (random.py:135),
    megatron-core 0.19.2, private module functions looked up at call time. Not reversed."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = get_state
    megatron_random._set_cuda_rng_state = set_state


def run_recompute_under(context: Callable[[], AbstractContextManager[Any]]) -> None:
    """Run Megatron's two activation-recompute entry points inside ``context()``:
    megatron/core/tensor_parallel/random.py ``CheckpointFunction.backward``
    (random.py:625, a staticmethod) and ``CheckpointWithoutOutput._recompute``
    (random.py:768, private), megatron-core 0.19.2. Wraps them each time it is called
    (call it once). Not reversed."""
    from megatron.core.tensor_parallel import random as megatron_random

    checkpoint_backward = megatron_random.CheckpointFunction.backward
    recompute = megatron_random.CheckpointWithoutOutput._recompute

    def backward_under_context(ctx, *args):
        with context():
            return checkpoint_backward(ctx, *args)

    def recompute_under_context(self, *args):
        with context():
            return recompute(self, *args)

    megatron_random.CheckpointFunction.backward = staticmethod(backward_under_context)
    megatron_random.CheckpointWithoutOutput._recompute = recompute_under_context


def tensor_parallel_random_has_te() -> bool:
    """Whether megatron/core/tensor_parallel/random.py found Transformer Engine: its module
    global ``HAVE_TE`` (random.py:89-91, megatron-core 0.19.2)."""
    from megatron.core.tensor_parallel import random as megatron_random

    return bool(megatron_random.HAVE_TE)


def wrap_checkpoint_without_output_init(after_init: Callable[[Any], None]) -> bool:
    """Run ``after_init(self)`` after every ``CheckpointWithoutOutput.__init__(self, fp8)``
    (megatron/core/tensor_parallel/random.py:739, megatron-core 0.19.2).

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    from megatron.core.tensor_parallel import random as megatron_random

    cls = megatron_random.CheckpointWithoutOutput
    init = cls.__init__
    if getattr(init, "_lrmoe_fp8_off", False):
        return False

    def __init__(self, fp8=False):
        init(self, fp8)
        after_init(self)

    __init__._lrmoe_fp8_off = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


def replace_dispatcher_move_to_cpu(make_replacement: Wrapper) -> None:
    """Make ``make_replacement(moe_utils.maybe_move_tensor_to_cpu)`` the
    ``maybe_move_tensor_to_cpu`` that the all-to-all dispatcher calls: the module global of
    megatron/core/transformer/moe/token_dispatcher.py (imported from moe_utils at
    token_dispatcher.py:39, looked up by
    ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``, token_dispatcher.py:927-933),
    megatron-core 0.19.2. The wrapped function is always moe_utils' own, so a second call
    replaces rather than stacks. Not reversed."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = make_replacement(
        moe_utils.maybe_move_tensor_to_cpu)


@contextmanager
def installed_cuda_rng_tracker(tracker: Any) -> Iterator[None]:
    """Make ``tracker`` the one ``get_cuda_rng_tracker()`` returns, marked initialised, for
    the block: megatron/core/tensor_parallel/random.py module globals
    ``_CUDA_RNG_STATE_TRACKER`` and ``_CUDA_RNG_STATE_TRACKER_INITIALIZED`` (random.py,
    megatron-core 0.19.2; read by ``get_cuda_rng_tracker``). Restored after."""
    from megatron.core.tensor_parallel import random as megatron_random

    before = (megatron_random._CUDA_RNG_STATE_TRACKER,
              megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        yield
    finally:
        (megatron_random._CUDA_RNG_STATE_TRACKER,
         megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED) = before


def model_parallel_rng_tracker_name() -> str:
    """The name of the model-parallel RNG state, Megatron's default ``fork`` name:
    random.py ``_MODEL_PARALLEL_RNG_TRACKER_NAME`` (megatron-core 0.19.2)."""
    from megatron.core.tensor_parallel import random as megatron_random

    return megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME


@contextmanager
def swapped_dispatcher_dtoh_stream(stream: Any) -> Iterator[None]:
    """``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (a class attribute its constructor
    fills with a new CUDA stream once per process: token_dispatcher.py, megatron-core
    0.19.2) set to ``stream`` for the block, restored after."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    before = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    try:
        yield
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = before


def clear_mtp_loss_tracker() -> None:
    """Empty ``MTPLossLoggingHelper.tracker`` (multi_token_prediction.py, megatron-core
    0.19.2), a class-level dict whose tensors are sized by the MTP depth of the first model
    that records into it and never reset: a process that trains several models (a test
    pool's worker) clears it before each."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def replaced_dispatcher_dtoh(dispatcher: Any, replacement: Callable[..., Any]) -> None:
    """Make ``replacement(point, tokens_per_expert)`` the ``_maybe_dtoh_and_synchronize``
    of this one all-to-all dispatcher instance (token_dispatcher.py,
    ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``, megatron-core 0.19.2: called
    by its dispatch stages at each sync point; moves the split sizes to the host at
    ``cuda_dtoh_point`` and returns ``tokens_per_expert``). The class is untouched."""
    dispatcher._maybe_dtoh_and_synchronize = replacement


# -----------------------------------------------------------------------------
# Megatron-Bridge (0.6.2)
# -----------------------------------------------------------------------------


def wrap_bridge_initialize_megatron(make_wrapper: Wrapper) -> bool:
    """Replace the ``initialize_megatron`` that megatron/bridge/training/setup.py:setup calls
    (its module global, imported from megatron/bridge/training/initialize.py;
    Megatron-Bridge 0.6.2, which passes no ``allow_no_cuda``) by
    ``make_wrapper(initialize_megatron)``.

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    bridge_setup = importlib.import_module("megatron.bridge.training.setup")
    return _wrap_attribute(bridge_setup, "initialize_megatron", make_wrapper)


def wrap_bridge_compile_helpers(make_wrapper: Wrapper) -> bool:
    """Replace the ``compile_helpers`` that megatron/bridge/training/initialize.py:
    initialize_megatron runs on local rank 0 (its module global, imported from
    megatron/core/datasets/utils.py; Megatron-Bridge 0.6.2) by ``make_wrapper(original)``.

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    bridge_initialize = importlib.import_module(_BRIDGE_INITIALIZE)
    return _wrap_attribute(bridge_initialize, "compile_helpers", make_wrapper)


def wrap_bridge_set_random_seed(make_wrapper: Wrapper) -> bool:
    """Replace megatron/bridge/training/initialize.py:_set_random_seed (private, looked up
    by ``finish_mpu_init`` inside ``torch_dist_init``; Megatron-Bridge 0.6.2: seeds
    Megatron's model-parallel RNG tracker only when ``torch.cuda.device_count() > 0``) by
    ``make_wrapper(original)``.

    Idempotent: returns False, changing nothing, when it is wrapped already."""
    bridge_initialize = importlib.import_module(_BRIDGE_INITIALIZE)
    return _wrap_attribute(bridge_initialize, "_set_random_seed", make_wrapper)


@contextmanager
def swapped_bridge_mtp_block_spec(replacement: Callable[..., Any]) -> Iterator[None]:
    """While active, ``GPTModelProvider.provide`` builds its MTP block spec with
    ``replacement(config, vp_stage=...)``: the module global ``mtp_block_spec`` of
    megatron/bridge/models/gpt_provider.py (Megatron-Bridge 0.6.2, which passes
    ``use_transformer_engine=True`` to megatron-core's ``get_gpt_mtp_block_spec``).
    Restored on exit, also on error."""
    gpt_provider = importlib.import_module("megatron.bridge.models.gpt_provider")
    real = gpt_provider.mtp_block_spec
    gpt_provider.mtp_block_spec = replacement
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = real


# -----------------------------------------------------------------------------
# megatron-core's asynchronous checkpoint saves (0.19.2)
# -----------------------------------------------------------------------------

#: The static methods replaced in this process, as megatron-core defines them.
_REPLACED_STATIC: dict[tuple[str, str], Callable[..., Any]] = {}


def _replace_static_method(module: str, owner: str, name: str,
                           replacement: Callable[..., Any]) -> bool:
    cls = getattr(importlib.import_module(module), owner)
    if _marked(getattr(cls, name)):
        return False
    _REPLACED_STATIC[(module, f"{owner}.{name}")] = cls.__dict__[name].__func__
    setattr(cls, name, staticmethod(_mark(replacement)))
    return True


def _original_static_method(module: str, owner: str, name: str) -> Callable[..., Any]:
    found = _REPLACED_STATIC.get((module, f"{owner}.{name}"))
    if found is not None:
        return found
    return getattr(importlib.import_module(module), owner).__dict__[name].__func__


def replace_persistent_async_loop(replacement: Callable[..., Any]) -> bool:
    """Make ``replacement`` megatron/core/dist_checkpointing/strategies/async_utils.py:
    ``PersistentAsyncCaller.async_loop`` (a static method: the target of the persistent
    worker process of asynchronous saves, started with ``spawn``; megatron-core 0.19.2).
    The spawned interpreter unpickles the target by its name, so ``replacement`` must be
    a module-level function. Idempotent: returns False, changing nothing, when it is
    replaced already."""
    return _replace_static_method(_ASYNC_UTILS, "PersistentAsyncCaller", "async_loop",
                                  replacement)


def persistent_async_loop() -> Callable[..., Any]:
    """megatron-core's own ``PersistentAsyncCaller.async_loop``, replaced or not."""
    return _original_static_method(_ASYNC_UTILS, "PersistentAsyncCaller", "async_loop")


def replace_async_preload_tensors(replacement: Callable[..., Any]) -> bool:
    """Make ``replacement`` megatron/core/dist_checkpointing/strategies/filesystem_async.py:
    ``FileSystemWriterAsync.preload_tensors(write_buckets, non_blocking)`` (a static
    method, sent by reference to the async-save worker, which calls it to stage the
    tensors to write while the training rank waits; megatron-core 0.19.2). Module-level
    ``replacement`` only, as above. Idempotent."""
    return _replace_static_method(_FILESYSTEM_ASYNC, "FileSystemWriterAsync",
                                  "preload_tensors", replacement)


def async_preload_tensors() -> Callable[..., Any]:
    """megatron-core's own ``FileSystemWriterAsync.preload_tensors``, replaced or not."""
    return _original_static_method(_FILESYSTEM_ASYNC, "FileSystemWriterAsync",
                                   "preload_tensors")


# -----------------------------------------------------------------------------
# torch, for Megatron's hooks
# -----------------------------------------------------------------------------


def forward_pre_hooks(module: Any) -> tuple[Callable[..., Any], ...]:
    """The forward pre-hooks registered on ``module`` (torch 2.13:
    ``torch.nn.Module._forward_pre_hooks``), in registration order: there megatron-core
    0.19.2's ``DistributedDataParallel`` puts its wait for the overlapped parameter
    all-gather (megatron/core/distributed/distributed_data_parallel.py:408,
    ``_make_forward_pre_hook``). Run them as the module's call would:
    ``hook(module, ())``."""
    return tuple(module._forward_pre_hooks.values())


# -----------------------------------------------------------------------------
# Checking the list against a Megatron
# -----------------------------------------------------------------------------


def _resolve(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _instances_have(cls: type, attr: str) -> bool:
    """Whether ``cls``'s instances get ``attr`` in ``__init__``: on an instance where one
    can be made without arguments (others may have patched ``__init__``: torch.compile
    wraps ``torch.nn.Module.__init__``), else in the constructor's code."""
    try:
        return hasattr(cls(), attr)
    except TypeError:
        init = inspect.unwrap(cls.__init__).__code__
        return attr in init.co_names + init.co_consts


def missing_privates(privates: tuple[MegatronPrivate, ...] = PRIVATES) -> list[str]:
    """What of ``privates`` the importable Megatron lacks: the symbol, a parameter the
    plugin binds by name, or the function that looks a module global up by name. Empty
    when everything is there. Imports each module (run it where the Megatron to check is
    the one on ``sys.path``)."""
    problems: list[str] = []
    for private in privates:
        try:
            module = importlib.import_module(private.module)
        except ImportError as exc:
            problems.append(f"{private}: module does not import ({exc})")
            continue
        try:
            if private.read_off_argument:
                reader = inspect.unwrap(_resolve(module, private.looked_up_by)).__code__
                if private.name not in reader.co_names + reader.co_consts:
                    problems.append(f"{private}: {private.looked_up_by} no longer reads it")
                continue
            if private.on_instance:
                owner, _, attr = private.name.rpartition(".")
                if not _instances_have(_resolve(module, owner), attr):
                    problems.append(f"{private}: {owner}.__init__ no longer sets it")
                continue
            value = _resolve(module, private.name)
        except AttributeError:
            problems.append(f"{private}: no such attribute")
            continue
        if private.params:
            params = inspect.signature(value).parameters
            lacking = [p for p in private.params if p not in params]
            if lacking:
                problems.append(f"{private}: no parameter {', '.join(lacking)}")
        if private.looked_up_by is not None:
            reader = inspect.unwrap(_resolve(module, private.looked_up_by))
            global_name = private.name.rpartition(".")[2]
            if global_name not in reader.__code__.co_names:
                problems.append(f"{private}: {private.looked_up_by} no longer looks it up")
    return problems
