"""Every MoE pretraining recipe of the installed Megatron-Bridge against its row in
docs/implementation.md ("Megatron-Bridge recipes").

Each ``<model>_pretrain_config`` recipe function of ``megatron.bridge.recipes`` that sets
expert parallelism is found by reading the functions (``moe_recipe_functions``), so a MoE
recipe a new Bridge adds fails ``test_every_moe_recipe_has_a_row`` until it has a row.
Each row's recipe is built offline (its Hub config from tests/fixtures/hf_configs, in the
pre-filled cache tests/conftest.py points huggingface_hub at) and given
``enable_lrmoe(adapt=True)``; the outcome must be the row's:

* ``accepted``: exactly the changes the row lists, each an implementation choice; every
  architecture, layout and precision field equal to the recipe's own, every other field
  too but the LRMoE options; the final checks (``finalize()``, as the
  launcher's dry run runs them) pass;
* ``refused``: the error names the row's ``field=value`` settings;
* ``needs a newer Megatron-Core``: the provider Bridge builds sets what the installed
  megatron-core has no field (or no value) for;
* ``not built offline``: building fails, for the reason the row quotes.

Built here without CUDA: Bridge's recipes choose their flex backend by the machine, so on
a GPU machine a row's changes may differ. Only configs are built, no model.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "implementation.md"
HEADING = "### Megatron-Bridge recipes"
OUTCOMES = ("accepted", "refused", "needs a newer Megatron-Core", "not built offline")

#: Bridge provider fields that define the model beyond Megatron's config fields
#: (``options.megatron.ARCHITECTURE_FIELDS``): embeddings, positions, the hybrid pattern.
PROVIDER_ARCHITECTURE_FIELDS = frozenset({
    "vocab_size", "share_embeddings_and_output_weights", "position_embedding_type",
    "rotary_base", "rotary_percent", "seq_length", "hybrid_layer_pattern",
    "mtp_hybrid_override_pattern",
})


class Row(NamedTuple):
    recipe: str
    model: str
    outcome: str
    items: tuple[str, ...]       # the backquoted items of the "what" column
    trained: str
    trained_items: tuple[str, ...]


def _quoted(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def table_rows(text: str) -> list[Row]:
    """The rows of the recipes table under ``HEADING`` in ``text``."""
    section = text.split(HEADING, 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = []
    for line in lines[2:]:                     # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        recipe, model, outcome, what, trained = cells
        rows.append(Row(recipe.strip("`"), model, outcome, _quoted(what), trained,
                        _quoted(trained)))
    return rows


ROWS = {row.recipe: row for row in table_rows(DOC.read_text())}


def moe_recipe_functions(recipes: Any) -> list[str]:
    """The ``<model>_pretrain_config`` functions of ``recipes`` that set expert parallelism
    above 1, in their own source or in a recipe function of their module they call (a
    recipe alias that delegates, as Nemotron-3 Super's does). Read, not built: building
    needs each model's Hub config, shipped for the MoE ones only. In Bridge 0.6.2 every MoE
    recipe function sets it and no dense one does (24 found)."""
    found = []
    for name in sorted(dir(recipes)):
        if not re.fullmatch(r"[a-z0-9_]+_pretrain_config", name):
            continue
        function = inspect.unwrap(getattr(recipes, name))
        sources = [inspect.getsource(function)]
        for called in re.findall(r"\b(_?[a-z0-9_]+_config)\(\)", sources[0]):
            inner = function.__globals__.get(called)
            if inspect.isfunction(inner) and inner is not function:
                sources.append(inspect.getsource(inner))
        sizes = [int(n) for source in sources
                 for n in re.findall(r"expert_model_parallel_size\s*=\s*(\d+)", source)]
        if any(n > 1 for n in sizes):
            found.append(name)
    return found


@functools.cache
def _built(name: str) -> Any:
    from megatron_lrmoe.bridge_launcher.cli import recipe_function

    return recipe_function(name)()


def _fields(model: Any) -> dict[str, Any]:
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}


def test_the_table_is_well_formed():
    assert ROWS
    for row in ROWS.values():
        assert row.outcome in OUTCOMES, row
        assert row.outcome == "accepted" or row.items, row          # a refusal names why
        assert row.trained in ("built, not trained on CPU", "not built") or \
            row.trained.startswith(("trained shrunk", "built, not trained on CPU: ")), row
        # An accepted row not trained says why.
        assert row.outcome != "accepted" or row.trained != "built, not trained on CPU", row
        assert (row.trained == "not built") == (row.outcome == "not built offline"), row


def test_trained_rows_name_the_test_that_trains_them():
    """A row trained on CPU names its test file, which trains that recipe (by its name or
    the harness constant holding it) or the variant of it the row names."""
    from lrmoe_testing import bridge as harness

    constants = {value: name for name, value in vars(harness).items()
                 if name.isupper() and isinstance(value, str)}
    trained = [row for row in ROWS.values() if row.trained.startswith("trained shrunk")]
    assert trained
    for row in trained:
        assert row.outcome == "accepted", row
        files = [item for item in row.trained_items if item.startswith("tests/")]
        recipes = [row.recipe, *(i for i in row.trained_items if i.endswith("_config"))]
        assert files, row
        for file in files:
            text = (REPO / file).read_text()
            names = [*recipes, *(f"harness.{constants[r]}" for r in recipes if r in constants)]
            assert any(n in text for n in names), (file, names)


def test_every_moe_recipe_has_a_row(bridge):
    from megatron.bridge import recipes

    assert sorted(moe_recipe_functions(recipes)) == sorted(ROWS)


def test_the_counts_stated_are_the_rows():
    """The section's summary line counts the rows it heads."""
    counts = {outcome: sum(row.outcome == outcome for row in ROWS.values())
              for outcome in OUTCOMES}
    stated = (f"**{counts['accepted']} accepted, {counts['refused']} refused, "
              f"{counts['needs a newer Megatron-Core']} need a newer Megatron-Core, "
              f"{counts['not built offline']} not built offline.**")
    assert " ".join(DOC.read_text().split(HEADING, 1)[1].split()).count(stated) == 1, stated
    assert counts["accepted"] >= 19


@pytest.mark.parametrize("name", sorted(ROWS))
def test_recipe_outcome_is_its_row(bridge, monkeypatch, name):
    row = ROWS[name]
    if row.outcome == "not built offline":
        _check_not_built(name, row.items, monkeypatch)
        return
    cfg = copy.deepcopy(_built(name))
    if row.outcome == "needs a newer Megatron-Core":
        _check_needs_newer_megatron(cfg.model, row.items)
        return
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    if row.outcome == "refused":
        with pytest.raises(BridgeConfigError) as info:
            enable_lrmoe(cfg, adapt=True)
        text = str(info.value)
        assert info.value.flag == row.items[0].partition("=")[0], text   # the first named
        for setting in row.items:
            assert f"{setting} (needs " in text, (setting, text)
        return
    _check_accepted(cfg, row.items)


def _check_accepted(cfg: Any, expected: tuple[str, ...]) -> None:
    """``adapt`` makes the row's changes and no other: implementation choices only, the
    recipe's architecture, layout and precision kept."""
    from megatron_lrmoe.bridge_launcher.cli import check_final_values
    from megatron_lrmoe.integration.bridge import enable_lrmoe, refused_settings
    from megatron_lrmoe.options.lrmoe import OPTIONS
    from megatron_lrmoe.options.megatron import ARCHITECTURE_FIELDS, megatron_option

    before = _fields(cfg.model)
    changes = enable_lrmoe(cfg, adapt=True)
    assert sorted(str(c) for c in changes) == sorted(expected)
    assert refused_settings(cfg) == []
    after = _fields(cfg.model)
    architecture = (ARCHITECTURE_FIELDS | PROVIDER_ARCHITECTURE_FIELDS) & before.keys()
    assert len(architecture) > 50
    assert {f: after[f] for f in architecture} == {f: before[f] for f in architecture}
    changed = {c.path.split(".", 1)[1] for c in changes if c.path.startswith("model.")}
    assert not changed & architecture
    for field in changed:
        assert megatron_option(field).adaptable, field
    lrmoe = {o.field for o in OPTIONS}
    assert {k: v for k, v in after.items() if k not in lrmoe | changed} == \
        {k: v for k, v in before.items() if k not in changed}
    assert cfg.model.moe_lrmoe
    check_final_values(cfg.model)


def _check_needs_newer_megatron(model: Any, settings: tuple[str, ...]) -> None:
    """Each ``name=value`` the row names is set on Bridge's provider, and the installed
    megatron-core's config has no such field, or does not take that value."""
    import typing

    from megatron.core.transformer import MLATransformerConfig

    fields = {f.name: f for f in dataclasses.fields(MLATransformerConfig)}
    for setting in settings:
        name, _, value = setting.partition("=")
        assert str(getattr(model, name)) == value, (name, getattr(model, name, None))
        if name in fields:
            allowed = [a for arg in typing.get_args(fields[name].type)
                       for a in (typing.get_args(arg) or (arg,))]
            assert value not in map(str, allowed), (name, allowed)


def _check_not_built(name: str, reasons: tuple[str, ...], monkeypatch: Any) -> None:
    """Building fails; each of ``reasons`` is in the message of an exception of the chain
    or names a function its tracebacks pass through."""
    import time
    import types

    from megatron.bridge.models.hf_pretrained import safe_config_loader

    # Bridge retries a failed Hub read three times with 7 s of back-off; offline, the
    # cache it reads does not change between tries.
    monkeypatch.setattr(safe_config_loader, "time",
                        types.SimpleNamespace(time=time.time, sleep=lambda seconds: None))
    with pytest.raises(Exception) as info:
        _built(name)
    seen: list[str] = []
    exc: BaseException | None = info.value
    while exc is not None:
        seen.append(str(exc))
        frames = traceback.extract_tb(exc.__traceback__)
        seen += [frame.name for frame in frames]
        exc = exc.__cause__ or exc.__context__
    for reason in reasons:
        assert any(reason in text for text in seen), (reason, seen[:3])
