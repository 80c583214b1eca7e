"""Where the unit-scaled GPT's plain FP8 cast loses precision after some training.

Takes a `gpt_unit` run (any precision; by default the learning-rate sweep's float32
width-128, lr-1 run: `python scripts/lr_transfer.py --only u-μP --widths 128 --lrs 1`,
500 steps), copies it, resumes the copy for one step under `recipe=gpt_unit_fp8
precision.keep=[]` (every matmul cast, the readout too) with
`trainer.numerics_every` set to the checkpoint's step, and prints the tensors that are
FP8 in that program: how many of their values are zero (a causal mask makes 49.2% of
the attention probabilities zero; any more was flushed by the cast) and their RMS and
largest value (E4M3 saturates at 448), with the copy's validation loss after that step
next to the float32 run's.

    python scripts/unit_fp8_report.py                       # about 2 minutes
    python scripts/unit_fp8_report.py --run outputs/lr_transfer/umup_w128_lr2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

from lowtrain.numerics import Report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run", type=pathlib.Path, default="outputs/lr_transfer/umup_w128_lr1"
    )
    parser.add_argument("--out", type=pathlib.Path, default="outputs/unit_fp8_report")
    args = parser.parse_args()
    summary = json.loads((args.run / "summary.json").read_text())
    cfg, steps = summary["config"], summary["steps"]
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.run, args.out)
    opt = cfg["optimizer"]
    overrides = [
        "recipe=gpt_unit_fp8",
        "precision.keep=[]",  # every matmul, as documented: the readout too
        f"model.n_embd={cfg['model']['n_embd']}",
        "trainer.resume=true",
        f"trainer.steps={steps + 1}",
        f"optimizer.lr={opt['lr']}",
        f"optimizer.min_lr={opt['min_lr']}",
        f"optimizer.warmup_steps={opt['warmup_steps']}",
        f"data.eval_batches={cfg['data']['eval_batches']}",
        f"trainer.eval_every={steps + 1}",
        f"trainer.checkpoint_every={10 * steps}",
        f"trainer.numerics_every={steps}",
        "trainer.progress=false",
        f"hydra.run.dir={args.out}",
    ]
    subprocess.run([sys.executable, "-m", "lowtrain", *overrides], check=True)
    fp8 = json.loads((args.out / "summary.json").read_text())["final"]["val_loss"]
    record = json.loads((args.out / "numerics.jsonl").read_text().splitlines()[-1])
    report = Report(record["rows"])
    precision = summary["precision"]
    loss = summary["final"]["val_loss"]
    print(f"the {precision} run, step {steps}: val loss {loss:.4f}")
    print(f"one FP8 step later (eval in FP8): val loss {fp8:.4f}\n")
    print("| pass | zero | rms | absmax | shape | tensor (cast to FP8) |")
    print("|---|---:|---:|---:|---|---|")
    for row in report.rows:
        if row["dtype"].startswith("float8") and (
            row["zero"] > 0.01 or row["absmax"] > 100
        ):
            print(
                f"| {row['pass']} | {100 * row['zero']:.1f}% | {row['rms']:.3g} "
                f"| {row['absmax']:.3g} | {row['shape']} | {row['name'][-60:]} |"
            )


if __name__ == "__main__":
    main()
