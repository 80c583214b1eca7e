"""A run whose loss has exploded to finite values stops, as one that reaches inf or
NaN does: `Keras`' `TerminateOnNaN`, extended to the finite blow-ups of float32,
bf16 and FP8 runs (an fp16 run's loss scale catches its own first)."""

from __future__ import annotations

import math

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
