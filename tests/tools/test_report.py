"""Run reports (``python -m megatron_lrmoe.tools.report``): on CI-sized launcher runs (Megatron
with --record-routing, LRMoE with its statistics every step) the PNGs exist with the
expected panels and axes, and every plotted series equals the one in the JSON-lines log
(read here with json, independently of the report builder)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lrmoe.tools import report, run_log
from megatron_lrmoe.tools.figures import REPORT_EXTRA

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "6", "--split", "95,5,0",
    "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "2", "--no-progress-bar",
    "--expert-model-parallel-size", "2", "--seed", "1234",
]


def _train(argv: list[str]) -> dict:
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train

    return train(parse_args(argv))


@pytest.fixture(scope="module")
def runs(gloo2, corpus, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("report_runs")
    megatron, lrmoe = root / "megatron", root / "lrmoe"
    gloo2.run(_train, TINY + ["--data-path", corpus, "--log-json", str(megatron / "log.jsonl"),
                              "--record-routing", str(megatron / "trace")], timeout=300)
    gloo2.run(_train, TINY + ["--data-path", corpus, "--log-json", str(lrmoe / "log.jsonl"),
                              "--moe-lrmoe", "--moe-lrmoe-log-interval", "2"], timeout=300)
    return [megatron, lrmoe]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _logged(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    return ([r["iteration"] for r in records if key in r], [r[key] for r in records if key in r])


def test_series_equal_the_logged_ones(runs):
    built = report.build_report(runs)
    assert [r.name for r in built] == ["megatron", "lrmoe"]
    for run, path in zip(built, runs, strict=True):
        records = _records(path)
        assert run.iterations == [r["iteration"] for r in records] == list(range(1, 7))
        assert run.loss == [r["lm-loss"] for r in records]
        assert run.moe_forward_s == [r["moe-forward-s"] for r in records]
        assert run.moe_backward_s == [r["moe-backward-s"] for r in records]
        assert run.moe_cumulative_s == [r["moe-cumulative-s"] for r in records]
        assert run.validation == _logged(records, "validation-loss")
        assert len(run.validation[0]) == 2
    megatron, lrmoe = built
    assert megatron.retained == ([], []) and megatron.load.source == "routing"
    assert megatron.load.layers == [1, 2] and megatron.load.iterations == list(range(1, 7))
    for i, n in enumerate(megatron.load.layers):
        assert megatron.load.values[i] == _logged(
            _records(runs[0]), f"routing/layer{n}/load-max-over-mean")[1]
    assert lrmoe.retained == _logged(_records(runs[1]), "lrmoe/retained-fraction")
    assert lrmoe.retained[0] == [2, 4, 6]
    assert lrmoe.dropped == _logged(_records(runs[1]), "lrmoe/dropped-contribution-fraction")
    assert lrmoe.load.source == "lrmoe" and lrmoe.load.iterations == [2, 4, 6]


def test_figures_have_their_panels_axes_and_data(runs):
    built = report.build_report(runs)
    records = [_records(p) for p in runs]

    fig = report.plot_loss(built)
    by_step, by_time = fig.axes
    assert by_step.get_xlabel() == "training step"
    assert by_time.get_xlabel().startswith("cumulative MoE-layer time")
    assert by_step.get_ylabel().startswith("training loss")
    for ax, xkey in ((by_step, "iteration"), (by_time, "moe-cumulative-s")):
        logged = [line for line in ax.lines if line.get_gid() == "logged"]
        assert len(logged) == 2
        for line, recs in zip(logged, records, strict=True):
            assert list(line.get_xdata()) == [r[xkey] for r in recs]
            assert list(line.get_ydata()) == [r["lm-loss"] for r in recs]
    assert [t.get_text() for t in by_step.get_legend().get_texts()] == ["megatron", "lrmoe"]
    validation = [line for line in by_step.lines if line.get_gid() == "validation"]
    assert [list(line.get_ydata()) for line in validation] == [
        _logged(recs, "validation-loss")[1] for recs in records]

    fig = report.plot_moe_time(built)
    assert [ax.get_title() for ax in fig.axes] == ["MoE forward per step", "MoE backward per step"]
    for ax, key in zip(fig.axes, ("moe-forward-s", "moe-backward-s"), strict=True):
        assert ax.get_ylabel().startswith("MoE-layer")
        for line, recs in zip(ax.lines, records, strict=True):
            assert list(line.get_ydata()) == pytest.approx([1e3 * r[key] for r in recs])

    fig = report.plot_lrmoe(built)
    kept, dropped = fig.axes
    assert kept.get_ylabel() == "retained fraction"
    assert dropped.get_ylabel() == "dropped contribution fraction"
    assert len(kept.lines) == 1                       # only the LRMoE run logs them
    assert list(kept.lines[0].get_ydata()) == _logged(records[1], "lrmoe/retained-fraction")[1]
    assert list(dropped.lines[0].get_ydata()) == _logged(
        records[1], "lrmoe/dropped-contribution-fraction")[1]

    fig = report.plot_load(built)
    heatmaps = [ax for ax in fig.axes if ax.get_ylabel() == "MoE layer"]
    assert len(heatmaps) == 2
    for ax, recs, source in zip(heatmaps, records, ("routing", "lrmoe"), strict=True):
        grid = ax.collections[0].get_array().reshape(2, -1)
        for i, n in enumerate((1, 2)):
            assert grid[i].tolist() == _logged(recs, f"{source}/layer{n}/load-max-over-mean")[1]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"]


def test_command_line_writes_the_pngs(runs, tmp_path, capsys):
    import matplotlib.image

    out = tmp_path / "report"
    assert report.main([str(p) for p in runs] + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    for name in ("loss.png", "moe_time.png", "lrmoe.png", "routed_load.png"):
        assert str(out / name) in printed
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    index = (out / "index.md").read_text()
    assert "| megatron |" in index and "| lrmoe |" in index
    # One Megatron run: no LRMoE figure, and the default output directory.
    assert report.main([str(runs[0])]) == 0
    assert sorted(p.name for p in (runs[0] / "report").iterdir()) == [
        "index.md", "loss.png", "moe_time.png", "routed_load.png"]
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_without_matplotlib_the_report_names_the_extra(runs, tmp_path, capsys, monkeypatch):
    # matplotlib is the optional "report" extra: an install without it gets one error line
    # naming the extra, status 2, and no half-written report directory.
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib: ImportError
    out = tmp_path / "report"
    assert report.main([str(runs[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and REPORT_EXTRA in err[0], err
    assert not out.exists()


def test_appended_logs_keep_the_last_history(tmp_path):
    def rec(i, loss, fwd=0.1, bwd=0.2):
        return {"iteration": i, "lm-loss": loss, "moe-forward-s": fwd, "moe-backward-s": bwd}

    lines = [rec(1, 9.0), rec(2, 8.0), rec(3, 7.0),       # a first run, later restarted
             rec(1, 6.0), rec(2, 5.0), rec(3, 4.0), rec(4, 3.0),
             rec(3, 2.5, 0.5, 0.5), rec(4, 2.0, 0.5, 0.5), rec(5, 1.0, 0.5, 0.5)]  # resumed at 2
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    run = report.read_run(tmp_path)
    assert run.iterations == [1, 2, 3, 4, 5]
    assert run.loss == [6.0, 5.0, 2.5, 2.0, 1.0]
    assert run.moe_cumulative_s == pytest.approx(np.cumsum([0.3, 0.3, 1.0, 1.0, 1.0]).tolist())
    assert run.load is None and run.retained == ([], [])
    log.write_text('{"iteration": 1}\nnot json\n')
    with pytest.raises(ValueError, match="log.jsonl:2: not a JSON line"):
        report.read_run(log)


def test_a_compressed_log_reads_as_the_plain_one(tmp_path):
    run_dir = tmp_path / "run-s1"
    run_dir.mkdir()
    log = run_dir / "log.jsonl"
    log.write_text("".join(json.dumps({"iteration": i, "lm-loss": 9.0 - i, "moe-forward-s": 0.1,
                                       "moe-backward-s": 0.2}) + "\n" for i in (1, 2, 3)))
    plain = report.read_run(run_dir)
    run_log.compress(log)
    for path in (run_dir, log, run_dir / "log.jsonl.xz"):
        packed = report.read_run(path)
        assert packed.name == "run-s1" and packed.path == run_dir / "log.jsonl.xz"
        assert (packed.iterations, packed.loss, packed.moe_cumulative_s) == (
            plain.iterations, plain.loss, plain.moe_cumulative_s)
