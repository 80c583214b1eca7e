"""Run every recipe to the end and print the results table of docs/results.md.

    python scripts/recipe_results.py                 # all: MNIST, then the GPT
    python scripts/recipe_results.py --task gpt      # one task
    python scripts/recipe_results.py --table-only    # re-read the summaries in --out
    python scripts/recipe_results.py --unit          # the unit-scaled models
    python scripts/recipe_results.py --block         # the block-scaled precisions
    python scripts/recipe_results.py --task gpt_gpu --precision fp32 \\
        --precision bf16 --precision fp8             # on a GPU: the GPU-size GPT

Each run is `python -m lowtrain <overrides> hydra.run.dir=<out>/<task>_<precision>`,
one after the other (they share the CPU otherwise); its log is `<out>/<name>.log`.
The targets (each precision's largest distance to fp32) are in `MNIST_GAP`,
`GPT_GAP` and `UNIT_TARGETS`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8_naive", "scalify_fp8", "fp8_delayed")
GPU_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8_delayed")  # recipe=gpt_gpu_*
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
# The char-GPT at nanoGPT's shakespeare-char GPU size (`recipe=gpt_gpu_*`,
# 5000 steps of batch 64 x 256): for a GPU, its val loss reported (no fp32 target:
# nanoGPT's 1.47 is on a fifth of this corpus), the others held to GPT_GAP.
RUNS.update({("gpt_gpu", p): [f"recipe=gpt_gpu_{p}"] for p in GPU_PRECISIONS})
# The largest distance to fp32 each precision may have (None: reported only).
MNIST_GAP = {p: 0.3 for p in ("bf16", "fp16", "fp8", "scalify_fp8", "fp8_delayed")}
GPT_GAP = {
    "fp16": 0.02,
    "fp8": 0.05,
    "scalify_fp8": 0.05,
    "fp8_delayed": 0.05,
}  # nats/char; bf16: no target, reported


# The unit-scaled models (u-μP's AdamW), each precision a plain cast: no
# loss scale, no per-tensor scales. (task, precision) -> overrides, as RUNS.
UNIT_RUNS = {
    ("gpt_unit", "fp32"): ["recipe=gpt_unit_fp32"],
    ("gpt_unit", "bf16"): ["recipe=gpt_unit_bf16"],
    ("gpt_unit", "fp16"): ["recipe=gpt_unit_fp16"],
    ("gpt_unit", "fp8"): ["recipe=gpt_unit_fp8"],  # the readout stays bf16
    ("gpt_unit", "fp8_naive"): ["recipe=gpt_unit_fp8", "precision.keep=[]"],  # all
    ("mnist_unit", "fp8"): ["recipe=mnist_unit_fp8"],
}
# The line each unit-scaled run is held against: (task, precision, largest gap).
UNIT_TARGETS = {
    ("gpt_unit", "fp32"): ("gpt", "fp32", 0.05),  # the standard GPT, same steps
    ("gpt_unit", "fp8"): ("gpt_unit", "fp32", 0.03),
}
# The block-scaled precisions on the char-GPT, each held against gpt_bf16: (task,
# name) -> (overrides, largest gap to bf16 or None: reported). NVFP4's recipe
# (`recipe=gpt_nvfp4`: all four parts), each part switched off in turn over the
# first 500 steps (task gpt500, against bf16 and the full recipe over as many), and
# the autopilot choosing the format of each matmul (which must also keep at least
# half of the matmul FLOPs in NVFP4).
AUTO_FORMATS = [
    "recipe=gpt_nvfp4",
    "precision.keep=[]",
    "precision.auto=true",
    "precision.formats=[nvfp4,mxfp8,fp8]",
]
BLOCK_RUNS = {
    ("gpt", "bf16"): (["recipe=gpt_bf16"], None),
    ("gpt", "mxfp8"): (["recipe=gpt_mxfp8"], 0.01),
    ("gpt", "fp8_block"): (["recipe=gpt_fp8_block"], None),
    ("gpt", "nvfp4"): (["recipe=gpt_nvfp4"], 0.05),
    ("gpt", "nvfp4_head_nvfp4"): (["recipe=gpt_nvfp4", "precision.keep=[]"], None),
    ("gpt", "nvfp4_auto"): (AUTO_FORMATS, 0.03),
    **{
        ("gpt500", name): ([*overrides, "trainer.steps=500"], None)
        for name, overrides in {
            "bf16": ["recipe=gpt_bf16"],
            "nvfp4": ["recipe=gpt_nvfp4"],
            "nvfp4_no_weight_2d": ["recipe=gpt_nvfp4", "precision.weight_2d=false"],
            "nvfp4_no_hadamard": ["recipe=gpt_nvfp4", "precision.hadamard=false"],
            "nvfp4_no_stochastic": ["recipe=gpt_nvfp4", "precision.stochastic=false"],
            "nvfp4_head_nvfp4": ["recipe=gpt_nvfp4", "precision.keep=[]"],
        }.items()
    },
}
AUTO_NVFP4_SHARE = 0.5  # the autopilot's NVFP4 share of the matmul FLOPs, at least
# The standard GPT's lines of docs/results.md (this script, seed 0), used when --out
# does not hold those runs: the unit-scaled lines need not rerun them.
DOCUMENTED_GPT = {"fp32": 1.6645, "fp8_naive": 3.5440, "bf16": 1.6602}


def run(task: str, precision: str, out: pathlib.Path) -> None:
    name = f"{task}_{precision}"
    overrides = {**RUNS, **UNIT_RUNS, **_block_overrides()}[task, precision]
    command = [
        *(sys.executable, "-m", "lowtrain", *overrides),
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
        if base is None and task == "gpt_gpu":
            return shown, "", "reported"
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


def _summary(out: pathlib.Path, task: str, precision: str) -> dict | None:
    path = out / f"{task}_{precision}" / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    if task == "gpt" and precision in DOCUMENTED_GPT:
        value = DOCUMENTED_GPT[precision]
        return {"final": {"val_loss": value}, "seconds": None, "documented": True}
    return None


def unit_table(out: pathlib.Path) -> str:
    """The unit-scaled models' table: the standard GPT in fp32 and naive FP8 (from
    `--out`'s `gpt_fp32` and `gpt_fp8_naive` runs), then the unit-scaled lines."""
    rows = [
        "| model | precision | result | target | time (s) | overrides |",
        "|---|---|---|---|---|---|",
    ]
    lines = [("gpt", "fp32"), ("gpt", "fp8_naive"), *UNIT_RUNS]
    for task, precision in lines:
        summary = _summary(out, task, precision)
        overrides = " ".join({**RUNS, **UNIT_RUNS}[task, precision])
        if summary is None:
            rows.append(f"| {task} | {precision} | not run | | | `{overrides}` |")
            continue
        if task.startswith("mnist"):
            value = 100 * summary["final"]["test_accuracy"]
            shown, ok = f"{value:.2f}%", value >= 98.0
            target = ">= 98.0%: " + ("met" if ok else "MISSED")
        else:
            value = summary["final"]["val_loss"]
            shown, target = f"{value:.4f}", "reported"
            if (task, precision) in UNIT_TARGETS:
                *ref, limit = UNIT_TARGETS[task, precision]
                base = _summary(out, *ref)
                if base is None:
                    target = f"vs {'_'.join(ref)}: not run"
                else:
                    gap = value - base["final"]["val_loss"]
                    met = "met" if abs(gap) <= limit else "MISSED"
                    target = f"{gap:+.4f} vs {'_'.join(ref)}, within {limit}: {met}"
        if summary.get("documented"):
            shown, seconds = f"{shown} (docs/results.md)", ""
        else:
            seconds = f"{summary['seconds']:.0f}"
        rows.append(
            f"| {task} | {precision} | {shown} | {target} | {seconds} | `{overrides}` |"
        )
    return "\n".join(rows)


