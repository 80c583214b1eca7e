"""Automatic rescaling: `fit` keeps the data of arithmetic results near unit RMS.

Static scale rules follow the unit-scaling variance model (a sum of N independent
unit-RMS terms has RMS sqrt(N)); it fails for inputs that are not unit-RMS (scale-1
weights of RMS 0.02), correlated sums (a bias gradient summed over a batch),
cancellation (`x - mean(x)`) and `rsqrt` of a small variance, and the errors compound
through a program and its backward pass into float16 subnormals, zeros or overflow.
`fit` checks the float32 data of the results where scales drift before they are cast.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._eqn import Eqn
from ._scaled_array import ScaledArray, pow2_round

# `fit` leaves data whose RMS lies in [1 / BAND, BAND] at its static scale: float16
# keeps 10 significant bits from 2**-14 to 2**15, so the band leaves room either side.
BAND = 2.0**4

# The primitives whose results `fit` checks: those where a static scale goes wrong
# (contractions and sums of correlated or non-unit terms, cotangent accumulation,
# division and `rsqrt` of small values). Elementwise `add`, `mul`, `square`, `tanh`,
# ... keep their static scales: each check is a reduction over the result, which
# would split XLA's fusion of elementwise chains (the optimizer's update, say) and
# cost a pass over memory per op.
RESCALED = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "reduce_sum",
        "cumsum",
        "add_any",
        "rsqrt",
    }
)


class Ctx:
    """What rules need besides their inputs: the power-of-two rounding mode and
    whether `fit` rescales data that left the band (`auto`)."""

    def __init__(self, pow2: str, auto: bool = True):
        self.pow2_mode = pow2
        self.auto = auto

    def pow2(self, x):
        return pow2_round(x, self.pow2_mode)


def fit(ctx: Ctx, eqn: Eqn, data_f32, scale, i: int = 0) -> ScaledArray:
    """The values `data_f32 * scale` as a ScaledArray of the output dtype. With
    `ctx.auto` and a primitive in `RESCALED`, where the RMS of the data's finite
    entries lies outside `[1 / BAND, BAND]`, the scale becomes `scale * pow2(rms)`
    and the data `data / pow2(rms)` (its RMS then in `[1, 2)` with "down");
    otherwise, or for all-zero data, `scale` stays. One fused sum of squares per
    output."""
    if ctx.auto and eqn.primitive.name in RESCALED:
        finite = jnp.where(jnp.isfinite(data_f32), data_f32, 0.0)
        rms = jnp.sqrt(jnp.mean(jnp.square(finite)))
        off = (rms > 0) & ((rms < 1 / BAND) | (rms > BAND))
        factor = ctx.pow2(jnp.where(off, rms, 1.0))
        if ctx.pow2_mode == "none":
            data_f32 = data_f32 / factor
        else:
            # A power of two in float32's normal range: its reciprocal is exact, so
            # multiplying by it is the division, at a fraction of the cost.
            factor = jnp.clip(factor, 2.0**-126, 2.0**126)
            data_f32 = data_f32 * (1.0 / factor)
        scale = scale * factor
    return ScaledArray(data_f32.astype(eqn.out_avals[i].dtype), scale)
