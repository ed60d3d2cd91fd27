"""Which Megatron this plugin supports, defined once.

The subclasses, the CPU runtime's fixes and the Megatron-LM integration were read
against one release line; every version check in the package goes through here.
A core_v0.19.0 Megatron-LM checkout reports megatron-core 0.19.1, the registry's
wheel is 0.19.2: the check accepts the line (major.minor), not one patch release.
"""

from __future__ import annotations

import os
import re

from packaging.version import Version

#: The megatron-core release line every fix and subclass was read against.
SUPPORTED_LINE: tuple[int, int] = (0, 19)
#: What scripts/setup.sh installs (requirements/lock.txt).
MEGATRON_CORE_PIN = "megatron-core==0.19.2"
#: The Megatron-LM tag the patch, the wrapper and the opt-in tests are written for.
MEGATRON_LM_TAG = "core_v0.19.0"


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not of the supported release line."""


def supported(version: str | Version) -> bool:
    """Whether ``version`` (e.g. ``0.19.2+23e29ed``) is of the supported line."""
    release = Version(str(version)).release
    return tuple(release[:2]) == SUPPORTED_LINE


def line() -> str:
    """The supported line as text, e.g. ``0.19``."""
    return ".".join(map(str, SUPPORTED_LINE))


def check_megatron_core_version() -> Version:
    """The installed megatron-core's version; refuses any outside the supported line."""
    from megatron.core import package_info

    # __version__ may carry a "+<git hash>" that megatron-core reads from the folder
    # it is installed in; the short version is the release alone.
    installed = Version(getattr(package_info, "__shortversion__", package_info.__version__))
    if not supported(installed):
        raise UnsupportedMegatronVersion(
            f"megatron-lrmoe supports megatron-core {line()}.x, but {installed} is "
            f"installed: pip install {MEGATRON_CORE_PIN} (bash scripts/setup.sh installs "
            f"the pinned environment)"
        )
    return installed


def megatron_lm_version(root: str) -> str | None:
    """megatron-core version of a Megatron-LM checkout, read from its package_info.py
    (no import); None when ``root`` has none."""
    info = os.path.join(root, "megatron", "core", "package_info.py")
    if not os.path.isfile(info):
        return None
    with open(info) as f:
        text = f.read()
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None  # type: ignore[union-attr]
