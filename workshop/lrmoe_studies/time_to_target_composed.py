"""MoE-layer time to target, composed: the time-to-loss curve's steps ratios (measured at
the EP 8 study model) times the simulator's MoE seconds per step at the same policy at a
recipe's scale (``projections.GOAL_PRESET``, Qwen3-30B-A3B on 16 x H100), relative to the
fitted SYMI-style and the fitted dropless.

    python -m lrmoe_studies.time_to_target_composed --curve CURVE/report.json \\
        --out CURVE/composed     # CURVE: the curve stage's --out-dir, its report written

Per curve run (a policy at a seed, ``compose``):
  * steps: the run's steps to its seed's 100% training target over the seed's dropless
    run's (the curve's pairs). SYMI-style and LRMoE at gamma inf drop nothing, so they
    train as dropless does (the same gradients up to rounding): their steps ratio is 1;
  * per step: the policy's MoE seconds per step at its fitting choice over the fitting
    choice's of dropless and of SYMI-style (``projections.project`` under the device's
    memory, the policy's flags as the curve ran them with the ``auto`` budget);
  * time to target: the product. A run that did not reach the target by the curve's cap
    has none, and is counted.

Per rule (``fit_rule``): a quadratic in the retained fraction r, t(r) = a + b r + c r^2,
fitted by least squares to every seed's time to target (vs dropless) at its measured
steady-state retention (fewer distinct r than three: the line or the constant). The
minimum is read from the fit over the measured range of r (no extrapolation); its range
over seeds is each seed's own fit of the same form evaluated there. Against SYMI-style the
figures are the same fits scaled by dropless's MoE seconds over SYMI-style's.

The default's conditions (``default_checks``, at each rule's measured point nearest its
fitted minimum): validation loss at equal steps within ``VAL_MEDIAN_LIMIT`` of dropless
at the median over seeds, and no seed's further from its dropless run than the dropless
seeds' own spread ((max - min) / median of their validation losses).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from lrmoe_studies import fitting as F
from lrmoe_studies import projections as P
from lrmoe_studies.steps_to_target import Range
from lrmoe_studies.time_to_loss_curve import describe
from lrmoe_studies.time_to_loss_policies import REFERENCE, Policies
from megatron_lrmoe.tools.figures import pyplot, save_png
from megatron_lrmoe.tools.provenance import code_version

__all__ = ["BASELINES", "GOAL", "VAL_MEDIAN_LIMIT", "compose", "compose_curve",
           "default_checks", "fit", "fit_minimum", "fit_rule", "goal_verdict", "markdown",
           "plot", "policy_table", "project_curve"]

GOAL = P.GOAL
"""Composed MoE time to target over the fitted SYMI-style's and dropless's: at most this
over the seeds' range (``projections.GOAL``)."""
VAL_MEDIAN_LIMIT = 0.01
"""Validation loss at equal steps: at most this above dropless's, at the median."""
NO_DROP = P.ma_policy("inf")
"""LRMoE memory-aware at gamma inf: placement alone, the curve's retention 1."""
BASELINES = (REFERENCE, "symi")


def policy_table(names: list[str]) -> dict[str, tuple[str, tuple[str, ...], str | None]]:
    """``projections.POLICIES``' form for the baselines, LRMoE at gamma inf and the curve's
    LRMoE policies ``names`` (their flags as the curve ran them, under the ``auto``
    budget: the device less the rest of the memory account)."""
    flags = Policies("auto")
    table = {name: P.POLICIES[name] for name in (*BASELINES, NO_DROP)}
    for name in names:
        d = describe(name)
        table[name] = (f"LRMoE {d['rule']}, gamma {d['gamma']:g}, memory-aware",
                       tuple(flags[name]), None)
    return table


def project_curve(names: list[str], steps: int, planner_s: float | None,
                  log=lambda _: None) -> tuple[dict, dict[str, P.Projection]]:
    """The preset's context and each policy's projection (``policy_table``) at
    ``projections.GOAL_PRESET``."""
    preset = P.PRESETS[P.GOAL_PRESET]
    traces, source = P.preset_traces(preset)
    table = policy_table(names)
    context, rows = P.project(preset, traces, steps=steps, policies=tuple(table),
                              largest_limit=0, planner_s=planner_s, log=log, table=table)
    return context | {"routing": source}, {r.policy: r for r in rows}


