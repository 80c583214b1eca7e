"""What a model does per layer for the Trainer: `gather_layer` gathers one layer's
parameters whole where the layer runs under FSDP (an all-gather in the forward
pass; their gradients reduce-scattered back to the shards there), and
`remat_layer` makes the backward pass recompute what the Trainer's `remat` says
(`REMAT`). The Trainer sets both while it traces a step (`in_step`); elsewhere
they are the identity."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._context import trace_setting
from ._placement import constrain_state

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
    # While a step is traced: the mesh to gather over (None: no FSDP), the remat
    # policy's name, and whether the model called `gather_layer`.
    def __init__(self, mesh: Mesh | None, remat: str):
        self.mesh, self.remat, self.called = mesh, remat, False


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar(
    "lowtrain_step", default=None
)


@contextlib.contextmanager
def in_step(mesh: Mesh | None, remat: str = "none"):
    """While tracing a Trainer's step: `gather_layer` gathers over `mesh` (None:
    it does not; a Trainer with `sharding="fsdp"`), `remat_layer` applies the
    policy `REMAT[remat]`. Yields a record whose `called` says whether the model
    called `gather_layer`."""
    step = _Step(mesh, remat)
    token = _STEP.set(step)
    try:
        with trace_setting(("layer", mesh, remat)):  # keys the transforms' traces
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
    replicated); in the backward pass their gradients are constrained back to the
    shards (`lowtrain.train.array_spec`), so XLA reduce-scatters them there. The
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
    if step.mesh is None or step.mesh.size == 1:
        return layer
    mesh = step.mesh
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    return eqx.combine(_gather(mesh, params), static)


def _gather(mesh: Mesh, params: PyTree) -> PyTree:
    @jax.custom_vjp
    def gather(params):
        return constrain_state(mesh, "replicated", params)

    def forward(params):
        return gather(params), None

    def backward(_, grads):
        return (constrain_state(mesh, "fsdp", grads),)

    gather.defvjp(forward, backward)
    return jax.tree.map(lambda x: checkpoint_name(x, GATHERED), gather(params))
