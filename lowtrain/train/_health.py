"""Whether a run is still training, checked after each step (`HealthCheck`): a
non-finite loss, a step skipped with the loss scale at its floor, too many skipped
in a row, and a loss that has exploded to finite values (`DivergenceCheck`: Keras'
`TerminateOnNaN`, extended to the finite blow-ups of float32, bf16 and FP8 runs; an
fp16 run's loss scale catches its own first) each stop it with a
`FloatingPointError` that says what to change."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._hooks import finite_number, positive_int


class DivergenceCheck:
    """Raises `FloatingPointError` once the loss has been above `factor` times the
    best (lowest) loss seen, and above the first loss of the fit, at `patience`
    checked steps in a row. Positive losses only: a loss at or below 0 (a negative
    log-likelihood, say) is never judged. `factor=None` turns it off.

    """

    def __init__(self, factor: float | None = 1e4, patience: int = 20):
        self.factor = finite_number(factor, "diverge_factor", above=1)
        self.patience = positive_int(patience, "diverge_patience", optional=False)
        self.reset()

    def reset(self) -> None:
        """Forget the losses seen (a new `fit`)."""
        self._first: float | None = None
        self._best: tuple[int, float] | None = None  # (step, loss)
        self._above = 0

    def update(self, step: int, loss: float) -> None:
        """Note the (finite) loss of the update from `state.step == step`."""
        if self.factor is None or not math.isfinite(loss) or loss <= 0:
            return
        if self._first is None:
            self._first = loss
        if self._best is None or loss < self._best[1]:
            self._best = (step, loss)
        best_step, best = self._best
        if loss > self.factor * best and loss > self._first:
            self._above += 1
        else:
            self._above = 0
        if self._above >= self.patience:
            raise FloatingPointError(
                f"The run diverged: the loss was {loss:.4g} at train step {step + 1}, "
                f"above {self.factor:g}x the best loss ({best:.4g}, step "
                f"{best_step + 1}) and the first ({self._first:.4g}) for "
                f"{self._above} steps in a row. Lower the learning rate (or warm it "
                "up), clip the gradients, or check the data; `diverge_factor` and "
                "`diverge_patience` set this check (None turns it off)."
            )


class HealthCheck:
    """What one `Trainer.fit` checks of each step's `health` (see
    `Trainer.train_step`): the Trainer's `stop_on_nonfinite`,
    `max_consecutive_skips` and divergence check (reset here), and the loss scale's
    floor."""

    def __init__(self, stop_on_nonfinite: bool, max_skips: int | None, divergence):
        self.stop_on_nonfinite = stop_on_nonfinite
        self.max_skips = max_skips
        self.divergence = divergence
        divergence.reset()  # a new fit: no losses seen

    def __call__(self, step: int, health, min_scale) -> None:
        """Check `health` of the update from `state.step == step` (raises
        `FloatingPointError`)."""
        loss, applied, in_a_row, at_floor = jax.device_get(health)
        loss, applied, in_a_row = float(loss), bool(applied), int(in_a_row)
        if not math.isfinite(loss) and (applied or self.stop_on_nonfinite):
            check_loss(step, loss, applied)
        if at_floor and not applied:
            raise FloatingPointError(
                f"Train step {step + 1} was skipped with the loss scale at its "
                f"minimum ({min_scale:g}): its gradients are not finite "
                "even unscaled, and backing off cannot help. The run diverged or the "
                "batch holds inf/NaN. Lower the learning rate, check batch "
                f"`data({step})`, or train in bf16 (float32's range)."
            )
        self.divergence.update(step, loss)
        limit = self.max_skips
        if limit is not None and in_a_row >= limit:
            raise FloatingPointError(
                f"{in_a_row} train steps in a row were skipped (non-finite "
                f"gradients), up to step {step + 1}: the run is not training. "
                "Lower the learning rate, check the data for inf/NaN, start the loss "
                "scale lower, or train in bf16; `max_consecutive_skips` "
                f"(now {limit}) sets this limit."
            )


def check_loss(step: int, loss, applied: bool = False) -> None:
    value = float(loss)
    if math.isfinite(value):
        return
    where = (
        f"at train step {step + 1} (the update from `state.step == {step}`, on batch "
        f"`data({step})`)"
    )
    if applied:
        raise FloatingPointError(
            f"The loss is {value} {where}, but its gradients were finite, so the "
            "step was applied: the loss reads values its gradients do not, such as "
            "labels outside the number of classes (a gather out of range gives NaN) "
            "or a log of 0. Check the batch's labels and the loss."
        )
    raise FloatingPointError(
        f"The loss is {value} {where}. Expected a finite loss: without loss scaling "
        "this means the run diverged or the batch holds inf/NaN. Lower the learning "
        "rate, check that batch, train with a `lowtrain.DynamicLossScale`, or pass "
        "`stop_on_nonfinite=False` to the Trainer to skip such steps (non-finite "
        "gradients leave the model unchanged and count in `state.skipped`)."
    )


def skips_in_a_row(opt_state) -> Array:
    # The Trainer's optimizer state is `optax.apply_if_finite`'s (or lowtrain's
    # select version of it): `notfinite_count` counts the skips in a row.
    return jnp.asarray(getattr(opt_state, "notfinite_count", 0), jnp.int32)
