"""The precisions of `python -m lowtrain`: the factories the `precision` configs name
(`_target_`), each returning a `lowtrain.train.Precision`, and the matmul rule of
scalify's FP8 path. With `lowtrain.train.Rewrite` applied to every `dot_general` and
`conv_general_dilated`, rules make the FP8 baseline (`naive_fp8_op`, which is
`lowtrain.unit_scaling.fp8_cast_op`, the cast of `uu.simulate_fp8`) and scalify's
FP8 path out of models written in plain JAX.

    python -m lowtrain recipe=mnist precision=fp8_naive
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtyping import Array

import lowtrain
from lowtrain.fp8 import E4M3, E5M2
from lowtrain.scalify import cast_fp8, dynamic_rescale_l2, dynamic_rescale_l2_grad
from lowtrain.train import Amp, Chain, Precision, Rewrite, Scalify
from lowtrain.unit_scaling import MATMULS, fp8_cast_rules, keep_scopes
from lowtrain.unit_scaling import fp8_cast_op as naive_fp8_op  # noqa: F401 (the rule)

from ._config import LossScale


def scalify_fp8_op(op, lhs: Array, rhs: Array) -> Array:
    """`op(lhs, rhs)` under the Scalify precision: both operands rescaled to unit
    RMS, and their data cast to E4M3; in the backward pass the output cotangent is
    rescaled to unit RMS and its data cast to E5M2
    (`lowtrain.scalify.dynamic_rescale_l2[_grad]`, `cast_fp8`: the scales are kept,
    so values do not change beyond FP8 rounding).
    Unit RMS puts the data where the FP8 formats have their precision and range.
    Outside `scalify` the rescales are the identity and the casts have scale 1."""
    lhs = cast_fp8(dynamic_rescale_l2(lhs), E4M3, None)
    rhs = cast_fp8(dynamic_rescale_l2(rhs), E4M3, None)
    # Backward, the cotangent meets the rescale first, then the E5M2 cast.
    out = cast_fp8(op(lhs, rhs), None, E5M2)
    return dynamic_rescale_l2_grad(out)


def amp(
    policy: str = "fp32",
    loss_scale: LossScale | str = LossScale.none,
    init_scale: float = 2.0**15,
    growth_interval: int = 2000,
    residuals: str = "all",
) -> Precision:
    """`lowtrain.train.Amp(policy)` with the loss scale `loss_scale` names; the
    policy saves `residuals` ("all", or "half": only compute-dtype values, the float32
    ones recomputed in the backward pass) for the backward pass."""
    kind = LossScale(loss_scale)
    scale = {
        LossScale.none: lambda: lowtrain.NoOpLossScale(),
        LossScale.static: lambda: lowtrain.StaticLossScale(init_scale),
        LossScale.dynamic: lambda: lowtrain.DynamicLossScale(
            init_scale, growth_interval=growth_interval
        ),
    }[kind]()
    return Amp(lowtrain.get_policy(policy).with_residuals(residuals), loss_scale=scale)


def naive_fp8(
    policy: str = "bf16", weights_only: bool = False, keep: Sequence[str] = ()
) -> Precision:
    """Every matmul through `naive_fp8` (FP8 with scale 1), then AMP under `policy`;
    with `weights_only`, of the `dot_general`s only those with a weight operand
    (`lowtrain.unit_scaling.fp8_cast_rules`); the matmuls inside the named scopes
    in `keep` stay as `policy` has them (as `uu.simulate_fp8(..., keep=keep)`)."""
    if lowtrain.get_policy(policy) == lowtrain.get_policy("fp8"):
        raise ValueError(
            "Expected a policy that leaves matmuls alone (e.g. bf16) for the naive "
            f"FP8 baseline, got {policy!r} instead, which would quantize them twice. "
            "Use `precision=fp8_naive precision.policy=bf16`."
        )
    rewrite = Rewrite(fp8_cast_rules(weights_only), keep_scopes(keep))
    return Chain(rewrite, amp(policy))


def scalify(policy: str = "p=f32,c=f16", fp8: bool = False) -> Precision:
    """`lowtrain.train.Scalify(policy)`; with `fp8`, every matmul through
    `scalify_fp8_op`."""
    if not fp8:
        return Scalify(policy)
    return Chain(Scalify(policy), Rewrite(dict.fromkeys(MATMULS, scalify_fp8_op)))
