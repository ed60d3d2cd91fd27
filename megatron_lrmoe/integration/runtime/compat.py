"""Megatron-Core 0.19 and Megatron-Bridge 0.6 without what cannot be installed here.

The one place for stand-ins of absent modules; each is used only where the real one is
missing, so a machine that has it uses it.

``fp8_off_in_checkpoint_without_output_when_te_absent``:
``tensor_parallel.CheckpointWithoutOutput`` (selective recompute of ``layernorm`` and
``moe_act``) sets ``self.fp8 = fp8 is not None`` (megatron/core/tensor_parallel/random.py:740
in 0.19.2), True for its default ``fp8=False``, and then asks Transformer Engine's
``FP8GlobalStateManager`` (random.py:693), a NameError without TE. Without TE there is no
FP8, so the flag is made False. The launcher applies this on every machine, the
Megatron-LM integration with ``--moe-lrmoe``; the CPU runtime includes it.

``stub_bridge_imports_of_absent_modules``: Bridge 0.6.2 imports two modules at module
level, without a fallback, that this environment cannot have (``BRIDGE_IMPORT_STUBS``,
the reason beside each stub). Each stub is given *only to the Bridge module that imports
it*: its ``import`` statement is answered through that module's own
``__builtins__.__import__``, and the stub never enters ``sys.modules``. A global stub would
make every ``try: import transformer_engine`` in megatron-core and Bridge believe TE is
present (``HAVE_TE``) and take TE code paths.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any


def fp8_off_in_checkpoint_without_output_when_te_absent() -> bool:
    """Make ``CheckpointWithoutOutput`` objects non-FP8 when TE is absent.

    Returns True when the constructor was wrapped (TE absent), False otherwise.
    Idempotent. Megatron's internals are reached through ``megatron_privates``."""
    from megatron_lrmoe.megatron_privates import (
        tensor_parallel_random_has_te,
        wrap_checkpoint_without_output_init,
    )

    if tensor_parallel_random_has_te():
        return False
    return wrap_checkpoint_without_output_init(_fp8_off)


def _fp8_off(checkpoint: object) -> None:
    checkpoint.fp8 = False  # type: ignore[attr-defined]   # no FP8 without Transformer Engine


# ---------------------------------------------------------------------------
# Megatron-Bridge's unconditional imports of modules that cannot be installed here
# ---------------------------------------------------------------------------


class BridgeStubUsed(ImportError):
    """A stub that stands in for an uninstalled module was asked for something real."""


_TE_ABSENT = ("Transformer Engine is not installed; Megatron-Bridge's LoRA layers "
              "(megatron.bridge.peft) need it. Install Transformer Engine (a GPU machine) "
              "to use PEFT/LoRA.")


class _AbsentTEType(type):
    """Classes standing for TE's (``te.Linear``, ``te.ops.Sequential``): any attribute is
    another such class, nothing is an instance of one, and building one raises."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentTEType(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise BridgeStubUsed(f"{cls.__name__}: {_TE_ABSENT}")


def _te_pytorch_stub() -> types.ModuleType:
    """``transformer_engine.pytorch`` for megatron/bridge/peft/lora_layers.py (Bridge 0.6.2).

    Why: lora_layers.py imports it at line 20 with no fallback, and is reached from
    ``import megatron.bridge`` (megatron/bridge/models/conversion/peft_bridge.py ->
    megatron/bridge/peft/canonical_lora.py).
    Transformer Engine is a CUDA-only build that cannot be installed on a machine without
    a GPU toolchain. lora_layers names ``te`` classes in annotations and ``isinstance``
    checks, and builds them only in LoRA's methods: the stub's classes match nothing and
    refuse to be built, with a message that LoRA needs TE.
    """
    module = types.ModuleType("transformer_engine.pytorch")

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentTEType(f"transformer_engine.pytorch.{name}", (), {})

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


class _NvrxCallWrapper:
    """Stand-in for ``nvidia_resiliency_ext.inprocess.CallWrapper``.

    Bridge never builds one itself: nvidia-resiliency-ext's in-process restart passes it
    to ``_pretrain``. Without the package in-process restart cannot be enabled, so no
    instance ever exists; the class only satisfies the import and annotations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise BridgeStubUsed(
            "nvidia_resiliency_ext is not installed: Megatron-Bridge's in-process restart "
            "(inprocess_restart.enabled) needs it; leave inprocess_restart off")


