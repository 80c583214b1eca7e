"""`StepInfo`, what hooks receive, and the hook registry entry."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx

from ._state import TrainState


class StepInfo(eqx.Module):
    """What a hook (`Trainer.add_hook`) receives after a train step.

    `step` is the number of train steps taken so far, this one included, skipped ones
    too: it equals `state.step` after the update, so it is 1 after the first step. A
    hook registered with `every=N` runs when `step % N == 0`. Everywhere else in
    lowtrain (the metrics file, checkpoint names, errors) "step" means the same.

    - `state`: the `TrainState` after the step. `fit` donates it to the next step, so
      copy what you keep (e.g. `jax.tree.map(np.asarray, eqx.filter(...))`).
    - `loss`: this step's loss (float32, unscaled). `aux`: what `loss` returned next
      to it, or None.
    - `loss_scale`: the scale after this step's `adjust` (1.0 without loss scaling).
    - `skipped`: the number of steps skipped so far (non-finite gradients).
    - `grad_norm`: the global L2 norm of this step's unscaled gradients (inf or NaN on
      a skipped step).
    - `learning_rate`: the rate of the most recent applied update (see `Trainer`), or
      None if unknown.
    - `steps_per_second`, `examples_per_second`: measured over the steps since the
      previous `StepInfo` was made (the first window includes compilation).
    - `eval`: the results of `Trainer.run_evaluation` if `fit` evaluated at this step,
      else None.
    - `record`: what `fit` logged at this step (the metrics file's line: the fields
      above, the scalars of a dict `aux`, `eval_<name>`), or None if it did not log.

    `info.stop(reason)` asks `fit` to end after this step (see
    `lowtrain.train.Callback`); `info.stopping` says whether something did.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
    seen = []
    trainer.add_hook(lambda info: seen.append((info.step, info.loss)), every=2)
    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    state = trainer.init(key=jax.random.key(1))
    trainer.fit(state, lambda step: data, steps=4, progress=False)
    assert [s for s, _ in seen] == [2, 4] and seen[1][1] < seen[0][1]
    ```
    """

    step: int
    state: TrainState
    loss: float
    aux: Any
    loss_scale: float
    skipped: int
    grad_norm: float
    learning_rate: float | None
    steps_per_second: float
    examples_per_second: float
    eval: dict[str, float] | None = None
    record: dict[str, Any] | None = None
    _stop: list = eqx.field(repr=False, default_factory=list)

    # Written out: the `__init__` Equinox generates walks every leaf of its
    # arguments, here the whole `TrainState`, at each of `fit`'s logs.
    def __init__(
        self,
        step: int,
        state: TrainState,
        loss: float,
        aux: Any,
        loss_scale: float,
        skipped: int,
        grad_norm: float,
        learning_rate: float | None,
        steps_per_second: float,
        examples_per_second: float,
        eval: dict[str, float] | None = None,
        record: dict[str, Any] | None = None,
        _stop: list | None = None,
    ):
        self.step, self.state, self.loss, self.aux = step, state, loss, aux
        self.loss_scale, self.skipped, self.grad_norm = loss_scale, skipped, grad_norm
        self.learning_rate = learning_rate
        self.steps_per_second = steps_per_second
        self.examples_per_second = examples_per_second
        self.eval = eval
        self.record = record
        self._stop = [] if _stop is None else _stop

    def stop(self, reason: str = "stopped by a callback") -> None:
        """Ask `Trainer.fit` to end after this step: it saves this step's checkpoint
        (with a `checkpoint_dir`), runs `on_fit_end` and returns the state. The
        `reason` (a string) goes to the `lowtrain` logger."""
        self._stop.append(str(reason))

    @property
    def stopping(self) -> bool:
        return bool(self._stop)


def positive_int(value, what: str, *, optional: bool = True) -> int | None:
    """`value` checked to be an int >= 1 (a bool is not), or None when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected an int `{what}` >= 1, got {value!r} instead.")
    return value


def finite_number(value, what: str, *, above: float) -> float | None:
    """`value` checked to be a finite int or float > `above` (a bool is not), or
    None."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not above < value < math.inf
    ):
        raise ValueError(
            f"Expected `{what}` a finite number > {above:g} (or None), got {value!r} "
            "instead."
        )
    return value


class Hook(NamedTuple):
    fn: Callable[[StepInfo], Any]
    every: int
