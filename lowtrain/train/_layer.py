"""What a model does per layer for the Trainer: `gather_layer` gathers one layer's
parameters whole where the layer runs under FSDP (an all-gather in the forward
pass; their gradients reduce-scattered back to the shards there), `remat_layer`
makes the backward pass recompute what the Trainer's `remat` says (`REMAT`), and
`logical_constraint` places an activation by its logical axis names (tensor
parallelism). The Trainer sets them while it traces a step (`in_step`); elsewhere
they are the identity."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jaxtyping import Array, PyTree

from .._context import trace_setting
from ._placement import Layout

# The name of a gathered parameter in the program, for `jax.checkpoint` policies.
GATHERED = "lowtrain_fsdp_gathered"

# `Trainer(remat=...)`: what the backward pass of a layer under `remat_layer`
# recomputes instead of saving. "none": nothing (every residual saved, no
# `jax.checkpoint`); "dots": everything but the matmuls' outputs
# (`jax.checkpoint_policies.dots_saveable`: under FSDP also the gathered
# parameters, gathered again); "full": everything (`nothing_saveable`: only the
# layer's inputs saved).
REMAT = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class _Step:
    # While a step is traced: the Trainer's layout, the remat policy's name, and
    # whether the model called `gather_layer`.
    def __init__(self, layout: Layout, remat: str):
        self.layout, self.remat, self.called = layout, remat, False


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar(
    "lowtrain_step", default=None
)


@contextlib.contextmanager
def in_step(layout: Layout, remat: str = "none"):
    """While tracing a Trainer's step: `gather_layer` gathers over the FSDP axis
    of `layout` (if it has one), `logical_constraint` places by its rules,
    `remat_layer` applies the policy `REMAT[remat]`. Yields a record whose
    `called` says whether the model called `gather_layer`."""
    step = _Step(layout, remat)
    token = _STEP.set(step)
    try:
        with trace_setting(("layer", layout, remat)):  # keys the transforms' traces
            yield step
    finally:
        _STEP.reset(token)


def check_remat(remat: str) -> str:
    """`remat` (the Trainer's argument), checked to name a policy of `REMAT`."""
    if remat not in REMAT:
        raise ValueError(
            f"Expected `remat` one of {sorted(REMAT)}, got {remat!r} instead."
        )
    return remat


def remat_layer(fn: Callable) -> Callable:
    """`fn`, one layer's computation (such as the body of the `lax.scan` over a
    stack of layers), under `jax.checkpoint` with the policy the Trainer's `remat`
    names (`"dots"`: the backward pass recomputes all but the matmuls' outputs;
    `"full"`: all of the layer but its inputs), when called in a Trainer's step;
    elsewhere, or with `remat="none"`, `fn` itself.

    **Arguments:**

    - `fn`: a function of arrays (a layer's call, a scan body).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain

    body = lambda x, w: (jnp.tanh(x @ w), None)
    assert lowtrain.train.remat_layer(body) is body  # outside a step
    x, _ = jax.lax.scan(lowtrain.train.remat_layer(body), jnp.ones(4),
                        jnp.ones((3, 4, 4)))
    assert x.shape == (4,)
    ```
    """
    step = _STEP.get()
    policy = None if step is None else REMAT[step.remat]
    if policy is None:
        return fn
    return jax.checkpoint(fn, policy=policy)


def gather_layer(layer: PyTree) -> PyTree:
    """`layer` with its float arrays gathered whole on every device, when traced in
    the step of a Trainer with `sharding="fsdp"`; elsewhere `layer` itself.

    Call it on a layer's parameters where the layer runs, such as at the top of
    the body of the `lax.scan` over a stack of layers, and on the arrays outside
    the layers where they are used: the step then holds one layer gathered at a
    time instead of the whole model (a model that never calls it is gathered whole
    before its loss). With the Trainer's `remat="dots"` or `"full"` and the layer
    under `remat_layer`, the backward pass gathers each layer again instead of
    keeping every gathered layer until then. In the forward pass the
    arrays are all-gathered (each a `jax.lax.with_sharding_constraint` to
    replicated over the FSDP axis; still split over "tensor" where the Trainer's
    `axis_names` say); in the backward pass their gradients are constrained back to
    the shards (`Trainer.layout`), so XLA reduce-scatters them there. The arrays'
    paths within `layer` are matched by `axis_names`, so a slice of a stacked
    layer is named as the stack is. The
    values are unchanged: a step computes what replicated data parallelism does.
    Each gathered array is named `GATHERED` for `jax.checkpoint` policies.

    **Arguments:**

    - `layer`: a pytree (an Equinox module, one slice of a stacked layer); its
      float arrays are gathered, the rest passed through.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain

    layer = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    assert lowtrain.train.gather_layer(layer) is layer  # outside an FSDP step

    class Stack(eqx.Module):  # a scanned stack of layers, as the recipes' GPT
        layers: eqx.nn.Linear

        def __call__(self, x):
            params, static = eqx.partition(self.layers, eqx.is_array)

            def body(x, p):
                one = eqx.combine(lowtrain.train.gather_layer(p), static)
                return jnp.tanh(one(x)), None

            return jax.lax.scan(body, x, params)[0]

    stack = Stack(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(
        jax.random.split(jax.random.key(1), 3)))
    assert stack(jnp.ones(4)).shape == (4,)
    ```
    """
    step = _STEP.get()
    if step is None:
        return layer
    step.called = True
    if step.layout.fsdp_axis is None:
        return layer
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    return eqx.combine(_gather(step.layout, params), static)


def _gather(layout: Layout, params: PyTree) -> PyTree:
    @jax.custom_vjp
    def gather(params):
        return layout.constrain(params, gathered=True)

    def forward(params):
        return gather(params), None

    def backward(_, grads):
        return (layout.constrain(grads),)

    gather.defvjp(forward, backward)
    return jax.tree.map(lambda x: checkpoint_name(x, GATHERED), gather(params))


def logical_constraint(x: Array, names: tuple[str | None, ...]) -> Array:
    """`x`, an activation whose dimensions have the logical axis `names` (one per
    dimension; None: whole), constrained to the mesh axes the Trainer's
    `axis_rules` give them (`jax.lax.with_sharding_constraint`), when traced in
    the step of a Trainer whose mesh has a "tensor" axis; elsewhere `x` itself.

    Tensor parallelism splits the weights by their names; this says where the
    activations between them live, so that XLA keeps, for example, each device's
    attention heads on that device (`("batch", None, "heads", None)` after the
    query projection) instead of gathering them. A dimension whose size does not
    divide by its mesh axes stays whole.

    **Arguments:**

    - `x`: an array.
    - `names`: a tuple of logical axis names (keys of the Trainer's
      `axis_rules`, such as "batch", "heads", "mlp") or None, one per dimension
      of `x`.

    ```python
    import jax.numpy as jnp
    import lowtrain

    h = jnp.ones((8, 16, 64))  # (batch, sequence, MLP)
    assert lowtrain.train.logical_constraint(h, ("batch", None, "mlp")) is h
    ```
    """
    if len(names) != jnp.ndim(x):
        raise ValueError(
            f"Expected one logical axis name per dimension of `x` ({jnp.ndim(x)}), "
            f"got {len(names)}: {names} instead."
        )
    step = _STEP.get()
    if step is None or not step.layout.tensor_parallel:
        return x
    layout = step.layout
    spec = layout.activation_spec(names, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
