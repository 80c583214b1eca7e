"""Saturating FP8 casts and per-tensor scales.

Convention (the one all of lowtrain uses, as scalify's `ScaledArray`): a tensor `x` is
represented by FP8 `data` and a float32 `scale` with `x ~= data * scale`. So quantizing
divides by the scale and dequantizing multiplies by it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._pow2 import pow2_round
from ._formats import fp8_max
from ._sites import Site

F32 = jnp.float32


def quantize(
    x: ArrayLike,
    dtype,
    scale: ArrayLike = 1.0,
    *,
    rounding: str = "nearest",
    key: PRNGKeyArray | None = None,
) -> Array:
    """FP8 `data` with `x ~= data * scale`: `x / scale`, clipped to the format, cast.

    Saturating, as the FP8 formats paper prescribes: finite values beyond the
    format's range become `+-max` (448 for E4M3, 57344 for E5M2) instead of NaN (E4M3
    has no infinity: a bare `astype` turns anything at or above 464 into NaN) or inf
    (E5M2). Infinities are not saturated: they become NaN in E4M3 and stay `+-inf`
    in E5M2, so a step whose tensors overflowed stays non-finite and the Trainer's
    finiteness check skips it (a 448 would hide it). NaN stays NaN.

    `rounding="nearest"` (the default): to nearest, ties to even, subnormals kept,
    exactly as `ml_dtypes` casts. `rounding="stochastic"`: each value rounds to one
    of its two FP8 neighbours, up with probability equal to its distance from the
    lower one over their gap, so the cast is unbiased: `E[data * scale] = x` (up to
    saturation). The uniform draws come from `key` if given; otherwise from a hash of
    each value's bits and index, so the rounding is deterministic given the tensor
    (a new step's tensor, new draws) and needs no key threaded through a model
    (`lowtrain.unit_scaling.fp8_cast_rules(rounding=)`).

    The division by the scale runs inside a `jax.named_scope` naming the cast
    (`lowtrain.fp8._sites`), where `lowtrain.numerics.track(fn, casts=True)` reads
    the values as the cast sees them.

    **Arguments:**

    - `x`: the array to cast (converted to float32 first).
    - `dtype`: the FP8 dtype, `lowtrain.fp8.E4M3` or `E5M2`.
    - `scale`: the scale `x` is divided by, a scalar or an array that broadcasts
      against `x` (cast to float32); default 1.
    - `rounding`: "nearest" (the default) or "stochastic", as above.
    - `key`: a PRNG key for the stochastic draws; None (the default): a hash.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    data = fp8.quantize(jnp.array([1e4, -300.0, 3.0]), fp8.E4M3, scale=2.0)
    assert data.dtype == fp8.E4M3
    assert data.astype(jnp.float32).tolist() == [448.0, -144.0, 1.5]  # -150: 3 bits
    assert jnp.isnan(fp8.quantize(jnp.array(jnp.inf), fp8.E4M3).astype(jnp.float32))
    # 1 + 2**-5 lies a quarter of the way from 1 to 1.125: rounded up a quarter of
    # the time, so the mean is the value.
    x = jnp.full(20000, 1 + 2**-5)
    up = fp8.quantize(x, fp8.E4M3, rounding="stochastic", key=jax.random.key(0))
    assert abs(float(up.astype(jnp.float32).mean()) - (1 + 2**-5)) < 2e-3
    ```
    """
    return quantize_at(x, dtype, scale, rounding=rounding, key=key)


def quantize_at(
    x: ArrayLike,
    dtype,
    scale: ArrayLike = 1.0,
    *,
    rounding: str = "nearest",
    key: PRNGKeyArray | None = None,
    site: Site | None = None,
) -> Array:
    # `quantize`, its division named as `site` (the caller's matmul and role; see
    # `_sites.py`) or as a cast of `dtype` outside a matmul.
    fmax = fp8_max(dtype)
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"Expected `rounding` among {', '.join(ROUNDINGS)}, got {rounding!r} "
            "instead."
        )
    site = site or Site(str(jnp.dtype(dtype)))
    s = jnp.asarray(scale, F32)
    x32 = jnp.asarray(x).astype(F32)
    with jax.named_scope(site.scope()):
        scaled = x32 / s
    clipped = jnp.clip(scaled, -fmax, fmax)
    if rounding == "stochastic":
        clipped = _stochastic(clipped, jnp.dtype(dtype), key, ROLES_SALT[site.role])
    return jnp.where(jnp.isinf(scaled), scaled, clipped).astype(dtype)


ROUNDINGS = ("nearest", "stochastic")
# A different hash stream for each role of a matmul's casts, so that the two
# operands of `x @ x` do not round alike.
ROLES_SALT = {"": 0x243F6A88, "lhs": 0x85A308D3, "rhs": 0x13198A2E, "grad": 0x03707344}


def _uniform_bits(v: Array, key, salt: int, index: Array | None = None) -> Array:
    # 32 uniform bits per value: from `key`, or a hash of the value's bits and index
    # (murmur3's finaliser; multiplications and shifts wrap in uint32). `index`: each
    # value's position (uint32, `v`'s shape); default its row-major one.
    if key is not None:
        return jax.random.bits(key, v.shape, jnp.uint32)
    u32 = jnp.uint32
    if index is None:
        index = jnp.arange(v.size, dtype=u32).reshape(v.shape)
    h = lax.bitcast_convert_type(v, u32) ^ (index * u32(0x9E3779B9)) ^ u32(salt)
    h = h ^ (h >> u32(16))
    h = h * u32(0x85EBCA6B)
    h = h ^ (h >> u32(13))
    h = h * u32(0xC2B2AE35)
    return h ^ (h >> u32(16))


def _gap_exponent(v: Array, dtype) -> Array:
    # The exponent (int32) of the spacing of `dtype`'s values around `v`: its own
    # exponent less the mantissa bits, the subnormals' below the smallest normal one.
    info = jnp.finfo(dtype)
    exponent = (lax.bitcast_convert_type(jnp.abs(v), jnp.int32) >> 23) - 127  # 0: -127
    return jnp.maximum(exponent, info.minexp) - info.nmant


def _pow2(k: Array) -> Array:
    # 2**k in float32, for int32 k in [-126, 127]: a normal number, exactly.
    return lax.bitcast_convert_type((k + 127) << 23, F32)


def _stochastic(v: Array, dtype, key, salt: int, bits: Array | None = None) -> Array:
    """`v` (float32, within the format's range) rounded to a neighbour in `dtype`
    at random, up with probability (distance to the lower one) / gap: the gap is
    `2**(e - mantissa bits)` for a value of exponent `e`, the subnormals' below the
    smallest normal exponent. The result is exact in `dtype`. `bits`: the 32 random
    bits of each value; default `_uniform_bits(v, key, salt)`."""
    gap = _pow2(_gap_exponent(v, dtype))
    bits = _uniform_bits(v, key, salt) if bits is None else bits
    u = (bits >> jnp.uint32(8)).astype(F32) * F32(2.0**-24)
    rounded = jnp.floor(jnp.abs(v) / gap + u) * gap  # v / gap exact: gap is 2**k
    return jnp.where(v < 0, -rounded, rounded)


def _nearest(v: Array, dtype) -> Array:
    """`v` (float32, within the format's range, or NaN) rounded to the nearest value
    of `dtype`, ties to even, as float32: `v.astype(dtype).astype(float32)` bit for
    bit, signed zeros included, in float arithmetic that vectorizes (XLA:CPU's casts
    to FP8 and FP4 are emulated value by value). The scaling by the gap is exact (a
    power of two), so the one rounding is `round`'s."""
    e = _gap_exponent(v, dtype)
    rounded = lax.round(jnp.abs(v) * _pow2(-e), lax.RoundingMethod.TO_NEAREST_EVEN)
    return jnp.copysign(rounded * _pow2(e), v)


def dequantize(data: ArrayLike, scale: ArrayLike = 1.0, dtype=F32) -> Array:
    """The value `data * scale`, in `dtype` (float32 by default): `data` and
    `scale` (default 1) are each cast to `dtype` and multiplied.

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

    **Arguments:**

    - `amax`: the absolute maximum of the tensor, a scalar (cast to float32).
    - `dtype`: the FP8 dtype, `lowtrain.fp8.E4M3` or `E5M2`.
    - `margin`: the headroom exponent, an int; default 0.
    - `pow2`: whether to round the scale up to a power of two; default False.
    - `last`: the scale returned for a zero or non-finite `amax`; default 1.

    Returns a float32 scalar.

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
    """`max(|x|)` in float32, a scalar, over all elements of the array `x`.

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
    """Current scaling: the scale of `x` from its own amax,
    `compute_scale(amax(x), dtype, margin=margin, pow2=pow2)`.

    **Arguments:**

    - `x`: the array to be quantized.
    - `dtype`: the FP8 dtype it is to be cast to, `lowtrain.fp8.E4M3` or `E5M2`.
    - `margin`: the headroom exponent (`2**margin`); default 0.
    - `pow2`: whether to round the scale up to a power of two; default False.

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
        """**Arguments:**

        - `dtype`: the FP8 dtype the tensor is cast to, `lowtrain.fp8.E4M3` or
          `E5M2`.
        - `history`: `H`, the number of past amaxes kept, an int `>= 1`; default 16.
          They start at 0 and the scale at 1.
        - `margin`: the headroom exponent of `compute_scale`; default 0.
        - `pow2`: whether `compute_scale` rounds the scale up to a power of two;
          default False.
        """
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
