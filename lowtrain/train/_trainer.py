"""`Trainer`: a plain class with a few override points; `fit` runs the loop."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from .. import fp8, scalify
from .._amp import Policy, amp, get_policy
from .._loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    _LossScale,
    scaled_value_and_grad,
)
from ._fit import fit as _fit
from ._hooks import Hook, StepInfo
from ._metrics import global_norm
from ._state import TrainState

# `optax.apply_if_finite` applies an update anyway after this many non-finite ones in
# a row; its counter saturates at the int32 maximum, so it never gets there.
_NEVER = int(np.iinfo(np.int32).max)


def _is_fp32(policy: Policy) -> bool:
    return policy == get_policy("fp32")


class Trainer:
    """Trains an Equinox model with an Optax optimizer; subclass it and define `loss`.

    Construction: `Trainer(model, optimizer, *, policy="fp32", loss_scale=None,
    redo_on_nan=0, stop_on_nonfinite=None, learning_rate=None, devices=None)`.

    - `policy`: a `lowtrain.Policy` or a name ("fp32", "bf16", "fp16", ...). The
      model's float arrays are stored in `policy.param_dtype`. Unless the policy is
      "fp32", `loss` and `evaluate` receive `lowtrain.amp(model, policy)`: call it
      as you would call the model (its forward and backward run in the policy's
      precision, its float outputs come back in `policy.output_dtype`, so the loss
      itself is computed in float32 with the presets); `model.__wrapped__` is the
      model itself. A model that is not callable needs the "fp32" policy and `amp`
      applied inside `loss`.
    - `loss_scale`: default `DynamicLossScale()` if the policy computes in float16,
      else `NoOpLossScale()`. `redo_on_nan` is passed to
      `lowtrain.scaled_value_and_grad`.
    - The optimizer is wrapped in `optax.apply_if_finite` (that is `self.optimizer`):
      a step whose gradients are not all finite leaves the model and the optimizer
      state bit for bit unchanged and counts in `state.skipped` (only the loss scale
      backs off).
    - `stop_on_nonfinite` (default: True exactly when the loss scale is a
      `NoOpLossScale`): `fit` raises `FloatingPointError` on a non-finite loss.
    - `learning_rate`: a number or an Optax schedule, only for logging, when the
      optimizer is not built with `optax.inject_hyperparams` (whose state is read).
    - `transform`: "amp" (the default, as above) or "scalify": the whole step, the
      optimizer included, runs under `lowtrain.scalify.scalify`, the weights stored
      as `ScaledArray`s of the policy's compute dtype and the optimizer state as
      float32 `ScaledArray`s; `loss` gets the model itself (no loss scale needed).
    - `devices`: data parallelism over these devices (default `jax.devices()`, all
      devices of all processes): a 1-D `Mesh` named "data"; each batch is split along
      its leading axis, which must divide by the number of devices; the state is
      replicated. Gradients are averaged by XLA across devices, so a step computes
      the same as on one device.

    Override points: `loss(self, model, batch, *, key)` (required) returns a float
    scalar, or `(loss, aux)`; `evaluate(self, model, batch)` returns a dict of scalar
    metrics (default: `{"loss": ...}` with `key=None`); `train_step(self, state,
    batch)` returns `(new_state, metrics)` for full control. Hooks: `add_hook(fn,
    every=N)`. See `fit` for the loop, and `lowtrain.StepInfo` for what "step" means.
    The step is traced once, reading the attributes set here: to change them, build a
    new Trainer.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import lowtrain

    class Regression(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            pred = jax.vmap(model)(batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

    x = jax.random.normal(jax.random.key(0), (64, 3))
    data = lowtrain.ArrayBatches({"x": x, "y": x @ jnp.ones((3, 1))}, 16, seed=0)
    model = eqx.nn.Linear(3, 1, key=jax.random.key(1))
    trainer = Regression(model, optax.adam(0.1), policy="fp16")
    state = trainer.init(key=jax.random.key(2))
    assert isinstance(state.loss_scale, lowtrain.DynamicLossScale)  # fp16 default
    state = trainer.fit(state, data, steps=20, progress=False)
    assert int(state.step) == 20 and state.model.weight.dtype == jnp.float32
    assert trainer.run_evaluation(state, data)["loss"] < 0.5
    ```
    """

    def __init__(
        self,
        model: PyTree,
        optimizer: optax.GradientTransformation,
        *,
        policy: Policy | str = "fp32",
        loss_scale: _LossScale | None = None,
        redo_on_nan: int = 0,
        stop_on_nonfinite: bool | None = None,
        learning_rate: Callable[[Any], Any] | float | None = None,
        devices: Sequence[jax.Device] | None = None,
        transform: str = "amp",
    ):
        if type(self).loss is Trainer.loss:
            raise TypeError(
                f"Expected a subclass of `lowtrain.Trainer` that defines "
                f"`loss(self, model, batch, *, key)`, got {type(self).__name__} "
                "without one instead. Subclass it: `class MyTrainer(lowtrain.Trainer)"
                ": def loss(self, model, batch, *, key): ...`."
            )
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "Expected an Optax optimizer such as `optax.adam(1e-3)`, got "
                f"{type(optimizer).__name__} instead."
            )
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        if not isinstance(self.policy, Policy):
            raise TypeError(
                "Expected a `lowtrain.Policy` or a policy name such as 'bf16', got "
                f"{type(policy).__name__} instead."
            )
        if transform not in ("amp", "scalify"):
            raise ValueError(
                f"Expected `transform` 'amp' or 'scalify', got {transform!r} instead."
            )
        self.transform = transform
        if loss_scale is None:
            half = self.policy.compute_dtype == jnp.float16
            scaled = transform == "amp" and half
            loss_scale = DynamicLossScale() if scaled else NoOpLossScale()
        if not isinstance(loss_scale, _LossScale):
            raise TypeError(
                "Expected a loss scale such as `lowtrain.DynamicLossScale()`, got "
                f"{type(loss_scale).__name__} instead."
            )
        self.model = model
        self.optimizer = optax.apply_if_finite(optimizer, _NEVER)
        self.loss_scale = loss_scale
        if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, int):
            raise TypeError(f"Expected an int `redo_on_nan`, got {redo_on_nan!r}.")
        if redo_on_nan < 0:
            raise ValueError(f"Expected `redo_on_nan` >= 0, got {redo_on_nan}.")
        self.redo_on_nan = redo_on_nan
        if stop_on_nonfinite is None:
            stop_on_nonfinite = isinstance(loss_scale, NoOpLossScale)
        self.stop_on_nonfinite = bool(stop_on_nonfinite)
        self.learning_rate = learning_rate
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("Expected at least one device in `devices`, got none.")
        self.devices = devices
        self.mesh = Mesh(np.array(devices), ("data",))
        self.hooks: list[Hook] = []

    # -- override points ---------------------------------------------------------

    def loss(self, model: PyTree, batch: PyTree, *, key: PRNGKeyArray | None) -> Any:
        """The loss of `model` on `batch`: a float scalar, or `(loss, aux)`.

        `model` is `self.policy_model(state.model)` (see the class docstring).
        `key` is this step's PRNG key (`jax.random.fold_in(state.key, state.step)`),
        or None from the default `evaluate`: use `key is None` to turn dropout off.
        A dict `aux` of scalars is logged next to the loss.
        """
        raise NotImplementedError

    def evaluate(self, model: PyTree, batch: PyTree) -> dict[str, Array]:
        """Metrics of `model` on one eval batch: a dict of scalars (traced, jitted).

        `run_evaluation` averages each over the eval batches. The default is
        `{"loss": loss}` from `self.loss(model, batch, key=None)`.
        """
        out = self.loss(model, batch, key=None)
        return {"loss": out[0] if isinstance(out, tuple) else out}

    def train_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        """One step: returns the new state and metrics (traced once, under `jit`).

        The metrics are `loss` (f32), `aux`, `grad_norm` (f32) and `grads_finite`.
        """
        key = jax.random.fold_in(state.key, state.step)
        value_and_grad = scaled_value_and_grad(
            self._loss_with_aux, has_aux=True, redo_on_nan=self.redo_on_nan
        )
        ((loss, aux), grads), loss_scale, finite = value_and_grad(
            state.loss_scale, state.model, batch, key=key
        )
        # FP8 delayed-scaling state comes back as its own "gradient": keep it away from
        # the optimizer, and write it into the new model as it is.
        grads, fp8_scales = fp8.pop_scales(grads)
        params = eqx.filter(state.model, eqx.is_inexact_array)
        if self.transform == "scalify":
            # The optimizer's arithmetic in float32 (Adam squares the gradients), its
            # updates cast back to the weights' dtype (scales are kept).
            f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
            updates, opt_state = self.optimizer.update(
                f32(grads), state.opt_state, f32(params)
            )
            updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
        else:
            updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
        new_model = eqx.apply_updates(state.model, updates)
        # apply_if_finite adds zero updates on a skipped step; `where` also keeps the
        # bits (p + 0.0 would turn -0.0 into +0.0).
        model = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old) if eqx.is_array(new) else new,
            new_model,
            state.model,
        )
        model = fp8.put_scales(model, fp8_scales)
        new_state = TrainState(state.step + 1, model, opt_state, loss_scale, state.key)
        metrics = {
            "loss": loss,
            "aux": aux,
            "grad_norm": global_norm(grads),
            "grads_finite": finite,
        }
        return self._replicated(new_state), metrics

    # -- hooks -------------------------------------------------------------------

    def add_hook(self, fn: Callable[[StepInfo], Any], every: int = 1) -> None:
        """Call `fn(info)` with a `lowtrain.StepInfo` after each step where
        `info.step % every == 0`, during `fit`. Hooks run in the order added."""
        if not callable(fn):
            raise TypeError(f"Expected a callable hook, got {fn!r} instead.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Expected an int `every` >= 1, got {every!r} instead.")
        self.hooks.append(Hook(fn, every))

    # -- state, placement, compiled steps ----------------------------------------

    def init(self, *, key: PRNGKeyArray) -> TrainState:
        """A fresh `TrainState` (step 0) for `self.model`, replicated on `devices`.

        The model's float arrays are cast to `policy.param_dtype` and copied, so the
        model given to the constructor is never donated.
        """
        model = self.policy.cast_to_param(self.model)
        opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        if self.transform == "scalify":
            # Master weights as ScaledArrays of the compute dtype; optimizer state as
            # float32 ScaledArrays (moments of small gradients need the range).
            model = scalify.as_scaled_array(model, dtype=self.policy.compute_dtype)
            opt_state = scalify.as_scaled_array(opt_state)
        state = TrainState(
            jnp.zeros((), jnp.int32), model, opt_state, self.loss_scale, key
        )
        dynamic, static = eqx.partition(state, eqx.is_array)
        dynamic = jax.device_put(
            dynamic, NamedSharding(self.mesh, P()), may_alias=False
        )
        return eqx.combine(dynamic, static)

    def _replicated(self, tree):
        sharding = NamedSharding(self.mesh, P())
        return jax.tree.map(
            lambda x: (
                jax.lax.with_sharding_constraint(x, sharding)
                if isinstance(x, jax.Array)
                else x
            ),
            tree,
        )

    def shard_batch(self, batch: PyTree) -> PyTree:
        """Place `batch` on the devices, split along its leading axis.

        In a multi-process run each process passes its own part of the global batch
        (`jax.make_array_from_process_local_data`).
        """
        local = [d for d in self.devices if d.process_index == jax.process_index()]
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            shape = np.shape(x)
            if not shape or shape[0] % len(local):
                raise ValueError(
                    f"Expected every batch array's leading axis to divide by the "
                    f"number of devices ({len(local)}), got shape {shape} at "
                    f"`batch{jax.tree_util.keystr(path)}` instead. Use a batch size "
                    f"that is a multiple of {len(local)}, or pass "
                    "`devices=jax.devices()[:n]` to the Trainer."
                )
        sharding = NamedSharding(self.mesh, P("data"))
        if jax.process_count() == 1:
            return jax.device_put(batch, sharding)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
            batch,
        )

    def policy_model(self, model: PyTree) -> PyTree:
        """`model` as `loss` and `evaluate` receive it: `lowtrain.amp(model, policy)`,
        or `model` itself under the "fp32" policy or the scalify transform."""
        if _is_fp32(self.policy) or self.transform == "scalify":
            return model
        return amp(model, self.policy)

    def _inputs(self, batch: PyTree) -> PyTree:
        # Under scalify the model computes in its weights' dtype: float inputs are
        # cast to it, as `amp` casts them on entry.
        if self.transform == "scalify":
            return self.policy.cast_to_compute(batch)
        return batch

    def _transformed(self, fn: Callable) -> Callable:
        # transform="scalify": the whole step (forward, gradient, optimizer) runs under
        # `lowtrain.scalify.scalify`; metrics come back as plain float32 arrays.
        if self.transform != "scalify":
            return fn
        scaled = scalify.scalify(fn)

        def run(*args):
            out = scaled(*args)
            if isinstance(out, tuple):  # (state, metrics)
                return out[0], scalify.asarray(out[1], jnp.float32)
            return scalify.asarray(out, jnp.float32)

        return run

    def _loss_with_aux(self, model, batch, *, key):
        out = self.loss(self.policy_model(model), batch, key=key)
        return out if isinstance(out, tuple) else (out, None)

    @functools.cached_property
    def compiled_step(self) -> Callable:
        """`train_step` under `eqx.filter_jit`, built once, called as
        `compiled_step(batch, state)`: every array of `state` is donated (its buffers
        are reused for the new state), the batch is not."""

        step = self._transformed(
            lambda batch, state: self.train_step(state, self._inputs(batch))
        )
        return eqx.filter_jit(step, donate="all-except-first")

    @functools.cached_property
    def _compiled_eval(self) -> Callable:
        def run(model, batch):
            return self.evaluate(self.policy_model(model), self._inputs(batch))

        return eqx.filter_jit(self._transformed(run))

    def run_evaluation(self, state: TrainState, data: Iterable[PyTree]) -> dict:
        """The mean of each `evaluate` metric over the batches of `data`, as floats.

        `data` is iterated once (an `ArrayBatches` gives one epoch in order).
        """
        totals: dict[str, float] = {}
        count = 0
        for batch in data:
            metrics = self._compiled_eval(state.model, self.shard_batch(batch))
            if not isinstance(metrics, dict):
                raise TypeError(
                    "Expected `evaluate` to return a dict of scalars such as "
                    f"{{'loss': loss}}, got {type(metrics).__name__} instead."
                )
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value)
            count += 1
        if not count:
            raise ValueError("Expected at least one batch in the eval data, got none.")
        return {name: total / count for name, total in totals.items()}

    fit = _fit
