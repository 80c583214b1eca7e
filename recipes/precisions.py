"""The precisions of `python -m lowtrain`: the factories the `precision` configs name
(`_target_`), each returning a `lowtrain.train.Precision`, and the matmul rule of
scalify's FP8 path. With `lowtrain.train.Rewrite` applied to every `dot_general` and
`conv_general_dilated`, rules make the FP8 baseline (`naive_fp8_op`, which is
`lowtrain.unit_scaling.fp8_cast_op`, the cast of `uu.simulate_fp8`) and scalify's
FP8 path out of models written in plain JAX. `fp8_delayed` swaps the models'
`Linear` layers for `DelayedLinear` (FP8 with delayed scaling) when the Trainer
initialises them.

Every FP8 precision takes `keep`: matmuls kept out of FP8 (scope names, or a scope,
`@` and the right operand's shape; `lowtrain.unit_scaling.keep_scopes`), which is
how a `lowtrain.numerics.Plan` applies (`precision.keep=[...]`, or
`precision.auto=true`: `recipes/_autopilot.py`). The `auto*` fields of their
configs are the autopilot's; the factories take and ignore them.

    python -m lowtrain recipe=mnist precision=fp8_naive
    python -m lowtrain recipe=gpt precision=fp8_delayed
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import lowtrain
import lowtrain.fp8 as fp8
from lowtrain.fp8 import E4M3, E5M2
from lowtrain.scalify import cast_fp8, dynamic_rescale_l2, dynamic_rescale_l2_grad
from lowtrain.train import Amp, Chain, DelayedFp8, Precision, Rewrite, Scalify
from lowtrain.unit_scaling import MATMULS, fp8_cast_rules, keep_scopes, parse_keep
from lowtrain.unit_scaling import fp8_cast_op as naive_fp8_op  # noqa: F401 (the rule)

from ._config import AUTO_FIELDS, LossScale
from ._layers import Linear, _add_bias

# The scope `jnp.einsum` gives the recipes' `Linear` (and `DelayedLinear`, which
# opens it itself): how `precision.keep` names one of them.
LINEAR_SCOPE = "...i,io->...o"


def _check_auto(auto: dict) -> None:
    # The autopilot's fields of a precision config: taken, not used, by a factory.
    unknown = set(auto) - set(AUTO_FIELDS)
    if unknown:
        raise TypeError(
            f"Expected precision arguments, got unknown ones: {sorted(unknown)}."
        )


def _keep_rewrite(keep: Sequence[str]) -> Precision:
    # The kept matmuls as written (shadows of current-scaled casts named for the
    # numerics report), the others left to the policy.
    return Rewrite({}, keep_scopes(keep, amax=True))


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
    min_dim: int = 0,
    keep: Sequence[str] = (),
    **auto,
) -> Precision:
    """`lowtrain.train.Amp(policy)` with the loss scale `loss_scale` names; the
    policy saves `residuals` ("all", or "half": only compute-dtype values, the float32
    ones recomputed in the backward pass) for the backward pass; with `min_dim`, an
    FP8 policy's matmuls whose GEMM has an M, N or K below it run in the compute
    dtype (`lowtrain.Policy.fp8_min_dim`), and so do those `keep` selects (see the
    module docstring: a `Rewrite` runs them as `keep_op` in a scope the policy
    maps to its compute dtype)."""
    _check_auto(auto)
    kind = LossScale(loss_scale)
    scale = {
        LossScale.none: lambda: lowtrain.NoOpLossScale(),
        LossScale.static: lambda: lowtrain.StaticLossScale(init_scale),
        LossScale.dynamic: lambda: lowtrain.DynamicLossScale(
            init_scale, growth_interval=growth_interval
        ),
    }[kind]()
    chosen = lowtrain.get_policy(policy).with_residuals(residuals)
    shown = keep if isinstance(keep, str) else list(keep)  # a ListConfig as a list
    checked = (("min_dim", min_dim), ("keep", shown), ("auto", auto.get("auto")))
    for name, value in checked:
        if value and "fp8" not in dict(chosen.rules).values():
            raise ValueError(
                f"Expected `precision.{name}` only with an FP8 policy, got {name}="
                f"{value} with policy {policy!r}, which runs no matmul in FP8. Drop "
                f"`precision.{name}`, or use `precision=fp8`."
            )
    chosen = chosen.with_fp8_min_dim(min_dim)
    if not keep:
        return Amp(chosen, loss_scale=scale)
    # A kept matmul runs in `fp8.KEEP_SCOPE` (`keep_op`): in the compute dtype.
    chosen = chosen.with_scopes({fp8.KEEP_SCOPE: "compute"})
    return Chain(_keep_rewrite(keep), Amp(chosen, loss_scale=scale))


def naive_fp8(
    policy: str = "bf16",
    weights_only: bool = False,
    keep: Sequence[str] = (),
    min_dim: int = 0,
    rounding: str = "nearest",
    **auto,
) -> Precision:
    """Every matmul through `naive_fp8` (FP8 with scale 1: on a GPU an FP8 GEMM with
    no amax pass), then AMP under `policy`; with `weights_only`, of the
    `dot_general`s only those with a weight operand
    (`lowtrain.unit_scaling.fp8_cast_rules`); the matmuls `keep` selects (see the
    module docstring), and those whose GEMM has an M, N or K below `min_dim`, stay
    as `policy` has them (as `uu.simulate_fp8(..., keep=keep, min_dim=min_dim)`).
    `rounding`: the casts' ("nearest", or "stochastic": `fp8_cast_rules`)."""
    _check_auto(auto)
    if lowtrain.get_policy(policy) == lowtrain.get_policy("fp8"):
        raise ValueError(
            "Expected a policy that leaves matmuls alone (e.g. bf16) for the naive "
            f"FP8 baseline, got {policy!r} instead, which would quantize them twice. "
            "Use `precision=fp8_naive precision.policy=bf16`."
        )
    rules = fp8_cast_rules(weights_only, min_dim, rounding)
    rewrite = Rewrite(rules, keep_scopes(keep, rules))
    return Chain(rewrite, amp(policy))


