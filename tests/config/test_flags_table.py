"""The Flags table of docs/design.md is the one ``megatron_lrmoe.config.flags_table`` makes
from the options' fields, and what that table says is the fields' own."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from megatron_lrmoe.config import flags_table
from megatron_lrmoe.config.flags import ENTRY_POINT_OPTIONS, EntryPointOptions
from megatron_lrmoe.config.flags_table import BEGIN, COMMAND, END, design_table, field_docs
from megatron_lrmoe.options.lrmoe import OPTIONS, LRMoEOptions

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_design_flags_table_is_generated():
    table = flags_table.flags_table()
    assert design_table(DESIGN.read_text()) == table, (
        "docs/design.md's Flags table differs from the options' fields; regenerate it: "
        + COMMAND)


@pytest.mark.parametrize("cls", [LRMoEOptions, EntryPointOptions])
def test_every_field_has_a_docstring_and_help(cls):
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name}: no docstring"
        assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name}: no help"


def test_field_docs_reads_attribute_docstrings():
    @dataclasses.dataclass
    class Toy:
        a: int = 1
        """First
        one."""

        b: int = 2
        c: str = "x"
        """Third."""

    assert field_docs(Toy) == {"a": "First one.", "c": "Third."}


def _rows() -> list[list[str]]:
    lines = flags_table.flags_table().splitlines()
    assert lines[:2] == ["| flag | default | meaning |", "|---|---|---|"]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def test_table_rows_are_the_fields():
    """One row per option, in the fields' order, the entry point's own flags last; each
    default cell reads back as the field's default unless the field says how it is shown;
    each meaning starts with the docstring and lists the choices there are."""
    rows = _rows()
    options = OPTIONS + ENTRY_POINT_OPTIONS
    assert [row[0] for row in rows] == [f"`{o.flag}`" for o in options]
    assert rows[-1][0] == "`--device-memory-gb`"
    docs = field_docs(LRMoEOptions) | field_docs(EntryPointOptions)
    for (_, default, meaning), o in zip(rows, options, strict=True):
        if o.shown is not None:
            assert default == o.shown
        elif o.type is bool:
            assert default == {False: "off", True: "on"}[o.default]
        elif o.default is None:
            assert default == "none"
        elif o.type is str:
            assert default == f"`{o.default}`"
        else:
            assert math.isclose(float(default), o.default), o.field
        assert meaning.startswith(docs[o.field].replace("``", "`")), o.field
        for choice in o.choices or ():
            assert f"`{choice}`" in meaning, (o.field, choice)


def test_write_replaces_only_the_table(tmp_path, capsys):
    design = tmp_path / "design.md"
    design.write_text(f"# Doc\n\n## Flags\n\nprose\n\n{BEGIN}\n| stale |\n{END}\n\nafter\n")
    assert flags_table.main(["--write", str(design)]) == 0
    text = design.read_text()
    assert text == (f"# Doc\n\n## Flags\n\nprose\n\n{BEGIN}\n{flags_table.flags_table()}"
                    f"{END}\n\nafter\n")
    assert flags_table.main([]) == 0
    assert capsys.readouterr().out.endswith(flags_table.flags_table())


def test_missing_markers_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="markers"):
        design_table("## Flags\n\n| flag | default | meaning |\n")
    plain = tmp_path / "plain.md"
    plain.write_text("## Flags\n")
    with pytest.raises(SystemExit):
        flags_table.main(["--write", str(plain)])
    assert f"--write {plain}: the markers" in capsys.readouterr().err
    assert plain.read_text() == "## Flags\n"
