"""The precisions of `python -m lowtrain`: the factories the `precision` configs name
(`_target_`), each returning a `lowtrain.train.Precision`. The FP8 baseline and
scalify's FP8 path are the library's (`lowtrain.train.naive_fp8`, `scalify_fp8`:
what `Trainer(precision="fp8_naive")` builds); `fp8_delayed` swaps the recipes'
models' `Linear` layers for `DelayedLinear` (FP8 with delayed scaling) when the
Trainer initialises them, and, as `lowtrain.train.delayed_fp8` does, every
`eqx.nn.Linear` for a delayed `lowtrain.fp8.Fp8Linear`.

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
from lowtrain.train import (
    Amp,
    Chain,
    DelayedFp8,
    Fp8Linears,
    Precision,
    Rewrite,
    Scalify,
)
from lowtrain.unit_scaling import keep_scopes, parse_keep

from ._config import AUTO_FIELDS, BLOCK_AUTO_FIELDS, LossScale
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


def naive_fp8(policy: str = "bf16", **fields) -> Precision:
    """`lowtrain.train.naive_fp8(policy, **fields)` (its other fields:
    `weights_only`, `keep`, `min_dim`, `rounding`), taking the autopilot's fields
    and ignoring them."""
    _check_auto({k: v for k, v in fields.items() if k not in _NAIVE_FIELDS})
    ours = {k: v for k, v in fields.items() if k in _NAIVE_FIELDS}
    return lowtrain.train.naive_fp8(policy, **ours)


_NAIVE_FIELDS = ("weights_only", "keep", "min_dim", "rounding")


def scalify(policy: str = "p=f32,c=f16", fp8: bool = False) -> Precision:
    """`lowtrain.train.Scalify(policy)`; with `fp8`, every matmul through
    `lowtrain.train.scalify_fp8_op` (`lowtrain.train.scalify_fp8`)."""
    return lowtrain.train.scalify_fp8(policy) if fp8 else Scalify(policy)


def block_scaled(
    recipe: str = "mxfp8",
    weight_2d: bool | None = None,
    hadamard: bool | None = None,
    stochastic: bool | None = None,
    grads: str | None = None,
    keep: Sequence[str] = (),
    routes: Sequence[str] = (),
    base: str | None = None,
    min_dim: int = 0,
    **auto,
) -> Precision:
    """`lowtrain.train.block_scaled(recipe, ...)`: the block-scaled precisions
    `mxfp8`, `fp8_block` and `nvfp4`, their recipe's parts as fields (None: the
    recipe's own), what `Trainer(precision=recipe)` builds; the autopilot's fields
    taken and ignored."""
    _check_auto({k: v for k, v in auto.items() if k not in BLOCK_AUTO_FIELDS})
    return lowtrain.train.block_scaled(
        recipe,
        weight_2d=weight_2d,
        hadamard=hadamard,
        stochastic=stochastic,
        grads=grads,
        keep=list(keep),
        routes=list(routes),
        base=base,
        min_dim=min_dim,
    )


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


class DelayedLinears(Fp8Linears):
    """Every `Linear` of the model as a `DelayedLinear`, and as
    `lowtrain.train.Fp8Linears` does, every `eqx.nn.Linear` as a delayed
    `lowtrain.fp8.Fp8Linear` (in `cast_params`, so in `Trainer.init`: the state,
    its checkpoints and `export` hold the swapped model). Chain it with
    `Amp("fp8")`, which keeps the other matmuls (the GPT's tied head, the einsum
    attention, the CNN's convolutions) in current-scaled FP8, and `DelayedFp8`,
    which carries the scales' state from step to step (`delayed_fp8`)."""

    # `precision.keep`: the DelayedLinears it selects run wide (`wrap_model`; the
    # model's structure, so its state and checkpoints, do not depend on it).
    keep: tuple[str, ...] = eqx.field(static=True, default=())

    def cast_params(self, model):
        is_linear = lambda m: isinstance(m, Linear | eqx.nn.Linear)
        if not any(map(is_linear, jax.tree.leaves(model, is_leaf=is_linear))):
            raise ValueError(
                "Expected a model with the recipes' `Linear` layers or "
                "`eqx.nn.Linear` layers for `precision=fp8_delayed`, got a "
                f"{type(model).__name__} without any. The unit-scaled models "
                "(`model=gpt_unit`, `model=mlp_unit`) have their own FP8 recipes "
                "(`recipe=gpt_unit_fp8`); use `precision=fp8` for current scaling."
            )
        big = lambda m: min(m.kernel.shape[-2:]) >= self.min_dim
        ours = lambda m: isinstance(m, Linear)
        swap = lambda m: (
            DelayedLinear(m, history=self.history, margin=self.margin)
            if ours(m) and big(m)
            else m
        )
        model = jax.tree.map(swap, model, is_leaf=ours)
        has_eqx = lambda m: isinstance(m, eqx.nn.Linear)
        if any(map(has_eqx, jax.tree.leaves(model, is_leaf=has_eqx))):
            model = super().cast_params(model)
        return model

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
