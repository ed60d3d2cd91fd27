"""Run reports: ``python -m megatron_lrmoe.tools.report RUN_DIR... [--out DIR]``.

Reads the launcher's JSON-lines logs (``--log-json``; a RUN_DIR is a directory holding
``log.jsonl`` or, once its study stored it compressed, ``log.jsonl.xz``; or the log file
itself) and writes PNGs (matplotlib, Agg):

- ``loss.png``: training loss vs step and vs cumulative MoE-layer time (every run
  overlaid; thin: the logged per-step loss, solid: its trailing mean; dots: validation);
- ``moe_time.png``: MoE forward and backward seconds per step (slowest rank per stage);
- ``lrmoe.png``: LRMoE's retained fraction and dropped contribution over steps (runs
  with ``--moe-lrmoe``; logged every ``--moe-lrmoe-log-interval`` steps);
- ``routed_load.png``: per-layer routed load max/mean over steps, one heatmap per run:
  per step from ``--record-routing`` (``routing/layer<N>/load-max-over-mean``, Megatron's
  expert layout, any MoE layer) where the run recorded, else LRMoE's own statistic
  (``lrmoe/layer<N>/load-max-over-mean``: maximum over each log interval, after its
  placement's routing);
- ``index.md``: which runs, which files, and which series a run did not log.

``build_report`` returns the series (what the figures plot, tested against the logs);
``write_report`` draws them. A log that holds several runs appended one after the other
(the launcher appends) is read as the history the last run continued: a record whose
iteration is not past the previous one replaces the records from that iteration on (a
resume from a checkpoint, or a fresh start). The cumulative MoE time of that history is
the running sum of the logged forward + backward seconds, which equals the launcher's
``moe-cumulative-s`` for a run that was not resumed (the launcher's sum restarts at 0
on resume).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.figures import FiguresUnavailable, pyplot, save_png

__all__ = ["LoadSeries", "RunSeries", "build_report", "read_run", "write_report"]

_LOAD_KEY = re.compile(r"^(routing|lrmoe)/layer(\d+)/load-max-over-mean$")


@dataclass
class LoadSeries:
    """Per-layer routed load max/mean: ``values[i][j]`` for ``layers[i]`` at
    ``iterations[j]`` (None where that step did not log the layer)."""

    source: str                      # "routing" (--record-routing) or "lrmoe"
    layers: list[int]
    iterations: list[int]
    values: list[list[float | None]]


@dataclass
class RunSeries:
    """One run's logged series, as plotted."""

    name: str
    path: Path
    iterations: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    moe_forward_s: list[float] = field(default_factory=list)
    moe_backward_s: list[float] = field(default_factory=list)
    moe_cumulative_s: list[float] = field(default_factory=list)
    validation: tuple[list[int], list[float]] = ([], [])
    retained: tuple[list[int], list[float]] = ([], [])
    dropped: tuple[list[int], list[float]] = ([], [])
    load: LoadSeries | None = None


def _log_file(path: Path) -> Path:
    if run_log.stored(path).is_file():
        return run_log.stored(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run directory or log file")
    if run_log.stored(path / "log.jsonl").is_file():
        return run_log.stored(path / "log.jsonl")
    logs = sorted([*path.glob("*.jsonl"), *path.glob("*.jsonl" + run_log.SUFFIX)])
    if len(logs) != 1:
        raise FileNotFoundError(f"{path}: expected log.jsonl (the launcher's --log-json) or "
                                f"one *.jsonl file, found {[p.name for p in logs]}")
    return logs[0]


def history(records: list[dict]) -> list[dict]:
    """The records of the last run's history (see the module docstring)."""
    kept: list[dict] = []
    for record in records:
        if "iteration" not in record:
            continue
        while kept and kept[-1]["iteration"] >= record["iteration"]:
            kept.pop()
        kept.append(record)
    return kept


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["iteration"], float(r[key])) for r in records if key in r]
    return [i for i, _ in pairs], [v for _, v in pairs]


def _load_series(records: list[dict]) -> LoadSeries | None:
    found: dict[str, set[int]] = {"routing": set(), "lrmoe": set()}
    for record in records:
        for key in record:
            match = _LOAD_KEY.match(key)
            if match:
                found[match.group(1)].add(int(match.group(2)))
    source = "routing" if found["routing"] else "lrmoe" if found["lrmoe"] else None
    if source is None:
        return None
    layers = sorted(found[source])
    rows = [r for r in records if any(f"{source}/layer{n}/load-max-over-mean" in r
                                      for n in layers)]
    values = [[float(r[k]) if (k := f"{source}/layer{n}/load-max-over-mean") in r else None
               for r in rows] for n in layers]
    return LoadSeries(source, layers, [r["iteration"] for r in rows], values)


