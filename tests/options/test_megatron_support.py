"""The supported Megatron line, checked once (megatron_lrmoe/options/megatron_support.py)."""

from __future__ import annotations

import re

import pytest

from megatron_lrmoe.options import megatron_support


@pytest.mark.parametrize("version", ["0.16.1", "0.18.0", "0.20.0rc0", "1.19.2"])
def test_refuses_megatron_outside_the_supported_line(monkeypatch, version):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__shortversion__", version)
    with pytest.raises(megatron_support.UnsupportedMegatronVersion,
                       match=rf"supports megatron-core 0\.19\.x, but {re.escape(version)} is "
                             r"installed: pip install megatron-core==0\.19\.2"):
        megatron_support.check_megatron_core_version()


@pytest.mark.parametrize("version", ["0.19.0", "0.19.1", "0.19.2", "0.19.3+abc1234"])
def test_accepts_the_supported_line(monkeypatch, version):
    # A core_v0.19.0 checkout says 0.19.1; the wheel 0.19.2, with a git hash when installed
    # inside a git work tree.
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__shortversion__", version)
    assert megatron_support.check_megatron_core_version().release[:2] == (0, 19)


def test_installed_megatron_is_the_pinned_one():
    pin = megatron_support.MEGATRON_CORE_PIN.split("==")[1]
    assert str(megatron_support.check_megatron_core_version()) == pin


def test_the_lock_pins_what_the_module_names():
    import os

    lock = os.path.join(os.path.dirname(__file__), "..", "..", "requirements", "lock.txt")
    with open(lock) as f:
        pins = [line.split()[0] for line in f if line.startswith("megatron-core==")]
    assert pins == [megatron_support.MEGATRON_CORE_PIN]


@pytest.mark.parametrize("files, expected", [
    ({"MAJOR": 0, "MINOR": 19, "PATCH": 1}, "0.19.1"),
    ({"MAJOR": 0, "MINOR": 16}, None),
])
def test_megatron_lm_version_reads_package_info(tmp_path, files, expected):
    info = tmp_path / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("".join(f"{k} = {v}\n" for k, v in files.items()))
    assert megatron_support.megatron_lm_version(str(tmp_path)) == expected
    assert megatron_support.megatron_lm_version(str(tmp_path / "nowhere")) is None