def scalify(policy: str = "p=f32,c=f16", fp8: bool = False) -> Precision:
    """`lowtrain.train.Scalify(policy)`; with `fp8`, every matmul through
    `scalify_fp8_op`."""
    if not fp8:
        return Scalify(policy)
    return Chain(Scalify(policy), Rewrite(dict.fromkeys(MATMULS, scalify_fp8_op)))


class DelayedLinear(eqx.Module):
    """`Linear` with its matmul in FP8 under delayed scaling: `x` and `kernel` cast to
    E4M3, the output cotangent to E5M2, each with the scale of its
    `lowtrain.fp8.DelayedScale` (the largest amax of the last `history` steps), so no
    cast waits for the amax of its own tensor (`lowtrain.fp8.fp8_dot_general_delayed`;
    the step's amaxes come back as the "gradients" of the scales, by which
    `lowtrain.train.DelayedFp8` advances them after the update). Made from a
    `Linear` by `DelayedLinears`, with the same `kernel` and `bias`; a stacked
    `Linear` (the GPT's blocks, `kernel` of shape `(layers, in, out)`) gets stacked
    scales, one history per layer.

    The first step quantizes with scale 1 (no history yet), as Transformer Engine's
    does. Under `lowtrain.amp` the product comes back in the policy's compute dtype,
    as the `fp8` policy's own FP8 matmuls do.
    """

    kernel: Float[Array, "*stack in out"]
    bias: Float[Array, "*stack out"] | None
    x_scale: fp8.DelayedScale
    w_scale: fp8.DelayedScale
    g_scale: fp8.DelayedScale

    def __init__(self, linear: Linear, *, history: int = 16, margin: int = 0):
        stack = linear.kernel.shape[:-2]

        def scale(dtype):
            one = fp8.DelayedScale(dtype, history=history, margin=margin)
            return jax.tree.map(lambda a: jnp.broadcast_to(a, stack + a.shape), one)

        self.kernel, self.bias = linear.kernel, linear.bias
        self.x_scale, self.w_scale, self.g_scale = scale(E4M3), scale(E4M3), scale(E5M2)

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        dn = (((x.ndim - 1,), (0,)), ((), ()))
        scales = (self.x_scale, self.w_scale, self.g_scale)
        with jax.named_scope(LINEAR_SCOPE):  # named as the `Linear` it replaced
            y = fp8.fp8_dot_general_delayed(x, self.kernel, dn, *scales)
        return _add_bias(y, self.bias)


