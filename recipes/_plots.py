"""PNG plots of a run's `metrics.jsonl`: loss, accuracy and the loss-scale history.

Drawn with matplotlib's object API on the Agg canvas: no display, no `pyplot` global
state, so it works headless and inside a Hydra sweep.
"""

from __future__ import annotations

import json
import math
import pathlib

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def read_metrics(path) -> list[dict]:
    """The records of a `metrics.jsonl` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict], name: str) -> tuple[list, list]:
    points = [
        (r["step"], r[name])
        for r in records
        if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])
    ]
    return [s for s, _ in points], [v for _, v in points]


def _save(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    FigureCanvasAgg(fig)  # attaches itself to `fig`
    fig.savefig(path, dpi=100)
    return path


def _curves(records, names, title, ylabel, path, *, logy=False):
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for name, label in names:
        steps, values = _series(records, name)
        if steps:
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 else "")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if logy:
        ax.set_yscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_metrics(metrics_file, out_dir, title: str) -> list[pathlib.Path]:
    """Write `loss.png`, `accuracy.png` (if accuracies were logged) and
    `loss_scale.png` to `out_dir`; returns their paths."""
    records = read_metrics(metrics_file)
    out_dir = pathlib.Path(out_dir)
    paths = [
        _curves(
            records,
            [("loss", "train (batch)"), ("eval_loss", "eval")],
            f"{title}: loss",
            "cross-entropy (nats)",
            out_dir / "loss.png",
        )
    ]
    if any("accuracy" in r or "eval_accuracy" in r for r in records):
        paths.append(
            _curves(
                records,
                [("accuracy", "train (batch)"), ("eval_accuracy", "eval")],
                f"{title}: accuracy",
                "accuracy",
                out_dir / "accuracy.png",
            )
        )
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    steps, scales = _series(records, "loss_scale")
    ax.step(steps, scales, where="post", label="loss scale")
    ax.set(title=f"{title}: loss scale", xlabel="step", ylabel="loss scale")
    ax.set_yscale("log", base=2)
    ax.grid(alpha=0.3)
    skipped = ax.twinx()
    steps, counts = _series(records, "skipped")
    skipped.step(steps, counts, where="post", color="tab:red", label="skipped steps")
    skipped.set_ylabel("skipped steps (total)")
    skipped.set_ylim(0, max([1, *counts]) * 1.1)
    fig.legend(loc="outside lower center", ncols=2)
    paths.append(_save(fig, out_dir / "loss_scale.png"))
    return paths
