"""Rewriting Megatron ModuleSpecs without touching the original.

Megatron describes a model as a tree of ``ModuleSpec`` (module class, params,
submodules) whose submodules are dataclasses (``TransformerLayerSubmodules``,
``MoESubmodules``, ``TransformerBlockSubmodules`` ...) holding more specs or bare
classes. ``map_spec_modules`` walks such a tree and returns a copy in which every
module class went through a function: the one mechanism behind every spec
transform of the project (norm substitution here, the LRMoE converter later).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

ModuleMap = Callable[[type], type]


def map_spec_modules(spec: Any, fn: ModuleMap) -> Any:
    """Copy of ``spec`` with every module class ``c`` replaced by ``fn(c)``."""
    if isinstance(spec, ModuleSpec):
        module = fn(spec.module) if isinstance(spec.module, type) else spec.module
        return dataclasses.replace(
            spec, module=module, submodules=map_spec_modules(spec.submodules, fn)
        )
    if isinstance(spec, type):
        return fn(spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: map_spec_modules(getattr(spec, f.name), fn)
            for f in dataclasses.fields(spec)
            if f.init
        }
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, list | tuple):
        return type(spec)(map_spec_modules(item, fn) for item in spec)
    return spec


def map_module_specs(spec: Any, fn: Callable[[ModuleSpec], ModuleSpec]) -> Any:
    """Copy of ``spec`` in which every ``ModuleSpec`` went through ``fn`` (outermost
    first). Where ``fn`` returns a new spec, that spec is taken as is (not descended
    into); where it returns its argument, the walk continues into its submodules."""
    if isinstance(spec, ModuleSpec):
        new = fn(spec)
        if new is not spec:
            return new
        return dataclasses.replace(spec, submodules=map_module_specs(spec.submodules, fn))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: map_module_specs(getattr(spec, f.name), fn)
            for f in dataclasses.fields(spec)
            if f.init
        }
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, list | tuple):
        return type(spec)(map_module_specs(item, fn) for item in spec)
    return spec


def replace_module(spec: Any, old: type, new: type) -> Any:
    """Copy of ``spec`` with the class ``old`` replaced by ``new`` everywhere."""
    return map_spec_modules(spec, lambda cls: new if cls is old else cls)


def spec_modules(spec: Any) -> list[type]:
    """Every module class that appears in ``spec`` (with repeats), for inspection."""
    found: list[type] = []

    def record(cls: type) -> type:
        found.append(cls)
        return cls

    map_spec_modules(spec, record)
    return found
