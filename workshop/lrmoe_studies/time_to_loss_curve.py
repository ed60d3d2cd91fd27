"""The time-to-loss curve: steps to the 100% training-loss target against the measured
retained fraction, per selection rule, every run paired with its seed's dropless run
(``bash benchmarks/studies/time_to_loss.sh --stage curve``; the stage:
``lrmoe_studies.time_to_loss.STAGES``).

Pairing: a run and its seed's dropless run share ``--seed`` (so the same initialisation
and data order) and ``--train-iters`` (so the same learning-rate schedule). The forward
is exact, so their first training losses agree; the pairing table shows the difference
as a check that the pair is one.

Per pair (``pair``):
  * retained: the steady-state retained fraction, the median over the run's LRMoE log
    intervals after the first (the first holds step 1, which plans before any placement:
    Megatron's static layout); 1 for a run without LRMoE;
  * steps: the first step whose smoothed training loss reaches the seed's 100% target,
    when it is at most the cap, ``cap_factor`` x the dropless run's steps; a run not
    there by the cap is "not reached", reported with its loss gap at the cap (its
    smoothed loss there less the target, absolute and relative to the target);
  * the validation loss at equal steps (the last evaluation at or before ``--steps``),
    and relative to the dropless run's;
  * the calls whose gamma the planner lowered to fit the memory budget (0: the budget
    did not bind, and the drop is what gamma asks).

Per point (``points``, one policy over its seeds): the medians and ranges of the above;
the steps ratio over the seeds that reached the target.

Pure: the runs' records and analysed figures in, numbers and tables out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from lrmoe_studies.time_to_loss_policies import REFERENCE, LRMoEPolicy
from megatron_lrmoe.tools.report import trailing_mean

__all__ = ["budget_adjusted_calls", "describe", "markdown", "ordered", "pair", "pairs", "points",
           "steady_retention"]

RunKey = tuple[str, int]        # (policy, seed)

SEEDS_RESOLVE = "Three seeds detect differences of about 15% in steps, not less."
"""What a point's range can tell (issue 48): said beside the curve's tables."""


def steady_retention(records: list[dict]) -> float | None:
    """The median retained fraction over the LRMoE log intervals after the first (None:
    the run logged no LRMoE statistics)."""
    retained = [r["lrmoe/retained-fraction"] for r in records if "lrmoe/retained-fraction" in r]
    return statistics.median(retained[1:] or retained) if retained else None


def budget_adjusted_calls(records: list[dict]) -> int:
    """Layer calls whose gamma the planner lowered to fit the memory budget, over the run."""
    return round(sum(r.get("lrmoe/budget-adjusted-calls", 0.0) for r in records))


def pair(records: list[dict], run: dict, dropless_records: list[dict], dropless: dict,
         target: float, window: int, cap_factor: float) -> dict:
    """A run against its seed's dropless run (the module docstring). ``run`` and
    ``dropless`` are their ``time_to_loss.analyse_run`` figures, ``target`` the seed's
    100% target, ``window`` the smoothing window."""
    dropless_hit = dropless["reached"][1.0]
    if dropless_hit is None:
        raise ValueError("the dropless run does not reach its own 100% target: its run is "
                         "shorter than --steps")
    dropless_steps = dropless_hit["step"]
    cap = int(cap_factor * dropless_steps)
    hit = run["reached"][1.0]
    steps = hit["step"] if hit and hit["step"] <= cap else None
    train = [r for r in records if "lm-loss" in r]
    smoothed = trailing_mean([r["lm-loss"] for r in train], window)
    at_cap = [loss for r, loss in zip(train, smoothed, strict=True) if r["iteration"] <= cap]
    gap = None if steps is not None or not at_cap else at_cap[-1] - target
    first = [r["lm-loss"] for r in dropless_records if "lm-loss" in r][:1]
    retained = steady_retention(records)
    return {
        "dropless_steps": dropless_steps, "cap": cap, "steps": steps,
        "steps_vs_dropless": None if steps is None else steps / dropless_steps,
        "loss_gap": gap, "loss_gap_rel": None if gap is None else gap / target,
        # A run shorter than the cap ends before it: its gap is at its last step.
        "gap_at": None if gap is None else train[len(at_cap) - 1]["iteration"],
        "retained": 1.0 if retained is None else retained,
        "val_at_steps": run["val_at_steps"],
        "val_vs_dropless": (run["val_at_steps"] / dropless["val_at_steps"] - 1.0
                            if run["val_at_steps"] and dropless["val_at_steps"] else None),
        "first_loss_diff": train[0]["lm-loss"] - first[0] if train and first else None,
        "budget_adjusted_calls": budget_adjusted_calls(records),
    }


def pairs(logs: Mapping[RunKey, list[dict]], per_run: Mapping[RunKey, dict],
          targets: Mapping[int, Mapping[float, float]], window: int,
          cap_factor: float) -> dict[RunKey, dict]:
    """``pair`` for every run whose seed has a dropless run (that run included)."""
    out = {}
    for (name, seed), run in per_run.items():
        if (REFERENCE, seed) in per_run:
            out[name, seed] = pair(logs[name, seed], run, logs[REFERENCE, seed],
                                   per_run[REFERENCE, seed], targets[seed][1.0], window,
                                   cap_factor)
    return out


def _spread(values: list[float]) -> dict | None:
    return {"median": statistics.median(values), "min": min(values),
            "max": max(values)} if values else None


def describe(name: str) -> dict:
    """A policy's rule, gamma and minimum retention, from its name (a policy without the
    LRMoE drop, dropless or a baseline: its name as its rule)."""
    try:
        policy = LRMoEPolicy.parse(name)
    except ValueError:
        return {"rule": name, "gamma": None, "min_retention": None}
    rule = policy.selection + (f" + {policy.metric}" if policy.metric else "")
    # An unnamed minimum retention is the launcher's default: 0, no floor.
    return {"rule": rule, "gamma": float(policy.gamma),
            "min_retention": float(policy.min_retention or 0.0)}


def points(paired: Mapping[RunKey, dict]) -> list[dict]:
    """One point per policy, over its seeds: dropless first, then by rule and gamma
    (largest first)."""
    out = []
    for name in sorted({n for n, _ in paired}):
        runs = [(seed, p) for (n, seed), p in sorted(paired.items()) if n == name]
        reached = [p["steps_vs_dropless"] for _, p in runs if p["steps"] is not None]
        out.append({
            "policy": name, **describe(name), "seeds": [seed for seed, _ in runs],
            "retained": _spread([p["retained"] for _, p in runs]),
            "reached": len(reached),
            "steps_vs_dropless": _spread(reached),
            "not_reached": {seed: {"loss_gap": p["loss_gap"], "loss_gap_rel": p["loss_gap_rel"]}
                            for seed, p in runs if p["steps"] is None},
            "val_vs_dropless": _spread([p["val_vs_dropless"] for _, p in runs
                                        if p["val_vs_dropless"] is not None]),
            "budget_adjusted_calls": sum(p["budget_adjusted_calls"] for _, p in runs),
        })
    return sorted(out, key=lambda p: (p["policy"] != REFERENCE, p["rule"],
                                      -(p["gamma"] or 0.0)))


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _range(s: dict | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    if s is None:
        return "-"
    median, low, high = (format(s[k] * scale, spec) + unit for k in ("median", "min", "max"))
    return f"{median} ({low} to {high})"


def ordered(paired: Mapping[RunKey, dict]) -> list[tuple[RunKey, dict]]:
    """The pairs by seed, dropless first, then by policy name."""
    return sorted(paired.items(), key=lambda kv: (kv[0][1], kv[0][0] != REFERENCE, kv[0][0]))


def markdown(paired: Mapping[RunKey, dict], cap_factor: float) -> str:
    """The curve's two tables, points then pairs, with what they mean."""
    lines = [
        "Points (one policy over its seeds; median and range): steady-state retained "
        "fraction (median over the LRMoE log intervals after the first, whose step 1 "
        "plans before any placement); steps to the 100% training target relative to the "
        "seed's dropless run (over the seeds that reached it); seeds not reaching it by "
        f"{cap_factor:g} x dropless's steps, with their smoothed loss gap to the target "
        "there; validation loss at equal steps relative to dropless; layer calls whose "
        "gamma the planner lowered to fit the memory budget (0: the budget did not bind). "
        + SEEDS_RESOLVE,
        "",
        "| policy | rule | gamma | min retention | retained | reached | steps vs dropless "
        "| not reached: loss gap at the cap | val loss @ steps vs dropless | budget-adjusted "
        "calls |",
        "|" + "---|" * 10,
    ]
    for p in points(paired):
        gaps = "; ".join(f"seed {seed}: {g['loss_gap']:+.4f} ({100 * g['loss_gap_rel']:+.2f}%)"
                         for seed, g in sorted(p["not_reached"].items())
                         if g["loss_gap"] is not None) or "-"
        lines.append("| " + " | ".join([
            p["policy"], p["rule"], _fmt(p["gamma"], "g"), _fmt(p["min_retention"], "g"),
            _range(p["retained"], ".3f"), f"{p['reached']}/{len(p['seeds'])}",
            _range(p["steps_vs_dropless"], ".2f"), gaps,
            _range(p["val_vs_dropless"], "+.2f", 100.0, "%"),
            str(p["budget_adjusted_calls"])]) + " |")
    lines += [
        "",
        "Pairs (each run and its seed's dropless run: the same seed, so the same "
        "initialisation and data order; \"first loss diff\": their step-1 training losses, "
        "equal up to rounding since the forward is exact):",
        "",
        "| seed | policy | dropless steps | cap | steps | vs dropless | loss gap at the cap "
        "| retained | val loss @ steps vs dropless | first loss diff |",
        "|" + "---|" * 10,
    ]
    for (name, seed), p in ordered(paired):
        lines.append("| " + " | ".join([
            str(seed), name, str(p["dropless_steps"]), str(p["cap"]),
            "not reached" if p["steps"] is None else str(p["steps"]),
            _fmt(p["steps_vs_dropless"], ".2f"), _fmt(p["loss_gap"], "+.4f"),
            _fmt(p["retained"], ".3f"),
            "-" if p["val_vs_dropless"] is None else f"{100 * p['val_vs_dropless']:+.2f}%",
            _fmt(p["first_loss_diff"], ".1e")]) + " |")
    return "\n".join(lines)
