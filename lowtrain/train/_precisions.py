"""The `Precision`s lowtrain ships: `Amp`, `Scalify`, `DelayedFp8`, `Rewrite`,
`UnitScale`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import fp8, scalify
from .._amp import Policy, amp, get_policy
from .._loss_scale import AbstractLossScale, DynamicLossScale, NoOpLossScale
from .._rewrite import Rule, rewrite
from ..fp8.internal import advanced_scales, split_records, zero_scales
from ..unit_scaling import constraints, unit_scale
from ._protocol import Precision

F32 = jnp.float32


def _at_least_f32(x):
    if eqx.is_inexact_array(x) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(F32)
    return x


def _policy(policy: Policy | str) -> Policy:
    policy = get_policy(policy) if isinstance(policy, str) else policy
    if not isinstance(policy, Policy):
        raise TypeError(
            "Expected a `lowtrain.Policy` or a policy name such as 'bf16', got "
            f"{type(policy).__name__} instead."
        )
    return policy


class Amp(Precision):
    """Automatic mixed precision: `loss` receives `lowtrain.amp(model, policy)`.

    Parameters are stored in `policy.param_dtype` (master weights); the model's
    forward and backward run as the policy says; its float outputs come back in
    `policy.output_dtype`. Under the "fp32" policy the model is passed as it is.
    Default loss scale: `loss_scale` if given, else `DynamicLossScale()` when the
    policy computes in float16 and `NoOpLossScale()` otherwise.

    ```python
    import jax.numpy as jnp
    import lowtrain
    from lowtrain.train import Amp

    precision = Amp("fp16")
    assert precision.policy.compute_dtype == jnp.float16
    assert isinstance(precision.default_loss_scale(), lowtrain.DynamicLossScale)
    ```
    """

    policy: Policy = eqx.field(static=True)
    loss_scale: AbstractLossScale | None

    def __init__(
        self, policy: Policy | str = "fp32", loss_scale: AbstractLossScale | None = None
    ):
        self.policy = _policy(policy)
        if loss_scale is not None and not isinstance(loss_scale, AbstractLossScale):
            raise TypeError(
                "Expected a loss scale such as `lowtrain.DynamicLossScale()`, got "
                f"{type(loss_scale).__name__} instead."
            )
        self.loss_scale = loss_scale

    def cast_params(self, model):
        return self.policy.cast_to_param(model)

    def to_optimizer(self, tree):
        # Half-precision parameters (`param_dtype` float16/bfloat16): the optimizer
        # computes and keeps its state in float32 (Adam squares the gradients);
        # float32 ones pass as they are.
        return jax.tree.map(_at_least_f32, tree)

    def from_optimizer(self, updates, params):
        return jax.tree.map(
            lambda u, p: u.astype(p.dtype) if eqx.is_inexact_array(u) else u,
            updates,
            params,
        )

    def default_loss_scale(self):
        if self.loss_scale is not None:
            return self.loss_scale
        half = self.policy.compute_dtype == jnp.float16
        return DynamicLossScale() if half else NoOpLossScale()

    def wrap_model(self, model):
        if self.policy == get_policy("fp32"):
            return model
        return amp(model, self.policy)


class Scalify(Precision):
    """The whole step (forward, gradient, optimizer) under `lowtrain.scalify.scalify`.

    The weights are stored as `ScaledArray`s of `policy.compute_dtype` (cast first
    to `policy.param_dtype`), the optimizer state as float32 `ScaledArray`s (moments
    of small gradients need the range); float inputs are cast to the compute dtype;
    the optimizer's arithmetic runs on float32 (Adam squares the gradients) and its
    updates are cast back to the weights' dtype, scales kept. `loss` receives the
    model itself; metrics come back as plain float32 arrays. No loss scale.

    ```python
    import jax.numpy as jnp
    from lowtrain.train import Scalify

    precision = Scalify("p=f32,c=f16")
    model, opt_state = precision.store({"w": jnp.ones(3)}, ())
    assert model["w"].data.dtype == jnp.float16  # a ScaledArray
    ```
    """

    policy: Policy = eqx.field(static=True)

    def __init__(self, policy: Policy | str = "p=f32,c=f16"):
        self.policy = _policy(policy)

    def cast_params(self, model):
        return self.policy.cast_to_param(model)

    def store(self, model, opt_state):
        model = scalify.as_scaled_array(model, dtype=self.policy.compute_dtype)
        return model, scalify.as_scaled_array(opt_state)

    def default_loss_scale(self):
        return NoOpLossScale()

    def wrap_step(self, step: Callable) -> Callable:
        scaled = scalify.scalify(step)

        def run(*args):
            carry, metrics = scaled(*args)
            return carry, scalify.asarray(metrics, F32)

        return run

    def inputs(self, batch):
        # The model computes in its weights' dtype: float inputs are cast to it.
        return self.policy.cast_to_compute(batch)

    def to_optimizer(self, tree):
        return jax.tree.map(lambda x: x.astype(F32), tree)

    def from_optimizer(self, updates, params):
        return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)

    def export(self, model):
        return scalify.asarray(model, F32)


class DelayedFp8(Precision):
    """FP8 delayed scaling (`lowtrain.fp8.Fp8Linear(delayed=True)`): what the step's
    calls recorded (their amaxes, see `fp8.pop_scales`) comes back as the
    "gradients" of the model's `DelayedScale`s. It is taken out before the optimizer
    (zeros in its place, so clipping, norms and finiteness checks never see it), the
    optimizer's updates of the states are zeroed (weight decay would shrink them),
    and after the update each state advances by its records (`merge`; written into
    the model exactly, as `fp8.put_scales`). A model without `DelayedScale`s is left
    alone, so the Trainer adds this to every policy it is given by name.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8
    from lowtrain.train import DelayedFp8

    layer = fp8.Fp8Linear(2, 2, delayed=True, key=jax.random.key(0))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.full((1, 2), 3.0))))(layer)
    grads, records = DelayedFp8().split_gradients(grads)
    assert not grads.x_scale.amax_history.any()
    assert DelayedFp8().merge(layer, records).x_scale.amax_history[0] == 3.0
    ```
    """

    def split_gradients(self, grads):
        return split_records(grads)

    def from_optimizer(self, updates, params):
        return zero_scales(updates)

    def merge(self, model, extra):
        # `model`'s states are the step's: their updates were zeroed.
        return fp8.put_scales(model, advanced_scales(model, extra))


class Rewrite(Precision):
    """The model's primitives named in `rules` replaced (`lowtrain.rewrite`): what
    `loss` receives, and what `export` gives, is `lowtrain.rewrite(model, rules,
    scopes=scopes)` (`scopes`: other rules inside named scopes, `{}` for none).

    Chain it before `Amp` to change every matmul of a model written without
    precision arguments (the recipes' naive-FP8 baseline), or after `Scalify`.

    ```python
    import jax.numpy as jnp
    from lowtrain.train import Rewrite

    double = Rewrite({"dot_general": lambda op, a, b: 2 * op(a, b)})
    model = double.wrap_model(lambda x: x @ x)
    assert model(jnp.eye(2))[0, 0] == 2.0
    ```
    """

    rules: tuple[tuple[str, Rule], ...] = eqx.field(static=True)
    scopes: tuple[tuple[str, tuple[tuple[str, Rule], ...]], ...] = eqx.field(
        static=True
    )

    def __init__(
        self,
        rules: Mapping[str, Rule],
        scopes: Mapping[str, Mapping[str, Rule]] | None = None,
    ):
        checked = rewrite(lambda: None, rules, scopes=scopes)  # checks now
        self.rules, self.scopes = checked.rules, checked.scopes

    def wrap_model(self, model):
        scopes = {name: dict(table) for name, table in self.scopes}
        return rewrite(model, dict(self.rules), scopes=scopes)


class UnitScale(Precision):
    """`loss` receives `lowtrain.unit_scaling.unit_scale(model)`: a model written
    without unit scaling (N(0, 1) weights, plain matmuls, `jax.nn` nonlinearities)
    gets unit-scaling's forward and backward scales on each op. Chain it before a
    plain FP8 cast (`[UnitScale(), Rewrite({...: fp8_cast_op}), Amp("bf16")]`).
    `constraint`: how an op's forward and backward scales are reconciled where
    they must be one (`lowtrain.unit_scaling.constraints`; default `gmean`, their
    geometric mean; None: each kept).

    ```python
    import jax.numpy as jnp
    from lowtrain.train import UnitScale

    model = UnitScale().wrap_model(lambda x, w: x @ w)
    assert model(jnp.ones((2, 16)), jnp.ones((16, 4)))[0, 0] == 4.0  # 16 / sqrt(16)
    ```
    """

    constraint: Callable | None = eqx.field(static=True)

    def __init__(self, constraint: Callable | None = constraints.gmean):
        self.constraint = constraint

    def wrap_model(self, model):
        return unit_scale(model, constraint=self.constraint)


def check_stored_alike(precision: Precision, state, expected) -> None:
    """That `state` has the structure, shapes and dtypes of `expected` (the
    abstract state `precision` stores), for `Trainer.use_precision`."""
    ours, tree = jax.tree_util.tree_flatten_with_path(state)
    want, want_tree = jax.tree.flatten(expected)
    mismatch = "" if tree == want_tree else "another pytree structure"
    for (path, a), b in zip(ours, want) if not mismatch else ():
        if isinstance(b, jax.ShapeDtypeStruct) and (
            np.shape(a) != b.shape or jnp.result_type(a) != b.dtype
        ):
            mismatch = (
                f"state{jax.tree_util.keystr(path)} is {jnp.result_type(a)}"
                f"{list(np.shape(a))}, expected {b.dtype}{list(b.shape)}"
            )
            break
    if mismatch:
        raise ValueError(
            f"Expected a precision that stores the state as it is, got "
            f"{type(precision).__name__}, which stores it otherwise: {mismatch}. "
            "Build a new Trainer with it and start from `trainer.init` (or a "
            "checkpoint of that precision) instead."
        )
