"""`Fp8Linear`: an Equinox linear layer whose matmul runs in FP8, and delayed scaling's
overwrite-with-gradient plumbing (`pop_scales`, `put_scales`)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._dot import fp8_dot_general, fp8_dot_general_delayed
from ._formats import E4M3, E5M2
from ._quantize import DelayedScale, advance


class Fp8Linear(eqx.Module):
    """`eqx.nn.Linear`, with its matmul in FP8 (E4M3 forward, E5M2 backward).

    Scales are per tensor: call it on a whole batch, `x` of shape
    `(..., in_features)`, for one scale per batch. With `delayed=False` (the default)
    each step scales every tensor by its own amax (current scaling, stateless; under
    `jax.vmap`, each example by its own). With `delayed=True` the layer holds a
    `DelayedScale` for its input, weight and output gradient, and quantizes with the
    scale computed from the last `history` steps' amaxes. What a step records for
    that state comes back *as the gradient* of those fields (Flax's "overwrite with
    gradient"): `pop_scales(grads, layer)` takes it out of the gradients before the
    optimizer sees them and returns the new state, which `put_scales` writes into
    the updated model (`lowtrain.Trainer` does both). Under `jax.vmap` over the batch
    the state records the whole batch's amaxes, as a call on the batch does (a
    vmapped stack of layers keeps one state per layer). A layer called several times
    in a step (applied twice, or closed over by a `lax.scan` body) records the sum of
    its calls' amaxes, at most `k` times their largest for `k` calls: the scale is
    never too small (nothing overflows), but can be up to `k` times too large, which
    loses up to `log2(k)` powers of two at the small end (give each use its own
    layer where that matters). A layer not called in a step keeps its state.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import lowtrain.fp8 as fp8

    layer = fp8.Fp8Linear(4, 3, delayed=True, key=jax.random.key(0))
    x = jnp.ones((2, 4))
    opt = optax.sgd(0.1)
    opt_state = opt.init(eqx.filter(layer, eqx.is_inexact_array))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    grads, scales = fp8.pop_scales(grads, layer)  # the new delayed-scaling state
    updates, opt_state = opt.update(grads, opt_state)
    layer = fp8.put_scales(eqx.apply_updates(layer, updates), scales)
    assert layer.x_scale.amax_history[0] == 1.0
    ```
    """

    weight: Array
    bias: Array | None
    x_scale: DelayedScale | None
    w_scale: DelayedScale | None
    g_scale: DelayedScale | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    margin: int = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        *,
        delayed: bool = False,
        history: int = 16,
        margin: int = 0,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`: the size of the input's last axis.
        - `out_features`: the size of the output's last axis.
        - `use_bias`: whether to add a bias; default True.
        - `delayed`: delayed scaling (True) or current scaling (False, the default).
        - `history`: with `delayed=True`, the number of past amaxes each
          `DelayedScale` keeps; default 16.
        - `margin`: the headroom exponent of every scale (`2**margin`); default 0.
        - `dtype`: the dtype of the weight and bias; default (None) float32.
        - `key`: a PRNG key for the initial weight (shape
          `(out_features, in_features)`) and bias, drawn uniformly from
          `[-1/sqrt(in_features), 1/sqrt(in_features))`.
        """
        dtype = dtype or jnp.float32
        wkey, bkey = jax.random.split(key)
        lim = 1 / math.sqrt(in_features)
        self.weight = jax.random.uniform(
            wkey, (out_features, in_features), dtype, -lim, lim
        )
        self.bias = (
            jax.random.uniform(bkey, (out_features,), dtype, -lim, lim)
            if use_bias
            else None
        )
        make = lambda fmt: DelayedScale(fmt, history=history, margin=margin)
        self.x_scale = make(E4M3) if delayed else None
        self.w_scale = make(E4M3) if delayed else None
        self.g_scale = make(E5M2) if delayed else None
        self.in_features, self.out_features, self.margin = (
            in_features,
            out_features,
            margin,
        )

    @classmethod
    def from_linear(
        cls,
        linear: eqx.nn.Linear,
        *,
        delayed: bool = False,
        history: int = 16,
        margin: int = 0,
    ) -> Fp8Linear:
        """The `Fp8Linear` of an `eqx.nn.Linear`: its `weight` and `bias` (the same
        arrays, not copies), with FP8 scaling as `__init__` sets it.

        **Arguments:**

        - `linear`: an `eqx.nn.Linear` with integer `in_features` and
          `out_features` (not "scalar").
        - `delayed`, `history`, `margin`: as `__init__` takes them.
        """
        if not isinstance(linear, eqx.nn.Linear) or "scalar" in (
            linear.in_features,
            linear.out_features,
        ):
            raise TypeError(
                "Expected an `eqx.nn.Linear` with integer `in_features` and "
                f"`out_features`, got {linear!r} instead."
            )
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.use_bias,
            delayed=delayed,
            history=history,
            margin=margin,
            dtype=linear.weight.dtype,
            key=jax.random.key(0),  # replaced: the weights are `linear`'s
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias),
            layer,
            (linear.weight, linear.bias),
            is_leaf=lambda x: x is None,
        )

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Expected input of shape (..., {self.in_features}), got {x.shape}."
            )
        dn = (((x.ndim - 1,), (1,)), ((), ()))  # x (..., in) . weight (out, in)
        if self.x_scale is None:
            y = fp8_dot_general(x, self.weight, dn, margin=self.margin)
        else:
            y = fp8_dot_general_delayed(
                x, self.weight, dn, self.x_scale, self.w_scale, self.g_scale
            )
        if self.bias is None:
            return y
        return y + jnp.broadcast_to(self.bias.astype(y.dtype), y.shape)


def _is_scale(x) -> bool:
    return isinstance(x, DelayedScale)


def zero_scales(tree: PyTree) -> PyTree:
    """`tree` with zeros for its `DelayedScale`s' leaves."""
    zero = lambda s: jax.tree.map(jnp.zeros_like, s) if _is_scale(s) else s
    return jax.tree.map(zero, tree, is_leaf=_is_scale)


