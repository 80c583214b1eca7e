"""Jaxpr inspection helpers for the tests."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr


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
    import equinox as eqx

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
