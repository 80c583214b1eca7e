"""Gradient accumulation: K micro-batches per optimizer step, in one compiled step."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, PRNGKeyArray, PyTree

from .._loss_scale import AbstractLossScale, redo_while_nonfinite, scaled_value_and_grad
from ._layer import in_step
from ._placement import Layout
from ._protocol import Precision

F32 = jnp.float32


def check_counts(redo_on_nan: int, grad_accum: int) -> tuple[int, int]:
    """The Trainer's `redo_on_nan` (an int >= 0) and `grad_accum` (an int >= 1),
    checked: a TypeError for a non-int, a ValueError for one too small."""
    for name, value, low in (
        ("redo_on_nan", redo_on_nan, 0),
        ("grad_accum", grad_accum, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"Expected an int `{name}`, got {value!r} instead.")
        if value < low:
            raise ValueError(f"Expected `{name}` >= {low}, got {value} instead.")
    return redo_on_nan, grad_accum


def micro_batches(batch: PyTree, k: int, n_devices: int) -> PyTree:
    """`batch` (leading axis B) as K micro-batches: leaves `(K, B / K, ...)`.

    Micro-batch `i` holds rows `i, i + K, i + 2K, ...`: each device's contiguous
    part of a batch split over devices holds B / (K * devices) rows of every
    micro-batch, so no row moves between devices.
    """
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(x)
        if not shape or shape[0] % (k * n_devices):
            raise ValueError(
                f"Expected every batch array's leading axis to divide by grad_accum "
                f"x devices ({k} x {n_devices}), got shape {shape} at "
                f"`batch{jax.tree_util.keystr(path)}` instead. Use a batch size "
                f"that is a multiple of {k * n_devices}, or change `grad_accum`."
            )
    split = lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def _mean_or_last(stacked: PyTree) -> PyTree:
    # Float leaves (the loss, `aux` metrics) averaged over the micro-batches; the rest
    # (ints, bools) from the last one.
    pick = lambda x: jnp.mean(x, 0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1]
    return jax.tree.map(pick, stacked)


def accumulated_value_and_grad(
    fn: Callable,
    precision: Precision,
    *,
    grad_accum: int,
    redo_on_nan: int,
    layout: Layout,
    remat: str = "none",
    layered: bool = True,
) -> Callable:
    """The Trainer's gradient of `fn(model, batch, *, key) -> (loss, aux)`, over
    `grad_accum` micro-batches; returns `g`, called as
    `((loss, aux), grads, extra), new_loss_scale, finite = g(ls, model, batch, key=k)`.

    `grads` and `extra` are `precision.split_gradients` of the gradients. With
    `grad_accum=1` this is `lowtrain.scaled_value_and_grad` and nothing else. With
    K > 1 (a `lax.scan` over `micro_batches(batch, K, layout.batch_shards)`):

    - every micro-batch uses the same loss scale and model, and the key
      `jax.random.fold_in(key, i)` for micro-batch `i`;
    - `grads` is the sum over micro-batches of each unscaled gradient, in float32,
      divided by K (the mean: K micro-batches of B / K give the update of one batch
      of B), cast to each gradient's dtype; `loss` and float `aux` leaves are means
      over the micro-batches (other `aux` leaves: the last micro-batch's);
    - `extra` (FP8 delayed scaling's records: amaxes and call counts) is the
      elementwise maximum over the micro-batches: a state records the amax of the
      whole batch, as with K=1;
    - `finite` is one decision for the step: False if any micro-batch's gradients
      are not all finite; the loss scale is adjusted once, by it; `redo_on_nan`
      redoes all K micro-batches at the backed-off scale.
    """
    single = scaled_value_and_grad(fn, has_aux=True, redo_on_nan=redo_on_nan)
    micro = scaled_value_and_grad(fn, has_aux=True)

    # FSDP: the parameters are gathered (all-gather) before they are used, so the
    # forward and backward compute what replicated data parallelism computes, and
    # the gradients leave reduce-scattered (`layout.constrain` on what depends on
    # them): a layer at a time where the model calls `gather_layer` (found by
    # tracing the loss once on shapes; not for `layered=False`), else all at once.
    # Whole over the FSDP axis, still split over "tensor".
    def gather(model, batch, key):
        if layout.fsdp_axis is not None and layered:
            with in_step(layout, remat) as seen:
                eqx.filter_eval_shape(lambda m, b: fn(m, b, key=key), model, batch)
            if seen.called:
                return model
        return layout.constrain(model, gathered=True)

    def one_step(
        ls: AbstractLossScale, model: PyTree, batch: PyTree, *, key: PRNGKeyArray
    ):
        model = gather(model, batch, key)
        with in_step(layout, remat):
            (value, grads), ls, finite = single(ls, model, batch, key=key)
        grads, extra = precision.split_gradients(grads)
        return (value, grads, extra), ls, finite

    def attempt(ls, model, batch, key):
        parts = micro_batches(batch, grad_accum, layout.batch_shards)
        spec = NamedSharding(layout.mesh, P(None, *layout.batch_spec()))
        parts = jax.tree.map(lambda x: lax.with_sharding_constraint(x, spec), parts)

        def body(acc, xs):
            part, i = xs
            (value, grads), _, finite = micro(
                ls, model, part, key=jax.random.fold_in(key, i)
            )
            grads, extra = precision.split_gradients(grads)
            acc = jax.tree.map(lambda a, g: a + g.astype(F32), acc, grads)
            return layout.constrain(acc), (value, extra, finite)

        params = eqx.filter(model, eqx.is_inexact_array)
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, F32), params)
        zeros = layout.constrain(zeros)  # sharded as the parameters
        steps = (parts, jnp.arange(grad_accum))
        acc, (values, extras, finites) = lax.scan(body, zeros, steps)
        grads = jax.tree.map(lambda a, p: (a / grad_accum).astype(p.dtype), acc, params)
        extra = jax.tree.map(lambda x: jnp.max(x, 0), extras)
        return ls, _mean_or_last(values), grads, extra, jnp.all(finites)

    def accumulated(
        ls: AbstractLossScale, model: PyTree, batch: PyTree, *, key: PRNGKeyArray
    ) -> tuple[tuple, AbstractLossScale, Bool[Array, ""]]:
        parts = micro_batches(batch, grad_accum, layout.batch_shards)
        part = jax.tree.map(lambda x: x[0], parts)
        gathered = gather(model, part, key)
        run = lambda ls: attempt(ls, gathered, batch, key)
        with in_step(layout, remat):
            ls, value, grads, extra, finite = redo_while_nonfinite(run, ls, redo_on_nan)
        return (value, grads, extra), ls.adjust(finite), finite

    return one_step if grad_accum == 1 else accumulated
