"""Opt-in CPU/gloo runtime for Megatron-Core 0.19.

Megatron-Core 0.19 assumes a CUDA device in a handful of places that have nothing to
do with the maths: stream bookkeeping in the all-to-all dispatcher and in DDP's grad
sync, the RNG tracker, buffer allocation with ``device='cuda'`` literals, optimizer type
checks against ``'torch.cuda.FloatTensor'``. On a machine without CUDA this module makes
those places behave as they would on one GPU, so that Megatron's own GPTModel, MoE
layers, schedules, optimizers and dist_checkpointing train on CPU with gloo.

The torch installed is the CUDA build, run without a GPU or driver:
``torch.cuda.is_available()`` is False, and what fails is the driver, not the build
(RuntimeError "Found no NVIDIA driver", or AcceleratorError "CUDA driver version is
insufficient"). Some calls do not fail at all: ``torch.cuda.Event()``,
``torch.cuda.stream(None)``, ``torch.cuda.manual_seed`` and ``set_rng_state`` (queued
until a CUDA init that never comes), so the fixes below do not rely on a failure.

Rules this module keeps:

* ``enable_cpu_runtime()`` is explicit. Importing this module changes nothing;
  the launcher calls it when no CUDA device exists, the test harness calls it.
* It is a no-op when CUDA is available: GPU runs are untouched Megatron.
* It refuses to run against a megatron-core outside the 0.19 line
  (``megatron_support``), since every fix below is tied to how 0.19 is written.
* Each fix is one named function with the reason next to it. Where Megatron has
  no hook, the patch is this module's, and the Megatron internal it touches is reached
  through ``megatron_privates.py`` (which names each with its version);
  torch's ``torch.cuda`` functions are replaced here.

The fixes (see ``FIXES``; file:line in megatron/core of 0.19.2):

``inert_cuda_streams``
    ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()``
    (token_dispatcher.py:469, AcceleratorError here) and ``_maybe_dtoh_and_synchronize``
    compares, waits on and records streams and events (token_dispatcher.py:922-950);
    DDP's grad sync takes ``torch.cuda.current_stream()`` every step
    (param_and_grad_buffer.py:632); p2p communication (p2p_communication.py:419) and the
    dist_checkpointing writer (filesystem_async.py:248) call ``torch.cuda.synchronize()``.
    On CPU every operation is synchronous, so inert stand-ins are exact.
``cpu_current_device``
    ``torch.cuda.current_device()`` picks the device of buffers (router weights at
    router.py:98, DDP's param and grad buffers, tensor-parallel mappings, rotary
    embeddings, GlobalMemoryBuffer); it answers the CPU.
``cpu_rng_for_megatron_tracker``
    Megatron's ``CudaRNGStatesTracker`` reads and swaps CUDA generator states
    (``model_parallel_cuda_manual_seed`` and ``add()``/``fork()``, random.py:285-345, 490;
    the recompute paths' ``_get_all_rng_states``, random.py:525-540). On CPU every random
    op (dropout, init) draws from the CPU default generator, so the tracker swaps that
    one instead; the silently queued ``torch.cuda.manual_seed``/``set_rng_state`` are
    mapped too, else seeds would never reach it. Its "CPU RNG state changed within GPU
    RNG context" warning (random.py:333) is then meaningless and is filtered.
``checkpoint_without_output_without_te``
    ``CheckpointWithoutOutput`` (selective ``layernorm`` / ``moe_act`` recompute, built
    with no argument at transformer_layer.py:633, 766) sets ``self.fp8 = fp8 is not
    None`` (random.py:740), True for its default ``fp8=False``, and then asks Transformer
    Engine's ``FP8GlobalStateManager`` (random.py:693), a NameError without TE
    (``integration/runtime/compat.py``, which the launcher also applies on GPUs).
``numpy_split_sizes_for_gloo``
    On GPU the dispatcher's device-to-host step turns the all-to-all split sizes into
    numpy arrays (token_dispatcher.py:930-938). ``maybe_move_tensor_to_cpu`` skips CPU
    tensors (moe_utils.py:1184), and gloo's ``all_to_all_single`` rejects tensor split
    sizes (TypeError). We make the CPU path do what the GPU path does.
``cpu_device_mode``
    A single ``TorchFunctionMode`` that maps ``device='cuda'`` (and ``.cuda()``,
    ``.to('cuda')``) to the CPU and makes the no-argument ``Tensor.type()`` answer the
    CUDA type name that Megatron's optimizer and gradient clipping compare against
    (optimizer.py:315, 698-702, 1249; clip_grads.py:108-180; distrib_optimizer.py:401,
    466, 758; schedules.py:749, 2292 token counters; utils.py:1332; the causal mask,
    megatron/core/transformer/utils.py:39). It costs one Python call per torch call: every benchmark
    policy pays the same.
``recompute_under_cpu_device_mode``
    Activation recompute runs forward code inside backward, and backward starts in
    ``torch.autograd.backward``, which torch hands to the mode's
    ``__torch_function__``, where the mode is off: a recomputed layer then meets
    ``device='cuda'`` literals unredirected (the causal mask of core attention).
    Megatron's two recompute entry points (``CheckpointFunction.backward``, random.py:625;
    ``CheckpointWithoutOutput._recompute``, random.py:768) run with the mode on again; the
    rest of backward stays as it was, so runs without recompute are timed as before.

Megatron-Bridge's training (``BRIDGE_FIXES``, applied by ``enable_bridge_cpu_runtime()``
on top of the above; file:line in megatron/bridge of 0.6.2; none is needed with CUDA):

``bridge_allow_no_cuda``
    ``setup()`` calls ``initialize_megatron`` without ``allow_no_cuda`` (setup.py:253),
    which then asserts ``torch.cuda.is_available()`` (initialize.py:89-91); the call gets
    ``allow_no_cuda=True``.
``bridge_prebuilt_dataset_helpers``
    ``initialize_megatron`` runs megatron-core's ``compile_helpers`` on local rank 0
    (initialize.py:141-147): ``make -C megatron/core/datasets``, which exits the process
    where megatron-core is the installed wheel (it ships ``helpers_cpp`` compiled and no
    Makefile). The build is skipped when ``helpers_cpp`` is found; else it runs.
``bridge_model_parallel_seed``
    ``_set_random_seed`` seeds Megatron's model-parallel RNG tracker only when
    ``torch.cuda.device_count() > 0`` (initialize.py:870-883), so on CPU the tracker has
    no ``model-parallel-rng`` state and the first model init fails. On this runtime the
    tracker seeds the CPU generator (``cpu_rng_for_megatron_tracker``): the call runs
    with one device counted, so Bridge seeds it as it would on one GPU.
``bridge_async_checkpoint_worker``
    Bridge's asynchronous saves need megatron-core's persistent worker process
    (config.py:603), a spawned interpreter whose loop first picks its GPU as
    ``rank % torch.cuda.device_count()``
    (megatron/core/dist_checkpointing/strategies/async_utils.py:565 of megatron-core
    0.19.2): ZeroDivisionError here, the worker dies and the rank waits on its queue
    forever. Its target becomes ``async_checkpoint_worker``, which enables this
    runtime in the worker (the writer calls ``torch.cuda.synchronize()``) and counts the
    rank's one device. The worker stages the tensors to write while the rank waits
    (``FileSystemWriterAsync.preload_tensors``, filesystem_async.py): on a GPU a
    device-to-host copy, on CPU ``.to("cpu")`` hands it the live tensors, which the next
    optimizer step overwrites while they are written; ``preload_as_copies`` copies them.

Dropped with 0.19: ``te_general_gemm_placeholder``. 0.19's ``moe_utils`` defines
``te_general_gemm = None`` when TE is absent (moe_utils.py:41-53), which selects its own
torch path in ``RouterGatingLinearFunction``.

Not a fix, only quieter output: ``quiet_known_cpu_warnings()`` (called by
``enable_cpu_runtime()``, and by the launcher before anything imports megatron.core,
since most of these fire at import) hides the benign notices listed in
``KNOWN_CPU_WARNINGS`` (six "Transformer Engine / Apex not installed" notices and
torch's deprecation of ``all_gather_into_tensor``, which Megatron calls) and
``KNOWN_CPU_LOG_RECORDS`` (torch's "No CUDA runtime is found" log line, which 0.19's
import of ``torch.utils.cpp_extension`` at random.py:17 triggers on every machine without
CUDA), each by its exact message *and* the module or logger that emits it, so every other
warning is still shown. It returns the one line that replaces them. It does nothing on
CUDA machines or when the user set ``-W``/``PYTHONWARNINGS``.

Not a fix either, only a faster start: ``skip_torch_compile_of_functions()`` (called by
``enable_cpu_runtime()`` and by the command-line tools, before megatron.core is imported)
makes ``torch.compile`` of a function return the function itself on a machine without
CUDA. megatron-core decorates its fusions (``jit_fuser``, megatron/core/jit.py) and the
router's top-k (router.py:918) at import, which cost every process that imports them
about 1.5 s here when torch's compiler came with the decoration; of them only the router's
expert-bias update (``TopKRouter._apply_expert_bias``, router.py:727: integer token
counts, a no-op without expert biases) runs on CPU, and each training process compiled
it at its first call. Their point is GPU kernels; on CPU they run as written, with the
same values. Modules compile as before.

The command-line tools (the launcher, its pre-flight ``megatron_lrmoe.launcher``, the
prepare tool) call ``quiet_known_warnings()`` instead: the CPU lists on CPU as above, and
on every device ``KNOWN_WARNINGS`` / ``KNOWN_LOG_RECORDS``, megatron-core 0.19.2's notices
that are not about the CPU and that a user of these tools cannot act on (docs/decisions.md,
"Launcher"). Same rule: exact message and emitter, nothing else hidden.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from megatron_lrmoe.integration.runtime.compat import (
    fp8_off_in_checkpoint_without_output_when_te_absent,
    stub_bridge_imports_of_absent_modules,
)
from megatron_lrmoe.megatron_privates import (
    async_preload_tensors,
    persistent_async_loop,
    replace_async_preload_tensors,
    replace_cuda_rng_state_functions,
    replace_dispatcher_move_to_cpu,
    replace_persistent_async_loop,
    run_recompute_under,
    wrap_bridge_compile_helpers,
    wrap_bridge_initialize_megatron,
    wrap_bridge_set_random_seed,
)
from megatron_lrmoe.options.megatron_support import check_megatron_core_version

logger = logging.getLogger(__name__)

_enabled_fixes: list[str] = []
_enabled_bridge_fixes: list[str] = []
_device_mode: TorchFunctionMode | None = None
_warnings_quieted = False
_device_warnings_quieted = False
_compile_skipped = False


# ---------------------------------------------------------------------------
# inert_cuda_streams
# ---------------------------------------------------------------------------


class _InertEvent:
    """A CUDA event stand-in: CPU work is complete when the call returns."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        raise RuntimeError("CUDA event timing is not available on the CPU runtime")


