"""Figures stored small: PNGs rendered at ``DPI`` and saved with a palette of at most
``COLORS`` colours, which line plots and heatmaps fill without visible change, so a
result's figures stay tens of kB each in the repository.

matplotlib (with Pillow) is an optional extra, ``pip install 'megatron-lrmoe[report]'``:
``pyplot`` is the one import of it, and names the extra where it is missing."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

__all__ = ["COLORS", "DPI", "REPORT_EXTRA", "FiguresUnavailable", "pyplot", "save_png"]

DPI = 80
COLORS = 256
REPORT_EXTRA = "pip install 'megatron-lrmoe[report]'"


class FiguresUnavailable(ImportError):
    """matplotlib is not installed (the ``report`` extra); the message says how to get it."""


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display); ``FiguresUnavailable``
    naming the extra where matplotlib is absent."""
    try:
        import matplotlib
    except ImportError as exc:
        raise FiguresUnavailable(
            f"figures need matplotlib, which is not installed: {REPORT_EXTRA} "
            "(or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | os.PathLike, dpi: float = DPI) -> Path:
    """Save the matplotlib figure ``fig`` as a palette PNG at ``path`` (atomically: a
    half-written file never replaces a figure)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    # No dithering: flat areas and lines stay flat instead of speckled.
    image = Image.open(buffer).convert("RGB").quantize(
        COLORS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    image.save(tmp, format="PNG", optimize=True)
    os.replace(tmp, path)
    return path
