"""Unit-scaled normalization: `layer_norm` and `rms_norm`.

A norm's output has unit RMS by construction and, for inputs of unit RMS, so has the
gradient of its input: only the optional weight and bias need a scale, for their
gradients sum over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ._core import broadcast_trailing, trailing_shape
from ._scale import scale_bwd


def _affine(y, weight, bias, x, shape):
    # Weight and bias gradients sum over the x.size / prod(shape) rows.
    grad_scale = (math.prod(shape) / max(x.size, 1)) ** 0.5
    if weight is not None:
        y = y * broadcast_trailing(scale_bwd(weight, grad_scale), y.shape)
    if bias is not None:
        y = y + broadcast_trailing(scale_bwd(bias, grad_scale), y.shape)
    return y


def _axes(x, shape) -> tuple[int, ...]:
    return tuple(range(x.ndim - len(shape), x.ndim))


def layer_norm(
    x: Float[Array, "*shape"],
    weight: Float[Array, "*normalized"] | None = None,
    bias: Float[Array, "*normalized"] | None = None,
    eps: float = 1e-5,
    *,
    normalized_shape: int | Sequence[int] | None = None,
) -> Float[Array, "*shape"]:
    """A unit-scaled layer norm: `(x - mean) / sqrt(var + eps) * weight + bias` over
    the trailing axes `normalized_shape` (default: the weight's or bias's shape if
    given, else the last axis), on a whole batch.

    Scales: output 1 and gradient of `x` 1 (a norm's output has unit RMS, and its
    input gradient too for unit-RMS inputs and cotangent); gradients of `weight`
    and `bias`: `batch ** -0.5`, where `batch = x.size / prod(normalized_shape)`.

    **Arguments:**

    - `x`: the whole batch, a float array of shape `(..., *normalized_shape)`.
    - `weight`: a gain of shape `normalized_shape`, multiplied after normalizing;
      None (default): none.
    - `bias`: of shape `normalized_shape`, added after the gain; None (default):
      none.
    - `eps`: added to the variance before the square root (default `1e-5`).
    - `normalized_shape`: keyword-only; the sizes of the trailing axes normalized
      over, an int or a sequence of ints; None (default): the weight's or bias's
      shape if given, else the last axis. Checked against `x`, `weight` and `bias`
      (`ValueError`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (8, 64))
    y = U.layer_norm(x, jnp.ones(64), jnp.zeros(64))
    assert jnp.allclose(jnp.std(y, axis=-1), 1.0, atol=1e-3)
    ```
    """
    shape = trailing_shape(x, normalized_shape, weight, bias)
    axes = _axes(x, shape)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=axes, keepdims=True)
    y = centred * lax.rsqrt(var + eps)
    return _affine(y, weight, bias, x, shape)


def rms_norm(
    x: Float[Array, "*shape"],
    weight: Float[Array, "*normalized"] | None = None,
    eps: float = 1e-5,
    *,
    normalized_shape: int | Sequence[int] | None = None,
) -> Float[Array, "*shape"]:
    """A unit-scaled RMS norm: `x / sqrt(mean(x**2) + eps) * weight` over the trailing
    axes `normalized_shape` (default: the weight's shape, else the last axis).

    Scales: output 1 and gradient of `x` 1 (as for `layer_norm`); gradient of
    `weight`: `batch ** -0.5`, where `batch = x.size / prod(normalized_shape)`.

    **Arguments:**

    - `x`: the whole batch, a float array of shape `(..., *normalized_shape)`.
    - `weight`: a gain of shape `normalized_shape`, multiplied after normalizing;
      None (default): none.
    - `eps`: added to the mean square before the square root (default `1e-5`).
    - `normalized_shape`: keyword-only; the sizes of the trailing axes normalized
      over, an int or a sequence of ints; None (default): the weight's shape if
      given, else the last axis. Checked against `x` and `weight` (`ValueError`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = 5.0 * jax.random.normal(jax.random.key(0), (8, 64))
    y = U.rms_norm(x)
    assert jnp.allclose(jnp.sqrt(jnp.mean(y**2, axis=-1)), 1.0, atol=1e-3)
    ```
    """
    shape = trailing_shape(x, normalized_shape, weight)
    ms = jnp.mean(x * x, axis=_axes(x, shape), keepdims=True)
    return _affine(x * lax.rsqrt(ms + eps), weight, None, x, shape)
