"""Saturating FP8 casts and per-tensor scales.

Convention (the one all of lowtrain uses, as scalify's `ScaledArray`): a tensor `x` is
represented by FP8 `data` and a float32 `scale` with `x ~= data * scale`. So quantizing
divides by the scale and dequantizing multiplies by it.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float

from .._pow2 import pow2_round
from ._formats import fp8_max

F32 = jnp.float32


def quantize(x: ArrayLike, dtype, scale: ArrayLike = 1.0) -> Array:
    """FP8 `data` with `x ~= data * scale`: `x / scale`, clipped to the format, cast.

    Saturating, as the FP8 formats paper prescribes: finite values beyond the
    format's range become `+-max` (448 for E4M3, 57344 for E5M2) instead of NaN (E4M3
    has no infinity: a bare `astype` turns anything at or above 464 into NaN) or inf
    (E5M2). Infinities are not saturated: they become NaN in E4M3 and stay `+-inf`
    in E5M2, so a step whose tensors overflowed stays non-finite and the Trainer's
    finiteness check skips it (a 448 would hide it). NaN stays NaN. Rounding is to
    nearest, ties to even, and subnormals are kept, exactly as `ml_dtypes` casts.

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    data = fp8.quantize(jnp.array([1e4, -300.0, 3.0]), fp8.E4M3, scale=2.0)
    assert data.dtype == fp8.E4M3
    assert data.astype(jnp.float32).tolist() == [448.0, -150.0, 1.5]
    assert jnp.isnan(fp8.quantize(jnp.array(jnp.inf), fp8.E4M3).astype(jnp.float32))
    ```
    """
    fmax = fp8_max(dtype)
    scaled = jnp.asarray(x).astype(F32) / jnp.asarray(scale, F32)
    clipped = jnp.clip(scaled, -fmax, fmax)
    return jnp.where(jnp.isinf(scaled), scaled, clipped).astype(dtype)


def dequantize(data: ArrayLike, scale: ArrayLike = 1.0, dtype=F32) -> Array:
    """The value `data * scale`, in `dtype` (float32 by default).

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jnp.array([0.1, 2.0, -300.0])
    s = fp8.current_scale(x, fp8.E4M3)
    assert jnp.allclose(fp8.dequantize(fp8.quantize(x, fp8.E4M3, s), s), x, rtol=0.07)
    ```
    """
    dtype = jnp.dtype(dtype)
    return jnp.asarray(data).astype(dtype) * jnp.asarray(scale).astype(dtype)


def compute_scale(
    amax: ArrayLike,
    dtype,
    *,
    margin: int = 0,
    pow2: bool = False,
    last: ArrayLike = 1.0,
) -> Float[Array, ""]:
    """The scale that maps `amax` to the format's max: `amax / max * 2**margin`.

    `margin` leaves `2**margin` of headroom; `pow2=True` rounds the scale up to a power
    of two (so scaling is exact in every format). A zero or non-finite `amax` keeps
    `last` (the previous scale, or 1.0): a step of all zeros or an overflow must not
    poison the next one. The scale is at least float32's smallest normal number: an
    amax so small that `amax / max` would flush to zero (below about 5e-36 for
    E4M3) gets that scale instead of 0 (which would turn every value into inf or
    NaN), and its values still fit the format.

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    assert fp8.compute_scale(896.0, fp8.E4M3) == 2.0
    assert fp8.compute_scale(900.0, fp8.E4M3, pow2=True) == 4.0
    assert fp8.compute_scale(jnp.inf, fp8.E4M3, last=0.5) == 0.5
    assert fp8.compute_scale(1e-37, fp8.E4M3) > 0  # not flushed to zero
    ```
    """
    amax = jnp.asarray(amax, F32)
    tiny = jnp.finfo(F32).tiny  # a scale below it flushes to zero on the devices
    scale = jnp.maximum(amax / fp8_max(dtype) * 2.0**margin, tiny)
    if pow2:
        scale = pow2_round(scale, "up")
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, scale, jnp.asarray(last, F32))


def amax(x: ArrayLike) -> Float[Array, ""]:
    """`max(|x|)` in float32.

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    assert fp8.amax(jnp.array([1.0, -3.0], jnp.bfloat16)) == 3.0
    ```
    """
    return jnp.max(jnp.abs(jnp.asarray(x))).astype(F32)


def current_scale(
    x: ArrayLike, dtype, *, margin: int = 0, pow2: bool = False
) -> Float[Array, ""]:
    """Current scaling: the scale of `x` from its own amax (see `compute_scale`).

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    assert fp8.current_scale(jnp.array([-896.0, 1.0]), fp8.E4M3) == 2.0
    ```
    """
    return compute_scale(amax(x), dtype, margin=margin, pow2=pow2)


def _finite_amax(amax_now: ArrayLike) -> Array:
    # An overflowed step's inf/NaN amax is recorded as 0 (ignored), so it cannot
    # block the window for `history` steps.
    amax_now = jnp.asarray(amax_now, F32)
    return jnp.where(jnp.isfinite(amax_now), amax_now, 0.0)


class DelayedScale(eqx.Module):
    """Delayed scaling (Transformer Engine / Flax style) for one tensor.

    Holds the amaxes of the last `H` steps (`amax_history[0]` the newest) and the scale
    to use now. A step quantizes with `scale` and then calls `update(amax_now)`, which
    pushes the new amax (a non-finite one as 0) and sets the next scale to
    `compute_scale(max(amax_history), dtype, margin, pow2, last=scale)`.

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    s = fp8.DelayedScale(fp8.E4M3, history=2)
    s = s.update(jnp.float32(896.0)).update(jnp.float32(448.0))
    assert s.amax_history.tolist() == [448.0, 896.0] and s.scale == 2.0
    ```
    """

    amax_history: Float[Array, " history"]
    scale: Float[Array, ""]
    dtype: jnp.dtype = eqx.field(static=True)
    margin: int = eqx.field(static=True)
    pow2: bool = eqx.field(static=True)

    def __init__(
        self, dtype, *, history: int = 16, margin: int = 0, pow2: bool = False
    ):
        fp8_max(dtype)  # validates
        if history < 1:
            raise ValueError(f"Expected `history` >= 1, got {history} instead.")
        self.amax_history = jnp.zeros(history, F32)
        self.scale = jnp.ones((), F32)
        self.dtype = jnp.dtype(dtype)
        self.margin = margin
        self.pow2 = pow2

    def update(self, amax_now: ArrayLike) -> DelayedScale:
        """The state after a step whose tensor had amax `amax_now`. (A stack of
        states, `amax_history` of shape `(*stack, H)`, takes one amax per state.)"""
        amax_now = _finite_amax(amax_now)
        history = jnp.roll(self.amax_history, 1, axis=-1).at[..., 0].set(amax_now)
        scale = compute_scale(
            jnp.max(history, axis=-1),
            self.dtype,
            margin=self.margin,
            pow2=self.pow2,
            last=self.scale,
        )
        new = eqx.tree_at(lambda s: s.amax_history, self, history)
        return eqx.tree_at(lambda s: s.scale, new, scale)


# Delayed scaling's "overwrite with gradient", made to add up. A delayed-scaling op
# returns, as the cotangent of each `DelayedScale` it used, a *record* of the call
# (`amax_history[0]`: the tensor's amax, zeros after it; `scale`: 1, the call). JAX
# adds the cotangents of an input used several times (a layer applied twice, or
# closed over by a `lax.scan` body), so the records of all of a step's calls arrive
# as their sum; no call leaves zeros. `advance` turns that sum into the new state.


def record(state: DelayedScale, amax_now: ArrayLike) -> DelayedScale:
    """One call's record for `state` (see above): `amax_now` (non-finite as 0) and a
    count of 1, in `state`'s shape and static fields."""
    amax_now = _finite_amax(amax_now)
    history = jnp.zeros_like(state.amax_history).at[..., 0].set(amax_now)
    new = eqx.tree_at(lambda s: s.amax_history, state, history)
    return eqx.tree_at(lambda s: s.scale, new, jnp.ones_like(state.scale))


