"""Figures stored small (megatron_lrmoe.tools.figures): a palette PNG at the figure's
size that shows what matplotlib drew (compared with matplotlib's own RGB render)."""

from __future__ import annotations

import io

import numpy as np

from megatron_lrmoe.tools.figures import DPI, save_png


def test_palette_png_shows_what_matplotlib_drew(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, (lines, heat) = plt.subplots(1, 2, figsize=(6, 3))
    x = np.linspace(0, 10, 200)
    for k in range(8):
        lines.plot(x, np.sin(x + k), label=f"run {k}", linewidth=0.8)
    lines.legend(fontsize=6)
    mesh = heat.pcolormesh(np.random.default_rng(0).random((4, 120)), cmap="magma")
    fig.colorbar(mesh, ax=heat)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    drawn = np.asarray(Image.open(buffer).convert("RGB"), dtype=np.int16)
    path = save_png(fig, tmp_path / "figure.png")
    plt.close(fig)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png"]
    with Image.open(path) as stored:
        assert stored.mode == "P" and stored.size == (6 * DPI, 3 * DPI)
        shown = np.asarray(stored.convert("RGB"), dtype=np.int16)
    error = np.abs(shown - drawn)
    assert error.mean() < 1.0 and np.quantile(error, 0.99) <= 16   # of 255 levels
    assert path.stat().st_size < len(buffer.getvalue())