def compose(pairs: list[dict], per_step: Mapping[str, float]) -> list[dict]:
    """Per curve run with a per-step figure: its steps ratio, its MoE seconds per step over
    dropless's (``per_step``: policy -> ratio), and their product (None: not reached)."""
    out = []
    for p in pairs:
        if p["policy"] == REFERENCE or p["policy"] not in per_step:
            continue
        steps = p["steps_vs_dropless"]
        out.append({"policy": p["policy"], "seed": p["seed"], "retained": p["retained"],
                    "steps_vs_dropless": steps, "moe_step_vs_dropless": per_step[p["policy"]],
                    "time_vs_dropless": None if steps is None else steps * per_step[p["policy"]],
                    "val_vs_dropless": p["val_vs_dropless"]})
    return out


def fit(x: list[float], y: list[float]) -> np.ndarray:
    """Least-squares polynomial coefficients (highest power first) of degree 2, or lower
    where fewer distinct x leave it undetermined."""
    degree = min(2, len(set(x)) - 1)
    if degree < 0:
        raise ValueError("fit: no points")
    return np.polyfit(np.asarray(x, float), np.asarray(y, float), degree)


def fit_minimum(coef: np.ndarray, lo: float, hi: float) -> tuple[float, float]:
    """(x, value) of the polynomial's minimum over [lo, hi]: an end, or a quadratic's
    vertex inside."""
    candidates = [lo, hi]
    if len(coef) == 3 and coef[0] > 0:
        vertex = -coef[1] / (2 * coef[0])
        if lo < vertex < hi:
            candidates.append(float(vertex))
    values = [float(np.polyval(coef, x)) for x in candidates]
    i = int(np.argmin(values))
    return candidates[i], values[i]


def fit_rule(runs: list[dict]) -> dict:
    """One rule's runs (``compose``'s, reached ones used): the pooled fit, its minimum over
    the measured retention range, and the per-seed fits' range there."""
    used = [r for r in runs if r["time_vs_dropless"] is not None]
    x = [r["retained"] for r in used]
    y = [r["time_vs_dropless"] for r in used]
    coef = fit(x, y)
    lo, hi = min(x), max(x)
    at, value = fit_minimum(coef, lo, hi)
    per_seed = {}
    for seed in sorted({r["seed"] for r in used}):
        mine = [r for r in used if r["seed"] == seed]
        c = fit([r["retained"] for r in mine], [r["time_vs_dropless"] for r in mine])
        per_seed[seed] = float(np.polyval(c, at))
    return {"coefficients": [float(c) for c in coef], "degree": len(coef) - 1,
            "retained_range": [lo, hi], "runs": len(used),
            "not_reached": len(runs) - len(used), "minimum_at": at, "minimum": value,
            "seeds_at_minimum": per_seed}


def default_checks(points: list[dict], pairs: list[dict], rule: str, at: float) -> dict:
    """The default's validation conditions (module doc) at ``rule``'s measured point whose
    median retention lies nearest ``at``."""
    mine = [p for p in points if p["rule"] == rule and p["retained"]]
    point = min(mine, key=lambda p: abs(p["retained"]["median"] - at))
    dropless = [p["val_at_steps"] for p in pairs
                if p["policy"] == REFERENCE and p.get("val_at_steps")]
    spread = (max(dropless) - min(dropless)) / statistics.median(dropless)
    seeds = {p["seed"]: p["val_vs_dropless"] for p in pairs if p["policy"] == point["policy"]}
    median = point["val_vs_dropless"]["median"]
    return {"policy": point["policy"], "val_median": median,
            "val_median_ok": median <= VAL_MEDIAN_LIMIT, "dropless_spread": spread,
            "val_seeds": seeds,
            "val_seeds_ok": all(abs(v) <= spread for v in seeds.values())}


def goal_verdict(f: dict, dropless_over_symi: float) -> str:
    """``projections.goal_check``'s levels for a rule's fitted minimum (``fit_rule``), the
    range its seeds' fits span there, against both baselines: the weaker of the two."""
    seeds = list(f["seeds_at_minimum"].values())
    span = Range(f["minimum"], min(seeds + [f["minimum"]]), max(seeds + [f["minimum"]]))
    return P.GOAL_LEVELS[min(P.goal_level(span.scale(s), GOAL) for s in (1.0, dropless_over_symi))]


