"""The time-to-loss study's model and policies: its config, the launcher flags of every
policy, and the memory budget that SYMI-style and memory-aware placement share.

The study's driver (``lrmoe_studies.time_to_loss``) and the layer profile
(``benchmarks/profile_moe_layer.py``) train the same model under the same policies;
both read them here, so a policy means one set of flags everywhere.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lrmoe.options.lrmoe import check_capacity_factor, check_fraction, option

ROOT = Path(__file__).resolve().parents[2]
STUDY_CONFIG = "configs/time_to_loss.yaml"   # relative to ROOT, as the launcher flags name it
REFERENCE = "megatron-dropless"
SELECTIONS = option("moe_lrmoe_selection").choices
METRICS = option("moe_lrmoe_metric").choices

LRMOE_NAME = "lrmoe-<selection>[-<metric>]-g<gamma>[-m<min retention>][-ma]"
"""How an LRMoE policy's name spells its flags (``LRMoEPolicy``), e.g.
``lrmoe-uniform-g0.45-ma`` or ``lrmoe-sample-prob-g0.45-ma``."""
# A selection may hold a hyphen (two-stage): the option's choices are tried first, longest
# first, then any word (refused by name in ``parse``).
_SELECTION = "|".join(map(re.escape, sorted(SELECTIONS, key=len, reverse=True)))
_LRMOE_NAME = re.compile(rf"lrmoe-(?P<selection>{_SELECTION}|[a-z_]+)(?:-(?P<metric>[a-z_]+))?"
                         r"-g(?P<gamma>inf|\d[\d.]*)(?:-m(?P<min_retention>\d[\d.]*))?"
                         r"(?P<memory_aware>-ma)?")


@dataclass(frozen=True)
class LRMoEPolicy:
    """An LRMoE policy, parsed from its name (``LRMOE_NAME``). Numbers stay as written,
    since the name is also the run's directory: ``g1.0`` and ``g1`` are two runs."""

    selection: str
    gamma: str
    metric: str | None = None            # None: the launcher's default metric
    min_retention: str | None = None     # None: the launcher's default (no floor)
    memory_aware: bool = False

    @classmethod
    def parse(cls, name: str) -> LRMoEPolicy:
        """The policy ``name`` spells; ValueError naming the part that is wrong."""
        match = _LRMOE_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"policy {name!r}: neither a baseline "
                             f"({', '.join(BASELINE_POLICIES)}) nor of the form {LRMOE_NAME}")
        policy = cls(match["selection"], match["gamma"], match["metric"],
                     match["min_retention"], bool(match["memory_aware"]))
        if policy.selection not in SELECTIONS:
            raise ValueError(f"policy {name!r}: selection {policy.selection!r} is not one of "
                             f"{', '.join(SELECTIONS)} (--moe-lrmoe-selection)")
        if policy.metric is not None and policy.metric not in METRICS:
            raise ValueError(f"policy {name!r}: metric {policy.metric!r} is not one of "
                             f"{', '.join(METRICS)} (--moe-lrmoe-metric)")
        for flag, value, check in (
                ("--moe-lrmoe-bwd-capacity-factor", policy.gamma, check_capacity_factor),
                ("--moe-lrmoe-min-retention", policy.min_retention, check_fraction)):
            try:
                problem = None if value is None else check(float(value))
            except ValueError:
                problem = f"not a number: {value!r}"
            if problem:
                raise ValueError(f"policy {name!r}: {flag}: {problem}")
        return policy

    @property
    def name(self) -> str:
        return "".join([f"lrmoe-{self.selection}", f"-{self.metric}" if self.metric else "",
                        f"-g{self.gamma}",
                        f"-m{self.min_retention}" if self.min_retention else "",
                        "-ma" if self.memory_aware else ""])

    def flags(self, budget: list[str]) -> list[str]:
        """Its launcher flags; memory-aware places under ``budget`` (the budget flag)."""
        return ["--moe-lrmoe", "--moe-lrmoe-selection", self.selection,
                *(["--moe-lrmoe-metric", self.metric] if self.metric else []),
                "--moe-lrmoe-bwd-capacity-factor", self.gamma,
                *(["--moe-lrmoe-min-retention", self.min_retention]
                  if self.min_retention else []),
                *(["--moe-lrmoe-placement", "memory-aware", *budget]
                  if self.memory_aware else [])]


BASELINE_POLICIES = (REFERENCE, "megatron-capacity-1.0", "symi")
LISTED = (
    *BASELINE_POLICIES,
    *(f"lrmoe-{selection}-g{gamma}{placement}" for selection in SELECTIONS
      for gamma in ("1.0", "0.75") for placement in ("", "-ma")),
    # A convergence lever (docs/benchmarks.md, "Retention bias"): a minimum retention per
    # expert lowers the hot experts' estimator variance.
    "lrmoe-uniform-g0.75-m0.25", "lrmoe-uniform-g0.75-m0.25-ma",
    # The planner's range (benchmarks/results/planner_ep16_cpu/): no drop unless memory
    # needs it (gamma inf), and a deep drop (0.5); memory-aware only.
    "lrmoe-uniform-ginf-ma", "lrmoe-uniform-g0.5-ma",
)
"""The policies ``--list`` shows and a study without ``--policies`` runs; any other
LRMoE policy is named by its flags (``LRMOE_NAME``)."""


