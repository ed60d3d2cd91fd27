"""Shared fixtures: long-lived gloo worker pools and a small prepared corpus."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import settings

from lrmoe_testing.gloo_pool import GlooPool
from lrmoe_testing.hf_cache import offline_hf_environment, prefilled_hf_cache

# Property tests draw the same examples on every run (CI gates on them; a new random
# counterexample should not fail a change that did not cause it). To search new ones:
# HYPOTHESIS_PROFILE=explore bash scripts/test.sh tests/planning/test_placement.py; a failure
# found that way becomes an @example of its test.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

# The main pytest process stays free of the CPU runtime (it patches torch
# process-wide); everything that runs Megatron goes through a pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ops check index and metric values on every device (a host sync on GPUs, off by
# default in training); set before the worker pools start, so they inherit it.
os.environ.setdefault("MEGATRON_LRMOE_DEBUG_CHECKS", "1")

# Megatron-Bridge's recipes read their models' config.json from the Hugging Face Hub: the
# shipped configs, in a pre-filled cache, offline (huggingface_hub reads these variables at
# import; set before the worker pools start, so they inherit them).
os.environ.update(offline_hf_environment(prefilled_hf_cache(
    tempfile.mkdtemp(prefix="lrmoe-hf-cache-"))))

_pools: dict[int, GlooPool] = {}


def _pool(world_size: int) -> GlooPool:
    if world_size not in _pools:
        _pools[world_size] = GlooPool(world_size)
    return _pools[world_size]


@pytest.fixture(scope="session")
def gloo1() -> GlooPool:
    return _pool(1)


@pytest.fixture(scope="session")
def gloo2() -> GlooPool:
    return _pool(2)


@pytest.fixture(scope="session")
def gloo4() -> GlooPool:
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A small real corpus (a few stdlib packages), byte-level, prepared once."""
    import sysconfig

    from megatron_lrmoe.data import prepare_dataset

    stdlib = sysconfig.get_paths()["stdlib"]
    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib_small")
    inputs = [os.path.join(stdlib, name) for name in ("json", "email", "logging")]
    prepare_dataset(inputs, prefix, extensions=".py")
    return prefix


@pytest.fixture(scope="session")
def bridge():
    """megatron.bridge, imported (Megatron-Bridge is part of the test environment; what
    cannot be installed here is stubbed for the Bridge modules that import it)."""
    from megatron_lrmoe.integration.runtime.compat import stub_bridge_imports_of_absent_modules

    stub_bridge_imports_of_absent_modules()
    import megatron.bridge

    return megatron.bridge


@pytest.fixture(scope="module")
def kernels():
    """The compiled extension; its absence is a failure, not a skip (CI builds it)."""
    from megatron_lrmoe.ops import backend as backend_mod
    from megatron_lrmoe.ops import kernels_available

    if not kernels_available():
        pytest.fail(
            "megatron_lrmoe._kernels did not import "
            f"({backend_mod._kernels_import_error}); build it with bash scripts/setup.sh"
        )
    return backend_mod.kernels_module()
