"""Optimizer factories for the `optimizer` config group (`_target_`, `_partial_: true`).

Hydra instantiates `optimizer` as a `functools.partial` of one of these; the recipe
completes it with what only it knows: `total_steps` (for the schedule) and
`decay_mask` (which parameters weight decay applies to). The learning rate is an
`optax.inject_hyperparams` hyperparameter, so `lowtrain.Trainer` logs its value.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import lowtrain.unit_scaling as uu

SCHEDULES = ("cosine", "constant")
log = logging.getLogger("lowtrain")


def make_schedule(
    lr: float, total_steps: int, warmup_steps: int, kind: str, min_lr: float
) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then `lr` constant, or cosine-decayed
    to `min_lr` at `total_steps`. A warmup as long as the run or longer (a short run
    of a recipe made for a long one, `trainer.steps=30`) is shortened to a tenth of
    the run, with a log line saying so."""
    if kind not in SCHEDULES:
        raise ValueError(
            f"Expected `optimizer.schedule` to be one of {', '.join(SCHEDULES)}, got "
            f"{kind!r} instead."
        )
    if warmup_steps < 0:
        raise ValueError(
            f"Expected `optimizer.warmup_steps` >= 0, got {warmup_steps} instead."
        )
    if warmup_steps >= total_steps:
        shorter = total_steps // 10
        log.info(
            "optimizer.warmup_steps=%d is not shorter than the run's %d steps: "
            "warming up over %d steps (a tenth of the run) instead",
            warmup_steps,
            total_steps,
            shorter,
        )
        warmup_steps = shorter
    warmup, decay = float(max(warmup_steps, 1)), float(total_steps - warmup_steps)

    def rate(count):
        # Written out (not optax's schedules) to stay within strict dtype promotion.
        step = jnp.asarray(count).astype(jnp.float32)
        ramp = lr * jnp.minimum(step / warmup, 1.0)
        if kind == "constant":
            return ramp
        t = jnp.clip((step - warmup_steps) / decay, 0.0, 1.0)
        cosine = min_lr + (lr - min_lr) * 0.5 * (1.0 + jnp.cos(math.pi * t))
        return jnp.where(step < warmup_steps, ramp, cosine)

    return rate


def _standard_promotion(tx) -> optax.GradientTransformation:
    # Optax's Adam computes `b1**count` with an int32 count, which JAX refuses under
    # `jax_numpy_dtype_promotion="strict"` (the tests' setting): the optimizer is
    # traced under standard promotion, whatever the caller's setting.
    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def _finish(tx, clip_norm: float | None) -> optax.GradientTransformation:
    if clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return _standard_promotion(tx)


def adamw(
    *,
    total_steps: int,
    decay_mask: Callable | None = None,
    model: Any = None,
    lr: float = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr: float = 0.0,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """AdamW with a warmup + cosine (or constant) schedule, optional clipping.
    (`model` is not read: the standard parametrisation needs nothing from it.)

    ```python
    from lowtrain.recipes import optim

    tx = optim.adamw(total_steps=100, lr=1e-3, warmup_steps=10, clip_norm=1.0)
    ```
    """
    sched = make_schedule(lr, total_steps, warmup_steps, schedule, min_lr)
    # Only the learning rate is injected (and so logged): b1 and b2 stay Python floats,
    # which Adam's bias correction `b1**count` needs under strict dtype promotion.
    tx = optax.inject_hyperparams(
        optax.adamw, static_args=("b1", "b2", "weight_decay", "mask")
    )(learning_rate=sched, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
    return _finish(tx, clip_norm)


def sgd(
    *,
    total_steps: int,
    decay_mask: Callable | None = None,
    model: Any = None,
    lr: float = 0.1,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr: float = 0.0,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """SGD with momentum and L2 weight decay (added to the gradient), scheduled as
    `adamw`.

    ```python
    from lowtrain.recipes import optim

    tx = optim.sgd(total_steps=100, lr=0.1, momentum=0.9, weight_decay=5e-4)
    ```
    """
    sched = make_schedule(lr, total_steps, warmup_steps, schedule, min_lr)
    tx = optax.inject_hyperparams(optax.sgd, static_args=("momentum", "nesterov"))(
        learning_rate=sched, momentum=momentum or None, nesterov=nesterov
    )
    if weight_decay:
        decay = optax.add_decayed_weights(weight_decay, mask=decay_mask)
        tx = optax.chain(decay, tx)
    return _finish(tx, clip_norm)


def umup_adamw(
    *,
    total_steps: int,
    model: Any,
    decay_mask: Callable | None = None,
    lr: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.999,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr: float = 0.0,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """`lowtrain.unit_scaling.optim.adamw` (u-μP: each parameter's learning rate
    from its kind, fan-in and depth in `model`) under `adamw`'s schedule; weight
    decay is u-μP's (decoupled, independent of the learning rate), on every
    parameter (`decay_mask` is not read).

    ```python
    import jax
    import lowtrain.unit_scaling as uu
    from lowtrain.recipes import optim

    model = uu.Linear(4, 4, key=jax.random.key(0))
    tx = optim.umup_adamw(total_steps=100, model=model, lr=0.1, warmup_steps=10)
    ```
    """
    sched = make_schedule(lr, total_steps, warmup_steps, schedule, min_lr)
    tx = uu.optim.adamw(
        sched, b1, b2, weight_decay=weight_decay, model=model, peak_learning_rate=lr
    )
    return _finish(tx, clip_norm)