def _block_overrides() -> dict:
    return {key: overrides for key, (overrides, _) in BLOCK_RUNS.items()}


def block_table(out: pathlib.Path) -> str:
    """The block-scaled precisions' table: each line against the bf16 line of its
    task (gpt: `--out`'s gpt_bf16, or the documented one; gpt500: its own)."""
    rows = [
        "| steps | precision | val loss | vs bf16 | target | matmul FLOPs | "
        "time (s) | overrides |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (task, name), (overrides, limit) in BLOCK_RUNS.items():
        steps = 500 if task == "gpt500" else 2000
        shown_overrides = " ".join(overrides)
        summary = _summary(out, task, name)
        if summary is None:
            continue  # not run
        value = summary["final"]["val_loss"]
        base = _summary(out, task, "bf16")
        gap = None if base is None else value - base["final"]["val_loss"]
        delta = "" if gap is None or name == "bf16" else f"{gap:+.4f}"
        auto = summary.get("auto")
        shares = (auto or {}).get("shares") or {}
        formats = ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
        target = "reported"
        if limit is not None and gap is not None:
            met = abs(gap) <= limit
            target = f"within {limit}"
            if name == "nvfp4_auto":
                met = met and shares.get("nvfp4", 0.0) >= AUTO_NVFP4_SHARE
                target += f", NVFP4 >= {AUTO_NVFP4_SHARE:.0%}"
            target += ": " + ("met" if met else "MISSED")
        if summary.get("documented"):
            shown, seconds = f"{value:.4f} (docs/results.md)", ""
        else:
            shown, seconds = f"{value:.4f}", f"{summary['seconds']:.0f}"
        rows.append(
            f"| {steps} | {name} | {shown} | {delta} | {target} | {formats} | "
            f"{seconds} | `{shown_overrides}` |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--task",
        choices=("mnist", "gpt", "gpt_gpu", "gpt_unit", "mnist_unit"),
        action="append",
        help="run only these (the last two with --unit)",
    )
    parser.add_argument("--out", default="outputs/results", type=pathlib.Path)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument(
        "--precision", choices=PRECISIONS, action="append", help="run only these"
    )
    parser.add_argument(
        "--unit",
        action="store_true",
        help="the unit-scaled runs (UNIT_RUNS) and their table instead",
    )
    parser.add_argument(
        "--block",
        action="store_true",
        help="the block-scaled runs (BLOCK_RUNS) and their table instead; "
        "--only NAME runs one (e.g. nvfp4_auto, gpt500_nvfp4_no_hadamard)",
    )
    parser.add_argument("--only", action="append", help="with --block: these runs")
    args = parser.parse_args()
    if args.block:
        args.out.mkdir(parents=True, exist_ok=True)
        for task, name in BLOCK_RUNS:
            label = name if task == "gpt" else f"{task}_{name}"
            if args.table_only or (args.only and label not in args.only):
                continue
            run(task, name, args.out)
        print(block_table(args.out))
        return
    tasks = args.task or ["mnist", "gpt"]
    if not args.unit and {"gpt_unit", "mnist_unit"} & set(tasks):
        parser.error("--task gpt_unit and mnist_unit need --unit")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.unit:
        for task, precision in UNIT_RUNS:
            chosen = (args.precision is None or precision in args.precision) and (
                args.task is None or task in args.task
            )
            if not args.table_only and chosen:
                run(task, precision, args.out)
        print(unit_table(args.out))
        return
    if not args.table_only:
        for task in tasks:
            for precision in args.precision or PRECISIONS:
                if (task, precision) in RUNS:  # gpt_gpu: GPU_PRECISIONS only
                    run(task, precision, args.out)
    print(table(args.out, tasks))


if __name__ == "__main__":
    main()
