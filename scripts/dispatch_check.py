"""The Trainer's step compiled by `lowtrain.train.async_filter_jit` (since git
24d59bd) trains exactly as it did compiled by `eqx.filter_jit`: short runs of four
recipes (FP8 and FP16 with its dynamic loss scale, MNIST and the char-GPT), each
way, compared metric by metric (the timing fields aside) and by their summaries.

    python scripts/dispatch_check.py --out /tmp/dispatch_check

With `--child {async,eqx} <overrides>` it is one such run: `python -m lowtrain`,
with the Trainer's step compiled the given way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import subprocess
import sys

RUNS = {
    "gpt_fp8": ["trainer.steps=30", "optimizer.warmup_steps=3"],
    "gpt_fp16": ["trainer.steps=30", "optimizer.warmup_steps=3"],
    "mnist_fp8": ["trainer.epochs=null", "trainer.steps=60"],
    "mnist_fp16": ["trainer.epochs=null", "trainer.steps=60"],
}
COMMON = ["trainer.log_every=1", "trainer.progress=false"]


def child(mode: str) -> None:
    from benchlib.waiting import waiting_steps

    from lowtrain.__main__ import main

    with waiting_steps() if mode == "eqx" else contextlib.nullcontext():
        main()


def metrics(folder: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    return [{k: v for k, v in r.items() if not k.endswith("per_second")} for r in rows]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        mode = sys.argv[2]
        del sys.argv[1:3]  # the rest are Hydra's
        return child(mode)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="dispatch_check")
    out = pathlib.Path(parser.parse_args().out)
    same = True
    for recipe, overrides in RUNS.items():
        folders = {}
        for mode in ("async", "eqx"):
            folders[mode] = out / mode / recipe
            run_dir = f"hydra.run.dir={folders[mode]}"
            command = [sys.executable, __file__, "--child", mode, f"recipe={recipe}"]
            subprocess.run([*command, *overrides, *COMMON, run_dir], check=True)
        rows = {mode: metrics(folder) for mode, folder in folders.items()}
        summaries = {
            mode: json.loads((folder / "summary.json").read_text())["final"]
            for mode, folder in folders.items()
        }
        equal = rows["async"] == rows["eqx"] and summaries["async"] == summaries["eqx"]
        same &= equal
        print(
            f"{recipe}: {len(rows['async'])} metric lines, final {summaries['async']}"
            f" (async) {summaries['eqx']} (eqx): {'identical' if equal else 'DIFFER'}",
            flush=True,
        )
    sys.exit(0 if same else "The two ways of compiling the step trained differently.")


if __name__ == "__main__":
    main()
