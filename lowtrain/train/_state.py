"""`TrainState`: everything a training run needs to continue exactly."""

from __future__ import annotations

import equinox as eqx
import jax
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._loss_scale import AbstractLossScale


class TrainState(eqx.Module):
    """The full state of a training run: saving it and loading it resumes exactly.

    - `step` (int32 scalar): the number of train steps taken since `Trainer.init`,
      skipped ones included. The step that takes `step` from `s` to `s + 1` uses batch
      `data(s)` and key `jax.random.fold_in(key, s)`.
    - `model`: the model, its float arrays in the policy's `param_dtype`.
    - `opt_state`: the optimizer state: `optax.apply_if_finite`'s state around yours.
    - `loss_scale`: a `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`.
    - `key`: the run's base PRNG key; it never changes (see `step`).
    - `model_state`: the model's state (`eqx.nn.State`: BatchNorm's running
      statistics, spectral norm's vectors) when the `Trainer` has a `model_state`,
      else None. It is not differentiated or optimised: the loss returns its new
      value (see `Trainer.loss`).

    `skipped` is the number of steps whose gradients were non-finite and so left the
    model and the optimizer state unchanged.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = Fit(model, optax.sgd(0.1)).init(key=jax.random.key(1))
    assert int(state.step) == 0 and int(state.skipped) == 0
    ```
    """

    step: Int[Array, ""]
    model: PyTree
    opt_state: PyTree
    loss_scale: AbstractLossScale
    key: PRNGKeyArray
    model_state: PyTree = None

    @property
    def skipped(self) -> Int[Array, ""]:
        if not isinstance(self.opt_state, optax.ApplyIfFiniteState):
            raise TypeError(
                "Expected `opt_state` to be the `optax.ApplyIfFiniteState` that "
                "`lowtrain.Trainer` builds, got "
                f"{type(self.opt_state).__name__} instead. Build the state with "
                "`Trainer.init`."
            )
        return self.opt_state.total_notfinite


def check_model_state(model_state: PyTree) -> PyTree:
    """`model_state` (the `Trainer`'s argument), or an error naming what a model
    state must be: None or a pytree of arrays."""
    if model_state is None:
        return None
    leaves = jax.tree.leaves(model_state)
    if not leaves or not all(eqx.is_array(x) for x in leaves):
        raise TypeError(
            "Expected `model_state` to be the state of a stateful model, a pytree of "
            "arrays such as `eqx.nn.State` (from `eqx.nn.make_with_state`), got "
            f"{type(model_state).__name__} with "
            f"{'no arrays' if not leaves else 'leaves that are not arrays'} instead."
        )
    return model_state
