"""Step time of a tracked training step (`lowtrain.numerics.track`) against the same
step untracked.

The model is the GPT of `bench.py amp`, the recipes' own
(`scripts/benchlib/models.py`: `lowtrain.recipes.gpt.GPT`, 4 layers, width 128,
context 64, batch 16, the blocks under `lax.scan`), in float32. Both steps are the
same Python function (`benchlib.timing.make_step`: forward, gradient, an
`optax.adam` update) jitted with `eqx.filter_jit`; the tracked one is
`lowtrain.numerics.track(step)` and its time includes building the `Report` on the
host (every float tensor of the forward, backward and update). Medians of
interleaved rounds, in one process; the ratio is what we report. The compile
times are a lower + compile of each program, before any is run.

    python scripts/bench.py numerics            # a few minutes on 2 CPU cores
    python scripts/bench.py numerics --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import optax

import lowtrain.numerics
from lowtrain.numerics._track import _tracked_call

from . import models, report, timing


def _compile_seconds(jitted, *args) -> float:
    start = time.perf_counter()
    jitted.lower(*args).compile()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py numerics", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    args = parser.parse_args(argv)
    steps, rounds = (3, 2) if args.quick else (5, 4)
    case = models.make_cases()[1]  # the GPT
    opt = optax.adam(1e-3)
    step = timing.make_step(models.loss, opt)
    tracked = lowtrain.numerics.track(step)
    rows = []

    def run_tracked(*args):
        outs, report_ = tracked(*args)
        rows.append(len(report_.rows))
        return outs

    fns = {"plain": eqx.filter_jit(step), "tracked": run_tracked}
    state = (case.model, opt.init(eqx.filter(case.model, eqx.is_inexact_array)))
    with jax.numpy_dtype_promotion("standard"):
        compile_plain = _compile_seconds(fns["plain"], *state, *case.batch)
        compile_tracked = _compile_seconds(
            _tracked_call, step, (*state, *case.batch), {}
        )
        times, _ = timing.interleaved(
            fns,
            {"plain": state, "tracked": state},
            case.batch,
            steps=steps * rounds,
            round_len=steps,
            warmup=1,
        )
    plain, track = (statistics.median(times[k]) for k in ("plain", "tracked"))
    print(
        "\n".join(
            [
                f"Machine: {report.machine()}",
                "",
                "| step | timed steps | plain (ms) | tracked (ms) | tracked / plain "
                "| report rows | compile plain / tracked (s) |",
                "|---|---:|---:|---:|---:|---:|---:|",
                f"| {case.name}, float32 | {len(times['plain'])} | {1e3 * plain:.1f} "
                f"| {1e3 * track:.1f} | **{track / plain:.2f}** | {rows[-1]} "
                f"| {compile_plain:.1f} / {compile_tracked:.1f} |",
            ]
        )
    )
