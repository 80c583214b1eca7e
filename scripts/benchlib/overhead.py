"""The Trainer's own overhead: `Trainer.fit` against a plain Python loop calling the
same compiled step (`trainer.compiled_step`) on the same data function."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

from .throughput import Case


def trainer_overhead(
    case: Case, data: Callable[[int], dict], *, chunk: int, rounds: int
) -> dict:
    """Seconds per step of `fit` and of the plain loop, and their ratio.

    Both start from `trainer.init` and run `chunk` steps at a time, alternating
    (fit, plain, plain, fit, ...) for `rounds` rounds after one warm-up chunk each;
    each chunk is timed until its last state is ready. `fit` runs as the recipes run
    it (`log_every` from the config: a metrics line, so a device sync, every
    `log_every` steps; the non-finite loss check one step late), minus the progress
    bar, the evaluation and the checkpoints. The plain loop is
    `state, metrics = trainer.compiled_step(data(s), state)` and nothing else.
    """
    trainer = case.trainer
    log_every = case.config.trainer.log_every
    states = {
        "fit": trainer.init(key=jax.random.key(1)),
        "plain": trainer.init(key=jax.random.key(1)),
    }

    def run_fit(state, start):
        return trainer.fit(
            state, data, steps=start + chunk, log_every=log_every, progress=False
        )

    def run_plain(state, start):
        for s in range(start, start + chunk):
            state, _ = trainer.compiled_step(data(s), state)
        return state

    runs = {"fit": run_fit, "plain": run_plain}
    times: dict[str, list[float]] = {"fit": [], "plain": []}
    for r in range(rounds + 1):
        order = ["fit", "plain"] if r % 2 == 0 else ["plain", "fit"]
        for name in order:
            state = states[name]
            start = int(state.step)  # a sync, outside the timed part
            t0 = time.perf_counter()
            state = jax.block_until_ready(runs[name](state, start))
            seconds = time.perf_counter() - t0
            states[name] = state
            if r > 0:  # round 0 warms up (the first fit call plans, opens, ...)
                times[name].append(seconds / chunk)
    fit, plain = (statistics.median(times[k]) for k in ("fit", "plain"))
    return {
        "fit_s": fit,
        "plain_s": plain,
        "ratio": fit / plain,
        "steps": chunk * rounds,
        "log_every": log_every,
    }
