"""Megatron-Bridge on this machine: the import stubs of ``compat`` are scoped to the Bridge
modules that need them and used only where the real module is absent; each CPU fix of
Bridge's training (``cpu.BRIDGE_FIXES``) replaces a real blocker.

Bridge is imported in the shared two-rank pool only (the Bridge training tests import it
there too).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import textwrap

import pytest

from megatron_lrmoe import megatron_privates as privates
from megatron_lrmoe.integration.runtime import compat
from megatron_lrmoe.integration.runtime import cpu as runtime

# ---------------------------------------------------------------------------
# The stubs, without Bridge: a module of our own stands in for Bridge's
# ---------------------------------------------------------------------------

_TE_USER = """
import transformer_engine.pytorch as te

def linear_types():
    return (te.Linear, te.LayerNormLinear)

def fused():
    return te.ops.Sequential()
"""
_NVRX_USER = "from nvidia_resiliency_ext.inprocess import CallWrapper\n"


class _PackageIn:
    """Finds ``stubbed_pkg`` in one folder (no change to sys.path)."""

    def __init__(self, folder) -> None:
        self.folder = str(folder)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "stubbed_pkg":
            return None
        return importlib.machinery.PathFinder.find_spec(name, path or [self.folder])


@pytest.fixture
def stubbed_pkg(tmp_path, monkeypatch):
    """A package whose modules import TE and nvrx as Bridge's do, given the same stubs."""
    pkg = tmp_path / "stubbed_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "te_user.py").write_text(textwrap.dedent(_TE_USER))
    (pkg / "nvrx_user.py").write_text(_NVRX_USER)
    (pkg / "plain.py").write_text("import transformer_engine\n")
    stubs = {"stubbed_pkg.te_user": compat.BRIDGE_IMPORT_STUBS["megatron.bridge.peft.lora_layers"],
             "stubbed_pkg.nvrx_user":
                 compat.BRIDGE_IMPORT_STUBS["megatron.bridge.training.pretrain"]}
    monkeypatch.setattr(sys, "meta_path", [compat._BridgeStubFinder(stubs),
                                           _PackageIn(tmp_path), *sys.meta_path])
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "stubbed_pkg"]:
        sys.modules.pop(name)


def test_stub_reaches_only_the_module_that_imports_it(stubbed_pkg):
    assert importlib.util.find_spec("transformer_engine") is None   # this machine
    te_user = importlib.import_module("stubbed_pkg.te_user")
    nvrx_user = importlib.import_module("stubbed_pkg.nvrx_user")
    # Nothing entered sys.modules: every other `import transformer_engine` still fails,
    # so megatron-core's and Bridge's HAVE_TE checks see no TE.
    assert not any(m.split(".")[0] in ("transformer_engine", "nvidia_resiliency_ext")
                   for m in sys.modules)
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        importlib.import_module("stubbed_pkg.plain")
    # The stub's TE classes match nothing and cannot be built; the error says what needs TE.
    linear, layer_norm_linear = te_user.linear_types()
    assert not isinstance(object(), (linear, layer_norm_linear))
    with pytest.raises(compat.BridgeStubUsed, match="LoRA"):
        te_user.fused()
    with pytest.raises(compat.BridgeStubUsed, match="inprocess_restart"):
        nvrx_user.CallWrapper()


def test_real_module_is_used_where_installed(monkeypatch):
    # An entry whose module exists here (json.decoder for Bridge's TE) is not stubbed.
    monkeypatch.setattr(compat, "_bridge_finder", None)
    monkeypatch.setattr(compat, "BRIDGE_IMPORT_STUBS",
                        {"megatron.bridge.peft.lora_layers": ("json.decoder",
                                                               compat._te_pytorch_stub)})
    before = list(sys.meta_path)
    monkeypatch.setattr(sys, "meta_path", list(before))
    assert compat.stub_bridge_imports_of_absent_modules() == ()
    assert sys.meta_path == before           # no finder added


def test_stubs_are_for_modules_absent_here():
    # Each stubbed module is absent on this machine; were it installed, it would be used.
    for importer_name, (stubbed, _) in compat.BRIDGE_IMPORT_STUBS.items():
        assert importer_name.startswith("megatron.bridge.")
        assert compat._module_absent(stubbed), stubbed


# ---------------------------------------------------------------------------
# With Bridge, in the pool
# ---------------------------------------------------------------------------


def _bridge_imports():
    """Bridge's modules, imported with the runtime: what their stubbed imports resolved to,
    and whether anything else sees TE."""
    runtime.enable_bridge_cpu_runtime()
    import megatron.bridge  # noqa: F401
    from megatron.bridge.peft import lora_layers
    from megatron.bridge.training import pretrain
    from megatron.core.extensions import transformer_engine as mcore_te

    return {
        "lora_te": type(lora_layers.te.Linear).__name__,
        "call_wrapper": pretrain.CallWrapper.__qualname__,
        "in_sys_modules": sorted(m for m in sys.modules
                                 if m.split(".")[0] in ("transformer_engine",
                                                        "nvidia_resiliency_ext")),
        "mcore_has_te": bool(mcore_te.HAVE_TE),
        "fixes": list(runtime.enabled_fixes()),
        "bridge_fixes": list(runtime.enabled_bridge_fixes()),
    }


def test_bridge_imports_with_scoped_stubs(gloo2):
    out = gloo2.run(_bridge_imports, timeout=300)[0]
    assert out["lora_te"] == "_AbsentTEType"
    assert out["call_wrapper"] == "_NvrxCallWrapper"
    assert out["in_sys_modules"] == [] and out["mcore_has_te"] is False
    assert out["fixes"] == list(runtime.FIXES)
    assert out["bridge_fixes"] == list(runtime.BRIDGE_FIXES)


