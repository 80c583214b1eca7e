"""The default train step after the gradients: what `Trainer.loss` returned, split
(`split_loss`); the update applied, or the step skipped bit for bit
(`apply_update`); and the metrics the step returns, with the health figures `fit`
checks one step late (`step_metrics`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, PyTree

from ._health import skips_in_a_row
from ._metrics import global_norm
from ._nnx import carry_inplace_state
from ._protocol import Precision
from ._state import TrainState


def split_loss(out, state: dict) -> tuple[Any, Any, Any]:
    """`(loss, aux, new_model_state)` of what `Trainer.loss` returned: `loss`,
    `(loss, aux)`, or with a model state (`state` not empty) `(loss, new_state)` or
    `(loss, aux, new_state)` (`new_state` None without one)."""
    if not state:
        if isinstance(out, tuple):
            if len(out) != 2:
                raise TypeError(
                    "Expected `loss` to return a scalar or `(loss, aux)`, got a "
                    f"tuple of {len(out)} instead. A stateful model passes "
                    "`model_state=` to the Trainer."
                )
            return out[0], out[1], None
        return out, None, None
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            "Expected `loss(model, batch, *, key, state)` of a Trainer with a "
            "`model_state` to return `(loss, new_state)` or `(loss, aux, "
            f"new_state)`, got {got} instead. Return the state the model gave back."
        )
    loss, *aux, new = out
    old = state["state"]
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            "Expected the state `loss` returns last to have the structure of the "
            f"model state passed in, got {jax.tree.structure(new)} instead of "
            f"{jax.tree.structure(old)}. Return the state the model gave back."
        )
    return loss, (aux[0] if aux else None), new


def apply_update(
    optimizer: optax.GradientTransformation,
    precision: Precision,
    state: TrainState,
    grads: PyTree,
    extra: PyTree,
    loss_scale,
    finite: Bool[Array, ""],
    *,
    model_state: PyTree = None,
    inplace: PyTree = None,
) -> TrainState:
    """The state after one step: `grads` (unscaled, as the precision split them
    off, with `extra`) through `optimizer` and applied where `finite`; where not,
    the model, its `model_state` and the optimizer's inner state stay bit for bit
    (`optimizer` is wrapped in `apply_if_finite`, which counts the skip). The
    new `model_state` (None: keep the old) and a Flax NNX model's `inplace` state
    are kept only where the step is applied, in the old state's dtypes."""
    if model_state is not None:
        model_state = jax.tree.map(
            lambda n, o: jnp.where(finite, n.astype(o.dtype), o),
            model_state,
            state.model_state,
        )
    else:
        model_state = state.model_state
    params = eqx.filter(state.model, eqx.is_inexact_array)
    updates, opt_state = optimizer.update(
        precision.to_optimizer(grads),
        state.opt_state,
        precision.to_optimizer(params),
    )
    updates = precision.from_optimizer(updates, params)
    # apply_if_finite adds zero updates on a skipped step; `where` also keeps the
    # bits (p + 0.0 would turn -0.0 into +0.0).
    model = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old) if eqx.is_array(new) else new,
        eqx.apply_updates(state.model, updates),
        state.model,
    )
    model = precision.merge(model, extra)
    if inplace is not None:
        model = carry_inplace_state(model, inplace, state.model, finite)
    return TrainState(
        state.step + 1, model, opt_state, loss_scale, state.key, model_state
    )


def step_metrics(
    loss, aux, grads: PyTree, finite: Bool[Array, ""], old: TrainState, new: TrainState
) -> dict:
    """The metrics of `Trainer.train_step`: `loss`, `aux`, `grad_norm` (float32)
    and `grads_finite`, and `health`: what `fit` checks one step late, in one
    transfer (the loss, whether the step was applied, the skips in a row, and
    whether it was skipped with the loss scale at its floor, where backing off can
    no longer help)."""
    return {
        "loss": loss,
        "aux": aux,
        "grad_norm": global_norm(grads),
        "grads_finite": finite,
        "health": (
            loss,
            finite,
            skips_in_a_row(new.opt_state),
            old.loss_scale.at_floor(),
        ),
    }