class Policies(Mapping[str, list[str]]):
    """Policy name -> launcher flags: the listed policies (iteration, ``--list``) and any
    LRMoE policy its name spells (lookup). SYMI-style and memory-aware get the same budget
    (GiB, or ``auto``: the device less the rest of the memory account)."""

    def __init__(self, budget_gb: float | str) -> None:
        self.budget = ["--moe-lrmoe-memory-budget-gb",
                       budget_gb if isinstance(budget_gb, str) else f"{budget_gb:.6g}"]

    def __getitem__(self, name: str) -> list[str]:
        if name in BASELINE_POLICIES:
            return {REFERENCE: [],
                    "megatron-capacity-1.0": ["--moe-expert-capacity-factor", "1.0"],
                    # Drops nothing: uniform at gamma inf keeps no bookkeeping of a drop.
                    "symi": ["--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
                             "--moe-lrmoe-selection", "uniform",
                             "--moe-lrmoe-bwd-capacity-factor", "inf", *self.budget]}[name]
        try:
            return LRMoEPolicy.parse(name).flags(self.budget)
        except ValueError as error:
            raise KeyError(name) from error

    def __iter__(self) -> Iterator[str]:
        return iter(LISTED)

    def __len__(self) -> int:
        return len(LISTED)

    @staticmethod
    def problem(name: str) -> str | None:
        """Why ``name`` is not a policy (None: it is one)."""
        if name in BASELINE_POLICIES:
            return None
        try:
            LRMoEPolicy.parse(name)
        except ValueError as error:
            return str(error)
        return None


def policies(budget_gb: float | str) -> Policies:
    """Policy name -> launcher flags under the budget ``budget_gb`` (``Policies``)."""
    return Policies(budget_gb)


def study_budget_gb(base_flags: list[str], extra_instances: float) -> float:
    """Balanced dropless need of the configured shape plus ``extra_instances`` expert
    instances per layer and rank (GiB), from the cost model (memory only)."""
    from megatron_lrmoe.integration.planner_inputs import machine_constants, moe_shape
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.run_config import transformer_config_from_args
    from megatron_lrmoe.planning.cost_model import CostModel
    from megatron_lrmoe.planning.memory_account import GIB

    # Validate as the runs will be: one rank per expert-parallel rank.
    # The shape only: mock data, so that the corpus need not be prepared yet.
    args = parse_args(without_flags(base_flags, ("--data-path", "--data-cache-path"))
                      + ["--moe-lrmoe", "--mock-data"], world_size(base_flags))
    shape = moe_shape(transformer_config_from_args(args),
                      args.micro_batch_size * args.seq_length)
    cost = CostModel(shape, machine_constants(None, "cpu"))
    extra = extra_instances * shape.instance_bytes * shape.num_layers
    return (cost.balanced_dropless_need() + extra) / GIB



def config_value(name: str, config: str = STUDY_CONFIG) -> Any:
    """A value of a study's model config (by default configs/time_to_loss.yaml)."""
    return _study_config(config)[name]


@functools.lru_cache(maxsize=4)
def _study_config(config: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / config).read_text())


def without_flags(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """``flags`` less each flag of ``names`` and the value that follows it."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in names:
            skip = True
        else:
            out.append(f)
    return out


def _last(flags: list[str], flag: str) -> str | None:
    if flag not in flags:
        return None
    return flags[len(flags) - 1 - flags[::-1].index(flag) + 1]


def flag_or_config(flags: list[str], name: str) -> Any:
    """The last value of ``--name`` in ``flags``, else that of the config the flags name
    (``--config``; without one, the time-to-loss study's): the launcher lets later flags
    override earlier ones and the config."""
    value = _last(flags, "--" + name)
    return value if value is not None else config_value(
        name, _last(flags, "--config") or STUDY_CONFIG)


def world_size(flags: list[str]) -> int:
    """The ranks a study's run starts (``--nproc-per-node``): one per expert-parallel rank
    of its one data-parallel group, times tensor and pipeline parallelism (1 unless set)."""
    config = _study_config(_last(flags, "--config") or STUDY_CONFIG)

    def size(name: str, default: int | None) -> int:
        value = _last(flags, "--" + name) or config.get(name, default)
        if value is None:
            raise SystemExit(f"--{name}: neither the flags nor the study config "
                             f"({_last(flags, '--config') or STUDY_CONFIG}) set it; give it "
                             "(the time-to-loss driver: --ep)")
        return int(value)

    return (size("expert-model-parallel-size", None) * size("tensor-model-parallel-size", 1)
            * size("pipeline-model-parallel-size", 1))
