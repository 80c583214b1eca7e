"""`Precision`: how the Trainer runs a model in low precision, as hooks it calls at
fixed points of its step; `Chain` composes several."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from .._loss_scale import AbstractLossScale


class Precision(eqx.Module):
    """The transform protocol of `lowtrain.Trainer`: one object per way of running a
    model in low precision (AMP, scalify, FP8 delayed scaling, op rewrites, ...).

    The Trainer calls these hooks, and only these, at fixed points. This base class
    is the identity everywhere (float32, as written); an implementation overrides
    what it needs. Each hook's meaning:

    Once, in `Trainer.init`:
    - `cast_params(model)`: the model with its parameters in their stored dtype; the
      optimizer state is initialised on its float arrays, through `to_optimizer`.
    - `store(model, opt_state)`: both in the form the step carries them (scalify:
      `ScaledArray`s).
    - `default_loss_scale()`: the loss scale to use when the Trainer is given none,
      or None for no opinion (then `NoOpLossScale()`).

    In the compiled step, in this order (`Trainer.train_step`):
    - `wrap_step(step)`: the whole step, `step(*args) -> (carry, metrics)`, as it
      runs (scalify runs it under `lowtrain.scalify.scalify`); the wrapped step must
      return `metrics` as plain arrays. Evaluation runs through it too.
    - `inputs(batch)`: the batch as the model is fed it.
    - `wrap_model(model)`: what `Trainer.loss` and `Trainer.evaluate` receive
      (`lowtrain.amp(model, policy)`, a `lowtrain.rewrite` of it, ...).
    - `split_gradients(grads) -> (grads, extra)`: take out of the gradients what is
      not for the optimizer (FP8 delayed-scaling state); `extra` comes back in `merge`.
    - `to_optimizer(tree)`: gradients and parameters as the optimizer sees them;
      `from_optimizer(updates, params)`: its updates as applied to `params`.
    - `merge(model, extra)`: the updated model with `extra` written back.

    Outside the step:
    - `export(model)`: `model` as a plain callable for use outside the Trainer, e.g.
      sampling text (default: `wrap_model(model)`).

    Implementations: `Amp`, `Scalify`, `DelayedFp8`, `Rewrite`; `Chain` (or a list
    given to the Trainer) composes them. docs/architecture.md adds one as a worked
    example.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import lowtrain
    from lowtrain.train import Precision

    class Bf16Inputs(Precision):  # feed the model bfloat16-rounded inputs
        def inputs(self, batch):
            return jax.tree.map(
                lambda x: x.astype(jnp.bfloat16).astype(x.dtype), batch
            )

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    precision = [Bf16Inputs(), lowtrain.train.Amp("bf16")]  # chained
    trainer = Fit(model, optax.sgd(0.1), precision=precision)
    state = trainer.init(key=jax.random.key(1))
    batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
    state = trainer.fit(state, lambda step: batch, steps=3, progress=False)
    assert int(state.step) == 3
    ```
    """

    def cast_params(self, model: PyTree) -> PyTree:
        """In `Trainer.init`: `model` with its parameters in their stored dtype (the
        optimizer state is initialised on its float arrays, through
        `to_optimizer`)."""
        return model

    def store(self, model: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        """In `Trainer.init`: `model` and `opt_state` in the form the step carries
        them (scalify: `ScaledArray`s)."""
        return model, opt_state

    def default_loss_scale(self) -> AbstractLossScale | None:
        """The loss scale to use when the Trainer is given none, or None for no
        opinion (then `NoOpLossScale()`)."""
        return None

    def wrap_step(self, step: Callable) -> Callable:
        """The whole step as it runs: `step(*args) -> (carry, metrics)` wrapped
        (scalify runs it under `lowtrain.scalify.scalify`); the wrapped step must
        return `metrics` as plain arrays. Evaluation runs through it too."""
        return step

    def inputs(self, batch: PyTree) -> PyTree:
        """In the step: `batch` as the model is fed it."""
        return batch

    def wrap_model(self, model: PyTree) -> PyTree:
        """In the step: what `Trainer.loss` and `Trainer.evaluate` receive for
        `model`, the stored model (`lowtrain.amp(model, policy)`, a
        `lowtrain.rewrite` of it, ...)."""
        return model

    def split_gradients(self, grads: PyTree) -> tuple[PyTree, Any]:
        """In the step: `(grads, extra)`, `grads` without what is not for the
        optimizer (FP8 delayed-scaling state); `extra` comes back in `merge`."""
        return grads, None

    def to_optimizer(self, tree: PyTree) -> PyTree:
        """In the step: `tree` (the gradients, or the parameters) as the optimizer
        sees it."""
        return tree

    def from_optimizer(self, updates: PyTree, params: PyTree) -> PyTree:
        """In the step: the optimizer's `updates` as applied to `params` (the
        stored parameters)."""
        return updates

    def merge(self, model: PyTree, extra: Any) -> PyTree:
        """In the step: the updated `model` with `extra` (of `split_gradients`)
        written back."""
        return model

    def export(self, model: PyTree) -> PyTree:
        """Outside the step: `model` (a stored model) as a plain callable for use
        outside the Trainer, e.g. sampling text (default: `wrap_model(model)`)."""
        return self.wrap_model(model)


class Chain(Precision):
    """Several precisions as one: each hook applies the parts' hooks in order (the
    first part's `wrap_model` innermost), `split_gradients`/`merge` give each part
    its own `extra`, and `default_loss_scale` is the first part's that is not None.

    ```python
    import lowtrain
    from lowtrain.train import Amp, Chain, DelayedFp8

    precision = Chain(DelayedFp8(), Amp("fp16"))  # DelayedFp8 has no opinion
    assert isinstance(precision.default_loss_scale(), lowtrain.DynamicLossScale)
    grads, extra = precision.split_gradients({"w": 1.0})
    assert len(extra) == 2  # one `extra` per part
    ```
    """

    parts: tuple[Precision, ...]

    def __init__(self, *parts: Precision):
        for part in parts:
            if not isinstance(part, Precision):
                raise TypeError(
                    "Expected `lowtrain.train.Precision` objects to chain, got "
                    f"{type(part).__name__} instead."
                )
        self.parts = tuple(parts)

    def _fold(self, hook: str, value):
        for part in self.parts:
            value = getattr(part, hook)(value)
        return value

    def cast_params(self, model):
        return self._fold("cast_params", model)

    def store(self, model, opt_state):
        for part in self.parts:
            model, opt_state = part.store(model, opt_state)
        return model, opt_state

    def default_loss_scale(self):
        scales = (p.default_loss_scale() for p in self.parts)
        return next((s for s in scales if s is not None), None)

    def wrap_step(self, step):
        return self._fold("wrap_step", step)

    def inputs(self, batch):
        return self._fold("inputs", batch)

    def wrap_model(self, model):
        return self._fold("wrap_model", model)

    def split_gradients(self, grads):
        extras = []
        for part in self.parts:
            grads, extra = part.split_gradients(grads)
            extras.append(extra)
        return grads, tuple(extras)

    def to_optimizer(self, tree):
        return self._fold("to_optimizer", tree)

    def from_optimizer(self, updates, params):
        for part in self.parts:
            updates = part.from_optimizer(updates, params)
        return updates

    def merge(self, model, extra):
        for part, e in zip(self.parts, extra):
            model = part.merge(model, e)
        return model

    def export(self, model):
        return self._fold("export", model)
