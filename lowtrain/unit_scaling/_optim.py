"""The u-μP learning-rate rules and the optax optimizers that apply them; the rule
table is in `lowtrain.unit_scaling.optim`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jaxtyping import PyTree

from ._modules import LinearReadout
from ._params import ParamInfo, param_info
from .constraints import to_output_scale


def _depth_scale(info: ParamInfo) -> float:
    return 1.0 if info.depth is None else info.depth**-0.5


def _unknown_kind(info: ParamInfo) -> ValueError:
    return ValueError(f"Expected a u-μP parameter kind, got {info.kind!r} instead.")


def lr_scale_adam(info: ParamInfo) -> float:
    """The u-μP learning-rate multiplier of one parameter under Adam or AdamW, from
    its `info` (a `ParamInfo`: kind, shape, depth); an unknown kind raises
    `ValueError`.

    ```python
    from lowtrain.unit_scaling.optim import ParamInfo, lr_scale_adam

    assert lr_scale_adam(ParamInfo("weight", (64, 256), depth=4)) == 1 / 32
    ```
    """
    if info.kind in ("bias", "norm", "output"):
        return _depth_scale(info)
    if info.kind in ("weight", "embedding"):
        return _depth_scale(info) * info.fan_in**-0.5
    raise _unknown_kind(info)


def lr_scale_sgd(readout_constraint: Callable | None) -> Callable[[ParamInfo], float]:
    """The u-μP learning-rate multiplier function for SGD, given
    `readout_constraint`, the constraint of the model's `LinearReadout`: None (then
    SGD sees unit gradients, and the Adam rules apply) or `to_output_scale` (another
    raises `ValueError`).

    ```python
    import lowtrain.unit_scaling as uu
    from lowtrain.unit_scaling.optim import ParamInfo, lr_scale_sgd

    rule = lr_scale_sgd(uu.constraints.to_output_scale)
    assert rule(ParamInfo("weight", (64, 256))) == 16.0
    ```
    """
    if readout_constraint is None:
        return lr_scale_adam
    if readout_constraint is not to_output_scale:
        raise ValueError(
            "Expected the readout's constraint to be None or "
            f"`to_output_scale` for u-μP SGD, got {readout_constraint!r} instead."
        )

    def rule(info: ParamInfo) -> float:
        if info.kind in ("bias", "norm"):
            return _depth_scale(info) * info.shape[0]
        if info.kind in ("weight", "embedding"):
            return _depth_scale(info) * info.fan_in**0.5
        if info.kind == "output":
            return _depth_scale(info)
        raise _unknown_kind(info)

    return rule


def lr_multipliers(
    model: PyTree,
    lr_scale: Callable[[ParamInfo], float] = lr_scale_adam,
    *,
    allow_non_unit_scaling_params: bool = False,
) -> PyTree[float | None]:
    """`lr_scale(info)` for every `info` of `param_info(model)`: the structure of
    `eqx.filter(model, eqx.is_inexact_array)`, a float for each parameter.

    A parameter that no unit-scaled module declares is an error, or gets 1.0 with
    `allow_non_unit_scaling_params=True`.

    **Arguments:**

    - `model`: the Equinox model (or any pytree; abstract, from
      `eqx.filter_eval_shape`, too) whose modules' `mup_kinds` name the kind of
      each parameter (see `param_info`).
    - `lr_scale`: the rule, `lr_scale(info) -> float` for a `ParamInfo`; default
      `lr_scale_adam` (for SGD, `lr_scale_sgd(readout_constraint)`).
    - `allow_non_unit_scaling_params`: keyword-only; False (default): a parameter
      no module declares raises `ValueError`; True: it gets 1.0.

    ```python
    import jax
    import lowtrain.unit_scaling as uu

    layer = uu.Linear(64, 8, key=jax.random.key(0))
    mults = uu.optim.lr_multipliers(layer)
    assert mults.weight == 1 / 8 and mults.bias == 1.0
    ```
    """

    def scale(info: ParamInfo | None):
        if info is None:
            return None
        if info.kind is None:
            if allow_non_unit_scaling_params:
                return 1.0
            raise ValueError(
                f"Expected only unit-scaled parameters, got an array of shape "
                f"{info.shape} that no module's `mup_kinds` names. Use the "
                "`lowtrain.unit_scaling` layers, declare `mup_kinds` on your module, "
                "or pass `allow_non_unit_scaling_params=True` (multiplier 1)."
            )
        return float(lr_scale(info))

    is_info = lambda x: isinstance(x, ParamInfo) or x is None
    return jax.tree.map(scale, param_info(model), is_leaf=is_info)


def _scale_by_multipliers(mults: PyTree[float | None]) -> optax.GradientTransformation:
    expected = jax.tree.structure(mults)

    def init(params):
        got = jax.tree.structure(params)
        if got != expected:
            raise ValueError(
                "Expected parameters of the structure of "
                f"`eqx.filter(model, eqx.is_inexact_array)`, {expected}, got {got} "
                "instead. Initialize with `opt.init(eqx.filter(model, "
                "eqx.is_inexact_array))` for the `model` the optimizer was built for."
            )
        return optax.EmptyState()

    def update(updates, state, params=None):
        return jax.tree.map(lambda u, m: u * m, updates, mults), state

    return optax.GradientTransformation(init, update)


def _mup_chain(
    direction: optax.GradientTransformation,
    rule: Callable[[ParamInfo], float],
    learning_rate,
    weight_decay: float,
    *,
    model: PyTree,
    independent: bool,
    peak: float | None,
    allow_non_unit_scaling_params: bool,
) -> optax.GradientTransformation:
    # update = -lr(t) * (mult * direction + decay * param), where decay is
    # weight_decay / peak (independent: the decay per step is weight_decay * lr(t) /
    # peak, whatever the multipliers and the base LR) or mult * weight_decay.
    mults = lr_multipliers(
        model, rule, allow_non_unit_scaling_params=allow_non_unit_scaling_params
    )
    steps = [direction]
    if weight_decay and not independent:
        steps.append(optax.add_decayed_weights(weight_decay))
    steps.append(_scale_by_multipliers(mults))
    if weight_decay and independent:
        if peak is None:
            if callable(learning_rate):
                raise ValueError(
                    "Expected `peak_learning_rate` with a schedule and independent "
                    "weight decay, got None. Pass the schedule's peak (e.g. "
                    "`peak_learning_rate=1e-2`) or `independent_weight_decay=False`."
                )
            peak = learning_rate
        steps.append(optax.add_decayed_weights(weight_decay / peak))
    steps.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*steps)


def adamw(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    model: PyTree,
    independent_weight_decay: bool = True,
    peak_learning_rate: float | None = None,
    allow_non_unit_scaling_params: bool = False,
) -> optax.GradientTransformation:
    """u-μP AdamW: `optax.adamw` with the per-parameter learning rate
    `learning_rate * lr_scale_adam(info)` (the table of
    `lowtrain.unit_scaling.optim`) for the parameters of `model`.

    Initialize it with `eqx.filter(model, eqx.is_inexact_array)` (as
    `lowtrain.Trainer` does). Weight decay is decoupled and, by default,
    independent of the learning rate as in u-μP: each step multiplies a parameter
    by `1 - weight_decay * lr(t) / peak` (`peak` is `learning_rate`, or
    `peak_learning_rate` for a schedule), whatever its multiplier; with
    `independent_weight_decay=False` by `1 - lr(t) * multiplier * weight_decay`
    (PyTorch's AdamW with these per-parameter learning rates). The default
    `weight_decay=0.0` is the unit-scaling library's.

    **Arguments:**

    - `learning_rate`: the base learning rate, a float or an optax schedule of the
      step, multiplied per parameter by `lr_scale_adam`.
    - `b1`: the decay rate of Adam's first moment estimate (default 0.9).
    - `b2`: the decay rate of its second moment estimate (default 0.999).
    - `eps`: added to the square root of the second moment in the denominator
      (default `1e-8`).
    - `weight_decay`: the decoupled weight decay coefficient; 0.0 (default): none.
    - `model`: keyword-only; the unit-scaled Equinox model to train, read once for
      each parameter's multiplier (`lr_multipliers`); `init` expects the structure
      of `eqx.filter(model, eqx.is_inexact_array)`.
    - `independent_weight_decay`: keyword-only; True (default): each step decays a
      parameter by `weight_decay * lr(t) / peak`; False: by
      `lr(t) * multiplier * weight_decay`.
    - `peak_learning_rate`: keyword-only; the `peak` of the independent decay
      (used only then, with a non-zero `weight_decay`). None (default):
      `learning_rate`, which must then be a float (a schedule raises `ValueError`).
    - `allow_non_unit_scaling_params`: keyword-only; False (default): a parameter
      that no module's `mup_kinds` names raises `ValueError`; True: its multiplier
      is 1.0.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu
    import lowtrain.unit_scaling.functional as U

    model = uu.Linear(16, 8, key=jax.random.key(0))
    opt = uu.optim.adamw(0.1, model=model)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)
    x, y = jnp.ones((4, 16)), jnp.zeros((4, 8))
    grads = jax.grad(lambda m: U.mse_loss(m(x), y))(model)
    updates, state = opt.update(grads, state, params)
    assert jnp.allclose(jnp.abs(updates.weight), 0.1 / 4)  # 0.1 * 16 ** -0.5
    ```
    """
    return _mup_chain(
        optax.scale_by_adam(b1, b2, eps),
        lr_scale_adam,
        learning_rate,
        weight_decay,
        model=model,
        independent=independent_weight_decay,
        peak=peak_learning_rate,
        allow_non_unit_scaling_params=allow_non_unit_scaling_params,
    )


def _readout_constraint(model: PyTree):
    is_readout = lambda x: isinstance(x, LinearReadout)
    found = {
        leaf.constraint
        for leaf in jax.tree.leaves(model, is_leaf=is_readout)
        if is_readout(leaf)
    }
    if len(found) > 1:
        raise ValueError(
            "Expected every `LinearReadout` of the model to have one constraint, "
            f"got {found}. Give them the same one."
        )
    return found.pop() if found else None


def sgd(
    learning_rate: float | optax.Schedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    model: PyTree,
    independent_weight_decay: bool = True,
    peak_learning_rate: float | None = None,
    allow_non_unit_scaling_params: bool = False,
) -> optax.GradientTransformation:
    """u-μP SGD: `optax.sgd` with the per-parameter learning rate
    `learning_rate * lr_scale_sgd(c)(info)` for the parameters of `model`, where `c`
    is the constraint of the model's `LinearReadout` (None if it has none; the
    table of `lowtrain.unit_scaling.optim`).

    Momentum as `optax.sgd`; weight decay decoupled (applied after momentum, not
    added to the gradient) and independent of the learning rate by default, as in
    `adamw`.

    **Arguments:**

    - `learning_rate`: the base learning rate, a float or an optax schedule of the
      step, multiplied per parameter by `lr_scale_sgd(c)`.
    - `momentum`: the momentum decay (`optax.trace`'s `decay`); None (default):
      plain SGD.
    - `nesterov`: with `momentum`, use Nesterov momentum (default False).
    - `weight_decay`: the decoupled weight decay coefficient; 0.0 (default): none.
    - `model`, `independent_weight_decay`, `peak_learning_rate`,
      `allow_non_unit_scaling_params`: keyword-only, as `adamw` takes them.

    ```python
    import equinox as eqx
    import jax
    import lowtrain.unit_scaling as uu

    model = uu.Linear(16, 8, key=jax.random.key(0))
    opt = uu.optim.sgd(0.5, momentum=0.9, model=model)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    ```
    """
    direction = (
        optax.trace(momentum, nesterov) if momentum is not None else optax.identity()
    )
    return _mup_chain(
        direction,
        lr_scale_sgd(_readout_constraint(model)),
        learning_rate,
        weight_decay,
        model=model,
        independent=independent_weight_decay,
        peak=peak_learning_rate,
        allow_non_unit_scaling_params=allow_non_unit_scaling_params,
    )
