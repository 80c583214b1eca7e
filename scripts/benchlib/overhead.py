"""The Trainer's own overhead: `Trainer.fit` against a plain Python loop calling the
same compiled step (`trainer.compiled_step`) on the same data function, and, where
the precision has a hand-written twin, against a plain loop of that step (the same
model and optimizer, the loss's casts by hand, `eqx.filter_jit`-style): what a user
pays for `fit` over writing the loop themselves."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

from .throughput import Case, hand_step


def trainer_overhead(
    case: Case, data: Callable[[int], dict], *, chunk: int, rounds: int
) -> dict:
    """Seconds per step of `fit` and of the plain loop, and their ratio; with a
    hand-written twin (`case.hand_loss`), also of the hand loop (`hand_s`) and
    `fit_over_hand`.

    Each starts from the same model and runs `chunk` steps at a time, alternating
    (fit, plain, hand, hand, plain, fit, ...) for `rounds` rounds after one warm-up
    chunk each;
    each chunk is timed until its last state is ready. `fit` runs as the recipes run
    it (`log_every` from the config: a metrics line, so a device sync, every
    `log_every` steps; the non-finite loss check one step late), minus the progress
    bar, the evaluation and the checkpoints. The plain loop is
    `state, metrics = trainer.compiled_step(data(s), state)` and nothing else; the
    hand loop is `benchlib.throughput.hand_step` (the hand-cast loss, its gradient
    and the recipe's optimizer under one jit, no loss scale, no finite check).
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
    steps_of = {"fit": lambda st: int(st.step), "plain": lambda st: int(st.step)}
    if case.hand_loss is not None:
        hand, states["hand"] = hand_step(case)
        done = {"hand": 0}

        def run_hand(state, start):
            model, opt = state
            for s in range(start, start + chunk):
                model, opt, _ = hand(model, opt, data(s))
            done["hand"] = start + chunk
            return model, opt

        runs["hand"] = run_hand
        steps_of["hand"] = lambda st: done["hand"]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 1):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            state = states[name]
            start = steps_of[name](state)  # a sync, outside the timed part
            t0 = time.perf_counter()
            state = jax.block_until_ready(runs[name](state, start))
            seconds = time.perf_counter() - t0
            states[name] = state
            if r > 0:  # round 0 warms up (the first fit call plans, opens, ...)
                times[name].append(seconds / chunk)
    fit, plain = (statistics.median(times[k]) for k in ("fit", "plain"))
    out = {
        "fit_s": fit,
        "plain_s": plain,
        "ratio": fit / plain,
        "steps": chunk * rounds,
        "log_every": log_every,
    }
    if "hand" in times:
        out["hand_s"] = statistics.median(times["hand"])
        out["fit_over_hand"] = fit / out["hand_s"]
    return out
