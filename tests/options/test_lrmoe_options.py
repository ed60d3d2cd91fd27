"""The options' definition (options/lrmoe.py): ``Option`` is a dataclass field seen as its
flag, ``flag_field`` refuses a field its flag could not be made from."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lrmoe.config.flags import ENTRY_POINT_OPTIONS
from megatron_lrmoe.options.lrmoe import (
    OPTIONS,
    LRMoEOptions,
    check_positive_int,
    flag_field,
    option,
    options_of,
)


def test_options_are_the_fields():
    fields = dataclasses.fields(LRMoEOptions)
    assert [o.field for o in OPTIONS] == [f.name for f in fields]
    for o, f in zip(OPTIONS, fields, strict=True):
        assert o is option(f.name)
        assert o.annotation == f.type and o.default == f.default, f.name
        assert o.help == f.metadata["help"] and o.choices == f.metadata.get("choices")
        assert o.flag == "--" + f.name.replace("_", "-")
        # the type argparse converts with: the annotation without None, unless a parser
        assert o.arg_type is f.metadata.get("parse", o.type)
        assert o.type in (bool, int, float, str), f.name


def test_postponed_annotations_are_evaluated():
    # config/flags.py postpones annotations: the option's type is still the class.
    (device,) = ENTRY_POINT_OPTIONS
    assert (device.field, device.type, device.default) == ("device_memory_gb", float, None)
    assert device.annotation == float | None


def test_none_default_needs_an_optional_annotation():
    @dataclasses.dataclass
    class Bad:
        n: int = flag_field(None, check=check_positive_int, help="n")

    with pytest.raises(TypeError, match="n: a default of None"):
        options_of(Bad)

    @dataclasses.dataclass
    class AlsoBad:
        n: int | None = flag_field(1, check=check_positive_int, help="n")

    with pytest.raises(TypeError, match="n: a default of None"):
        options_of(AlsoBad)


@pytest.mark.parametrize("kw", [{}, {"check": check_positive_int, "choices": ("a",)}])
def test_flag_field_needs_a_check_or_choices(kw):
    with pytest.raises(TypeError, match="check or choices"):
        flag_field(1, help="h", **kw)


def test_options_import_neither_torch_nor_megatron():
    code = ("import sys, megatron_lrmoe.options.lrmoe, megatron_lrmoe.config.flags_table; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120,
                         check=True).stdout
    assert out.strip() == "[]"
