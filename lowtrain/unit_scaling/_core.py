"""What every unit-scaled op is built from: scaling an elementwise function, the
empirical models' interpolation, and the size of the batch a gradient sums over.

Unit scaling gives each op three kinds of scale, chosen so that inputs and an output
cotangent of unit RMS (the model's assumption: independent, unit-normal entries) give
an output and gradients of unit RMS:

- the *output scale*, applied with `scale_fwd` to the op's result;
- the *input-gradient scale* of each input that flows on through the network, applied
  with `scale_bwd` to that input (tied to the output scale by a constraint, see
  `lowtrain.unit_scaling.constraints`);
- the *parameter-gradient scale* of each weight or bias, applied with `scale_bwd`
  too, and free: a parameter's gradient leaves the graph, so nothing else sees it.

A parameter's gradient sums over the batch, so its scale depends on the number of
rows in the call. Unit-scaled ops and modules therefore take whole batches: under
`jax.vmap` each call sees a batch of one and the parameter gradients come out too
large by the square root of the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jaxtyping import Array

from . import constraints as _constraints
from ._scale import scale_bwd, scale_fwd


def logarithmic_interpolation(alpha: float, lower: float, upper: float) -> float:
    """`lower ** (1 - alpha) * upper ** alpha`: `lower` at `alpha=0`, `upper` at
    `alpha=1`, evenly spaced in log space in between (both must be positive).

    ```python
    from lowtrain.unit_scaling._core import logarithmic_interpolation

    assert abs(logarithmic_interpolation(0.5, 1e-3, 1e-1) - 1e-2) < 1e-12
    ```
    """
    return math.exp(alpha * math.log(upper) + (1 - alpha) * math.log(lower))


def scale_elementwise(
    f: Callable[..., Array],
    output_scale: float,
    grad_input_scale: float,
    constraint: _constraints.Constraint | None,
) -> Callable[..., Array]:
    """`f` with its first argument's gradient multiplied by `grad_input_scale` and its
    output by `output_scale`, after `constraint` ties the two (`None`: left apart).

    The result is `lambda x, *args, **kwargs: output_scale * f(x, *args, **kwargs)`
    in the forward pass; in the backward pass the gradient reaching `x` is the one
    of `f` times `grad_input_scale`.

    ```python
    import jax
    import jax.numpy as jnp
    from lowtrain.unit_scaling._core import scale_elementwise

    f = scale_elementwise(jnp.tanh, 2.0, 8.0, constraint=None)
    y, vjp = jax.vjp(f, jnp.zeros(3))
    assert (y == 0).all() and (vjp(jnp.ones(3))[0] == 8.0).all()
    ```
    """
    output_scale, grad_input_scale = _constraints.apply(
        constraint, output_scale, grad_input_scale
    )

    def scaled(x: Array, *args, **kwargs) -> Array:
        x = scale_bwd(x, grad_input_scale)
        return scale_fwd(f(x, *args, **kwargs), output_scale)

    return scaled


def leading_size(x: Array, trailing: int) -> int:
    """The product of all axes of `x` but its last `trailing` ones: how many rows a
    parameter's gradient sums over (1 for an array with no leading axes)."""
    return math.prod(x.shape[: x.ndim - trailing])


def broadcast_trailing(p: Array, shape: Sequence[int]) -> Array:
    """`p`, whose shape is the trailing part of `shape`, broadcast to `shape`.

    Explicit, so that it also runs under `jax_numpy_rank_promotion="raise"`.
    """
    return jnp.broadcast_to(p, tuple(shape))


def at_least_float32(x: Array) -> Array:
    """`x` cast to float32 if it is a narrower float (bfloat16, float16), else `x`:
    where a softmax or a loss runs (written without implicit promotion, so it also
    runs under `jax_numpy_dtype_promotion="strict"`)."""
    if jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def trailing_shape(
    x: Array, normalized_shape: int | Sequence[int] | None, *params: Array | None
) -> tuple[int, ...]:
    """The trailing shape a norm works over: `normalized_shape` if given, else the
    shape of the first parameter given, else `x`'s last axis; checked against `x`."""
    if normalized_shape is None:
        given = [p.shape for p in params if p is not None]
        shape = tuple(given[0]) if given else tuple(x.shape[-1:])
    elif isinstance(normalized_shape, int):
        shape = (normalized_shape,)
    else:
        shape = tuple(normalized_shape)
    if len(shape) > x.ndim or tuple(x.shape[x.ndim - len(shape) :]) != shape:
        raise ValueError(
            f"Expected an input whose trailing axes are {shape}, got shape "
            f"{tuple(x.shape)} instead. Pass `normalized_shape` (or a weight) of the "
            "axes to normalize over."
        )
    for p in params:
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(
                f"Expected a weight or bias of shape {shape} (the normalized axes), "
                f"got {tuple(p.shape)} instead."
            )
    return shape
