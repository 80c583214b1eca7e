"""FP8 matmul and convolution: E4M3 operands forward, E5M2 cotangent backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .._scopes import AMP_STOP_SCOPE
from ._formats import E4M3, E5M2
from ._quantize import amax, current_scale, dequantize, quantize

F32 = jnp.float32


def _exact(fn):
    # The FP8 ops choose every dtype themselves: inside `amp` (which re-interprets
    # their jaxprs, forward and backward) they run exactly as written.
    @functools.wraps(fn)
    def wrapper(*args):
        with jax.named_scope(AMP_STOP_SCOPE):
            return fn(*args)

    return wrapper


def _qdq(x, dtype, scale, out_dtype):
    # Quantize then dequantize: on Hopper, XLA's GEMM rewriter fuses the pattern
    # `dot(convert(x_f8) * scale_x, convert(y_f8) * scale_y)` into one cuBLASLt FP8
    # GEMM with float32 accumulation; elsewhere it computes the same numbers.
    return dequantize(quantize(x, dtype, scale), scale, out_dtype)


def _fp8_op(op, lhs, rhs, out_dtype, margin):
    """`op(lhs, rhs)` with both operands through E4M3, its cotangent through E5M2.

    The residuals saved for the backward pass are the FP8 operands and their scales.
    """

    @jax.custom_vjp
    @_exact
    def run(lhs, rhs):
        return fwd(lhs, rhs)[0]

    @_exact
    def fwd(lhs, rhs):
        sl = current_scale(lhs, E4M3, margin=margin)
        sr = current_scale(rhs, E4M3, margin=margin)
        ql, qr = quantize(lhs, E4M3, sl), quantize(rhs, E4M3, sr)
        out = op(dequantize(ql, sl, out_dtype), dequantize(qr, sr, out_dtype))
        return out, (ql, sl, qr, sr)

    @_exact
    def bwd(res, g):
        ql, sl, qr, sr = res
        sg = current_scale(g, E5M2, margin=margin)
        g8 = _qdq(g, E5M2, sg, out_dtype)
        _, vjp = jax.vjp(
            op, dequantize(ql, sl, out_dtype), dequantize(qr, sr, out_dtype)
        )
        dl, dr = vjp(g8)
        return dl.astype(lhs.dtype), dr.astype(rhs.dtype)

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def fp8_dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers,
    *,
    out_dtype=None,
    margin: int = 0,
) -> Array:
    """`lax.dot_general` in FP8, with per-tensor current scaling.

    Forward: each operand is scaled by its own amax (`current_scale`), cast to E4M3
    with saturation, and multiplied with float32 accumulation; the result is returned
    in `out_dtype` (default: `lhs.dtype`). Backward: the output cotangent is scaled
    and cast to E5M2, and both input gradients are computed from FP8 operands (the
    E4M3 forward operands, saved as the residuals, and the E5M2 cotangent). Any batch
    and contracting dimensions work (attention einsums too).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (8, 16)) * 1e4
    w = jax.random.normal(jax.random.key(1), (16, 4)) * 1e-4
    y = fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
    assert jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.05
    ```
    """
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    op = functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        preferred_element_type=out_dtype,
    )
    return _fp8_op(op, lhs, rhs, out_dtype, margin)


def fp8_conv_general_dilated(
    lhs: Array, rhs: Array, *, out_dtype=None, margin=0, **params
):
    """`lax.conv_general_dilated` in FP8 (same scheme as `fp8_dot_general`).

    `params` are `conv_general_dilated`'s keyword arguments.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (1, 2, 8, 8))
    k = jax.random.normal(jax.random.key(1), (3, 2, 3, 3))
    y = fp8.fp8_conv_general_dilated(x, k, window_strides=(1, 1), padding="SAME")
    ref = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")
    assert jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref) < 0.05
    ```
    """
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    params = {**params, "preferred_element_type": out_dtype}
    op = functools.partial(lax.conv_general_dilated, **params)
    return _fp8_op(op, lhs, rhs, out_dtype, margin)


def fp8_dot_general_delayed(lhs, rhs, dimension_numbers, lhs_scale, rhs_scale, g_scale):
    """`fp8_dot_general` with delayed scaling.

    Each tensor is quantized with the scale of its `DelayedScale`, and the "gradients"
    returned for the three `DelayedScale` arguments are their updated states
    (overwrite with gradient; see `Fp8Linear`)."""
    out_dtype = jnp.dtype(lhs.dtype)
    op = functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        preferred_element_type=out_dtype,
    )

    @jax.custom_vjp
    @_exact
    def run(lhs, rhs, ls, rs, gs):
        return fwd(lhs, rhs, ls, rs, gs)[0]

    @_exact
    def fwd(lhs, rhs, ls, rs, gs):
        ql, qr = quantize(lhs, E4M3, ls.scale), quantize(rhs, E4M3, rs.scale)
        out = op(
            dequantize(ql, ls.scale, out_dtype), dequantize(qr, rs.scale, out_dtype)
        )
        new_ls, new_rs = ls.update(amax(lhs)), rs.update(amax(rhs))
        return out, (ql, qr, ls.scale, rs.scale, new_ls, new_rs, gs)

    @_exact
    def bwd(res, g):
        ql, qr, sl, sr, new_ls, new_rs, gs = res
        g8 = _qdq(g, E5M2, gs.scale, out_dtype)
        _, vjp = jax.vjp(
            op, dequantize(ql, sl, out_dtype), dequantize(qr, sr, out_dtype)
        )
        dl, dr = vjp(g8)
        return (
            dl.astype(lhs.dtype),
            dr.astype(rhs.dtype),
            new_ls,
            new_rs,
            gs.update(amax(g)),
        )

    run.defvjp(fwd, bwd)
    return run(lhs, rhs, lhs_scale, rhs_scale, g_scale)
