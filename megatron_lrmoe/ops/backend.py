"""Kernel backend selection: the one place that decides which implementation runs.

Backends
  "cpu"    compiled extension ``megatron_lrmoe._kernels``, C++ CPU code (kernels/*.cpp)
  "cuda"   the same extension's CUDA code (kernels/*.cu); present only when it was
           built against a CUDA torch with the CUDA toolkit available (setup.py)
  "torch"  pure-torch implementations in megatron_lrmoe/ops; always available,
           slower, and the same maths as the tests' oracles

Requests (``--moe-lrmoe-kernels``): "auto", "cpu", "cuda", "torch".
  auto         the compiled backend of the tensors' device when it exists, else
               "torch" with a warning logged once per reason
  cpu / cuda   that compiled backend, or a ValueError saying why it cannot be used
  torch        always "torch"

Ops call ``resolve_backend`` and, for a compiled backend, the torch ops that the
extension registers (``torch.ops.lrmoe.*``, through ``registered_ops``); nothing else
imports the extension. Each op module registers its op's fake implementation, so the
ops trace with fake tensors (FakeTensorMode, torch.compile) without computing.

Fake tensors: "auto" and "cuda" pick the compiled CUDA backend for fake CUDA tensors
even where the extension was built without its CUDA part (no nvcc) or the machine has
no GPU: a fake tensor runs only the op's fake implementation, which every build
registers, so no CUDA kernel is needed to trace (``resolve_backend(..., fake=True)``).

Deterministic mode (``deterministic_mode``): Megatron's ``deterministic_mode`` or torch's
deterministic algorithms. The ops that sum in an order the hardware picks (only
``scatter_add_rows`` on CUDA, with atomics) then sum in a fixed order instead.

Debug checks (``debug_checks``): checking index and metric *values* of tensors on a
GPU means reading a device reduction on the host, which stalls the CPU until the GPU
has drained (the LRMoE region must not; docs/design.md, "Region"). Such checks run
only while the switch is on: ``MEGATRON_LRMOE_DEBUG_CHECKS=1`` in the environment
(the tests set it) or ``set_debug_checks(True)``; off by default. Without them the
CUDA kernels skip out-of-range rows (never reading or writing out of bounds) and an
invalid value gives a wrong result instead of an error. Checks of host data (CPU
tensors, which the CPU kernels read anyway) always run.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import is_fake as _is_fake

logger = logging.getLogger(__name__)

BACKEND_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda", "torch")
BUILD_HINT = "bash scripts/setup.sh (or: pip install --no-build-isolation -e .)"
_FLAG = "--moe-lrmoe-kernels"

# Imported once at module import; a failed import is remembered (with its
# reason) instead of raised, so a checkout without a build still runs on the
# torch backend.
_kernels: ModuleType | None
_kernels_import_error: str | None
try:
    from megatron_lrmoe import _kernels
except ImportError as exc:  # not built, or built against another torch (ABI)
    _kernels = None
    _kernels_import_error = f"{type(exc).__name__}: {exc}"
else:
    _kernels_import_error = None
    # A build from sources older than the op registration imports but defines no
    # lrmoe::* ops: treat it as missing (the ops call them) instead of failing later.
    if not hasattr(torch.ops.lrmoe, "combine_rows_backward"):
        _kernels = None
        _kernels_import_error = ("megatron_lrmoe._kernels predates the lrmoe::* torch ops "
                                 "(built from older sources)")

# Reasons already warned about, so "auto" logs its fallback once, not per call.
_warned: set[str] = set()

DEBUG_CHECKS_ENV = "MEGATRON_LRMOE_DEBUG_CHECKS"
_debug_checks = os.environ.get(DEBUG_CHECKS_ENV, "0") not in ("", "0")


def debug_checks() -> bool:
    """Whether ops check values that live on a GPU (a host sync per check)."""
    return _debug_checks


def set_debug_checks(enabled: bool) -> bool:
    """Turn the value checks of device tensors on or off; returns the previous setting."""
    global _debug_checks
    previous, _debug_checks = _debug_checks, bool(enabled)
    return previous


def deterministic_mode(config_flag: bool = False) -> bool:
    """Whether the LRMoE path must be order-invariant (bitwise reproducible): Megatron's
    ``--deterministic-mode`` (``config_flag``, the layer config's ``deterministic_mode``)
    or ``torch.use_deterministic_algorithms(True)``. One flag read; callers read it once
    per layer call."""
    return bool(config_flag) or torch.are_deterministic_algorithms_enabled()


def needs_value_check(device: torch.device) -> bool:
    """Check values of tensors on ``device``: always on the host, on a GPU in debug mode."""
    return device.type == "cpu" or _debug_checks


def kernels_available() -> bool:
    """True when the compiled extension ``megatron_lrmoe._kernels`` imported."""
    return _kernels is not None


def cuda_kernels_available() -> bool:
    """True when the compiled extension imported and includes the CUDA backend."""
    return _kernels is not None and bool(_kernels.built_with_cuda())


def kernels_module() -> ModuleType:
    """The compiled extension; only for ops that resolved a compiled backend."""
    if _kernels is None:
        raise RuntimeError(
            f"megatron_lrmoe._kernels is not available ({_kernels_import_error}); "
            f"build it with {BUILD_HINT}"
        )
    return _kernels


def registered_ops() -> torch._ops._OpNamespace:
    """``torch.ops.lrmoe``: the extension's ops; only for ops that resolved a compiled
    backend (the extension, which registers them, is imported here first)."""
    kernels_module()
    return torch.ops.lrmoe


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (FakeTensorMode): it has metadata but no data,
    so only fake implementations may see it and no value is read.

    False while torch.compile's Dynamo traces the caller: the code it traces stands for
    the run on real tensors (and Dynamo cannot trace the test itself).
    """
    if torch.compiler.is_compiling():
        return False
    return _is_fake(tensor)


def _compiled_backend(device_type: str, fake: bool = False) -> tuple[str | None, str]:
    """(backend, reason): the compiled backend for a device type, or None and why not."""
    if _kernels is None:
        why = f"megatron_lrmoe._kernels did not import ({_kernels_import_error})"
        return None, why
    if device_type == "cpu":
        return "cpu", "compiled CPU kernels (megatron_lrmoe._kernels)"
    if device_type == "cuda":
        if fake:
            # Fake tensors run the ops' fake implementations, present in every build.
            return "cuda", "compiled CUDA kernels' fake implementations (fake tensors)"
        if not _kernels.built_with_cuda():
            return None, (
                "megatron_lrmoe._kernels was built without CUDA support (torch without CUDA, "
                "or no CUDA toolkit at build time)"
            )
        return "cuda", "compiled CUDA kernels (megatron_lrmoe._kernels)"
    return None, f"no compiled kernels exist for device type {device_type!r}"


def _resolve(requested: str, device: torch.device, fake: bool = False) -> tuple[str, str]:
    """(backend, reason) for a request, without logging; ValueError when impossible."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(
            f"unknown kernel backend {requested!r} ({_FLAG}); choose one of "
            f"{', '.join(BACKEND_CHOICES)}"
        )
    if requested == "torch":
        return "torch", "pure-torch ops requested explicitly"
    backend, why = _compiled_backend(device.type, fake)
    if requested == "auto":
        if backend is None:
            return "torch", f"fallback: {why}"
        return backend, why
    if device.type != requested:
        raise ValueError(
            f"{_FLAG} {requested} was requested but the tensors are on {device}; "
            f"use {_FLAG} auto to follow the tensors' device"
        )
    if backend is None:
        raise ValueError(
            f"{_FLAG} {requested} is unavailable: {why}. Build the kernels with {BUILD_HINT}, "
            f"or pass {_FLAG} auto (falls back to pure torch) or {_FLAG} torch"
        )
    return backend, why


def resolve_backend(requested: str = "auto", device: torch.device | str = "cpu", *,
                    fake: bool = False) -> str:
    """Backend ("cpu", "cuda" or "torch") that serves ``requested`` for tensors on ``device``.

    ``requested`` is one of "auto", "cpu", "cuda", "torch" (the values of
    ``--moe-lrmoe-kernels``). "auto" falls back to "torch", logging a warning
    once, when no compiled backend serves the device; an explicit "cpu" or
    "cuda" that cannot be served raises ValueError naming the fix. ``fake``: the
    tensors are fake (``is_fake``), so a compiled backend needs only the registered
    ops, not a CUDA build or a GPU.
    """
    device = torch.device(device)
    backend, why = _resolve(requested, device, fake)
    if requested == "auto" and backend == "torch" and why not in _warned:
        _warned.add(why)
        logger.warning(
            "LRMoE kernels: using the pure-torch backend for %s tensors (slower): %s. "
            "Build the compiled kernels with %s.",
            device.type,
            why,
            BUILD_HINT,
        )
    return backend


def describe_backend(requested: str = "auto", device: torch.device | str = "cpu") -> str:
    """One line for logs: which backend serves ``requested`` on ``device``, and why."""
    device = torch.device(device)
    try:
        backend, why = _resolve(requested, device)
    except ValueError as exc:
        return f"LRMoE kernels ({_FLAG} {requested}, {device.type} tensors): unavailable: {exc}"
    return f"LRMoE kernels ({_FLAG} {requested}, {device.type} tensors): backend {backend!r}: {why}"