def compose_curve(curve: dict, choices: Mapping[str, F.Prediction | None]) -> dict:
    """The composed figure from the curve report's ``curve`` and each policy's fitting
    choice at the preset (``project_curve``; None: fits nothing): per policy the rows
    of ``markdown``, per rule the fit (``fit_rule``) and the default's conditions."""
    names = [p["policy"] for p in curve["points"] if p["policy"] != REFERENCE]
    moe = {n: c.moe_s for n, c in choices.items() if c is not None}
    per_step = {n: moe[n] / moe[REFERENCE] for n in moe}
    runs = compose(curve["pairs"], per_step)
    rows = []
    for name in (NO_DROP, *names):
        c = choices.get(name)
        if c is None:
            continue
        mine = [x for x in runs if x["policy"] == name]
        reached = [x for x in mine if x["time_vs_dropless"] is not None]
        rows.append({
            "policy": name, "rule": describe(name)["rule"],
            # No curve run (gamma inf): retention 1 and steps 1, as dropless trains.
            "retained": [x["retained"] for x in mine] or [1.0],
            "retained_sim": c.retained, "replicas": c.replicas,
            "fitted": c.candidate.fitted, "moe_step_vs_dropless": per_step[name],
            "steps_vs_dropless": [x["steps_vs_dropless"] for x in reached] or (
                [] if mine else [1.0]),
            "time_vs_dropless": [x["time_vs_dropless"] for x in reached] or (
                [] if mine else [per_step[name]]),
            "not_reached": len(mine) - len(reached)})
    fits = {}
    for rule in sorted({describe(n)["rule"] for n in names}):
        mine = [x for x in runs if describe(x["policy"])["rule"] == rule]
        if any(x["time_vs_dropless"] is not None for x in mine):
            f = fit_rule(mine)
            fits[rule] = f | {"checks": default_checks(curve["points"], curve["pairs"], rule,
                                                       f["minimum_at"])}
    return {"preset": P.GOAL_PRESET, "dropless_over_symi": moe[REFERENCE] / moe["symi"],
            "fitted": {n: choices[n].candidate.fitted for n in BASELINES},
            "moe_s_per_step": moe, "rows": rows, "runs": runs, "fits": fits}


def _r(values: list[float]) -> str:
    return (f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"
            if values else "-")


