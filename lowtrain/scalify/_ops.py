"""User-facing scaling ops: dynamic rescaling, `stop_scaling`, scaled FP8 casts.

Each is one primitive, `scalify_op`, that is the identity on values (a rounding, for
the casts) outside `scalify`, and that the scalify interpreter turns into the scale
operation. Backward-only (`_grad`) variants act on the cotangent instead: they are
the identity forward and their transpose is the forward op.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .. import _compat
from ..fp8 import E4M3, E5M2, dequantize, quantize
from ._rules import Ctx, register, scaled
from ._scaled_array import ScaledArray, is_scaled

F32 = jnp.float32
NORMS = ("l1", "l2", "max")


def _impl(x, *, kind, norm, backward, dtype, grad_dtype):
    if kind == "cast" and dtype is not None:
        return dequantize(quantize(x, dtype), 1.0, x.dtype)
    return x  # rescaling and stop_scaling do not change values


def _transpose(ct, *, kind, norm, backward, dtype, grad_dtype):
    if kind == "rescale" and backward:
        return scalify_op_p.bind(
            ct, kind="rescale", norm=norm, backward=False, dtype=None, grad_dtype=None
        )
    if kind == "cast" and grad_dtype is not None:
        return scalify_op_p.bind(
            ct,
            kind="cast",
            norm=None,
            backward=False,
            dtype=grad_dtype,
            grad_dtype=None,
        )
    return ct


scalify_op_p = _compat.make_value_identity_primitive("scalify_op", _impl, _transpose)


def _norm(data, norm):
    data = jnp.abs(data.astype(F32))
    if norm == "l1":
        return jnp.mean(data)
    if norm == "l2":
        return jnp.sqrt(jnp.mean(data**2))
    return jnp.max(data)


@register("scalify_op")
def _scalify_op(ctx: Ctx, eqn, x):
    """rescale: scale `sa * norm(da)` (power of two), so the data's norm is ~1;
    stop: a plain array of the values; cast: the data cast (saturating) to the FP8
    format and back, the scale kept. Backward-only variants pass through."""
    p = eqn.params
    x = scaled(x)
    if p["kind"] == "stop":
        return [x.to_array(eqn.out_avals[0].dtype)]
    if p["backward"] or (p["kind"] == "cast" and p["dtype"] is None):
        return [x]
    if p["kind"] == "cast":
        data = dequantize(quantize(x.data, p["dtype"]), 1.0, x.data.dtype)
        return [ScaledArray(data, x.scale)]
    n = _norm(x.data, p["norm"])
    factor = ctx.pow2(jnp.where(jnp.isfinite(n) & (n > 0), n, 1.0))
    return [
        ScaledArray((x.data.astype(F32) / factor).astype(x.dtype), x.scale * factor)
    ]


def _apply(x, **params):
    params = {
        "norm": None,
        "backward": False,
        "dtype": None,
        "grad_dtype": None,
        **params,
    }
    if is_scaled(x):  # called directly on a ScaledArray, outside `scalify`
        return _scalify_op(Ctx("down"), _EagerEqn(params, x), x)[0]
    return scalify_op_p.bind(jnp.asarray(x), **params)


class _EagerEqn:
    def __init__(self, params, x):
        self.params = params
        self.out_avals = (x,)


def _rescale(x, norm: str, backward: bool):
    return _apply(x, kind="rescale", norm=norm, backward=backward)


def dynamic_rescale_l1(x: ArrayLike | ScaledArray) -> Array | ScaledArray:
    """Rescale `x` inside `scalify`: the scale absorbs the data's mean absolute
    value (rounded to a power of two), so the data's is about 1. Values do not
    change; outside `scalify` it is the identity.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.array([8.0, -8.0, 8.0, -8.0], jnp.float16), 1.0)
    y = scalify.dynamic_rescale_l1(x)
    assert (abs(y.data) == 1.0).all() and y.scale == 8.0
    ```
    """
    return _rescale(x, "l1", False)


def dynamic_rescale_l2(x: ArrayLike | ScaledArray) -> Array | ScaledArray:
    """Rescale `x` inside `scalify`: the scale absorbs the data's root mean square
    (rounded to a power of two), so the data's is about 1. Values do not change;
    outside `scalify` it is the identity. The recipes' Scalify FP8 matmuls call it
    on both operands before their E4M3 casts.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.full(4, 64.0, jnp.float16), 1.0)
    f = scalify.scalify(lambda x: scalify.dynamic_rescale_l2(x * 2.0))
    assert f(x).scale == 128.0 and (f(x).data == 1.0).all()
    ```
    """
    return _rescale(x, "l2", False)


def dynamic_rescale_max(x: ArrayLike | ScaledArray) -> Array | ScaledArray:
    """Rescale `x` inside `scalify`: the scale absorbs the data's largest absolute
    value (rounded to a power of two), so the data's is about 1. Values do not
    change; outside `scalify` it is the identity.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.array([64.0, 2.0], jnp.float16), 1.0)
    y = scalify.dynamic_rescale_max(x)
    assert y.data.tolist() == [1.0, 0.03125] and y.scale == 64.0
    ```
    """
    return _rescale(x, "max", False)


def dynamic_rescale_l1_grad(x: ArrayLike | ScaledArray) -> Array | ScaledArray:
    """`x` (an array or `ScaledArray`) unchanged forward; in the backward pass,
    inside `scalify`, its cotangent is rescaled as `dynamic_rescale_l1` rescales a
    value (its mean absolute value into the scale). Outside `scalify` it is the
    identity both ways.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.full(4, 3.0, jnp.float16), 1.0)
    f = scalify.scalify(lambda x: scalify.dynamic_rescale_l1_grad(x))
    assert f(x).scale == 1.0  # forward: unchanged
    g = jax.grad(lambda x: jnp.sum(scalify.dynamic_rescale_l1_grad(x) * 8.0))
    assert (g(jnp.ones(4)) == 8.0).all()  # values unchanged backward too
    ```
    """
    return _rescale(x, "l1", True)


def dynamic_rescale_l2_grad(x: ArrayLike | ScaledArray) -> Array | ScaledArray:
    """`x` (an array or `ScaledArray`) unchanged forward; in the backward pass,
    inside `scalify`, its cotangent is rescaled as `dynamic_rescale_l2` rescales a
    value (its root mean square into the scale), as the recipes' Scalify FP8
    matmuls do before the E5M2 cast of the output cotangent. Outside `scalify` it is
    the identity both ways.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.full(4, 3.0, jnp.float16), 1.0)
    f = scalify.scalify(lambda x: scalify.dynamic_rescale_l2_grad(x))
    assert f(x).scale == 1.0  # forward: unchanged
    g = jax.grad(lambda x: jnp.sum(scalify.dynamic_rescale_l2_grad(x) * 8.0))
    assert (g(jnp.ones(4)) == 8.0).all()
    ```
    """
    return _rescale(x, "l2", True)


def dynamic_rescale_max_grad(x: ArrayLike | ScaledArray) -> Array | ScaledArray:
    """`x` (an array or `ScaledArray`) unchanged forward; in the backward pass,
    inside `scalify`, its cotangent is rescaled as `dynamic_rescale_max` rescales a
    value (its largest absolute value into the scale). Outside `scalify` it is the
    identity both ways.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.full(4, 3.0, jnp.float16), 1.0)
    f = scalify.scalify(lambda x: scalify.dynamic_rescale_max_grad(x))
    assert f(x).scale == 1.0  # forward: unchanged
    g = jax.grad(lambda x: jnp.sum(scalify.dynamic_rescale_max_grad(x) * 8.0))
    assert (g(jnp.ones(4)) == 8.0).all()
    ```
    """
    return _rescale(x, "max", True)


def stop_scaling(x: ArrayLike | ScaledArray) -> Array:
    """The plain array of `x`'s values: inside `scalify`, scale propagation stops here.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    f = scalify.scalify(lambda x: scalify.stop_scaling(x * 2.0))
    out = f(scalify.ScaledArray(jnp.ones(2, jnp.float16), 4.0))
    assert not isinstance(out, scalify.ScaledArray) and out.tolist() == [8.0, 8.0]
    ```
    """
    return _apply(x, kind="stop")


def cast_fp8(x, dtype=E4M3, grad_dtype=E5M2):
    """Cast `x`'s data to `dtype` (an FP8 dtype; saturating, `lowtrain.fp8.quantize`),
    keeping its scale; in the backward pass its cotangent's data is cast to
    `grad_dtype`. Either may be None (left alone). E4M3 forward and E5M2 backward
    (the defaults), as the FP8 formats paper recommends. The data keeps its dtype,
    holding FP8 values (XLA turns the cast pairs into FP8 GEMM operands on Hopper).

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.ScaledArray(jnp.array([1.0, 1.0625, 500.0]), 2.0**-30)
    y = scalify.cast_fp8(x)
    assert y.data.tolist() == [1.0, 1.0, 448.0] and y.scale == 2.0**-30
    ```
    """
    dtype = None if dtype is None else jnp.dtype(dtype)
    grad_dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
    return _apply(x, kind="cast", dtype=dtype, grad_dtype=grad_dtype)


def fp8_scaled_dot_general(lhs, rhs, dimension_numbers, *, preferred_element_type=None):
    """`lax.dot_general` of `ScaledArray`s with FP8 data: both inputs' data cast to
    E4M3 (forward), the output's cotangent's data cast to E5M2 (backward), scales kept
    (`cast_fp8`). (`lowtrain.fp8.fp8_dot_general` is the FP8 matmul of plain
    arrays, with its own scales.)
    Inside `scalify(jax.grad(...))` every forward and backward matmul through it then
    multiplies FP8 data.

    **Arguments:**

    - `lhs`, `rhs`: the operands, `ScaledArray`s inside `scalify` (plain arrays
      outside it, whose values are rounded to FP8).
    - `dimension_numbers`: as for `lax.dot_general`.
    - `preferred_element_type`: the result's dtype, passed to `lax.dot_general`;
      default None (as `lax.dot_general` chooses).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    dn = (((1,), (0,)), ((), ()))
    x = scalify.as_scaled_array(jnp.full((2, 3), 1e5), dtype=jnp.float16)
    out = scalify.scalify(lambda a: scalify.fp8_scaled_dot_general(a, a.T, dn))(x)
    assert jnp.allclose(scalify.asarray(out, jnp.float32), 3e10, rtol=0.07)
    ```
    """
    from jax import lax

    lhs = cast_fp8(lhs, E4M3, None)
    rhs = cast_fp8(rhs, E4M3, None)
    out = lax.dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type
    )
    return cast_fp8(out, None, E5M2)
