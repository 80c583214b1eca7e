"""`ScaledArray`: a tensor stored as `data * scale`, and power-of-two rounding."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PyTree

from .._pow2 import POW2_MODES as POW2_MODES
from .._pow2 import pow2_round as pow2_round

F32 = jnp.float32


class ScaledArray(eqx.Module):
    """A tensor that represents the values `self.data * self.scale`.

    `data` is any float array (FP8 included) meant to stay near unit range; `scale` is
    a float32 scalar, a power of two unless made otherwise. It is a pytree like any
    other, so it passes through `jax.jit`, Equinox's filtered transforms and optax;
    `lowtrain.scalify` propagates scales through whole programs.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.array([0.5, -1.0], jnp.float16), 2.0**20)
    assert x.to_array(jnp.float32).tolist() == [2.0**19, -(2.0**20)]
    ```
    """

    data: Array
    scale: Float[Array, ""]

    def __init__(self, data: ArrayLike, scale: ArrayLike):
        data = jnp.asarray(data)
        scale = jnp.asarray(scale, F32)
        if not jnp.issubdtype(data.dtype, jnp.floating):
            raise TypeError(
                f"Expected float `data` for a ScaledArray, got {data.dtype} instead."
            )
        if scale.shape != ():
            raise ValueError(
                f"Expected a scalar `scale`, got shape {scale.shape} instead."
            )
        self.data, self.scale = data, scale

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def to_array(self, dtype=None) -> Array:
        """The values `data * scale`, computed in float32 and cast to `dtype` (default:
        the dtype of `data`)."""
        value = self.data.astype(F32) * self.scale
        return value.astype(dtype or self.data.dtype)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.to_array(), dtype=dtype)


def is_scaled(x) -> bool:
    """Whether `x` is a `ScaledArray` (also handy as `is_leaf` in `jax.tree` calls).

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    assert scalify.is_scaled(scalify.ScaledArray(jnp.ones(2), 1.0))
    assert not scalify.is_scaled(jnp.ones(2))
    ```
    """
    return isinstance(x, ScaledArray)


def as_scaled_array(
    tree: PyTree, *, dtype=None, scale: ArrayLike | None = None, pow2: str = "down"
) -> PyTree:
    """Every float array of `tree` as a `ScaledArray` (others left as they are).

    By default the scale is the array's max-abs rounded to a power of two (`pow2`), so
    the data lies within `[-2, 2]`: values far outside a narrow format's range (1e6,
    1e-9 in float16) become representable. `scale=` fixes the scale instead (`1.0` wraps
    the array unchanged); `dtype` is the data's dtype (default: the array's).

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.as_scaled_array(jnp.array([1e6, -3e5]), dtype=jnp.float16)
    assert x.data.dtype == jnp.float16 and x.scale == 2.0**19
    values = scalify.asarray(x, jnp.float32)
    assert jnp.allclose(values, jnp.array([1e6, -3e5]), rtol=1e-3)
    ```
    """

    def convert(x):
        if is_scaled(x) or not eqx.is_array_like(x):
            return x
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        s = jnp.max(jnp.abs(x)).astype(F32) if scale is None else scale
        s = pow2_round(jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0), pow2)
        data = (x.astype(F32) / s).astype(dtype or x.dtype)
        return ScaledArray(data, s)

    return jax.tree.map(convert, tree, is_leaf=is_scaled)


def asarray(tree: PyTree, dtype=None) -> PyTree:
    """Every `ScaledArray` of `tree` as the plain array of its values (`to_array`:
    computed in float32, cast to `dtype`, default None: the dtype of its data); other
    leaves unchanged.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    tree = {"w": scalify.ScaledArray(jnp.ones(2, jnp.float16), 8.0), "n": 3}
    assert scalify.asarray(tree)["w"].tolist() == [8.0, 8.0]
    ```
    """
    return jax.tree.map(
        lambda x: x.to_array(dtype) if is_scaled(x) else x, tree, is_leaf=is_scaled
    )