class _InertStream:
    """A CUDA stream stand-in whose every operation is already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _InertEvent:
        return event if event is not None else _InertEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _InertStream()


def _fix_inert_cuda_streams() -> None:
    torch.cuda.Stream = _InertStream  # type: ignore[misc, assignment]
    torch.cuda.Event = _InertEvent  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: _CURRENT_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _CURRENT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


# ---------------------------------------------------------------------------
# cpu_current_device
# ---------------------------------------------------------------------------


def _fix_cpu_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


# ---------------------------------------------------------------------------
# cpu_rng_for_megatron_tracker
# ---------------------------------------------------------------------------


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


#: The logger of megatron/core/tensor_parallel/random.py, whose tracker warns.
_TRACKER_LOGGER = "megatron.core.tensor_parallel.random"


class _DropTrackerCpuStateWarning(logging.Filter):
    """The tracker's fork() warns when the CPU generator moved inside a "GPU" fork.

    On the CPU runtime the tracked generator *is* the CPU generator, so it always
    moves when dropout runs inside a fork; the warning carries no information.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _fix_cpu_rng_for_megatron_tracker() -> None:
    replace_cuda_rng_state_functions(_get_cpu_rng_state, _set_cpu_rng_state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # type: ignore
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)  # type: ignore
    torch.cuda.manual_seed_all = torch.cuda.manual_seed  # type: ignore[assignment]
    logging.getLogger(_TRACKER_LOGGER).addFilter(_DropTrackerCpuStateWarning())