def _blockers_and_fixes():
    """Each Bridge fix against the function it wraps (``__wrapped__``): the blocker without
    it, the fixed behaviour with it."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import random as mcore_random

    runtime.enable_bridge_cpu_runtime()
    setup = importlib.import_module("megatron.bridge.training.setup")
    initialize = importlib.import_module("megatron.bridge.training.initialize")
    out = {}

    def probe(name, fn):
        try:
            out[name] = ("ok", fn())
        except BaseException as exc:   # noqa: BLE001 - SystemExit is the blocker shown
            out[name] = (type(exc).__name__, str(exc)[:200])

    # allow_no_cuda: Bridge's setup() calls initialize_megatron without it.
    real_init = setup.initialize_megatron.__wrapped__
    probe("bridge_allow_no_cuda:blocker", lambda: real_init(cfg=None))
    probe("bridge_allow_no_cuda:fixed", lambda: _forwards_allow_no_cuda(setup))
    # compile_helpers: make in the installed wheel's datasets folder (no Makefile there).
    probe("bridge_prebuilt_dataset_helpers:blocker", initialize.compile_helpers.__wrapped__)
    probe("bridge_prebuilt_dataset_helpers:fixed", initialize.compile_helpers)
    # _set_random_seed: the model-parallel RNG state, without and with the fix.
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    pgs = ProcessGroupCollection.use_mpu_process_groups()

    def seeded(fn):
        mcore_random.get_cuda_rng_tracker().reset()
        fn(1234, pg_collection=pgs)
        return sorted(mcore_random.get_cuda_rng_tracker().get_states())

    probe("bridge_model_parallel_seed:blocker",
          lambda: seeded(initialize._set_random_seed.__wrapped__))
    probe("bridge_model_parallel_seed:fixed", lambda: seeded(initialize._set_random_seed))
    out["device_count_after"] = torch.cuda.device_count()
    # The async-save worker: megatron-core's loop dies at its start (its GPU is rank modulo
    # no device), ours runs until told to stop; the staging hands out the live tensor,
    # ours a copy.
    probe("bridge_async_checkpoint_worker:blocker",
          lambda: _run_async_loop(privates.persistent_async_loop()))
    probe("bridge_async_checkpoint_worker:fixed",
          lambda: _run_async_loop(runtime.async_checkpoint_worker))
    live = torch.arange(4.0)
    for name, preload in (("blocker", privates.async_preload_tensors()),
                          ("fixed", runtime.preload_as_copies)):
        staged = preload([("file", "key", ([], [("item", live)]))], True)[0][2][1][0][1]
        same = staged.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
        out[f"bridge_async_checkpoint_worker:{name} preload"] = (staged.tolist(), same)
    return out


def _run_async_loop(loop) -> str:
    """``loop`` (the async-save worker's target) in this process, with a stop message
    waiting; the process's torch.cuda counters and logging level as they were after."""
    import logging
    import queue

    import torch

    saved = torch.cuda.device_count, torch.cuda.set_device
    level = logging.getLogger().level
    work = queue.Queue()
    work.put("DONE")
    try:
        loop(0, work, queue.Queue(), queue.Queue(), level)
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved
        logging.getLogger().setLevel(level)
    return "stopped" if work.unfinished_tasks == 0 else "running"


def _forwards_allow_no_cuda(setup):
    seen = {}
    wrapper = setup.initialize_megatron

    def record(*args, **kwargs):
        seen.update(kwargs)

    # The wrapper's closure holds Bridge's function; call it with a recorder in its place.
    cell = next(c for c in wrapper.__closure__ if callable(c.cell_contents))
    real, cell.cell_contents = cell.cell_contents, record
    try:
        wrapper(cfg=None)
    finally:
        cell.cell_contents = real
    return seen


def test_each_bridge_fix_replaces_a_blocker(gloo2):
    out = gloo2.run(_blockers_and_fixes, timeout=300)[0]
    assert out["bridge_allow_no_cuda:blocker"] == ("AssertionError", "Megatron requires CUDA.")
    assert out["bridge_allow_no_cuda:fixed"] == ("ok", {"cfg": None, "allow_no_cuda": True})
    assert out["bridge_prebuilt_dataset_helpers:blocker"] == ("SystemExit", "1")
    assert out["bridge_prebuilt_dataset_helpers:fixed"] == ("ok", None)
    tracker = "model-parallel-rng"
    blocker, fixed = (out["bridge_model_parallel_seed:blocker"],
                      out["bridge_model_parallel_seed:fixed"])
    assert blocker[0] == "ok" and tracker not in blocker[1]
    assert fixed[0] == "ok" and tracker in fixed[1]
    assert out["device_count_after"] == 0   # the count is restored after the call
    assert out["bridge_async_checkpoint_worker:blocker"] == (
        "ZeroDivisionError", "integer modulo by zero")
    assert out["bridge_async_checkpoint_worker:fixed"] == ("ok", "stopped")
    assert out["bridge_async_checkpoint_worker:blocker preload"] == ([0.0, 1.0, 2.0, 3.0], True)
    assert out["bridge_async_checkpoint_worker:fixed preload"] == ([0.0, 1.0, 2.0, 3.0], False)
    assert {k.partition(":")[0] for k in out if ":" in k} == set(runtime.BRIDGE_FIXES)