def markdown(result: dict) -> str:
    """The composed figure's tables (``main``'s result)."""
    symi = result["dropless_over_symi"]
    lines = [
        f"MoE-layer time to target at {result['preset']} (per step: the simulator at each "
        "policy's fitting choice; steps: the EP 8 curve's runs over their seed's dropless "
        "run), relative to the fitted dropless and the fitted SYMI-style. Median [min, "
        "max] over the seeds that reached the target. SYMI-style and LRMoE at gamma inf "
        "drop nothing and train as dropless: steps ratio 1.",
        "",
        "| policy | rule | retained (curve) | retained (simulated) | replicas / layer "
        "| MoE per step vs dropless | vs SYMI-style | steps vs dropless | time to target "
        "vs dropless | vs SYMI-style | not reached |",
        "|" + "---|" * 11,
    ]
    for row in result["rows"]:
        t = row["time_vs_dropless"]
        lines.append("| " + " | ".join([
            row["policy"], row["rule"], _r(row["retained"]), f"{row['retained_sim']:.3f}",
            f"{row['replicas']:.1f}", f"{row['moe_step_vs_dropless']:.3f}",
            f"{row['moe_step_vs_dropless'] * symi:.3f}", _r(row["steps_vs_dropless"]),
            _r(t), _r([v * symi for v in t]), str(row["not_reached"])]) + " |")
    lines += [
        "",
        "Fits per rule: t(r) = a + b r + c r^2 over every seed's time to target (vs "
        "dropless) at its measured retention r, least squares; the minimum over the "
        "measured range of r; the range over seeds: each seed's own fit there.",
        "",
        "| rule | runs | fit (a, b, c) | minimum at r | time to target vs dropless "
        f"| vs SYMI-style | goal (<= {GOAL:.2f} over the range) | val @ steps vs dropless "
        "(nearest point) | default conditions |",
        "|" + "---|" * 9,
    ]
    for rule, f in result["fits"].items():
        seeds = list(f["seeds_at_minimum"].values())
        goal = goal_verdict(f, symi)
        c = f["checks"]
        ok = c["val_median_ok"] and c["val_seeds_ok"]
        lines.append("| " + " | ".join([
            rule, f"{f['runs']} (+{f['not_reached']} not reached)",
            ", ".join(f"{v:.3g}" for v in reversed(f["coefficients"])),
            f"{f['minimum_at']:.3f}",
            f"{f['minimum']:.3f} [{min(seeds):.3f}, {max(seeds):.3f}]",
            f"{f['minimum'] * symi:.3f} [{min(seeds) * symi:.3f}, {max(seeds) * symi:.3f}]",
            goal, f"{c['policy']}: {100 * c['val_median']:+.2f}% (seeds "
            + ", ".join(f"{100 * v:+.2f}%" for v in c["val_seeds"].values()) + ")",
            ("met" if ok else "not met") + f" (median <= {100 * VAL_MEDIAN_LIMIT:g}%, "
            f"seeds within the dropless spread {100 * c['dropless_spread']:.1f}%)"]) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Time to target against retained fraction, one line per rule (its fit), each point's
    range over seeds shaded, vs dropless (left) and vs SYMI-style (right). LRMoE at gamma
    inf (no drop) stands with the uniform points at retention 1, outside the fit."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, scale, name in ((axes[0], 1.0, "dropless"),
                            (axes[1], result["dropless_over_symi"], "SYMI-style")):
        for i, (rule, f) in enumerate(result["fits"].items()):
            color = f"C{i}"
            rows = sorted((r for r in result["rows"] if r["rule"] == rule and r["retained"]
                           and r["time_vs_dropless"]),
                          key=lambda r: statistics.median(r["retained"]))
            x = [statistics.median(r["retained"]) for r in rows]
            ax.fill_between(x, [min(r["time_vs_dropless"]) * scale for r in rows],
                            [max(r["time_vs_dropless"]) * scale for r in rows],
                            color=color, alpha=0.15, linewidth=0)
            ax.plot(x, [statistics.median(r["time_vs_dropless"]) * scale for r in rows],
                    "o", color=color)
            grid = np.linspace(*f["retained_range"], 50)
            ax.plot(grid, np.polyval(f["coefficients"], grid) * scale, "-", color=color,
                    label=rule)
            ax.plot([f["minimum_at"]], [f["minimum"] * scale], "*", color=color,
                    markersize=12)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.axhline(GOAL, color="k", linestyle=":", linewidth=0.8)
        ax.set_xlabel("retained fraction (measured, steady state)")
        ax.set_ylabel(f"MoE time to target / fitted {name}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Composed time to target at {result['preset']}", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrmoe_studies.time_to_target_composed",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--curve", type=Path, required=True,
                    help="the curve's report.json (time_to_loss --stage curve)")
    ap.add_argument("--out", type=Path, required=True, help="directory for composed.md, "
                    ".json and .png")
    ap.add_argument("--steps", type=int, default=P.WINDOW_STEPS,
                    help="simulated steps per configuration after the warm-up")
    ap.add_argument("--planner-ms", type=float, default=None,
                    help="the planner's host time per call (ms); default: measured here")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    try:
        report = json.loads(a.curve.read_text())
        curve = report["curve"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: --curve {a.curve}: not a curve report ({e}); run "
                         "time_to_loss --stage curve without --no-plots first") from e
    command = shlex.join(["python", "-m", "lrmoe_studies.time_to_target_composed",
                          *(sys.argv[1:] if argv is None else argv)])
    names = [p["policy"] for p in curve["points"] if p["policy"] != REFERENCE]
    started = time.perf_counter()
    context, rows = project_curve(names, a.steps, None if a.planner_ms is None
                                  else a.planner_ms / 1e3,
                                  log=lambda line: print(line, file=sys.stderr, flush=True))
    missing = [n for n in (*BASELINES, *names) if rows[n].choice is None]
    if REFERENCE in missing or "symi" in missing:
        raise SystemExit(f"error: {', '.join(missing)} fit nothing at {P.GOAL_PRESET}: no "
                         "baseline to compose against")
    result = {"command": command, "code": code_version(), "curve": str(a.curve),
              "context": context,
              **compose_curve(curve, {n: r.choice for n, r in rows.items()}),
              "seconds": time.perf_counter() - started, "caveat": P.DISPATCHER_CAVEAT}
    moe = result["moe_s_per_step"]
    text = (f"# Composed time to target\n\n    {command}\n\n{result['code']}; "
            f"{result['seconds']:.0f} s. Fitted baselines: dropless "
            f"{result['fitted'][REFERENCE]} ({moe[REFERENCE]:.2f} s MoE per step), SYMI-style "
            f"{result['fitted']['symi']} ({moe['symi']:.2f} s). {P.DISPATCHER_CAVEAT}\n\n"
            + markdown(result) + "\n")
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "composed.md").write_text(text)
    (a.out / "composed.json").write_text(json.dumps(result, indent=1, default=str))
    if not a.no_plots:
        plot(result, a.out / "composed.png")
    return 0 if all(math.isfinite(v) for v in moe.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
