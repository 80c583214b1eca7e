"""Unit-scaled matrix products: `linear`, `linear_readout`, `matmul`, and `embedding`
(a matrix product with one-hot rows, done as a lookup)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from . import constraints as _constraints
from ._core import broadcast_trailing, leading_size
from ._scale import scale_bwd, scale_fwd
from .constraints import gmean


def _check_linear(x, weight, bias, name: str) -> None:
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"`{name}` expected `x` of shape (..., in) and `weight` of shape "
            f"(out, in) as in `eqx.nn.Linear`, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)} instead. Transpose the weight if it is (in, out)."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"`{name}` expected a bias of shape ({weight.shape[0]},), got "
            f"{tuple(bias.shape)} instead."
        )


def _scaled_linear(x, weight, bias, constraint, output_power: float, name: str):
    _check_linear(x, weight, bias, name)
    fan_out, fan_in = weight.shape
    batch = leading_size(x, 1)
    output_scale, grad_input_scale = _constraints.apply(
        constraint, fan_in**-output_power, fan_out**-0.5
    )
    grad_param_scale = batch**-0.5
    x = scale_bwd(x, grad_input_scale)
    y = x @ scale_bwd(weight, grad_param_scale).T  # (..., out)
    if bias is not None:
        y = y + broadcast_trailing(scale_bwd(bias, grad_param_scale), y.shape)
    return scale_fwd(y, output_scale)


def linear(
    x: Float[Array, "... in"],
    weight: Float[Array, "out in"],
    bias: Float[Array, " out"] | None = None,
    constraint: _constraints.Constraint | None = gmean,
) -> Float[Array, "... out"]:
    """A unit-scaled `x @ weight.T + bias`, on a whole batch `x` of shape `(..., in)`.

    Scales, for unit-normal `x`, `weight` and output cotangent:

    - output: `in ** -0.5` (a sum of `in` unit products has RMS `sqrt(in)`);
    - gradient of `x`: `out ** -0.5` (it sums over the `out` outputs);
      the two are tied by `constraint` (default `gmean`: both `(in * out) ** -0.25`,
      exact when `in == out`; `None`: each its own, so the gradient of `x` is the
      true one times `sqrt(in / out)`);
    - gradients of `weight` and `bias`: `batch ** -0.5`, where `batch` is the product
      of all leading axes of `x` (they sum over the batch).

    The bias is added before the output scale, so it counts `in ** -0.5` times.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = jax.random.normal(jax.random.key(0), (512, 256))
    w = jax.random.normal(jax.random.key(1), (256, 256))
    y = U.linear(x, w)
    assert jnp.allclose(y * 16.0, x @ w.T, rtol=1e-4, atol=1e-3)
    assert 0.9 < jnp.sqrt(jnp.mean(y**2)) < 1.1
    ```
    """
    return _scaled_linear(x, weight, bias, constraint, 0.5, "linear")


def linear_readout(
    x: Float[Array, "... in"],
    weight: Float[Array, "out in"],
    bias: Float[Array, " out"] | None = None,
    constraint: _constraints.Constraint | None = None,
) -> Float[Array, "... out"]:
    """`linear` for the last layer of a network (u-μP's readout): the output scale is
    `1 / in` rather than `in ** -0.5`.

    Scales: output `1 / in`, so unit-normal inputs give outputs of RMS `in ** -0.5`
    (u-μP's readout multiplier: logits start small and stay stable as the width
    grows); gradient of `x` `out ** -0.5` (unit), left apart from the output scale by
    the default `constraint=None` (with `to_output_scale` it is `1 / in` as well, the
    true gradient); gradients of `weight` and `bias` `batch ** -0.5`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = jax.random.normal(jax.random.key(0), (512, 256))
    w = jax.random.normal(jax.random.key(1), (10, 256))
    y = U.linear_readout(x, w)
    assert jnp.allclose(y * 256.0, x @ w.T, rtol=1e-4, atol=1e-3)
    ```
    """
    return _scaled_linear(x, weight, bias, constraint, 1.0, "linear_readout")


def matmul(
    left: Float[Array, "*batch m k"],
    right: Float[Array, "*batch k n"],
    constraint: _constraints.Constraint | None = gmean,
) -> Float[Array, "*batch m n"]:
    """A unit-scaled `left @ right` (`jnp.matmul`'s broadcasting).

    Scales, for unit-normal operands and cotangent: output `k ** -0.5`; gradient of
    `left` `n ** -0.5`; gradient of `right` `m ** -0.5`. All three are tied by
    `constraint` (default `gmean`, the geometric mean of the three; `None` leaves
    them apart; `to_left_grad_scale` and `to_right_grad_scale` pick one gradient's).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu
    import lowtrain.unit_scaling.functional as U

    a = jax.random.normal(jax.random.key(0), (64, 256))
    b = jax.random.normal(jax.random.key(1), (256, 64))
    y = U.matmul(a, b, constraint=uu.constraints.to_output_scale)
    assert jnp.allclose(y * 16.0, a @ b, rtol=1e-4, atol=1e-3)
    ```
    """
    if left.ndim < 2 or right.ndim < 2 or left.shape[-1] != right.shape[-2]:
        raise ValueError(
            "`matmul` expected `left` of shape (..., m, k) and `right` of shape "
            f"(..., k, n), got {tuple(left.shape)} and {tuple(right.shape)} instead."
        )
    m, k = left.shape[-2:]
    n = right.shape[-1]
    output_scale, left_scale, right_scale = _constraints.apply(
        constraint, k**-0.5, n**-0.5, m**-0.5
    )
    left = scale_bwd(left, left_scale)
    right = scale_bwd(right, right_scale)
    return scale_fwd(jnp.matmul(left, right), output_scale)


def embedding(
    ids: Int[Array, "*batch"], table: Float[Array, "vocab dim"]
) -> Float[Array, "*batch dim"]:
    """A unit-scaled lookup `table[ids]`, for integer `ids` of any shape.

    Scales: output 1 (rows of a unit-normal table are unit already; no input
    gradient); gradient of `table`: `sqrt(vocab / batch)`, where `batch = ids.size`:
    a row's gradient sums the cotangents of its `batch / vocab` occurrences on
    average (uniform ids), so it has RMS `sqrt(batch / vocab)`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    table = jax.random.normal(jax.random.key(0), (16, 8))
    ids = jnp.array([[1, 2, 3], [3, 2, 1]])
    assert (U.embedding(ids, table) == table[ids]).all()
    ```
    """
    if not jnp.issubdtype(ids.dtype, jnp.integer) or table.ndim != 2:
        raise ValueError(
            "`embedding` expected integer `ids` and a `table` of shape "
            f"(vocab, dim), got {ids.dtype} ids and a table of shape "
            f"{tuple(table.shape)} instead."
        )
    vocab = table.shape[0]
    table = scale_bwd(table, (vocab / max(ids.size, 1)) ** 0.5)
    return jnp.take(table, ids, axis=0)