def split_records(grads: PyTree) -> tuple[PyTree, PyTree]:
    """(`grads` with zeros for the `DelayedScale`s, their records: the step's calls'
    amaxes and counts, summed; None elsewhere). See `pop_scales`."""
    keep = lambda s: s if _is_scale(s) else None
    return zero_scales(grads), jax.tree.map(keep, grads, is_leaf=_is_scale)


def advanced_scales(model: PyTree, records: PyTree) -> PyTree:
    """The new `DelayedScale`s of `model` after a step that left `records` (from
    `split_records`; None elsewhere)."""
    is_leaf = lambda x: x is None or _is_scale(x)
    leaves, treedef = jax.tree.flatten(records, is_leaf=is_leaf)
    try:
        states = treedef.flatten_up_to(model)
    except ValueError as e:
        raise ValueError(
            "Expected `model` to be the model the gradients were taken of (the same "
            f"structure), got a {type(model).__name__} that differs (see above). "
            "Pass the model as it was called in the step."
        ) from e
    new = []
    for r, m in zip(leaves, states):
        if r is not None and not _is_scale(m):
            raise ValueError(
                "Expected `model` to be the model the gradients were taken of, with a "
                f"`DelayedScale` where they have one; got {type(m).__name__} there. "
                "Pass the model as it was called in the step."
            )
        new.append(None if r is None else advance(m, r))
    return jax.tree.unflatten(treedef, new)


def pop_scales(grads: PyTree, model: PyTree) -> tuple[PyTree, PyTree]:
    """Split `grads`, the gradients of `model`, into (the gradients with zeros for
    its delayed-scaling state, its new delayed-scaling state).

    The "gradient" of a `DelayedScale` is what the step's calls recorded (see
    `fp8_dot_general_delayed`): the sum of their amaxes and their number. Each new
    state is the state in `model` updated with that sum (the amax itself for one
    call; at most `k` times the largest for `k` calls, so never too small a scale),
    or the state unchanged if nothing called it in the step. The zeros keep the
    optimizer (and gradient clipping, norms, finiteness checks) from seeing the
    state; `put_scales` writes the new one into the updated model.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    layer = fp8.Fp8Linear(2, 2, delayed=True, key=jax.random.key(0))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(layer)
    grads, scales = fp8.pop_scales(grads, layer)
    assert not grads.x_scale.amax_history.any()  # zeros for the optimizer
    assert scales.x_scale.amax_history[0] == 1.0  # the new state
    assert fp8.put_scales(layer, scales).x_scale.amax_history[0] == 1.0
    ```
    """
    grads, records = split_records(grads)
    return grads, advanced_scales(model, records)


def put_scales(model: PyTree, scales: PyTree) -> PyTree:
    """`model` with its `DelayedScale`s replaced, exactly, by those of `scales` (from
    `pop_scales`).

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    layer = fp8.Fp8Linear(2, 2, delayed=True, key=jax.random.key(0))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.full((1, 2), 3.0))))(layer)
    layer = fp8.put_scales(layer, fp8.pop_scales(grads, layer)[1])
    assert layer.x_scale.amax_history[0] == 3.0
    ```
    """
    pick = lambda m, s: s if _is_scale(s) else m
    return jax.tree.map(
        pick, model, scales, is_leaf=lambda x: _is_scale(x) or x is None
    )
