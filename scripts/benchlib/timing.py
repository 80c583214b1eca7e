"""Train steps, interleaved step timing and cold trace/compile timing."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .models import Case, variant_losses


def make_step(loss_fn: Callable, optimizer: optax.GradientTransformation):
    """A train step (not jitted): value and gradient of `loss_fn` with respect to the
    model's float arrays, then an optimizer step; returns `(model, opt_state, loss)`.

    The optimizer's arithmetic runs on float32 gradients (Adam squares them) and the
    updated parameters keep their dtype (`optax.apply_updates` casts back), so the
    step also serves half-precision weights, `ScaledArray`s under scalify included.
    """

    def step(model, opt_state, *batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        # Only the float arrays: a model may hold other leaves (a bool flag).
        params = optax.apply_updates(params, updates)
        return eqx.combine(params, model), opt_state, loss

    return step


def interleaved(
    fns: dict[str, Callable],
    states: dict[str, tuple],
    batch: tuple,
    *,
    steps: int,
    round_len: int,
    warmup: int,
    per_round: bool = False,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Seconds per step of each `fns[name](*states[name], *batch)`, run in turn, and
    the loss of each one's last step.

    Each function returns its next state and a loss, `(*state, loss)`. After `warmup`
    steps of each (compilation included), the functions alternate in rounds of
    `round_len` steps (A, B, ..., A, B, ...) until each has run `steps` timed steps
    (rounded up to whole rounds), so that a slow spell of a shared machine hits all
    of them alike. Each step is timed until its results are ready; with
    `per_round`, each round is, and its steps queue one after another as in a
    training loop (asynchronous dispatch): one time per round, its mean per step.
    """
    states, losses = dict(states), {}

    def run(name, n=1):
        start = time.perf_counter()
        for _ in range(n):
            *state, loss = fns[name](*states[name], *batch)
            states[name], losses[name] = tuple(state), loss
        jax.block_until_ready((states[name], loss))
        return (time.perf_counter() - start) / n

    for name in fns:
        for _ in range(warmup):
            run(name)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(math.ceil(steps / round_len)):
        for name in fns:
            if per_round:
                times[name].append(run(name, round_len))
            else:
                times[name].extend(run(name) for _ in range(round_len))
    return times, losses


def median_iqr(times: list[float]) -> tuple[float, float]:
    """The median and interquartile range of `times`."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    return statistics.median(times), q3 - q1


def time_steps(case: Case, policy: str, steps: int, round_len: int, warmup: int):
    """`{variant: (median, iqr)}` step seconds of the variants of
    `models.variant_losses` under `policy`, interleaved in rounds."""
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(case.model, eqx.is_inexact_array))
    fns = {
        name: eqx.filter_jit(make_step(loss_fn, optimizer))
        for name, loss_fn in variant_losses(case, policy).items()
    }
    states = {name: (case.model, opt_state) for name in fns}
    times, _ = interleaved(
        fns, states, case.batch, steps=steps, round_len=round_len, warmup=warmup
    )
    return {name: median_iqr(ts) for name, ts in times.items()}


def time_compile(case: Case, policy: str, reps: int) -> dict[str, tuple[Any, Any]]:
    """Median (trace + lower, compile) seconds of the amp and hand steps, from cold."""
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(case.model, eqx.is_inexact_array))
    times: dict[str, list[tuple[float, float]]] = {"amp": [], "hand": []}
    for rep in range(reps):
        for name in ["amp", "hand"] if rep % 2 == 0 else ["hand", "amp"]:
            jax.clear_caches()
            # Fresh functions too, so no tracing cache keyed on them can hit.
            loss_fn = variant_losses(case, policy)[name]  # amp: residuals="all"
            step = eqx.filter_jit(make_step(loss_fn, optimizer))
            start = time.perf_counter()
            lowered = step.lower(case.model, opt_state, *case.batch)
            mid = time.perf_counter()
            lowered.compile()
            end = time.perf_counter()
            times[name].append((mid - start, end - mid))
    return {
        name: (
            statistics.median(t[0] for t in ts),
            statistics.median(t[1] for t in ts),
        )
        for name, ts in times.items()
    }
