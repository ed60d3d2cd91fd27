"""The time-to-loss study's model and policies: its config, the launcher flags of every
policy, and the memory budget that SYMI-style and memory-aware placement share.

The study's driver (``megatron_lrmoe.tools.time_to_loss``) and the layer profile
(``benchmarks/profile_moe_layer.py``) train the same model under the same policies;
both read them here, so a policy means one set of flags everywhere.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STUDY_CONFIG = "configs/time_to_loss.yaml"   # relative to ROOT, as the launcher flags name it
REFERENCE = "megatron-dropless"
SELECTIONS = ("topk", "sample", "uniform", "hybrid")


def policies(budget_gb: float | str) -> dict[str, list[str]]:
    """Policy name -> launcher flags. SYMI-style and memory-aware get the same budget
    (GiB, or ``auto``: the device less the rest of the memory account)."""
    budget = ["--moe-lrmoe-memory-budget-gb",
              budget_gb if isinstance(budget_gb, str) else f"{budget_gb:.6g}"]
    out = {
        REFERENCE: [],
        "megatron-capacity-1.0": ["--moe-expert-capacity-factor", "1.0"],
        "symi": ["--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
                 "--moe-lrmoe-bwd-capacity-factor", "inf", *budget],
    }
    for selection in SELECTIONS:
        for gamma in ("1.0", "0.75"):
            name = f"lrmoe-{selection}-g{gamma}"
            flags = ["--moe-lrmoe", "--moe-lrmoe-selection", selection,
                     "--moe-lrmoe-bwd-capacity-factor", gamma]
            out[name] = flags
            out[name + "-ma"] = flags + ["--moe-lrmoe-placement", "memory-aware", *budget]
    # A convergence lever (docs/benchmarks.md, "Retention bias"): a minimum retention per
    # expert lowers the hot experts' estimator variance.
    flags = ["--moe-lrmoe", "--moe-lrmoe-selection", "uniform",
             "--moe-lrmoe-bwd-capacity-factor", "0.75", "--moe-lrmoe-min-retention", "0.25"]
    out["lrmoe-uniform-g0.75-m0.25"] = flags
    out["lrmoe-uniform-g0.75-m0.25-ma"] = flags + ["--moe-lrmoe-placement", "memory-aware",
                                                   *budget]
    # The planner's range (benchmarks/results/planner_ep16_cpu/): no drop unless memory
    # needs it (gamma inf), and a deep drop (0.5); memory-aware only.
    for gamma in ("inf", "0.5"):
        out[f"lrmoe-uniform-g{gamma}-ma"] = [
            "--moe-lrmoe", "--moe-lrmoe-selection", "uniform",
            "--moe-lrmoe-bwd-capacity-factor", gamma, "--moe-lrmoe-placement", "memory-aware",
            *budget]
    return out


def study_budget_gb(base_flags: list[str], extra_instances: float) -> float:
    """Balanced dropless need of the configured shape plus ``extra_instances`` expert
    instances per layer and rank (GiB), from the cost model (memory only)."""
    from megatron_lrmoe.integration.planner_inputs import GIB, machine_constants, moe_shape
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.run_config import transformer_config_from_args
    from megatron_lrmoe.planning.cost_model import CostModel

    # Validate as the runs will be: one rank per expert-parallel rank.
    os.environ["WORLD_SIZE"] = str(world_size(base_flags))
    args = parse_args(base_flags + ["--moe-lrmoe"])
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
