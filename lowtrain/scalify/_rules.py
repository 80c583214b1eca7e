"""One short scale-propagation rule per primitive.

A rule gets the equation and its inputs, each a `ScaledArray` or a plain array (at least
one is scaled), and returns the outputs. Each rule's docstring states the scale it
chooses. Data is kept in the dtype the program was traced with; rescaling by ratios of
scales (powers of two by default) is done in float32 and is exact.

The arithmetic rules (their docstrings end "then `fit`") pick a static scale from the
unit-scaling variance model, then `fit` (`_auto.py`) moves the scale where the float32
data's RMS left a safe band, before the data is cast: for the primitives of
`_auto.RESCALED` (contractions, sums, `add_any`, `div`, `rsqrt`); the elementwise
rest keeps its static scale.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._interpret import SCATTERS, Eqn
from ._auto import Ctx, fit
from ._scaled_array import ScaledArray, is_scaled

F32 = jnp.float32

# Maps a primitive name to `rule(ctx, eqn, *invals) -> list of outputs`. Filled with
# `register`; registering a primitive twice is an error.
RULES: dict[str, Callable] = {}


def register(*names: str):
    def add(rule):
        for name in names:
            if name in RULES:
                raise ValueError(f"A scalify rule for `{name}` is already registered.")
            RULES[name] = rule
        return rule

    return add


# -- helpers ---------------------------------------------------------------------------


def scaled(x) -> ScaledArray:
    """`x` as a ScaledArray. A constant (a literal such as the `1e-5` of a layer norm)
    gets the power of two of its max-abs, known when tracing; a traced plain array,
    whose range is unknown, gets scale 1."""
    if is_scaled(x):
        return x
    try:
        const = np.asarray(x, np.float32)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return ScaledArray(jnp.asarray(x), 1.0)
    amax = float(np.max(np.abs(const))) if const.size else 0.0
    scale = 2.0 ** np.floor(np.log2(amax)) if np.isfinite(amax) and amax > 0 else 1.0
    return ScaledArray((const / scale).astype(jnp.result_type(x)), scale)


def value(x):
    """The float32 values of `x`."""
    return x.to_array(F32) if is_scaled(x) else jnp.asarray(x).astype(F32)


def ratio(num, den):
    """`num / den`, and 0 where `den` is 0 (a zero scale holds all-zero data, such as
    fresh optimizer state)."""
    return jnp.where(den != 0, num / jnp.where(den != 0, den, 1.0), 0.0)


def rescaled(x: ScaledArray, scale, dtype=None):
    """The data of `x` for a new `scale` (same values), in `dtype`."""
    return (x.data.astype(F32) * ratio(x.scale, scale)).astype(dtype or x.data.dtype)


def common(xs, dtypes):
    """Inputs brought to one scale: the largest scale of the ScaledArray inputs (plain
    inputs, such as the 0 of `max(x, 0)`, adopt it)."""
    scales = [x.scale for x in xs if is_scaled(x)] or [scaled(x).scale for x in xs]
    scale = functools.reduce(jnp.maximum, scales)
    xs = [x if is_scaled(x) else ScaledArray(jnp.asarray(x), 1.0) for x in xs]
    return [rescaled(x, scale, d) for x, d in zip(xs, dtypes)], scale


def out_dtype(eqn: Eqn, i: int = 0):
    return eqn.out_avals[i].dtype


def in_dtypes(eqn: Eqn):
    return [a.dtype for a in eqn.in_avals]


def as_output(ctx: Ctx, eqn: Eqn, result_f32, scale=None):
    """A float32 result as a ScaledArray: with `scale` (then `fit`), or (None) scaled
    dynamically by its own max-abs (one reduction), so any range fits the data
    dtype."""
    if scale is not None:
        return fit(ctx, eqn, result_f32 * ratio(1.0, scale), scale)
    amax = jnp.max(jnp.abs(result_f32))
    scale = ctx.pow2(jnp.where(jnp.isfinite(amax) & (amax > 0), amax, 1.0))
    data = (result_f32 * ratio(1.0, scale)).astype(out_dtype(eqn))
    return ScaledArray(data, scale)


# -- linear ops ------------------------------------------------------------------------


@register("add", "sub", "add_any")
def _add(ctx, eqn, a, b):
    """Scale `sqrt(sa**2 + sb**2)` (power of two): the scale of a sum of independent
    unit-scaled terms; then `fit` (cancellation: `x - mean(x)`)."""
    a, b = scaled(a), scaled(b)
    scale = ctx.pow2(jnp.sqrt(a.scale**2 + b.scale**2))
    da, db = rescaled(a, scale, F32), rescaled(b, scale, F32)
    return [fit(ctx, eqn, da - db if eqn.primitive.name == "sub" else da + db, scale)]


@register("mul")
def _mul(ctx, eqn, a, b):
    """Scale `sa * sb`, data `da * db`; then `fit`."""
    a, b = scaled(a), scaled(b)
    return [fit(ctx, eqn, a.data.astype(F32) * b.data.astype(F32), a.scale * b.scale)]


@register("div")
def _div(ctx, eqn, a, b):
    """Scale `sa / sb`, data `da / db`; then `fit`."""
    a, b = scaled(a), scaled(b)
    return [fit(ctx, eqn, a.data.astype(F32) / b.data.astype(F32), a.scale / b.scale)]


def _contraction(ctx, eqn, a, b, k):
    """`eqn` (a matmul or convolution) on the data, accumulated in float32, with scale
    `sa * sb * sqrt(k)` (power of two): a sum of k unit-scaled products; then
    `fit`."""
    scale = ctx.pow2(a.scale * b.scale * math.sqrt(k))
    da, db = a.data, b.data
    if jax.default_backend() == "cpu":
        # XLA:CPU has no bfloat16 x bfloat16 -> float32 dot kernel; float32 operands
        # give the same numbers (every half value is exact in float32).
        da, db = da.astype(F32), db.astype(F32)
    acc = eqn.bind(da, db, preferred_element_type=F32)[0]
    return [fit(ctx, eqn, acc * ratio(a.scale * b.scale, scale), scale)]


@register("dot_general")
def _dot_general(ctx, eqn, a, b):
    """Scale `sa * sb * sqrt(K)` (power of two), K the contracted size, then `fit`.
    Float32 accumulation."""
    a, b = scaled(a), scaled(b)
    (contract, _), _ = eqn.params["dimension_numbers"]
    return _contraction(ctx, eqn, a, b, math.prod(a.shape[i] for i in contract))


@register("conv_general_dilated")
def _conv(ctx, eqn, a, b):
    """Scale `sa * sb * sqrt(K)` (power of two), K the kernel's fan-in (input
    features per group times its spatial size), then `fit`. Float32 accumulation."""
    a, b = scaled(a), scaled(b)
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
    return _contraction(ctx, eqn, a, b, math.prod(b.shape[i] for i in rhs_spec[1:]))


@register("reduce_sum")
def _reduce_sum(ctx, eqn, a):
    """Scale `sa * sqrt(N)` (power of two), N the number of reduced elements, then
    `fit` (correlated terms sum to N). Float32 accumulation."""
    a = scaled(a)
    n = math.prod(a.shape[i] for i in eqn.params["axes"])
    scale = ctx.pow2(a.scale * math.sqrt(n))
    acc = jnp.sum(a.data.astype(F32), axis=eqn.params["axes"])
    return [fit(ctx, eqn, acc * ratio(a.scale, scale), scale)]


@register("cumsum")
def _cumsum(ctx, eqn, a):
    """Scale `sa * sqrt(N)` (power of two), N the length of the summed axis, then
    `fit`."""
    a = scaled(a)
    scale = ctx.pow2(a.scale * math.sqrt(a.shape[eqn.params["axis"]]))
    acc = lax.cumsum(a.data.astype(F32), eqn.params["axis"], eqn.params["reverse"])
    return [fit(ctx, eqn, acc * ratio(a.scale, scale), scale)]


# -- ops on the data that keep the scale -----------------------------------------------

_SAME_SCALE = (
    "neg reduce_max reduce_min cummax cummin reshape transpose broadcast_in_dim "
    "squeeze slice rev copy stop_gradient reduce_precision sharding_constraint name "
    "reduce_window_max reduce_window_min"
).split()


@register(*_SAME_SCALE)
def _same_scale(ctx, eqn, a, *rest):
    """Scale unchanged; the op applies to the data (layout ops, sign flips, maxima)."""
    a = scaled(a)
    return [ScaledArray(eqn.bind(a.data, *rest)[0], a.scale)]


@register("split")
def _split(ctx, eqn, a):
    """Scale unchanged for every piece."""
    return [ScaledArray(d, a.scale) for d in eqn.bind(a.data)]


@register("abs")
def _abs(ctx, eqn, a):
    """Scale unchanged; data `|da|`."""
    return [ScaledArray(jnp.abs(a.data), a.scale)]


@register("gather", "dynamic_slice")
def _indexed(ctx, eqn, a, *indices):
    """Scale unchanged; the data is indexed (indices are plain integers)."""
    a = scaled(a)
    return [ScaledArray(eqn.bind(a.data, *indices)[0], a.scale)]


@register("max", "min", "clamp", "concatenate", "pad", "select_n")
def _common_scale(ctx, eqn, *args):
    """The largest input scale; every float input is brought to it and the op applies
    to the data (`max(x, 0)` is relu on the data)."""
    floats = [
        i for i, a in enumerate(eqn.in_avals) if jnp.issubdtype(a.dtype, jnp.floating)
    ]
    datas, scale = common(
        [args[i] for i in floats], [in_dtypes(eqn)[i] for i in floats]
    )
    args = list(args)
    for i, d in zip(floats, datas):
        args[i] = d
    return [ScaledArray(eqn.bind(*args)[0], scale)]


@register("dynamic_update_slice")
def _dynamic_update_slice(ctx, eqn, operand, update, *indices):
    """The larger of the two scales; operand and update are brought to it."""
    (d_op, d_up), scale = common([operand, update], in_dtypes(eqn)[:2])
    return [ScaledArray(eqn.bind(d_op, d_up, *indices)[0], scale)]


@register(*SCATTERS)
def _scatter(ctx, eqn, operand, indices, updates):
    """The larger of the operand's and the updates' scales (scatter-mul: computed on
    the values, scaled dynamically: only some entries are multiplied)."""
    p = eqn.params
    kw = dict(
        indices_are_sorted=p["indices_are_sorted"],
        unique_indices=p["unique_indices"],
        mode=p["mode"],
    )
    fn = SCATTERS[eqn.primitive.name]
    if eqn.primitive.name == "scatter-mul":
        result = fn(
            value(operand), indices, value(updates), p["dimension_numbers"], **kw
        )
        return [as_output(ctx, eqn, result)]
    (d_op, d_up), scale = common(
        [operand, updates], [in_dtypes(eqn)[0], in_dtypes(eqn)[2]]
    )
    return [ScaledArray(fn(d_op, indices, d_up, p["dimension_numbers"], **kw), scale)]


@register("convert_element_type")
def _convert(ctx, eqn, a):
    """Float to float: the data is cast, the scale kept. To an integer or bool: the
    values are converted (a plain array)."""
    new = eqn.params["new_dtype"]
    if jnp.issubdtype(new, jnp.floating):
        return [ScaledArray(a.data.astype(new), a.scale)]
    return [value(a).astype(new)]


@register("integer_pow")
def _integer_pow(ctx, eqn, a):
    """Scale `sa ** y`, data `da ** y`; then `fit`."""
    y = eqn.params["y"]
    return [fit(ctx, eqn, lax.integer_pow(a.data.astype(F32), y), a.scale**y)]


@register("square")
def _square(ctx, eqn, a):
    """Scale `sa ** 2`, data `da ** 2`; then `fit`."""
    return [fit(ctx, eqn, jnp.square(a.data.astype(F32)), a.scale**2)]


@register("sqrt")
def _sqrt(ctx, eqn, a):
    """Scale `sqrt(sa)` (power of two), data `sqrt(da)` times the rounding ratio;
    then `fit`."""
    root = jnp.sqrt(a.scale)
    scale = ctx.pow2(root)
    return [fit(ctx, eqn, jnp.sqrt(a.data.astype(F32)) * ratio(root, scale), scale)]


@register("rsqrt")
def _rsqrt(ctx, eqn, a):
    """Scale `1 / sqrt(sa)` (power of two), data `rsqrt(da)` times the ratio; then
    `fit` (the rsqrt of a small variance)."""
    root = lax.rsqrt(a.scale)
    scale = ctx.pow2(root)
    return [fit(ctx, eqn, lax.rsqrt(a.data.astype(F32)) * ratio(root, scale), scale)]


@register("one_minus_square")
def _one_minus_square(ctx, eqn, a):
    """Scale `max(1, sa ** 2)`: |1 - x**2| <= max(1, x**2). JAX >= 0.11 emits it in the
    derivatives of tanh, asin, acos and atanh. Computed on the float32 values."""
    a = scaled(a)
    scale = jnp.maximum(1.0, ctx.pow2(a.scale) ** 2)
    return [as_output(ctx, eqn, eqn.bind(value(a))[0], scale)]


# -- ops computed on the values --------------------------------------------------------


@register("tanh", "erf", "sin")
def _odd_bounded(ctx, eqn, a):
    """Scale `min(1, sa)`: |f(x)| <= min(1, |x|) (erf: 1.13 |x|), so small inputs keep
    their precision; then `fit`. Computed on the float32 values."""
    a = scaled(a)
    scale = jnp.minimum(1.0, ctx.pow2(a.scale))
    return [as_output(ctx, eqn, eqn.bind(value(a))[0], scale)]


@register("logistic", "cos")
def _bounded(ctx, eqn, a):
    """Scale 1: the values lie in [-1, 1]; then `fit`. Computed on the float32
    values."""
    return [as_output(ctx, eqn, eqn.bind(value(a))[0], jnp.ones((), F32))]


_DYNAMIC = (
    "exp exp2 expm1 log log1p pow erf_inv erfc cbrt atan2 rem cumlogsumexp cumprod "
    "reduce_prod reduce_window_sum"
).split()


@register(*_DYNAMIC)
def _dynamic(ctx, eqn, *args):
    """Computed on the float32 values; the result is scaled by its own max-abs (power
    of two): exp and log change magnitudes in ways no static rule can predict."""
    result = eqn.bind(*[value(a) if _is_float(a) else a for a in args])[0]
    return [as_output(ctx, eqn, result)]


@register("sign", "floor", "ceil", "round")
def _sign_round(ctx, eqn, a):
    """Scale 1 (sign) or dynamic (rounding): computed on the float32 values."""
    result = eqn.bind(value(a))[0]
    scale = jnp.ones((), F32) if eqn.primitive.name == "sign" else None
    return [as_output(ctx, eqn, result, scale)]


@register("eq", "ne", "lt", "le", "gt", "ge")
def _compare(ctx, eqn, a, b):
    """A plain bool array: both sides brought to one scale, then compared."""
    (da, db), _ = common([a, b], [F32, F32])
    return eqn.bind(da, db)


@register("argmax", "argmin")
def _arg(ctx, eqn, a):
    """A plain integer array: a positive scale does not change the order."""
    return eqn.bind(a.data)


@register("is_finite")
def _is_finite(ctx, eqn, a):
    """A plain bool array, from the float32 values."""
    return [jnp.isfinite(value(a))]


@register("sort")
def _sort(ctx, eqn, *args):
    """Scale unchanged (positive scales keep the order); one operand only."""
    if len(args) != 1:
        raise NotImplementedError("scalify sorts a single ScaledArray operand only.")
    return [ScaledArray(eqn.bind(args[0].data)[0], args[0].scale)]


def _is_float(x) -> bool:
    return is_scaled(x) or jnp.issubdtype(jnp.result_type(x), jnp.floating)
