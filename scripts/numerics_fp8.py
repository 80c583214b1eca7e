"""The numerics reports of the three FP8 GPT recipes, side by side
(docs/numerics.md).

Runs `gpt_fp8`, `gpt precision=fp8_naive` and `gpt_scalify_fp8` for `--steps` steps
with `trainer.numerics_every` (a casts report of the loss-and-gradient program
before the first step and every `--every` steps after: each cast the precision
performs, judged after its scale in the format it casts to), one at a time, each
into `--out/<name>/`; then prints, for each run's first and last report, how many
casts lose more than 1% per format, the worst casts with what fixes them
(`lowtrain.numerics.worst_casts`) and the plan the autopilot would make from the
report (`lowtrain.numerics.plan`, default thresholds). `--no-run` reads existing
runs. Scale plots of the last reports, the plan marked, go to `--plots`.

    nice -n 5 python scripts/numerics_fp8.py --steps 1 --every 1 \\
        --out outputs/numerics --plots docs/numerics   # at initialisation
    nice -n 5 python scripts/numerics_fp8.py --steps 201 --every 200 ...  # and later
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from lowtrain.numerics import Report, plan, worst_casts

RUNS = {
    "gpt_fp8": ["recipe=gpt_fp8"],
    "gpt_fp8_naive": ["recipe=gpt", "precision=fp8_naive"],
    "gpt_scalify_fp8": ["recipe=gpt_scalify_fp8"],
}


def run(name: str, steps: int, every: int, out: pathlib.Path) -> None:
    # Fewer steps than the schedule's 100 warmup steps: no warmup (the report before
    # the first step does not depend on it).
    warmup = [] if steps > 100 else ["optimizer.warmup_steps=0"]
    args = [
        *RUNS[name],
        *warmup,
        f"trainer.steps={steps}",
        f"trainer.numerics_every={every}",
        f"trainer.eval_every={steps}",
        "trainer.progress=false",
        f"hydra.run.dir={out / name}",
    ]
    subprocess.run([sys.executable, "-m", "lowtrain", *args], check=True)


def percent(x: float) -> str:
    return f"{100 * x:.3g}%"  # 3 digits: a loss of 1e-5 is not shown as 0.0%


def lost(row: dict) -> float:
    fmt = row["dtype"]
    return row["underflow"][fmt] + row["overflow"][fmt]


def summary(report: Report) -> str:
    """Casts per format and how many lose more than 1% of their values."""
    parts = []
    for fmt in sorted({r["dtype"] for r in report.rows}):
        rows = [r for r in report.rows if r["dtype"] == fmt]
        bad = sum(lost(r) > 0.01 for r in rows)
        parts.append(f"{len(rows)} casts to {fmt}, {bad} losing > 1%")
    return "; ".join(parts) or "no casts"


def worst(report: Report, limit: int) -> list[str]:
    out = [
        "| pass | cast | format[shape] | rms | absmax | flushed | saturated | fix |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for w in worst_casts(report, limit):
        shape = ",".join(map(str, w["shape"]))
        role = f" ({w['role']})" if w["role"] else ""
        out.append(
            f"| {w['pass']} | `{w['name']}`{role} | {w['dtype']}[{shape}] "
            f"| {w['rms']:.3g} | {w['absmax']:.3g} | {percent(w['underflow'])} "
            f"| {percent(w['overflow'])} | {w['advice']} |"
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=101)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--limit", type=int, default=8, help="rows per table")
    parser.add_argument("--out", type=pathlib.Path, default="outputs/numerics")
    parser.add_argument("--plots", type=pathlib.Path, default=None)
    parser.add_argument("--no-run", action="store_true", help="read existing runs")
    parser.add_argument(
        "--only", nargs="*", default=list(RUNS), help="runs to make and read"
    )
    args = parser.parse_args()
    for name in args.only:
        if not args.no_run:
            run(name, args.steps, args.every, args.out)
        path = args.out / name / "numerics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        reports = [Report(r["rows"], kind=r.get("kind", "all")) for r in records]
        for record, report in list(zip(records, reports))[:: max(len(records) - 1, 1)]:
            if report.kind != "casts":
                raise SystemExit(f"{path}: expected casts reports, got {report.kind}")
            print(f"\n### {name}, before step {record['step'] + 1}\n")
            print(summary(report) + ".\n")
            print("\n".join(worst(report, args.limit)) + "\n")
            if plan(report).matmuls:  # scalify's FP8 casts are not matmul sites
                print("```\n" + plan(report).table() + "\n```")
        if args.plots is not None:
            args.plots.mkdir(parents=True, exist_ok=True)
            last = reports[-1]
            decided = plan(last) if last.rows else None
            last.plot(args.plots / f"{name}.png", plan=decided)


if __name__ == "__main__":
    main()
