"""Rewriting Megatron layer specs without touching the original.

Megatron describes a model as a tree of module builders whose submodules are
dataclasses (``TransformerLayerSubmodules``, ``MoESubmodules``, ``MLPSubmodules``
...) holding more builders or bare classes. Megatron-Core 0.19 has two kinds of
builder node: ``ModuleSpec`` (module class, params, submodules) and, in the MoE
positions, ``functools.partial(cls, submodules=...)`` (``MoELayer`` and its experts
and shared experts). ``map_spec_modules`` walks such a tree and returns a copy in which
every module class went through a function; ``map_module_specs`` hands every builder
node to a function. They are the one mechanism behind every spec transform of the
project (norm substitution, the LRMoE converter).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

ModuleMap = Callable[[type], type]
#: A builder node: a ModuleSpec, or functools.partial of a module class.
Builder = ModuleSpec | functools.partial


def is_builder(node: Any) -> bool:
    """Whether ``node`` is a builder node (a ModuleSpec or a partial of a class)."""
    return isinstance(node, ModuleSpec) or (
        isinstance(node, functools.partial) and isinstance(node.func, type))


def builder_class(node: Builder) -> Any:
    """The module class (or import path) a builder node builds."""
    return node.module if isinstance(node, ModuleSpec) else node.func


def builder_submodules(node: Builder) -> Any:
    """The submodules a builder node passes to its class (None when it passes none)."""
    if isinstance(node, ModuleSpec):
        return node.submodules
    return node.keywords.get("submodules")


def rebuild(node: Builder, cls: Any, submodules: Any) -> Builder:
    """A builder node of the same kind as ``node`` building ``cls`` with ``submodules``;
    every other argument of ``node`` is kept. ``node`` itself when nothing changes
    (partials compare by identity, so an untouched tree stays equal to the original)."""
    if cls is builder_class(node) and submodules is builder_submodules(node):
        return node
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, module=cls, submodules=submodules)
    keywords = dict(node.keywords)
    if submodules is not None or "submodules" in keywords:
        keywords["submodules"] = submodules
    return functools.partial(cls, *node.args, **keywords)


def _replace_fields(spec: Any, walk: Callable[[Any], Any]) -> Any:
    """A dataclass with every init field walked; ``spec`` itself when none changed."""
    changes = {f.name: walk(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.init}
    if all(value is getattr(spec, name) for name, value in changes.items()):
        return spec
    return dataclasses.replace(spec, **changes)


def _replace_items(spec: list | tuple, walk: Callable[[Any], Any]) -> list | tuple:
    """A list or tuple with every item walked; ``spec`` itself when none changed."""
    items = [walk(item) for item in spec]
    if all(new is old for new, old in zip(items, spec, strict=True)):
        return spec
    if isinstance(spec, list) and type(spec) is not list:
        # A list subclass may carry more than its items (Bridge's EXAONE-MoE and Step-3.5
        # block specs keep their MTP layer's dense spec on theirs) and need more than them
        # to construct: a shallow copy keeps the rest.
        new = copy.copy(spec)
        new[:] = items
        return new
    return type(spec)(items)


def map_spec_modules(spec: Any, fn: ModuleMap) -> Any:
    """Copy of ``spec`` with every module class ``c`` replaced by ``fn(c)`` (unchanged
    parts are shared with ``spec``, never modified)."""
    if is_builder(spec):
        cls = builder_class(spec)
        return rebuild(spec, fn(cls) if isinstance(cls, type) else cls,
                       map_spec_modules(builder_submodules(spec), fn))
    if isinstance(spec, type):
        return fn(spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return _replace_fields(spec, lambda value: map_spec_modules(value, fn))
    if isinstance(spec, list | tuple):
        return _replace_items(spec, lambda item: map_spec_modules(item, fn))
    return spec


def map_module_specs(spec: Any, fn: Callable[[Builder], Builder]) -> Any:
    """Copy of ``spec`` in which every builder node went through ``fn`` (outermost
    first). Where ``fn`` returns a new node, that node is taken as is (not descended
    into); where it returns its argument, the walk continues into its submodules."""
    if is_builder(spec):
        new = fn(spec)
        if new is not spec:
            return new
        return rebuild(spec, builder_class(spec),
                       map_module_specs(builder_submodules(spec), fn))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return _replace_fields(spec, lambda value: map_module_specs(value, fn))
    if isinstance(spec, list | tuple):
        return _replace_items(spec, lambda item: map_module_specs(item, fn))
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
