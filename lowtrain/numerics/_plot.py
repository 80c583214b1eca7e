"""The scale plot of a `Report` (in the spirit of the unit-scaling library's): one
row per tensor in program order, log2 RMS forward and backward, a format's range.

Drawn with matplotlib's object API on the Agg canvas (like `recipes/_plots.py`): no
display, no `pyplot` global state.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ._stats import lost

_COLORS = {"fwd": "tab:blue", "bwd": "tab:orange"}


def plot_report(report, path, fmt: str) -> None:
    """Write `report`'s scale plot for `fmt` as a PNG to `path`."""
    rows = report.rows
    info = jnp.finfo(jnp.dtype(fmt))
    low, high = math.log2(float(info.smallest_subnormal)), math.log2(float(info.max))
    normal = math.log2(float(info.smallest_normal))
    logs = [
        math.log2(r["rms"]) if math.isfinite(r["rms"]) and r["rms"] > 0 else None
        for r in rows
    ]
    finite = [v for v in logs if v is not None and math.isfinite(v)]
    left = min([low - 4, *finite]) - 1
    right = max([high + 4, *finite]) + 1
    height = min(max(3.0, 0.04 * len(rows) + 1.5), 30.0)
    fig = Figure(figsize=(8, height), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.axvspan(low, normal, color="0.92", label=f"{fmt} subnormals")
    ax.axvspan(normal, high, color="0.82", label=f"{fmt} normals")
    for pass_, color in _COLORS.items():
        ys = [i for i, r in enumerate(rows) if r["pass"] == pass_]
        xs = [logs[i] if logs[i] is not None else left for i in ys]
        ax.scatter(xs, ys, s=6, color=color, label=f"{pass_} log2 RMS")
    bad = [i for i, r in enumerate(rows) if lost(r, fmt) > 0.01]
    ax.scatter(
        [logs[i] if logs[i] is not None else left for i in bad],
        bad,
        s=30,
        facecolors="none",
        edgecolors="red",
        label=f"> 1% of values lost in {fmt}",
    )
    ax.set_xlim(left, right)
    ax.set_ylim(len(rows), -1)  # program order, top to bottom
    ax.set_xlabel("log2 RMS")
    ax.set_ylabel("tensor (program order)")
    if len(rows) <= 60:
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=6)
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title(f"{len(rows)} tensors, {len(bad)} losing > 1% in {fmt}")
    fig.tight_layout()
    fig.savefig(path, format="png")
