"""``--config FILE``: a flat YAML mapping of the launcher's flag names to values.

The names are the flags without the leading dashes (``num-layers`` and ``num_layers``
both work); flags on the command line override the file; ``true``/``false`` switch
store-true flags. The Megatron-LM glue reads the same files (``config_to_flags``), so a
launcher config stays valid for both entry points.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import yaml

from megatron_lrmoe.config.flags import ConfigError

__all__ = ["load_yaml_config"]


def _flag_dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read a flat YAML of flag names to values into parser defaults (by dest)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: file not found")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a flat mapping of flag names to values")
    actions = _flag_dests(parser)
    defaults: dict[str, Any] = {}
    for key, value in raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"--config {path}: unknown flag {key!r}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key} is a switch, give true or false")
        elif value is not None and action.type is not None:
            if action.nargs in ("*", "+"):
                items = value if isinstance(value, list) else str(value).split()
                value = [action.type(str(v)) for v in items]
            else:
                value = action.type(value if isinstance(value, int | list) else str(value))
        elif action.nargs in ("*", "+") and value is not None and not isinstance(value, list):
            value = str(value).split()
        if action.choices is not None and value is not None and value not in action.choices:
            raise ConfigError(
                f"--config {path}: {key}={value!r} is not one of {list(action.choices)}"
            )
        defaults[dest] = value
    return defaults
