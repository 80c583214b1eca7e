"""What several test files share: jaxpr inspection, tree comparison, small models
and data for the Trainer tests, and one program with every higher-order primitive.

The larger reference models (the GPT, the MLP) are the recipes' own:
`lowtrain.recipes.gpt.GPT`, `lowtrain.recipes.mnist.MLP`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

import lowtrain


def iter_eqns(jaxpr):
    """Every equation of `jaxpr` and of all its sub-jaxprs, depth first."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    yield from iter_eqns(sub)


def eqns_of(fn, *args, prim=None):
    jaxpr = make_jaxpr(fn)(*args)
    return [e for e in iter_eqns(jaxpr) if prim is None or e.primitive.name == prim]


def float_in_dtypes(eqn):
    return {
        np.dtype(v.aval.dtype)
        for v in eqn.invars
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    }


def tree_allclose(a, b, **kw):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    return all(
        np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **kw)
        for x, y in zip(la, lb)
    )


def make_jaxpr(fn):
    """`jax.make_jaxpr` that accepts Equinox modules (non-array leaves stay static)."""
    return lambda *args: eqx.filter_make_jaxpr(fn)(*args)[0]


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda r, c: (c * jnp.cos(r),))


def higher_order_program(x):
    """One of each higher-order primitive lowtrain handles: jit, custom_vjp (and
    custom_jvp, through relu), scan, cond, while, remat."""
    y = jax.jit(jnp.sin)(x)
    y = _sin(jax.nn.relu(y))
    y, _ = lax.scan(lambda c, _: (c * 2.0, None), y, None, length=2)
    y = lax.cond(jnp.sum(y) > 0, lambda a: a, lambda a: -a, y)
    y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.5), (0, y))[1]
    return jax.checkpoint(jnp.exp)(y)


# -- the Trainer tests' model and data ------------------------------------------

# With momentum, so there is optimizer state to keep. (optax's adam computes
# `b1 ** count` on f32 and int32, which strict dtype promotion refuses.)
SGD = lambda lr: optax.sgd(lr, momentum=0.9)


class Regression(lowtrain.Trainer):
    """Only `loss`; its dropout uses the step key: resume must get keys right."""

    def loss(self, model, batch, *, key):
        x = eqx.nn.Dropout(0.1, inference=key is None)(batch["x"], key=key)
        err = jax.vmap(model)(x) - batch["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def make_data(n=48, batch_size=8, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    y = np.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)
    return lowtrain.ArrayBatches({"x": x, "y": y}, batch_size, seed=seed)


def make_model(width=16):
    return eqx.nn.MLP(4, 2, width, 1, key=jax.random.key(0))


def snapshot(tree):
    """Host copies of every array (key data for PRNG keys): donation reuses buffers."""
    out = []
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.array(x, copy=True))
    return out


def same_bits(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b)
    )