# ---------------------------------------------------------------------------
# checkpoint_without_output_without_te
# ---------------------------------------------------------------------------


def _fix_checkpoint_without_output_without_te() -> None:
    fp8_off_in_checkpoint_without_output_when_te_absent()


# ---------------------------------------------------------------------------
# numpy_split_sizes_for_gloo
# ---------------------------------------------------------------------------


def _move_to_cpu_as_on_gpu(move_to_cpu: Callable[..., Any]) -> Callable[..., Any]:
    def move_to_cpu_as_on_gpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False):
        # Same result types as the GPU path: numpy split sizes, which gloo accepts.
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move_to_cpu_as_on_gpu


def _fix_numpy_split_sizes_for_gloo() -> None:
    replace_dispatcher_move_to_cpu(_move_to_cpu_as_on_gpu)


# ---------------------------------------------------------------------------
# cpu_device_mode
# ---------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int names a CUDA ordinal in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class CpuDeviceMode(TorchFunctionMode):
    """Redirect CUDA device requests to the CPU and report CUDA tensor type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _fix_cpu_device_mode() -> None:
    global _device_mode
    _device_mode = CpuDeviceMode()
    # Process-wide on purpose: Megatron's 'cuda' literals sit inside the schedules,
    # the optimizer and DDP, which the training loop calls on every step.
    _device_mode.__enter__()


# ---------------------------------------------------------------------------
# recompute_under_cpu_device_mode
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _device_mode_on():
    """The CPU device mode, pushed again unless it is active already."""
    if _device_mode is None or _device_mode in _get_current_function_mode_stack():
        yield
        return
    with _device_mode:
        yield


def _fix_recompute_under_cpu_device_mode() -> None:
    run_recompute_under(_device_mode_on)


# ---------------------------------------------------------------------------
# Known benign warnings (quieter output, not a fix)
# ---------------------------------------------------------------------------

_TE_APEX = "Transformer Engine and Apex are not installed. Falling back to "
_LOCAL_MTA = "local implementations of multi_tensor_applier and multi_tensor_scale"

#: (category, exact message, emitting module) of the warnings every CPU run prints once
#: per rank: megatron-core's import-time notices that it uses its own implementations
#: without Transformer Engine / Apex, and torch's deprecation of the collective that
#: Megatron's distributed code calls. Matched exactly; nothing else is hidden.
KNOWN_CPU_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, _TE_APEX + _LOCAL_MTA,
     "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
    (UserWarning, _TE_APEX + "Torch optimizers.", "megatron.core.optimizer"),
    (UserWarning, _TE_APEX + _LOCAL_MTA, "megatron.core.optimizer.optimizer"),
    (UserWarning, _TE_APEX + "local implementations of multi_tensor_applier, "
     "multi_tensor_l2norm, and multi_tensor_scale", "megatron.core.optimizer.clip_grads"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm",
     "megatron.core.models.backends"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm",
     "megatron.core.models.gpt.gpt_layer_specs"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. "
     "Please use `torch.distributed.all_gather_single` instead.",
     "torch.distributed.c10d_logger"),
)

#: (logger, level, exact format string) of the log records every CPU run prints once per
#: rank: torch logs where it would look for CUDA when ``torch.utils.cpp_extension`` is
#: imported without a CUDA device (megatron-core 0.19 imports it in
#: megatron/core/tensor_parallel/random.py to build a C++ helper for recompute; that build
#: needs no CUDA). The format string is
#: matched, so the path it names may differ; nothing else is hidden.
KNOWN_CPU_LOG_RECORDS: tuple[tuple[str, int, str], ...] = (
    ("torch.utils.cpp_extension", logging.WARNING,
     "No CUDA runtime is found, using CUDA_HOME='%s'"),
)


_MCORE_ASYNC_SAVE = ("MCore's async save is deprecated and will be removed in the future "
                     "releases. Please, use NVRx async solution by setting `async_strategy` "
                     "to `nvrx`.")
_GPT_MODEL = ("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new "
              "features. Please reference the migration guide "
              "`docs/user-guide/hybrid-model-migration.md` for details on how to use "
              "`HybridModel`")

#: (category, exact message, emitting module) of the warnings megatron-core 0.19.2 prints
#: on every device in a launcher run that the user cannot act on: get_megatron_optimizer
#: imports the experimental MIMO model (megatron/core/optimizer/__init__.py:1019), whose
#: config class warns at definition, once per rank. Hidden on CUDA too; nothing else is.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, "MimoModelConfig is experimental and still under active development. "
     "The API may change without notice in future releases.",
     "megatron.core.models.mimo.config.base_configs"),
)

#: (logger, level, exact format string) of megatron-core 0.19.2's log records of the same
#: kind, on every device: GPTModel's deprecation in favour of HybridModel (the launcher
#: builds GPTModel; porting is this project's work, tracked in docs/decisions.md), the
#: rerun state machine announcing the mode the launcher itself sets (DISABLED, as
#: Megatron-LM's default), and the deprecation that dist_checkpointing's *synchronous*
#: save logs because it runs through the async path internally
#: (megatron/core/dist_checkpointing/strategies/torch.py:727).
KNOWN_LOG_RECORDS: tuple[tuple[str, int, str], ...] = (
    ("megatron.core.models.gpt.gpt_model", logging.WARNING, _GPT_MODEL),
    ("megatron.core.rerun_state_machine", logging.WARNING,
     "RerunStateMachine initialized in mode RerunMode.DISABLED"),
    ("megatron.core.dist_checkpointing.strategies.torch", logging.WARNING, _MCORE_ASYNC_SAVE),
)


class _DropKnownRecord(logging.Filter):
    """Drops the records of one logger that have one exact level and format string."""

    def __init__(self, level: int, msg: str) -> None:
        super().__init__()
        self.level, self.msg = level, msg

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == self.level and record.msg == self.msg)


def _absent_backends_line() -> str | None:
    absent = [name for name, module in (("Transformer Engine", "transformer_engine"),
                                        ("Apex", "apex"))
              if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (f"cpu runtime: {' and '.join(absent)} not installed; "
            f"using megatron-core's local implementations")


def quiet_known_cpu_warnings() -> str | None:
    """Hide ``KNOWN_CPU_WARNINGS`` and ``KNOWN_CPU_LOG_RECORDS`` in this process (CPU only).

    Each filter names one exact message and the module or logger that emits it. Call it before
    megatron.core is imported (most of these fire at import). Returns the one line
    that says what is absent, the first time it installs the filters; None on a CUDA
    machine, when ``-W``/``PYTHONWARNINGS`` configure warnings, or on later calls.
    """
    global _warnings_quieted
    if _warnings_quieted or torch.cuda.is_available() or sys.warnoptions:
        return None
    _hide(KNOWN_CPU_WARNINGS, KNOWN_CPU_LOG_RECORDS)
    _warnings_quieted = True
    return _absent_backends_line()


def quiet_known_warnings() -> str | None:
    """The command-line tools' call: hide ``KNOWN_WARNINGS`` and ``KNOWN_LOG_RECORDS`` on
    every device, and on a machine without CUDA the CPU lists too
    (``quiet_known_cpu_warnings``, whose note it returns). Call it before megatron.core
    is imported. Nothing is hidden when ``-W``/``PYTHONWARNINGS`` configure warnings.
    """
    global _device_warnings_quieted
    if not (_device_warnings_quieted or sys.warnoptions):
        _hide(KNOWN_WARNINGS, KNOWN_LOG_RECORDS)
        _device_warnings_quieted = True
    return quiet_known_cpu_warnings()


def skip_torch_compile_of_functions() -> None:
    """On a machine without CUDA: ``torch.compile(fn)`` of a function returns ``fn``
    itself, so that torch's compiler is neither imported nor run for megatron-core's
    fusions (module doc). Call it before megatron.core is imported. No-op with CUDA, and
    on later calls."""
    global _compile_skipped
    if _compile_skipped or torch.cuda.is_available():
        return
    compile_now = torch.compile

    def compile(model: Any = None, **options: Any) -> Any:
        if model is None:                            # @torch.compile(...)
            return lambda fn: compile(fn, **options)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return compile_now(model, **options)
        return model

    torch.compile = compile
    _compile_skipped = True


def _hide(known_warnings: tuple[tuple[type[Warning], str, str], ...],
          known_records: tuple[tuple[str, int, str], ...]) -> None:
    """One filter per row: the exact message from the exact module or logger."""
    for category, message, module in known_warnings:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z",
                                category=category, module=re.escape(module) + r"\Z")
    # A logger's own filters see only the records it creates, not those of its children.
    for name, level, msg in known_records:
        logging.getLogger(name).addFilter(_DropKnownRecord(level, msg))


# ---------------------------------------------------------------------------
# Megatron-Bridge's training
# ---------------------------------------------------------------------------


def _allow_no_cuda(initialize_megatron: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialize_megatron)
    def initialize_megatron_without_cuda(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize_megatron_without_cuda


def _fix_bridge_allow_no_cuda() -> None:
    wrap_bridge_initialize_megatron(_allow_no_cuda)


def _unless_prebuilt(compile_helpers: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(compile_helpers)
    def compile_helpers_unless_prebuilt() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_helpers()

    return compile_helpers_unless_prebuilt


def _fix_bridge_prebuilt_dataset_helpers() -> None:
    wrap_bridge_compile_helpers(_unless_prebuilt)


def _with_one_device_counted(set_random_seed: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(set_random_seed)
    def set_random_seed_as_on_one_gpu(*args: Any, **kwargs: Any) -> Any:
        device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
        try:
            return set_random_seed(*args, **kwargs)
        finally:
            torch.cuda.device_count = device_count  # type: ignore[assignment]

    return set_random_seed_as_on_one_gpu


def _fix_bridge_model_parallel_seed() -> None:
    wrap_bridge_set_random_seed(_with_one_device_counted)


def async_checkpoint_worker(rank: int, *args: Any, **kwargs: Any) -> None:
    """The persistent worker of a CPU rank's asynchronous checkpoint saves (the process
    target in place of megatron-core's ``PersistentAsyncCaller.async_loop``; module-level,
    since the spawned interpreter imports it by name). The worker is a fresh interpreter:
    it enables the CPU runtime itself (the writer's ``torch.cuda.synchronize()`` calls), and
    megatron-core's loop picks its GPU as ``rank % torch.cuda.device_count()``, which it
    then finds as the one device of its rank, an inert ``set_device``."""
    enable_cpu_runtime()
    # This process only writes checkpoints; the patch ends with it.
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    persistent_async_loop()(rank, *args, **kwargs)


def preload_as_copies(write_buckets: list[Any], non_blocking: bool = True) -> list[Any]:
    """megatron-core's staging of an asynchronous save's tensors, with each tensor copied.
    The worker stages while the training rank waits; on a GPU the staging is the
    device-to-host copy, which training cannot change. On CPU ``.to("cpu")`` returns the
    live tensor (shared with the worker), which the next optimizer step would overwrite
    while the worker writes it; the copy keeps the saved step's values."""
    staged = async_preload_tensors()(write_buckets, non_blocking)
    return [(path, key, (data, [(item, tensor.clone()) for item, tensor in tensors]))
            for path, key, (data, tensors) in staged]


def _fix_bridge_async_checkpoint_worker() -> None:
    replace_persistent_async_loop(async_checkpoint_worker)
    replace_async_preload_tensors(preload_as_copies)


BRIDGE_FIXES: dict[str, Callable[[], None]] = {
    "bridge_allow_no_cuda": _fix_bridge_allow_no_cuda,
    "bridge_prebuilt_dataset_helpers": _fix_bridge_prebuilt_dataset_helpers,
    "bridge_model_parallel_seed": _fix_bridge_model_parallel_seed,
    "bridge_async_checkpoint_worker": _fix_bridge_async_checkpoint_worker,
}


FIXES: dict[str, Callable[[], None]] = {
    "inert_cuda_streams": _fix_inert_cuda_streams,
    "cpu_current_device": _fix_cpu_current_device,
    "cpu_rng_for_megatron_tracker": _fix_cpu_rng_for_megatron_tracker,
    "checkpoint_without_output_without_te": _fix_checkpoint_without_output_without_te,
    "numpy_split_sizes_for_gloo": _fix_numpy_split_sizes_for_gloo,
    "cpu_device_mode": _fix_cpu_device_mode,
    "recompute_under_cpu_device_mode": _fix_recompute_under_cpu_device_mode,
}


def enable_cpu_runtime() -> bool:
    """Make Megatron-Core runnable on CPU with gloo. Idempotent.

    Returns True when the CPU runtime is active, False when CUDA is available (in
    which case nothing is changed).
    """
    if torch.cuda.is_available():
        return False
    if _enabled_fixes:
        return True
    note = quiet_known_cpu_warnings()  # before the version check imports megatron.core
    skip_torch_compile_of_functions()
    if note:
        logger.info(note)
    check_megatron_core_version()
    for name, fix in FIXES.items():
        fix()
        _enabled_fixes.append(name)
    logger.info("megatron_lrmoe CPU runtime enabled: %s", ", ".join(_enabled_fixes))
    return True


def enable_bridge_cpu_runtime() -> bool:
    """``enable_cpu_runtime()`` plus ``BRIDGE_FIXES`` for Megatron-Bridge's ``pretrain()``.
    Imports megatron.bridge (with ``compat``'s stubs where their modules are absent).
    Idempotent.

    Returns True when the CPU runtime is active, False when CUDA is available (in which
    case nothing is changed)."""
    if not enable_cpu_runtime():
        return False
    if _enabled_bridge_fixes:
        return True
    stub_bridge_imports_of_absent_modules()
    for name, fix in BRIDGE_FIXES.items():
        fix()
        _enabled_bridge_fixes.append(name)
    logger.info("megatron_lrmoe CPU runtime for Megatron-Bridge: %s", ", ".join(BRIDGE_FIXES))
    return True


def cpu_runtime_active() -> bool:
    """Whether ``enable_cpu_runtime()`` has patched this process."""
    return bool(_enabled_fixes)


def enabled_fixes() -> tuple[str, ...]:
    """Names of the fixes applied in this process, in order."""
    return tuple(_enabled_fixes)


def enabled_bridge_fixes() -> tuple[str, ...]:
    """Names of the ``BRIDGE_FIXES`` applied in this process, in order."""
    return tuple(_enabled_bridge_fixes)
