"""A simulated block-scaled matmul: both operands and the output cotangent through
block-scaled formats, each along the axis its GEMM contracts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from ._blocks import (
    BlockFormat,
    _axes,
    _fake_quantize,
    block_format,
    block_site,
)
from ._dot import _exact, _normal_dn, gemm_of

F32 = jnp.dtype(jnp.float32)


def block_dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers,
    format: BlockFormat | str = "mxfp8_e4m3",
    *,
    rhs_format: BlockFormat | str | None = None,
    grad_format: BlockFormat | str | None = None,
    out_dtype=None,
    key: PRNGKeyArray | None = None,
    rounding: str = "nearest",
    hadamard: str | None = None,
) -> Array:
    """`lax.dot_general` of block-scaled operands: the reference a block-scaled GEMM
    (MXFP8, NVFP4, DeepSeek-V3's FP8 tiles) computes, simulated on any backend.

    Forward: `lhs` is fake-quantized to `format` and `rhs` to `rhs_format`
    (`block_fake_quantize`), each in blocks along its contracting dimension, and the
    two are multiplied in float32 (`precision=HIGHEST`); the result is returned in
    `out_dtype`. Backward (a `jax.custom_vjp`): each of the two gradient GEMMs is
    block-scaled along the dimensions *it* contracts, as the hardware needs and as
    torchao's MX training and `jax.nn.scaled_dot_general` do: for `d lhs = g . rhs`
    the output cotangent `g` goes through `grad_format` and `rhs` through
    `rhs_format`, both in blocks along `rhs`'s free dimension, and for `d rhs = lhs .
    g` along `lhs`'s free dimension. (Where there are several free dimensions, the
    blocks run along the last, the one that varies fastest.) The backward quantizes
    the saved operands afresh, from their high-precision values; 2-D tiles (128x128)
    are the same tiles either way. The gradients come back in the operands' dtypes.

    A 2-D tile spans the operand's last free dimension besides its contracting one.
    With `key` (or `rounding="stochastic"`), the two quantizations of the cotangent
    round stochastically (unbiased), each with its own half of `key` (without a key,
    from a hash of each value and its position); otherwise, and always in the
    forward pass, to nearest even. Under `lowtrain.amp` the op runs as written.

    `hadamard="rhs"` (or "lhs") applies NVIDIA's NVFP4 random Hadamard transform to
    the two inputs of the GEMM that makes that operand's gradient (the weight
    gradient, where it is the weight): both are multiplied, in groups of 16 along the
    dimension that GEMM contracts (zero-padded to a multiple of 16), by the same
    orthogonal `diag(signs) @ H16 / 4` (`H16` the 16x16 Sylvester Hadamard matrix,
    `signs` a fixed random sign vector), before they are
    quantized. The rotation cancels in the product (`Q @ Q.T = I`), so only the
    quantization sees it: it spreads an outlier over its group of 16.

    This is a quantizer and a simulated GEMM (dequantize, then multiply): it does not
    call a Blackwell block-scaled GEMM.

    **Arguments:**

    - `lhs`, `rhs`: the operands, float arrays.
    - `dimension_numbers`: `((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))`, as for `lax.dot_general`, with one contracting dimension per
      operand; each operand needs a free dimension (the backward GEMMs contract it).
    - `format`: the `BlockFormat` (or its name) of `lhs`; default "mxfp8_e4m3".
    - `rhs_format`: the format of `rhs`; default None: `format`.
    - `grad_format`: the format of the output cotangent; default None: `format`
      (what Transformer Engine's MXFP8 recipe and `jax.nn.scaled_dot_general` use
      by default).
    - `out_dtype`: the result's dtype; default None: `lhs.dtype`.
    - `key`: a PRNG key for stochastic rounding of the cotangent; default None.
    - `rounding`: the cotangent's rounding, "nearest" (the default, unless `key` is
      given) or "stochastic".
    - `hadamard`: None (the default), "lhs" or "rhs": the operand whose gradient
      GEMM's inputs get the random Hadamard transform.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (8, 64))
    w = jax.random.normal(jax.random.key(1), (64, 32))
    dn = (((1,), (0,)), ((), ()))

    @jax.jit
    def forward(x, w):
        y = fp8.block_dot_general(x, w, dn, "mxfp8_e4m3", grad_format="mxfp8_e5m2")
        # The product of the operands fake-quantized along K (axis 1 of x, 0 of w).
        xq = fp8.block_fake_quantize(x, "mxfp8_e4m3", axis=1)
        wq = fp8.block_fake_quantize(w, "mxfp8_e4m3", axis=0)
        return y, xq @ wq

    y, expected = forward(x, w)
    assert jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.05
    assert jnp.allclose(y, expected, rtol=1e-6, atol=1e-5)
    # NVFP4, with the cotangent rounded stochastically.
    loss = lambda w: fp8.block_dot_general(x, w, dn, "nvfp4", key=jax.random.key(2))
    grad = jax.jit(jax.grad(lambda w: loss(w).sum()))(w)
    assert grad.shape == w.shape and grad.dtype == w.dtype
    ```
    """
    lhs_fmt = block_format(format)
    rhs_fmt = lhs_fmt if rhs_format is None else block_format(rhs_format)
    grad_fmt = lhs_fmt if grad_format is None else block_format(grad_format)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(
            f"Expected `rounding` 'nearest' or 'stochastic', got {rounding!r} instead."
        )
    if hadamard not in (None, "lhs", "rhs"):
        raise ValueError(
            "Expected `hadamard` None, 'lhs' or 'rhs' (the operand whose gradient "
            f"GEMM's inputs are rotated), got {hadamard!r} instead."
        )
    stochastic = key is not None or rounding == "stochastic"
    dn = _normal_dn(dimension_numbers)
    (lc, rc), (lb, rb) = dn
    if len(lc) != 1 or len(rc) != 1:
        raise ValueError(
            "Expected one contracting dimension per operand (the blocks run along "
            f"it), got {dn} instead: reshape the contracting dimensions into one."
        )
    lhs_free = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
    rhs_free = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
    if not lhs_free or not rhs_free:
        raise ValueError(
            "Expected a free (neither contracting nor batch) dimension in each "
            f"operand, which the backward GEMMs contract, got shapes {lhs.shape} and "
            f"{rhs.shape} with {dn} instead: add a dimension of size 1."
        )
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    dot = functools.partial(
        lax.dot_general,
        dimension_numbers=dn,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=F32,
    )
    # The output's dimensions: batch, then lhs's free ones, then rhs's.
    nb, nl = len(lb), len(lhs_free)
    g_lhs_free = list(range(nb, nb + nl))
    g_rhs_free = list(range(nb + nl, nb + nl + len(rhs_free)))

    # Each cast named for a numerics report (`lowtrain.numerics.track(...,
    # casts=True)`): the operands' in both passes, the cotangent's in both GEMMs.
    gemm = gemm_of(lhs.shape, rhs.shape, dn)
    sites = {
        role: block_site(fmt, role, gemm, rhs.shape, stochastic and role == "grad")
        for role, fmt in (("lhs", lhs_fmt), ("rhs", rhs_fmt), ("grad", grad_fmt))
    }

    @jax.custom_vjp
    @_exact
    def run(lhs, rhs, key):
        return fwd(lhs, rhs, key)[0]

    @_exact
    def fwd(lhs, rhs, key):
        lq = _qdq(lhs, lhs_fmt, lc[0], lhs_free, site=sites["lhs"])
        rq = _qdq(rhs, rhs_fmt, rc[0], rhs_free, site=sites["rhs"])
        return dot(lq, rq).astype(out_dtype), (lhs, rhs, key)

    @_exact
    def bwd(res, g):
        lhs, rhs, key = res
        k_lhs, k_rhs = (None, None) if key is None else jax.random.split(key)
        g = g.astype(F32)
        # d lhs = g . rhs over rhs's free dimensions: blocks along the last of them.
        g_l, rhs_l = g, rhs.astype(F32)
        if hadamard == "lhs":  # both rotated alike along the dimension contracted
            g_l, rhs_l = _rht(g_l, g_rhs_free[-1]), _rht(rhs_l, rhs_free[-1])
        g_n = _qdq(
            g_l, grad_fmt, g_rhs_free[-1], g_lhs_free, k_lhs, stochastic, sites["grad"]
        )
        rhs_n = _qdq(
            rhs_l, rhs_fmt, rhs_free[-1], [*rhs_free[:-1], rc[0]], site=sites["rhs"]
        )
        # d rhs = lhs . g over lhs's free dimensions.
        g_r, lhs_r = g, lhs.astype(F32)
        if hadamard == "rhs":
            g_r, lhs_r = _rht(g_r, g_lhs_free[-1]), _rht(lhs_r, lhs_free[-1])
        g_m = _qdq(
            g_r, grad_fmt, g_lhs_free[-1], g_rhs_free, k_rhs, stochastic, sites["grad"]
        )
        lhs_m = _qdq(
            lhs_r, lhs_fmt, lhs_free[-1], [*lhs_free[:-1], lc[0]], site=sites["lhs"]
        )
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, F32)  # noqa: E731
        (d_lhs,) = jax.linear_transpose(lambda a: dot(a, rhs_n), shape(lhs))(g_n)
        (d_rhs,) = jax.linear_transpose(lambda b: dot(lhs_m, b), shape(rhs))(g_m)
        return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None

    run.defvjp(fwd, bwd)
    return run(lhs, rhs, key)


def _qdq(
    x, fmt: BlockFormat, axis: int, others, key=None, stochastic=False, site=None
) -> Array:
    # `x`'s float32 values after a round trip through `fmt`, in blocks along `axis`
    # (the cast named as `site`); a 2-D tile spans the last of `others` as well.
    tile_axis = others[-1] if fmt.block[0] > 1 and others else None
    if fmt.block[0] > 1 and tile_axis is None:
        raise ValueError(
            f"Expected a second dimension for the {fmt.block[0]}x{fmt.block[1]} tiles "
            f"of {fmt.name!r}, got an operand of shape {x.shape} with none instead: "
            "use a format with 1-D blocks for it."
        )
    axis, tile_axis = _axes(x.ndim, fmt, axis, tile_axis)
    return _fake_quantize(x, None, key, fmt, axis, tile_axis, stochastic, site)


def _hadamard16() -> np.ndarray:
    # The 16x16 Sylvester Hadamard matrix (entries +-1): H_{2n} = [[H, H], [H, -H]].
    h = np.ones((1, 1))
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return h


# The fixed random signs of the Hadamard transform: one draw (NVIDIA's recipe fixes
# its sign vector too, rather than drawing one per step).
_SIGNS = np.where(np.random.default_rng(16).random(16) < 0.5, -1.0, 1.0)
# diag(signs) @ H16 / 4: orthogonal (H16 @ H16.T = 16 I), exactly representable.
_RHT = (np.diag(_SIGNS) @ _hadamard16() / 4.0).astype(np.float32)


def _rht(x: Array, axis: int) -> Array:
    """`x` (float32) with each group of 16 along `axis` multiplied by the random
    Hadamard matrix (`x_group @ Q`); the axis zero-padded to a multiple of 16 first
    (so the result may be longer along it: the padding's products are zero)."""
    n = x.shape[axis]
    x = jnp.moveaxis(x, axis, -1)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % 16)])
    groups = x.reshape(*x.shape[:-1], -1, 16)
    rotated = jnp.matmul(groups, jnp.asarray(_RHT), precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(rotated.reshape(x.shape), -1, axis)
