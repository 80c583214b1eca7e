"""The numerics reports of the three FP8 GPT recipes, side by side (the numerics
guide, docs/guides/numerics.md).

Runs `gpt_fp8`, `gpt precision=fp8_naive` and `gpt_scalify_fp8` for `--steps` steps
with `trainer.numerics_every` (a report of the loss-and-gradient program before the
first step and every `--every` steps after), one at a time, each into
`--out/<name>/`; then prints, for each run's first and last report, the tensors an
FP8 cast hurts most: forward tensors judged in E4M3 and backward ones in E5M2 (the
formats FP8 training casts them to), and how many values the FP8 tensors of the
program hold as zeros. `--no-run` reads existing runs. Scale plots of the last
reports go to `--plots` (E4M3 range shaded).

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

from lowtrain.numerics import Report

RUNS = {
    "gpt_fp8": ["recipe=gpt_fp8"],
    "gpt_fp8_naive": ["recipe=gpt", "precision=fp8_naive"],
    "gpt_scalify_fp8": ["recipe=gpt_scalify_fp8"],
}
JUDGE = {"fwd": "float8_e4m3fn", "bwd": "float8_e5m2"}


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


def lost(row: dict) -> float:
    fmt = JUDGE[row["pass"]]
    return row["underflow"][fmt] + row["overflow"][fmt]


def table(report: Report, limit: int) -> list[str]:
    rows = [r for r in report.rows if not r["dtype"].startswith("float8")]
    worst = sorted(rows, key=lambda r: (-lost(r), -r["size"]))[:limit]
    out = [
        "| pass | tensor | dtype[shape] | rms | absmax | underflow | overflow |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in worst:
        fmt = JUDGE[r["pass"]]
        shape = ",".join(map(str, r["shape"]))
        out.append(
            f"| {r['pass']} | `{r['name']}` | {r['dtype']}[{shape}] | {r['rms']:.3g} "
            f"| {r['absmax']:.3g} | {r['underflow'][fmt]:.1%} "
            f"| {r['overflow'][fmt]:.1%} |"
        )
    return out


def casts(report: Report) -> list[str]:
    """Every FP8 tensor of the program: the fraction of its values that are zero
    (a causal mask's zeros are real; the rest were flushed by the cast)."""
    out = [
        "| pass | FP8 tensor | dtype[shape] | rms | zero |",
        "|---|---|---|---:|---:|",
    ]
    for r in report.rows:
        if r["dtype"].startswith("float8"):
            shape = ",".join(map(str, r["shape"]))
            out.append(
                f"| {r['pass']} | `{r['name']}` | {r['dtype']}[{shape}] "
                f"| {r['rms']:.3g} | {r['zero']:.1%} |"
            )
    return out


def summary(report: Report) -> str:
    parts = []
    for pass_, fmt in JUDGE.items():
        rows = [r for r in report.rows if r["pass"] == pass_]
        bad = [r for r in rows if lost(r) > 0.01]
        parts.append(f"{pass_}: {len(bad)} of {len(rows)} tensors lose > 1% in {fmt}")
    fp8 = [r for r in report.rows if r["dtype"].startswith("float8")]
    for pass_ in JUDGE:
        rows = [r for r in fp8 if r["pass"] == pass_]
        if rows:
            size = sum(r["size"] for r in rows)
            zero = sum(r["zero"] * r["size"] for r in rows) / size
            parts.append(f"{pass_} FP8 tensors: {len(rows)}, {zero:.1%} of values zero")
    return "; ".join(parts)


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
        for record in (records[0], records[-1]) if len(records) > 1 else records:
            report = Report(record["rows"])
            print(f"\n### {name}, before step {record['step'] + 1}\n")
            print(summary(report) + ".\n")
            print("\n".join(table(report, args.limit)) + "\n")
            print("\n".join(casts(report)))
        if args.plots is not None:
            args.plots.mkdir(parents=True, exist_ok=True)
            Report(records[-1]["rows"]).plot(args.plots / f"{name}.png")


if __name__ == "__main__":
    main()
