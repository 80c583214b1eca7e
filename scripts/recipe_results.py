"""Run every recipe to the end and print the results table of docs/results.md.

    python scripts/recipe_results.py                 # all: MNIST, then the GPT
    python scripts/recipe_results.py --task gpt      # one task
    python scripts/recipe_results.py --table-only    # re-read the summaries in --out

Each run is `python -m lowtrain <overrides> hydra.run.dir=<out>/<task>_<precision>`,
one after the other (they share the CPU otherwise); its log is `<out>/<name>.log`.
The targets are issue 6's acceptance criteria.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8_naive", "scalify_fp8")
# (task, precision) -> the overrides that select the run
RUNS = {
    (task, p): (
        [f"recipe={task}", "precision=fp8_naive"]
        if p == "fp8_naive"
        else [f"recipe={task}_{p}"]
    )
    for task in ("mnist", "gpt")
    for p in PRECISIONS
}
# The largest distance to fp32 each precision may have (None: reported only).
MNIST_GAP = {"bf16": 0.3, "fp16": 0.3, "fp8": 0.3, "scalify_fp8": 0.3}  # points
GPT_GAP = {
    "fp16": 0.02,
    "fp8": 0.05,
    "scalify_fp8": 0.05,
}  # nats/char; bf16: no target, reported


def run(task: str, precision: str, out: pathlib.Path) -> None:
    name = f"{task}_{precision}"
    command = [
        *(sys.executable, "-m", "lowtrain", *RUNS[task, precision]),
        f"hydra.run.dir={out / name}",
        "trainer.progress=false",
    ]
    print("$", " ".join(command[1:]), flush=True)
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)


def _cell(task, precision, summary, base) -> tuple[str, str, str]:
    if task == "mnist":
        value = 100 * summary["final"]["test_accuracy"]
        shown = f"{value:.2f}%"
        if base is None:
            return shown, "", "fp32 >= 98.0%: " + ("met" if value >= 98.0 else "MISSED")
        gap = value - 100 * base["final"]["test_accuracy"]
        limit = MNIST_GAP.get(precision)
    else:
        value = summary["final"]["val_loss"]
        shown = f"{value:.4f}"
        if base is None:
            return shown, "", "fp32 <= 1.90: " + ("met" if value <= 1.90 else "MISSED")
        gap = value - base["final"]["val_loss"]
        limit = GPT_GAP.get(precision)
    delta = f"{gap:+.2f} pt" if task == "mnist" else f"{gap:+.4f}"
    if limit is None:
        return shown, delta, "reported"
    ok = abs(gap) <= limit
    return shown, delta, f"within {limit}: " + ("met" if ok else "MISSED")


def table(out: pathlib.Path, tasks) -> str:
    rows = [
        "| task | precision | result | vs fp32 | target | skipped steps | "
        "final loss scale | time (s) | overrides |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        base = None
        for precision in PRECISIONS:
            path = out / f"{task}_{precision}" / "summary.json"
            if not path.is_file():
                continue
            summary = json.loads(path.read_text())
            shown, delta, target = _cell(task, precision, summary, base)
            if precision == "fp32":
                base = summary
            rows.append(
                f"| {task} | {precision} | {shown} | {delta} | {target} | "
                f"{summary['skipped_steps']} | {summary['final_loss_scale']:g} | "
                f"{summary['seconds']:.0f} | `{' '.join(RUNS[task, precision])}` |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("mnist", "gpt"), action="append")
    parser.add_argument("--out", default="outputs/results", type=pathlib.Path)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument(
        "--precision", choices=PRECISIONS, action="append", help="run only these"
    )
    args = parser.parse_args()
    tasks = args.task or ["mnist", "gpt"]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for task in tasks:
            for precision in args.precision or PRECISIONS:
                run(task, precision, args.out)
    print(table(args.out, tasks))


if __name__ == "__main__":
    main()
