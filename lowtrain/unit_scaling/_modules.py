"""Unit-scaled Equinox layers: `Linear`, `LinearReadout`, `Embedding`, `LayerNorm`,
`RMSNorm`.

Like `eqx.nn`'s, but initialized at unit scale (weights N(0, 1), norms' weights 1,
biases 0) and called on whole batches: the gradient of a weight sums over the batch,
and its unit scale needs the batch size, which under `jax.vmap` is 1 (the parameter
gradients would come out `sqrt(batch)` too large). Each class names the u-μP kind of
its parameters in `mup_kinds`, which `lowtrain.unit_scaling.optim` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import constraints as _constraints
from ._matmuls import embedding, linear, linear_readout
from ._norms import layer_norm, rms_norm
from .constraints import gmean


class _Linear(eqx.Module):
    # The fields and initialization `Linear` and `LinearReadout` share. Unit
    # initialization: the 1/sqrt(fan_in) lives in the op, not in the weights.
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    constraint: _constraints.Constraint | None = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        *,
        constraint: _constraints.Constraint | None = gmean,
        dtype=None,
        key: PRNGKeyArray,
    ):
        dtype = dtype or jnp.float32
        self.weight = jax.random.normal(key, (out_features, in_features), dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.in_features, self.out_features = in_features, out_features
        self.constraint = constraint


class Linear(_Linear):
    """A unit-scaled `eqx.nn.Linear`: `U.linear(x, weight, bias, constraint)`.

    `weight` has shape `(out_features, in_features)` and unit-normal entries, `bias`
    `(out_features,)` and zeros (or is None). Call it on a whole batch `x` of shape
    `(..., in_features)`, not under `jax.vmap`: the weight and bias gradients are
    scaled by `batch ** -0.5`, and under `vmap` the batch is 1. Scales: output
    `in ** -0.5`, input gradient `out ** -0.5`, tied by `constraint`; see
    `lowtrain.unit_scaling.functional.linear`.

    **Arguments:**

    - `in_features`: the input size (the last axis of `x`).
    - `out_features`: the output size.
    - `use_bias`: whether to add a bias (default True).
    - `constraint`: keyword-only; ties the output and input-gradient scales
      (default `gmean`); None keeps them apart.
    - `dtype`: keyword-only; the parameters' dtype; None (default): float32.
    - `key`: keyword-only; the PRNG key of the weight's initialization.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    layer = uu.Linear(256, 128, key=jax.random.key(0))
    y = layer(jax.random.normal(jax.random.key(1), (4, 32, 256)))
    assert y.shape == (4, 32, 128) and layer.weight.shape == (128, 256)
    ```
    """

    mup_kinds: ClassVar[dict[str, str]] = {"weight": "weight", "bias": "bias"}

    def __call__(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        return linear(x, self.weight, self.bias, self.constraint)


class LinearReadout(_Linear):
    """The unit-scaled last layer of a network: `U.linear_readout`, whose output
    scale is `1 / in_features` (u-μP's readout), and whose weight the u-μP optimizers
    treat as the "output" kind (learning rate independent of width).

    Shapes and initialization as `Linear`, but `use_bias=False` and
    `constraint=None` by default (as in u-μP: the input gradient keeps its unit
    scale `out ** -0.5`, apart from the output's). Call it on whole batches
    `(..., in_features)`, not under `jax.vmap` (the weight gradient is scaled by
    `batch ** -0.5`).

    **Arguments:**

    - `in_features`: the input size (the last axis of `x`).
    - `out_features`: the output size (e.g. the vocabulary's or the classes').
    - `use_bias`: whether to add a bias (default False).
    - `constraint`: keyword-only; ties the output and input-gradient scales;
      None (default) keeps them apart, `to_output_scale` makes the input gradient
      the true one.
    - `dtype`: keyword-only; the parameters' dtype; None (default): float32.
    - `key`: keyword-only; the PRNG key of the weight's initialization.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    head = uu.LinearReadout(64, 10, key=jax.random.key(0))
    logits = head(jax.random.normal(jax.random.key(1), (32, 64)))
    assert logits.shape == (32, 10) and head.bias is None
    assert jnp.sqrt(jnp.mean(logits**2)) < 0.25  # about 64 ** -0.5
    ```
    """

    mup_kinds: ClassVar[dict[str, str]] = {"weight": "output", "bias": "bias"}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = False,
        *,
        constraint: _constraints.Constraint | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        super().__init__(
            in_features,
            out_features,
            use_bias,
            constraint=constraint,
            dtype=dtype,
            key=key,
        )

    def __call__(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        return linear_readout(x, self.weight, self.bias, self.constraint)


class Embedding(eqx.Module):
    """A unit-scaled `eqx.nn.Embedding`: `U.embedding(ids, weight)`.

    `weight` has shape `(num_embeddings, embedding_size)` and unit-normal entries.
    Call it on all the ids of a batch at once, an integer array of any shape (it
    returns shape `ids.shape + (embedding_size,)`), not under `jax.vmap`: the table's
    gradient is scaled by `sqrt(num_embeddings / ids.size)`.

    **Arguments:**

    - `num_embeddings`: the number of rows (the vocabulary size); ids index them.
    - `embedding_size`: the size of each row, the output's last axis.
    - `dtype`: keyword-only; the table's dtype; None (default): float32.
    - `key`: keyword-only; the PRNG key of the table's initialization.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    emb = uu.Embedding(100, 16, key=jax.random.key(0))
    assert emb(jnp.zeros((4, 8), jnp.int32)).shape == (4, 8, 16)
    ```
    """

    weight: Float[Array, "vocab dim"]
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)

    mup_kinds: ClassVar[dict[str, str]] = {"weight": "embedding"}

    def __init__(
        self, num_embeddings: int, embedding_size: int, *, dtype=None, key: PRNGKeyArray
    ):
        shape = (num_embeddings, embedding_size)
        self.weight = jax.random.normal(key, shape, dtype or jnp.float32)
        self.num_embeddings, self.embedding_size = num_embeddings, embedding_size

    def __call__(
        self, ids: Int[Array, "*batch"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch dim"]:
        return embedding(ids, self.weight)


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


class LayerNorm(eqx.Module):
    """A unit-scaled `eqx.nn.LayerNorm` over the trailing axes `shape`.

    By default it has no weight and no bias (`use_weight=False, use_bias=False`, as
    in u-μP, where a learned gain only duplicates the next layer's weight); with them
    the weight starts at 1 and the bias at 0. Call it on a whole batch `(..., *shape)`,
    not under `jax.vmap`: the weight and bias gradients are scaled by
    `batch ** -0.5`.

    **Arguments:**

    - `shape`: the trailing axes normalized over, an int or a sequence of ints.
    - `eps`: added to the variance before the square root (default `1e-5`).
    - `use_weight`: whether to learn a gain of shape `shape` (default False).
    - `use_bias`: whether to learn a bias of shape `shape` (default False).
    - `dtype`: keyword-only; the weight's and bias's dtype; None (default): float32.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    norm = uu.LayerNorm(64, use_weight=True)
    y = norm(3.0 * jax.random.normal(jax.random.key(0), (8, 64)))
    assert jnp.allclose(jnp.std(y, axis=-1), 1.0, atol=1e-3)
    ```
    """

    weight: Float[Array, "*shape"] | None
    bias: Float[Array, "*shape"] | None
    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    mup_kinds: ClassVar[dict[str, str]] = {"weight": "norm", "bias": "bias"}

    def __init__(
        self,
        shape: int | Sequence[int],
        eps: float = 1e-5,
        use_weight: bool = False,
        use_bias: bool = False,
        *,
        dtype=None,
    ):
        self.shape, self.eps = _shape(shape), eps
        dtype = dtype or jnp.float32
        self.weight = jnp.ones(self.shape, dtype) if use_weight else None
        self.bias = jnp.zeros(self.shape, dtype) if use_bias else None

    def __call__(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        return layer_norm(
            x, self.weight, self.bias, self.eps, normalized_shape=self.shape
        )


class RMSNorm(eqx.Module):
    """A unit-scaled RMS norm over the trailing axes `shape`:
    `x / sqrt(mean(x**2) + eps) * weight`.

    By default it has no weight (`use_weight=False`, as in u-μP); with one it starts
    at 1. Call it on a whole batch `(..., *shape)`, not under `jax.vmap`: the weight
    gradient is scaled by `batch ** -0.5`.

    **Arguments:**

    - `shape`: the trailing axes normalized over, an int or a sequence of ints.
    - `eps`: added to the mean square before the square root (default `1e-5`).
    - `use_weight`: whether to learn a gain of shape `shape` (default False).
    - `dtype`: keyword-only; the weight's dtype; None (default): float32.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    norm = uu.RMSNorm(64)
    y = norm(5.0 * jax.random.normal(jax.random.key(0), (8, 64)))
    assert jnp.allclose(jnp.sqrt(jnp.mean(y**2, axis=-1)), 1.0, atol=1e-3)
    ```
    """

    weight: Float[Array, "*shape"] | None
    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    mup_kinds: ClassVar[dict[str, str]] = {"weight": "norm"}

    def __init__(
        self,
        shape: int | Sequence[int],
        eps: float = 1e-5,
        use_weight: bool = False,
        *,
        dtype=None,
    ):
        self.shape, self.eps = _shape(shape), eps
        dtype = dtype or jnp.float32
        self.weight = jnp.ones(self.shape, dtype) if use_weight else None

    def __call__(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        return rms_norm(x, self.weight, self.eps, normalized_shape=self.shape)
