"""u-μP's claim, measured: does the best learning rate stay put as the GPT widens?

A learning-rate sweep (factor-2 grid) over widths of the char-GPT, for the standard
parametrisation (`recipe=gpt`: GPT-2 init, AdamW) and for u-μP (`recipe=gpt_unit`:
`uu.TransformerDecoder`, `uu.optim.adamw`), each a short run of `python -m lowtrain`.
Prints a markdown table (validation loss per width and learning rate, the best
marked) and writes `lr_transfer.png` (a curve per width, one panel per
parametrisation) and `lr_transfer.json` to `--out`.

    python scripts/lr_transfer.py                     # widths 64 128 256, 500 steps
    python scripts/lr_transfer.py --steps 100 --widths 32 64   # a quick look
    python scripts/lr_transfer.py --table-only        # re-read the summaries
    python scripts/lr_transfer.py --only u-μP --widths 128 --lrs 1 2   # some cells

Finished runs (a `summary.json`) are skipped, so an interrupted sweep resumes; a
cell with a log but no summary failed (shown "diverged"), one with neither is
"not run".
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys

# Learning-rate grids, factor 2 apart, around each recipe's default (gpt: 2e-3,
# gpt_unit: 2; at width 128 and 500 steps u-μP's 4 was worse than 2). The standard
# one has a sixth point, 1.6e-2, because width 64's best was its largest, 8e-3.
GRIDS = {
    "standard": ("gpt", [2e-3 * 2.0**k for k in range(-2, 4)]),
    "u-μP": ("gpt_unit", [2.0**k for k in range(-2, 3)]),
}


def run_dir(out: pathlib.Path, name: str, width: int, lr: float) -> pathlib.Path:
    return out / f"{'umup' if name == 'u-μP' else name}_w{width}_lr{lr:.3g}"


def run(out, name, recipe, width, lr, steps) -> None:
    path = run_dir(out, name, width, lr)
    if (path / "summary.json").exists():
        return
    command = [
        *(sys.executable, "-m", "lowtrain", f"recipe={recipe}"),
        f"model.n_embd={width}",
        f"trainer.steps={steps}",
        f"optimizer.lr={lr}",
        f"optimizer.warmup_steps={max(steps // 20, 1)}",
        f"optimizer.min_lr={lr / 20}",
        f"trainer.eval_every={steps}",
        f"trainer.checkpoint_every={steps}",
        "data.eval_batches=10",
        "trainer.progress=false",
        f"hydra.run.dir={path}",
    ]
    print("$", " ".join(command[1:]), flush=True)
    log = out / f"{path.name}.log"
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:  # a diverged run is a result (inf), not a stop
        print(f"  failed (see {log})", flush=True)


def val_loss(out, name, width, lr) -> float | None:
    """The run's final validation loss; inf if it diverged (not finite), NaN if it
    failed or is still running (a log but no summary), None if it was not run."""
    summary = run_dir(out, name, width, lr) / "summary.json"
    if not summary.exists():
        return math.nan if (out / f"{summary.parent.name}.log").exists() else None
    value = json.loads(summary.read_text())["final"]["val_loss"]
    return value if math.isfinite(value) else math.inf


def table(results: dict, widths: list[int]) -> str:
    lines = []
    for name, (_, lrs) in GRIDS.items():
        lines += [
            f"**{name}** (validation loss, nats/char; best per width in bold)",
            "",
            "| width | " + " | ".join(f"{lr:.3g}" for lr in lrs) + " | best lr |",
            "|---|" + "---|" * (len(lrs) + 1),
        ]
        for w in widths:
            row = [results[name][w][lr] for lr in lrs]
            ran = [i for i, v in enumerate(row) if v is not None and not math.isnan(v)]
            best = min(ran, key=row.__getitem__) if ran else None
            cells = [
                "not run"
                if v is None
                else "failed"
                if math.isnan(v)
                else ("**{:.4f}**" if i == best else "{:.4f}").format(v)
                if math.isfinite(v)
                else "diverged"
                for i, v in enumerate(row)
            ]
            shown = "–" if best is None else f"{lrs[best]:.3g}"
            lines.append(f"| {w} | " + " | ".join(cells) + f" | {shown} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, widths: list[int], path: pathlib.Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    for i, (name, (_, lrs)) in enumerate(GRIDS.items()):
        ax = fig.add_subplot(1, len(GRIDS), i + 1)
        for w in widths:
            done = [lr for lr in lrs if results[name][w][lr] is not None]
            done = [lr for lr in done if not math.isnan(results[name][w][lr])]
            if done:  # a diverged run is drawn as a gap (inf)
                ys = [results[name][w][lr] for lr in done]
                ax.plot(done, ys, marker="o", label=f"{w}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("validation loss")
        ax.set_title(name)
        if ax.get_lines():
            ax.legend(title="width")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", type=pathlib.Path, default="outputs/lr_transfer")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument(
        "--only", choices=list(GRIDS), action="append", help="run only these"
    )
    parser.add_argument(
        "--lrs", type=float, nargs="+", help="run only these grid points"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for name, (recipe, lrs) in GRIDS.items():
        results[name] = {}
        for w in args.widths:
            results[name][w] = {}
            for lr in lrs:
                chosen = name in (args.only or GRIDS) and lr in (args.lrs or lrs)
                if not args.table_only and chosen:
                    run(args.out, name, recipe, w, lr, args.steps)
                results[name][w][lr] = val_loss(args.out, name, w, lr)
    print(table(results, args.widths))
    plot(results, args.widths, args.out / "lr_transfer.png")
    flat = {
        n: {str(w): {str(lr): v for lr, v in r.items()} for w, r in rs.items()}
        for n, rs in results.items()
    }
    (args.out / "lr_transfer.json").write_text(json.dumps(flat, indent=2))
    print(f"plot: {args.out / 'lr_transfer.png'}")


if __name__ == "__main__":
    main()
