"""The two scale primitives every unit-scaled op is built from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike


def _as(s, x):
    # The scale in `x`'s dtype: a float16 activation stays float16.
    return jnp.asarray(s, dtype=x.dtype)


@jax.custom_vjp
def scale_fwd(x: Array, s: ArrayLike) -> Array:
    """`x * s` in the forward pass; the gradient passes through unchanged.

    **Arguments:**

    - `x`: the array to scale.
    - `s`: the scale, a float or an array that broadcasts against `x`, converted to
      `x`'s dtype; its gradient is zero.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    y, vjp = jax.vjp(lambda x: U.scale_fwd(x, 4.0), jnp.ones(2))
    assert (y == 4.0).all() and (vjp(jnp.ones(2))[0] == 1.0).all()
    ```
    """
    return x * _as(s, x)


def _fwd_fwd(x, s):
    return x * _as(s, x), s


def _fwd_bwd(s, g):
    return g, jnp.zeros_like(jnp.asarray(s))


scale_fwd.defvjp(_fwd_fwd, _fwd_bwd)


@jax.custom_vjp
def scale_bwd(x: Array, s: ArrayLike) -> Array:
    """`x` in the forward pass; the gradient is multiplied by `s`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    y, vjp = jax.vjp(lambda x: U.scale_bwd(x, 4.0), jnp.ones(2))
    assert (y == 1.0).all() and (vjp(jnp.ones(2))[0] == 4.0).all()
    ```
    """
    return x


def _bwd_fwd(x, s):
    return x, s


def _bwd_bwd(s, g):
    return g * _as(s, g), jnp.zeros_like(jnp.asarray(s))


scale_bwd.defvjp(_bwd_fwd, _bwd_bwd)