def advance(state: DelayedScale, records: DelayedScale) -> DelayedScale:
    """`state` after a step whose calls left `records` (their sum): updated with the
    sum of the calls' amaxes (the amax itself for one call; for `k` calls at most `k`
    times the largest, so never too small a scale), or unchanged where nothing
    called it. Works on stacks of states, elementwise."""
    calls = records.scale
    new = state.update(records.amax_history[..., 0])
    return eqx.tree_at(
        lambda s: (s.amax_history, s.scale),
        state,
        (
            jnp.where(calls[..., None] > 0, new.amax_history, state.amax_history),
            jnp.where(calls > 0, new.scale, state.scale),
        ),
    )


def to_bits(q: Array) -> Array:
    """An FP8 array as its bits (uint8), the form FP8 residuals are saved in.

    `jax.checkpoint` (amp's `residuals="half"`, or a user's) passes each float
    residual it saves through `reduce_precision` with the dtype's exponent and
    mantissa bits (JAX PR 22244), which treats E4M3 as an IEEE-style format whose
    largest value is 240: saved E4M3 values between 240 and 448 became NaN, and so did
    every gradient. Integers get no such pass; the bitcasts cost nothing."""
    return lax.bitcast_convert_type(q, jnp.uint8)


def from_bits(b: Array, dtype) -> Array:
    """The FP8 array of `dtype` whose bits `to_bits` gave."""
    return lax.bitcast_convert_type(b, dtype)