def _nvrx_inprocess_stub() -> types.ModuleType:
    """``nvidia_resiliency_ext.inprocess`` for megatron/bridge/training/pretrain.py (Bridge
    0.6.2).

    Why: pretrain.py imports ``CallWrapper`` from it at line 19, unconditionally, for a
    type annotation. megatron-core 0.19.2's extras want nvidia-resiliency-ext 0.6.0, which
    this registry does not have; its 0.4.1 breaks megatron-core 0.19.2's import, so
    neither can be installed beside megatron-core here."""
    module = types.ModuleType("nvidia_resiliency_ext.inprocess")
    module.CallWrapper = _NvrxCallWrapper  # type: ignore[attr-defined]
    return module


#: Bridge module -> (the module it imports unconditionally, the stub's factory).
BRIDGE_IMPORT_STUBS: dict[str, tuple[str, Callable[[], types.ModuleType]]] = {
    "megatron.bridge.peft.lora_layers": ("transformer_engine.pytorch", _te_pytorch_stub),
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext.inprocess",
                                          _nvrx_inprocess_stub),
}


def _module_absent(name: str) -> bool:
    """Whether ``name`` cannot be imported: its top-level package is not found, or (an
    installed package) the submodule is not."""
    top = name.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        return True
    try:
        return importlib.util.find_spec(name) is None
    except ImportError:
        return True


def _import_with(stub_name: str, stub: types.ModuleType) -> Callable[..., Any]:
    """``__import__`` that answers ``import stub_name`` (either form) with ``stub``."""
    parent_name, _, child = stub_name.rpartition(".")
    parent = types.ModuleType(parent_name)
    setattr(parent, child, stub)

    def stubbed_import(name: str, globals: Any = None, locals: Any = None,
                       fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and name == stub_name:
            # ``from a.b import x`` wants a.b; ``import a.b [as c]`` wants a (then .b).
            return stub if fromlist else parent
        return builtins.__import__(name, globals, locals, fromlist, level)

    return stubbed_import


class _StubbedImportLoader(importlib.machinery.SourceFileLoader):
    """Bridge's own source loader, with the module's ``import`` of one absent module
    answered by a stub."""

    def __init__(self, fullname: str, path: str, stub_name: str,
                 make_stub: Callable[[], types.ModuleType]) -> None:
        super().__init__(fullname, path)
        self.stub_name, self.make_stub = stub_name, make_stub

    def exec_module(self, module: types.ModuleType) -> None:
        own_builtins = dict(vars(builtins))
        own_builtins["__import__"] = _import_with(self.stub_name, self.make_stub())
        module.__builtins__ = own_builtins  # type: ignore[attr-defined]
        super().exec_module(module)


class _BridgeStubFinder:
    """Finds the Bridge modules of ``BRIDGE_IMPORT_STUBS`` whose import is absent."""

    def __init__(self, stubs: dict[str, tuple[str, Callable[[], types.ModuleType]]]) -> None:
        self.stubs = stubs

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.stubs:
            return None
        for finder in sys.meta_path:   # the spec the other finders would give
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        stub_name, make_stub = self.stubs[fullname]
        if not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _StubbedImportLoader(fullname, spec.origin, stub_name, make_stub)
        return spec


_bridge_finder: _BridgeStubFinder | None = None


def stub_bridge_imports_of_absent_modules() -> tuple[str, ...]:
    """Let ``import megatron.bridge`` (and its ``training.pretrain``) work where the
    modules of ``BRIDGE_IMPORT_STUBS`` are not installed. Call before megatron.bridge is
    imported. Returns the names stubbed (empty on a machine that has them all: it then
    uses the real modules and nothing changes). Idempotent."""
    global _bridge_finder
    absent = {importer: entry for importer, entry in BRIDGE_IMPORT_STUBS.items()
              if _module_absent(entry[0])}
    if _bridge_finder is None and absent:
        _bridge_finder = _BridgeStubFinder(absent)
        sys.meta_path.insert(0, _bridge_finder)
    return tuple(entry[0] for entry in (_bridge_finder.stubs.values() if _bridge_finder else ()))