def read_run(path: str | os.PathLike, name: str | None = None) -> RunSeries:
    """One run's series from its JSON-lines log."""
    log = _log_file(Path(path))
    records = []
    for number, line in enumerate(run_log.read_text(log).splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{log}:{number}: not a JSON line ({error})") from None
    records = history(records)
    train = [r for r in records if "lm-loss" in r]
    plain = Path(log.name.removesuffix(run_log.SUFFIX))
    run = RunSeries(name or (log.parent.name if plain.name == "log.jsonl" else plain.stem), log)
    run.iterations = [r["iteration"] for r in train]
    run.loss = [float(r["lm-loss"]) for r in train]
    run.moe_forward_s = [float(r.get("moe-forward-s", 0.0)) for r in train]
    run.moe_backward_s = [float(r.get("moe-backward-s", 0.0)) for r in train]
    total = 0.0
    for forward, backward in zip(run.moe_forward_s, run.moe_backward_s, strict=True):
        total += forward + backward        # the launcher's own summation order
        run.moe_cumulative_s.append(total)
    run.validation = _series(records, "validation-loss")
    run.retained = _series(records, "lrmoe/retained-fraction")
    run.dropped = _series(records, "lrmoe/dropped-contribution-fraction")
    run.load = _load_series(records)
    return run


def build_report(paths: list[str | os.PathLike]) -> list[RunSeries]:
    """The series of every run; names are the run directories' names, made unique."""
    runs = [read_run(p) for p in paths]
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
        if seen[run.name] > 1:
            run.name = f"{run.name} ({seen[run.name]})"
    return runs


# -----------------------------------------------------------------------------
# Figures (each returns the matplotlib Figure; ``write_report`` saves them)
# -----------------------------------------------------------------------------


def _colors(count: int) -> list:
    plt = pyplot()
    cmap = plt.get_cmap("tab10" if count <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(count)]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss(runs: list[RunSeries]):
    """Two panels: loss vs step, loss vs cumulative MoE seconds. Lines with gid 'logged'
    are the logged per-step losses."""
    plt = pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, color in zip(runs, _colors(len(runs)), strict=True):
        window = max(1, len(run.loss) // 25)
        smooth = trailing_mean(run.loss, window)
        for ax, x in ((by_step, run.iterations), (by_time, run.moe_cumulative_s)):
            (raw,) = ax.plot(x, run.loss, color=color, linewidth=0.5, alpha=0.35)
            raw.set_gid("logged")
            ax.plot(x, smooth, color=color, linewidth=1.4, label=run.name)
        if run.validation[0]:
            by_step.plot(*run.validation, "o", color=color, markersize=4, gid="validation")
    by_step.set_xlabel("training step")
    by_time.set_xlabel("cumulative MoE-layer time, forward + backward (s, slowest rank)")
    for ax in (by_step, by_time):
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    by_step.set_title("loss vs step (thin: per step, solid: trailing mean, dots: "
                      "validation)", fontsize=9)
    by_time.set_title("loss vs cumulative MoE time", fontsize=9)
    fig.tight_layout()
    return fig


def plot_moe_time(runs: list[RunSeries]):
    """Two panels: MoE forward and backward milliseconds per step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for run, color in zip(runs, _colors(len(runs)), strict=True):
        for ax, seconds in zip(axes, (run.moe_forward_s, run.moe_backward_s), strict=True):
            ax.plot(run.iterations, [1e3 * s for s in seconds], color=color, linewidth=0.8,
                    label=run.name)
    for ax, what in zip(axes, ("forward", "backward"), strict=True):
        ax.set_title(f"MoE {what} per step", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"MoE-layer {what} ms (slowest rank)")
        ax.yaxis.set_tick_params(labelleft=True)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_lrmoe(runs: list[RunSeries]):
    """Two panels: retained fraction and dropped contribution (runs that logged them);
    None when no run did."""
    with_stats = [(run, color) for run, color in zip(runs, _colors(len(runs)), strict=True)
                  if run.retained[0]]
    if not with_stats:
        return None
    plt = pyplot()
    fig, (kept, dropped) = plt.subplots(1, 2, figsize=(12, 4))
    for run, color in with_stats:
        kept.plot(*run.retained, "-o", color=color, markersize=3, linewidth=1, label=run.name)
        dropped.plot(*run.dropped, "-o", color=color, markersize=3, linewidth=1,
                     label=run.name)
    kept.set_title("LRMoE retained fraction (backward pairs kept / routed)", fontsize=10)
    kept.set_ylabel("retained fraction")
    dropped.set_title("LRMoE dropped contribution (metric dropped / total)", fontsize=10)
    dropped.set_ylabel("dropped contribution fraction")
    for ax in (kept, dropped):
        ax.set_xlabel("training step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_load(runs: list[RunSeries]):
    """One heatmap per run with load data (layers x steps, colour = max/mean); None when
    no run logged any."""
    with_load = [run for run in runs if run.load is not None]
    if not with_load:
        return None
    import numpy as np

    plt = pyplot()
    cols = min(2, len(with_load))
    rows = (len(with_load) + cols - 1) // cols
    per_row = 1.6 + 0.25 * max(len(r.load.layers) for r in with_load)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, per_row * rows), squeeze=False)
    top = max(v for r in with_load for row in r.load.values for v in row if v is not None)
    for ax, run in zip(axes.flat, with_load, strict=False):
        load = run.load
        grid = np.ma.masked_invalid(
            np.array([[np.nan if v is None else v for v in row] for row in load.values]))
        # Cells span half-way to the neighbouring logged steps (LRMoE logs every interval).
        steps = np.asarray(load.iterations, dtype=float)
        mids = (steps[1:] + steps[:-1]) / 2
        first = steps[0] - (mids[0] - steps[0] if mids.size else 0.5)
        last = steps[-1] + (steps[-1] - mids[-1] if mids.size else 0.5)
        edges = np.concatenate([[first], mids, [last]])
        mesh = ax.pcolormesh(edges, np.arange(len(load.layers) + 1) - 0.5, grid,
                             cmap="magma", vmin=1.0, vmax=max(top, 1.0 + 1e-6))
        ax.set_yticks(range(len(load.layers)), [str(n) for n in load.layers])
        ax.set_xlabel("training step")
        ax.set_ylabel("MoE layer")
        what = ("per step, Megatron's expert layout (--record-routing)"
                if load.source == "routing" else "max over each LRMoE log interval")
        ax.set_title(f"{run.name}: routed load max/mean, {what}", fontsize=8)
        fig.colorbar(mesh, ax=ax, label="max/mean", pad=0.01)
    for ax in list(axes.flat)[len(with_load):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


FIGURES = {"loss.png": plot_loss, "moe_time.png": plot_moe_time, "lrmoe.png": plot_lrmoe,
           "routed_load.png": plot_load}


def write_report(runs: list[RunSeries], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Draw every figure that has data into ``out_dir`` (plus ``index.md``); returns
    file name -> path of what was written."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, draw in FIGURES.items():
        fig = draw(runs)
        if fig is None:
            (out / name).unlink(missing_ok=True)     # no stale figure from an earlier report
            continue
        save_png(fig, out / name)
        plt.close(fig)
        written[name] = out / name
    lines = ["# Run report", "", "| run | log (relative to this file) | steps | final loss | "
             "MoE s | LRMoE stats | "
             "routed load |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        load = "-" if run.load is None else run.load.source
        log = os.path.relpath(run.path.resolve(), out.resolve())   # portable: relative to out
        lines.append(f"| {run.name} | `{log}` | {len(run.iterations)} | "
                     f"{run.loss[-1]:.4f} | {run.moe_cumulative_s[-1]:.1f} | "
                     f"{'yes' if run.retained[0] else 'no'} | {load} |"
                     if run.iterations else f"| {run.name} | `{log}` | 0 | - | - | - | - |")
    lines += ["", "Figures: " + ", ".join(f"`{n}`" for n in written) + ".", ""]
    missing = [n for n in FIGURES if n not in written]
    if missing:
        lines.append("Not drawn (no run logged the series): " + ", ".join(
            f"`{n}`" for n in missing) + ". `lrmoe.png` needs `--moe-lrmoe`; "
            "`routed_load.png` needs `--record-routing` or `--moe-lrmoe`.")
    (out / "index.md").write_text("\n".join(lines) + "\n")
    written["index.md"] = out / "index.md"
    return written


def default_out_dir(paths: list[Path]) -> Path:
    """``RUN_DIR/report`` for one run, else ``report`` in the runs' common directory."""
    dirs = [p if p.is_dir() else p.parent for p in paths]
    if len(dirs) == 1:
        return dirs[0] / "report"
    return Path(os.path.commonpath([str(d.resolve()) for d in dirs])) / "report"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_lrmoe.tools.report",
                                description="PNG report of launcher runs (JSON-lines logs).")
    p.add_argument("runs", nargs="+", type=Path,
                   help="run directories holding log.jsonl or log.jsonl.xz (--log-json), or "
                        "the log files")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: RUN_DIR/report for one run, else "
                        "report/ in the runs' common directory)")
    args = p.parse_args(argv)
    try:
        runs = build_report(args.runs)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = args.out or default_out_dir(args.runs)
    try:
        written = write_report(runs, out)
    except FiguresUnavailable as error:
        print(f"error: the report is figures: {error}", file=sys.stderr)
        return 2
    for path in written.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
