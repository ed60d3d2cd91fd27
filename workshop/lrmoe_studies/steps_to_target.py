"""Steps-to-target files from a time-to-loss study, and the spread of their ratios.

    python -m lrmoe_studies.steps_to_target \\
        benchmarks/results/time_to_loss/ep_study_ep16/held/confirm --out FILE.json

A study directory (its ``report.json`` and ``runs/*/done.json``, as
``lrmoe_studies.time_to_loss`` writes them) becomes a file in the format
``simulate.read_steps_to_target`` reads: per seed, the fastest run of each baseline's
family to the 100% target (fewest MoE seconds: the run the report's ratio columns compare
with; in a held study its fastest fitted configuration), LRMoE's run (``--lrmoe``: the
study's one LRMoE policy unless named), each paired with that seed's fastest dropless
run's steps. Simulator policies: ``capacity-drop`` (``megatron-capacity-1.0``), ``symi``,
``lrmoe-ma`` (LRMoE's run). A run that did not reach the target within its steps has no
steps to give: the command stops, or with ``--allow-unreached`` leaves that seed's pair
out and lists it under ``"unreached"``.

Spread (``ratio_range``, ``paired_range``): a policy's steps ratio to dropless as the
median and [min, max] of its per-seed ratios; one policy's over another's per seed where
both name the same seeds, else the conservative cross range.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from lrmoe_studies.paths import ROOT
from lrmoe_studies.time_to_loss import UNCONSTRAINED, family
from lrmoe_studies.time_to_loss_policies import REFERENCE
from megatron_lrmoe.tools.simulate import StepsPair

__all__ = ["STUDY_POLICIES", "Range", "from_study", "paired_range", "ratio_range"]

STUDY_POLICIES = {"capacity-drop": "megatron-capacity-1.0", "symi": "symi"}
"""Simulator policy -> the study's baseline family (LRMoE's run: ``lrmoe-ma``)."""
LRMOE = "lrmoe-ma"


@dataclass(frozen=True)
class Range:
    """A ratio's median and [low, high] over seeds."""

    median: float
    low: float
    high: float

    def scale(self, factor: float) -> Range:
        return Range(self.median * factor, self.low * factor, self.high * factor)

    def text(self, spec: str = ".3f") -> str:
        return f"{self.median:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def ratio_range(pairs: tuple[StepsPair, ...]) -> Range:
    """Steps / the same seed's dropless steps: median, min and max over the pairs."""
    ratios = [p.steps / p.dropless_steps for p in pairs]
    return Range(statistics.median(ratios), min(ratios), max(ratios))


def paired_range(a: tuple[StepsPair, ...], b: tuple[StepsPair, ...]) -> tuple[Range, str]:
    """Steps ratio of policy ``a`` over policy ``b`` and how it was formed. Where every
    pair of both names its seed and the two name the same seeds: per seed, a's ratio to
    its dropless run over b's (the same run, so a's steps over b's), median and range
    over the seeds ("per seed"). Otherwise the conservative cross range: a's median over
    b's median, a's lowest ratio over b's highest to a's highest over b's lowest
    ("cross")."""
    seeds_a = {p.seed: p for p in a}
    seeds_b = {p.seed: p for p in b}
    if (None not in seeds_a and None not in seeds_b and len(seeds_a) == len(a)
            and len(seeds_b) == len(b) and seeds_a.keys() == seeds_b.keys()):
        ratios = [(seeds_a[s].steps / seeds_a[s].dropless_steps)
                  / (seeds_b[s].steps / seeds_b[s].dropless_steps) for s in seeds_a]
        return Range(statistics.median(ratios), min(ratios), max(ratios)), "per seed"
    ra, rb = ratio_range(a), ratio_range(b)
    return Range(ra.median / rb.median, ra.low / rb.high, ra.high / rb.low), "cross"