class _KeptLinear(eqx.Module):
    # A `DelayedLinear` that `keep` selects, as the plain `Linear` (its scales
    # unused: they keep their history until it runs in FP8 again).
    kernel: Float[Array, "*stack in out"]
    bias: Float[Array, "*stack out"] | None

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        return _add_bias(jnp.einsum(LINEAR_SCOPE, x, self.kernel), self.bias)


def _selects(keep: Sequence[str], kernel_shape) -> bool:
    # Whether a `keep` entry selects a `Linear` of this kernel (`LINEAR_SCOPE`, its
    # `(in, out)` shape; the GPT's blocks have no scope of their own).
    for entry in keep:
        scope, shape = parse_keep(entry)
        if fnmatch.fnmatchcase(LINEAR_SCOPE, scope) and shape in (
            None,
            tuple(kernel_shape[-2:]),
        ):
            return True
    return False


class DelayedLinears(Precision):
    """Every `Linear` of the model as a `DelayedLinear` (in `cast_params`, so in
    `Trainer.init`: the state, its checkpoints and `export` hold the swapped model).
    Chain it with `Amp("fp8")`, which keeps the other matmuls (the GPT's tied head, the
    einsum attention, the CNN's convolutions) in current-scaled FP8, and `DelayedFp8`,
    which carries the scales' state from step to step (`delayed_fp8`)."""

    history: int = eqx.field(static=True)
    margin: int = eqx.field(static=True)
    min_dim: int = eqx.field(static=True, default=0)  # smaller Linears stay as they are
    # `precision.keep`: the DelayedLinears it selects run wide (`wrap_model`; the
    # model's structure, so its state and checkpoints, do not depend on it).
    keep: tuple[str, ...] = eqx.field(static=True, default=())

    def cast_params(self, model):
        is_linear = lambda m: isinstance(m, Linear)
        if not any(map(is_linear, jax.tree.leaves(model, is_leaf=is_linear))):
            raise ValueError(
                "Expected a model with the recipes' `Linear` layers for "
                f"`precision=fp8_delayed`, got a {type(model).__name__} without "
                "any. The unit-scaled models (`model=gpt_unit`, `model=mlp_unit`) "
                "have their own FP8 recipes (`recipe=gpt_unit_fp8`); use "
                "`precision=fp8` for current scaling."
            )
        big = lambda m: min(m.kernel.shape[-2:]) >= self.min_dim
        swap = lambda m: (
            DelayedLinear(m, history=self.history, margin=self.margin)
            if is_linear(m) and big(m)
            else m
        )
        return jax.tree.map(swap, model, is_leaf=is_linear)

    def wrap_model(self, model):
        if not self.keep:
            return model
        is_delayed = lambda m: isinstance(m, DelayedLinear)
        wide = lambda m: (
            _KeptLinear(m.kernel, m.bias)
            if is_delayed(m) and _selects(self.keep, m.kernel.shape)
            else m
        )
        return jax.tree.map(wide, model, is_leaf=is_delayed)


def delayed_fp8(
    history: int = 16,
    margin: int = 0,
    min_dim: int = 0,
    keep: Sequence[str] = (),
    **auto,
) -> Precision:
    """The `fp8` policy with delayed scaling for the models' `Linear` layers
    (`DelayedLinears`, scales from the largest amax of the last `history` steps,
    `margin` powers of two of headroom), current scaling for their other matmuls;
    the matmuls whose GEMM has an M, N or K below `min_dim` (a `Linear` whose input
    or output width is) stay bf16, and so do those `keep` selects (a `Linear` by
    its scope `...i,io->...o` and kernel shape; its delayed scales wait, unchanged,
    until it runs in FP8 again)."""
    _check_auto(auto)
    return Chain(
        DelayedLinears(history, margin, min_dim, tuple(keep)),
        amp("fp8", min_dim=min_dim, keep=keep),
        DelayedFp8(),
    )
