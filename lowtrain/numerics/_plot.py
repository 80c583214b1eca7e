"""The scale plots of a `Report` (in the spirit of the unit-scaling library's).

A casts report: its FP8 casts by name, one column per layer of the scanned stack
(and one for the casts outside it), in each the matmuls by scope and their three
casts; a bar from log2 RMS to log2 absmax of each cast's values (after its scale)
over its format's range, lossy casts in red, shadows (matmuls kept wide) hollow, the
plan's wide matmuls labelled. A report of every tensor: one row per tensor in
program order, log2 RMS forward and backward, a format's range.

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
_ROLES = ("lhs", "rhs", "grad")


def _log2(v: float) -> float | None:
    return math.log2(v) if math.isfinite(v) and v > 0 else None


def _range(fmt: str) -> tuple[float, float, float]:
    info = jnp.finfo(jnp.dtype(fmt))
    return (
        math.log2(float(info.smallest_subnormal)),
        math.log2(float(info.smallest_normal)),
        math.log2(float(info.max)),
    )


def plot_report(report, path, fmt: str, plan=None) -> None:
    """Write `report`'s scale plot as a PNG to `path` (see `Report.plot`)."""
    sites = [r for r in report.rows if r.get("site") and r["site"]["role"] in _ROLES]
    if report.kind == "casts" and sites:  # else scalify's own casts: program order
        _plot_casts(sites, path, plan)
    else:
        _plot_all(report, path, fmt)


def _plot_casts(rows, path, plan) -> None:
    # `rows`: the casts of matmuls (with a site and a role).
    wide = set()
    if plan is not None:
        wide = {m.key for m in plan.matmuls if m.decision == "wide"}
    layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
    columns = [*layers, None] if any(r["layer"] is None for r in rows) else layers
    columns = columns or [None]
    entries: list[tuple[str, str]] = []  # (matmul key, role), first seen first
    for r in rows:
        key = f"{r['name']}@{'x'.join(map(str, r['site']['rhs']))}"
        if (key, r["site"]["role"]) not in entries:
            entries.append((key, r["site"]["role"]))
    # Group each matmul's casts together, matmuls in the order first seen.
    order = list(dict.fromkeys(k for k, _ in entries))
    entries.sort(key=lambda e: (order.index(e[0]), _ROLES.index(e[1])))
    where = {e: i for i, e in enumerate(entries)}
    cells: dict[tuple, dict] = {}
    for r in rows:  # several rows of one cast (remat, passes): the worst
        key = f"{r['name']}@{'x'.join(map(str, r['site']['rhs']))}"
        cell = (key, r["site"]["role"], r["layer"])
        old = cells.get(cell)
        if old is None or lost(r, r["dtype"]) > lost(old, old["dtype"]):
            cells[cell] = r
    height = min(max(3.0, 0.22 * len(entries) + 1.6), 24.0)
    fig = Figure(figsize=(2.6 * len(columns) + 3.2, height), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(columns), sharey=True, squeeze=False)[0]
    logs = [
        v for r in rows for v in (_log2(r["rms"]), _log2(r["absmax"])) if v is not None
    ]
    left = min([-18.0, *logs]) - 1
    right = max([17.0, *logs]) + 1
    bad = 0
    for ax, layer in zip(axes, columns):
        for (key, role), y in where.items():
            fmt = "float8_e5m2" if role == "grad" else "float8_e4m3fn"
            low, normal, high = _range(fmt)
            ax.broken_barh([(low, normal - low)], (y - 0.45, 0.9), color="0.93")
            ax.broken_barh([(normal, high - normal)], (y - 0.45, 0.9), color="0.84")
            r = cells.get((key, role, layer))
            if r is None:
                continue
            rms, top = _log2(r["rms"]), _log2(r["absmax"])
            lossy = lost(r, r["dtype"]) > 0.01
            bad += lossy
            color = "tab:red" if lossy else _COLORS[r["pass"]]
            x = left if rms is None else rms
            ax.plot([x, top if top is not None else x], [y, y], color=color, lw=2)
            face = color if r["site"]["applied"] else "none"
            ax.scatter([x], [y], s=22, facecolors=face, edgecolors=color, zorder=3)
        ax.set_xlim(left, right)
        ax.set_title("outside the scan" if layer is None else f"layer {layer}")
        ax.set_xlabel("log2 RMS .. log2 absmax")
        ax.grid(axis="x", color="0.7", lw=0.5)
    labels = []
    for key, role in entries:
        mark = " [wide]" if key in wide else ""
        labels.append(f"{key} {role}{mark}" if role == "lhs" else f"{role}{mark}")
    axes[0].set_yticks(range(len(entries)), labels, fontsize=7)
    axes[0].set_ylim(len(entries) - 0.5, -0.5)
    share = "" if plan is None else f"; plan: FP8 on {plan.fp8_share:.0%} of FLOPs"
    fig.suptitle(
        f"{len(rows)} FP8 casts, {bad} losing > 1% in their format (red); hollow: "
        f"kept wide{share}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")


def _plot_all(report, path, fmt: str) -> None:
    rows = report.rows
    low, normal, high = _range(fmt)
    logs = [_log2(r["rms"]) for r in rows]
    finite = [v for v in logs if v is not None]
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