def _done(study: Path, run: str) -> dict:
    path = study / "runs" / run / "done.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _flag(command: str, flag: str) -> str | None:
    words = shlex.split(command) if command else []
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def from_study(study: Path, lrmoe: str | None = None,
               allow_unreached: bool = False) -> dict:
    """The steps-to-target document of a time-to-loss study directory (module doc).
    Raises ValueError naming the option or the field at fault."""
    report = study / "report.json"
    try:
        rows = json.loads(report.read_text())["per_seed"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"STUDY {study}: expected the study's report.json with "
                         f"\"per_seed\" rows ({e})") from e
    rows = [r for r in rows if not r["policy"].startswith(UNCONSTRAINED)]
    lrmoe_families = sorted({family(r["policy"]) for r in rows
                             if family(r["policy"]).startswith("lrmoe-")})
    if lrmoe is None:
        if len(lrmoe_families) != 1:
            raise ValueError(f"--lrmoe: the study has LRMoE policies "
                             f"{', '.join(lrmoe_families) or 'none'}; name the one to use")
        lrmoe = lrmoe_families[0]
    elif lrmoe not in lrmoe_families:
        raise ValueError(f"--lrmoe {lrmoe}: not among the study's LRMoE policies "
                         f"({', '.join(lrmoe_families) or 'none'})")
    families = {REFERENCE: REFERENCE, **STUDY_POLICIES, LRMOE: lrmoe}
    seeds = sorted({r["seed"] for r in rows})
    policies: dict[str, dict] = {name: {"study_policy": families[name], "pairs": []}
                                 for name in (*STUDY_POLICIES, LRMOE)}
    unreached: list[str] = []
    eps: set[str] = set()
    for seed in seeds:
        fastest: dict[str, dict | None] = {}
        for name, fam in families.items():
            runs = [r for r in rows if r["seed"] == seed and family(r["policy"]) == fam]
            reached = [r for r in runs if r["steps"] is not None]
            fastest[name] = min(reached, key=lambda r: r["moe_s"]) if reached else None
            if runs and not reached:
                unreached.append(f"{fam} seed {seed}")
        ref = fastest.pop(REFERENCE)
        for name, hit in fastest.items():
            if hit is None or ref is None:
                continue
            run, ref_run = (f"{x['policy']}-s{seed}" for x in (hit, ref))
            done, ref_done = _done(study, run), _done(study, ref_run)
            data = _flag(ref_done.get("command", ""), "--data-path")
            eps.update(e for e in (_flag(d.get("command", ""), "--expert-model-parallel-size")
                                   for d in (done, ref_done)) if e)
            policies[name]["pairs"].append({
                "corpus": data and Path(data).name, "seed": seed, "steps": hit["steps"],
                "dropless_steps": ref["steps"], "run": f"runs/{run}",
                "dropless_run": f"runs/{ref_run}",
                "code": done.get("code", "not recorded").removeprefix("commit ")})
    if unreached and not allow_unreached:
        raise ValueError(f"STUDY {study}: did not reach the 100% target within the run: "
                         f"{'; '.join(unreached)} (--allow-unreached leaves those seeds' "
                         "pairs out and lists them)")
    empty = [n for n, e in policies.items() if not e["pairs"]]
    if empty:
        raise ValueError(f"STUDY {study}: no seed gives a pair for {', '.join(empty)} "
                         "(a run of the policy and of dropless that reached the target)")
    if len(eps) > 1:
        raise ValueError(f"STUDY {study}: runs at different EP sizes ({', '.join(eps)})")
    try:
        root = str(study.resolve().relative_to(ROOT))
    except ValueError:
        root = str(study)
    return {
        "what": "Steps to the 100% loss target per simulator policy, each seed's fastest "
                "run of the policy's family to it (fewest MoE seconds; in a held study its "
                "fastest fitted configuration) paired with the same seed's fastest dropless "
                "run's steps. A policy's steps-to-target ratio is steps / dropless_steps "
                "per pair (dropless: 1 by definition).",
        "study": f"time-to-loss study {root}",
        "fields": "per pair: corpus (the runs' --data-path) and seed; steps: the policy's "
                  "run's steps to the target; dropless_steps: the same seed's dropless "
                  "run's; run, dropless_run: their directories under root; code: the "
                  "commit of the policy's run (its done.json)",
        "root": root,
        "ep": int(next(iter(eps))) if eps else None,
        "sources": {"study": f"{root}/report.json (per_seed)"},
        "unreached": unreached,
        "used_by": "python -m lrmoe_studies.projections --steps-to-target-by-ep",
        "policies": policies,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrmoe_studies.steps_to_target",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("study", type=Path, metavar="STUDY",
                    help="a time-to-loss study directory (report.json, runs/)")
    ap.add_argument("--lrmoe", default=None,
                    help="the study's LRMoE policy (default: its only one)")
    ap.add_argument("--allow-unreached", action="store_true",
                    help="leave out seeds whose run did not reach the target (listed)")
    ap.add_argument("--out", type=Path, required=True, help="the steps-to-target file")
    a = ap.parse_args(argv)
    try:
        doc = from_study(a.study, a.lrmoe, a.allow_unreached)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    doc["command"] = shlex.join(["python", "-m", "lrmoe_studies.steps_to_target",
                                 *(sys.argv[1:] if argv is None else argv)])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, entry in doc["policies"].items():
        pairs = tuple(StepsPair(p["steps"], p["dropless_steps"]) for p in entry["pairs"])
        print(f"{name} ({entry['study_policy']}): {len(pairs)} seed(s), steps ratio to "
              f"dropless {ratio_range(pairs).text()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
