"""Step and compile time of a tracked training step (`lowtrain.numerics.track`)
against the same step untracked, on the recipes' char-GPT.

The model is the GPT of `bench.py amp`, the recipes' own
(`scripts/benchlib/models.py`: `lowtrain.recipes.gpt.GPT`, 4 layers, width 128,
context 64, batch 16, the blocks under `lax.scan`). Rows:

- `float32, every tensor`: `track(step)` of the float32 train step
  (`benchlib.timing.make_step`: forward, gradient, an `optax.adam` update), every
  float tensor of the forward, backward and update, against the same step jitted;
- `<precision>, casts`: what a Trainer's numerics report and the FP8 autopilot
  (`precision.auto=true`) track, `track(loss_and_grads, casts=True)` of the
  Trainer's loss and gradients under the recipes' precision (`fp8`, `fp8_naive`,
  `scalify_fp8`: each FP8 cast after its scale), against the Trainer's own
  compiled train step (update included) under that precision.

Both times include building the `Report` on the host. Medians of interleaved
rounds, in one process; the ratios are what we report. The compile times are a
lower + compile of each program, before any is run.

    python scripts/bench.py numerics            # some minutes on 2 CPU cores
    python scripts/bench.py numerics --quick    # fewer timed steps
    python scripts/bench.py numerics --only fp8,scalify_fp8
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import optax

import lowtrain.numerics
from lowtrain.numerics.internal import tracked_call
from lowtrain.recipes import gpt, precisions

from . import models, report, timing

PRECISIONS = {
    "fp8": lambda: precisions.amp("fp8"),
    "fp8_naive": lambda: precisions.naive_fp8("bf16"),
    "scalify_fp8": lambda: precisions.scalify(fp8=True),
}


def _compile_seconds(jitted, *args) -> float:
    start = time.perf_counter()
    jitted.lower(*args).compile()
    return time.perf_counter() - start


def _alternate(fns: dict, steps: int, rounds: int) -> dict[str, float]:
    # Median seconds of each `fns[name]()` (which waits for its results), one warm-up
    # call each, then `rounds` rounds of `steps` calls of each in turn.
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _compare(label, plain, tracked, fn, args, casts, steps, rounds) -> dict:
    # `plain(*args)` (jitted) against `tracked(*args)` (`fn` tracked): compile
    # times first, then interleaved timings; the report's row count.
    rows = []

    def run_tracked():
        _, report_ = tracked(*args)
        rows.append(len(report_.rows))

    def run_plain():
        jax.block_until_ready(plain(*args))

    with jax.numpy_dtype_promotion("standard"):
        compile_plain = _compile_seconds(plain, *args)
        compile_tracked = _compile_seconds(tracked_call, fn, args, {}, casts)
        times = _alternate({"plain": run_plain, "tracked": run_tracked}, steps, rounds)
    return {
        "step": label,
        "plain": times["plain"],
        "tracked": times["tracked"],
        "rows": rows[-1],
        "compile": (compile_plain, compile_tracked),
    }


def every_tensor(case, steps: int, rounds: int) -> dict:
    """The float32 step tracked in full against the plain one."""
    opt = optax.adam(1e-3)
    step = timing.make_step(models.loss, opt)
    state = (case.model, opt.init(eqx.filter(case.model, eqx.is_inexact_array)))
    label = f"{case.name}, float32, every tensor"
    tracked = lowtrain.numerics.track(step)
    args = (*state, *case.batch)
    return _compare(
        label, eqx.filter_jit(step), tracked, step, args, False, steps, rounds
    )


def casts(case, name: str, steps: int, rounds: int) -> dict:
    """The Trainer's step under precision `name` against its casts report."""
    trainer = gpt.GptTrainer(case.model, optax.adam(1e-3), precision=PRECISIONS[name]())
    x, y = case.batch
    batch = trainer.shard_batch({"x": x, "y": y})
    state = trainer.init(key=jax.random.key(0))

    def loss_and_grads(batch, s):
        ((loss, _), grads, _), _, _ = trainer.loss_and_grads(s, batch)
        return grads, {"loss": loss}

    fn = trainer.precision.wrap_step(loss_and_grads)
    tracked = lowtrain.numerics.track(fn, casts=True)
    step = trainer.precision.wrap_step(lambda b, s: trainer.train_step(s, b))
    plain = eqx.filter_jit(step)  # not donating: the state is reused
    label = f"{case.name}, {name}, casts"
    return _compare(label, plain, tracked, fn, (batch, state), True, steps, rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py numerics", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument(
        "--only",
        default="float32," + ",".join(PRECISIONS),
        help="rows to run: float32 (every tensor) and/or " + ", ".join(PRECISIONS),
    )
    args = parser.parse_args(argv)
    steps, rounds = (3, 2) if args.quick else (5, 4)
    case = models.make_cases()[1]  # the GPT
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = set(wanted) - {"float32", *PRECISIONS}
    if unknown:
        parser.error(
            f"expected rows among float32, {', '.join(PRECISIONS)}, got "
            f"{', '.join(sorted(unknown))}"
        )
    lines = [
        f"Machine: {report.machine()}",
        "",
        "| step | plain (ms) | tracked (ms) | tracked / plain | report rows "
        "| compile plain / tracked (s) | compile ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name in wanted:
        if name == "float32":
            row = every_tensor(case, steps, rounds)
        else:
            row = casts(case, name, steps, rounds)
        cp, ct = row["compile"]
        line = (
            f"| {row['step']} | {1e3 * row['plain']:.1f} | {1e3 * row['tracked']:.1f} "
            f"| **{row['tracked'] / row['plain']:.2f}** | {row['rows']} "
            f"| {cp:.1f} / {ct:.1f} | **{ct / cp:.2f}** |"
        )
        print(line, flush=True)
