"""`Trainer`: a plain class with a few override points; `fit` runs the loop. Below
it, what the loop needs besides itself: its arguments validated into a `FitPlan`
(what happens at which step), the non-finite loss check, `StepInfo`s and metric
records."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray, PyTree
from tqdm import tqdm

from .._amp import Policy
from .._loss_scale import NoOpLossScale, _LossScale
from ._accumulate import accumulated_value_and_grad, check_counts
from ._callbacks import Callback, StopTraining, check_callbacks, overrides
from ._checkpoint import (
    Checkpoints,
    latest_checkpoint,
    list_checkpoints,
    restore_latest,
)
from ._data import restore_data_position, with_data_position
from ._divergence import DivergenceCheck
from ._finite import skip_nonfinite
from ._hooks import Hook, StepInfo, finite_number, positive_int
from ._jit import async_filter_jit
from ._lock import RunLock
from ._metrics import LearningRates, global_norm
from ._nnx import has_inplace_state, keep_inplace_state, read_inplace_state
from ._numerics import NumericsRecorder
from ._placement import constrain_state, data_mesh, put_state, shard_batch, step_batch
from ._precisions import resolve
from ._preemption import (
    DEFAULT_STOP_SIGNALS,
    Preempted,
    SignalWatch,
    agree,
    check_stop_signals,
)
from ._protocol import Precision
from ._state import TrainState

if TYPE_CHECKING:
    from ._loggers import Logger

log = logging.getLogger("lowtrain")


class Trainer:
    """Trains an Equinox model with an Optax optimizer; subclass it and define `loss`.

    - `precision`: a `lowtrain.train.Precision` (`Amp`, `Scalify`, `DelayedFp8`,
      `Rewrite`, your own) or a list of them (chained): `self.precision`, whose
      hooks the step calls. A policy instead (a `lowtrain.Policy` or a name:
      "fp32", the default, "bf16", "fp16", "fp8", ...) means
      `[Amp(policy), DelayedFp8()]`: parameters stored in `param_dtype`, and
      unless the policy is "fp32", `loss` and `evaluate` receive
      `lowtrain.amp(model, policy)`, called as the model is (float outputs in
      `output_dtype`; `model.__wrapped__` is the model). A model that is not
      callable needs "fp32" and `amp` applied inside `loss`.
    - `loss_scale`: default the precision's `default_loss_scale()`
      (`DynamicLossScale()` if an `Amp` policy computes in float16), else
      `NoOpLossScale()`. `redo_on_nan` is passed to `lowtrain.scaled_value_and_grad`.
    - The optimizer is wrapped in `optax.apply_if_finite` (that is `self.optimizer`;
      on GPUs `lowtrain.train.apply_if_finite`, the same without a branch): a step
      whose gradients are not all finite leaves the model and the optimizer state
      bit for bit unchanged and counts in `state.skipped` (only the loss scale
      backs off).
    - `stop_on_nonfinite` (default: True exactly when the loss scale is a
      `NoOpLossScale`): `fit` raises `FloatingPointError` on a non-finite loss.
      Whatever it says, `fit` also raises `FloatingPointError` when a run stops
      training: `max_consecutive_skips` steps in a row skipped (default 20; None:
      no limit), a step skipped with a `DynamicLossScale` already at its
      `min_scale`, or a non-finite loss whose gradients were finite (the step was
      applied: the loss reads values its gradients do not, such as labels outside
      the classes).
    - `diverge_factor`, `diverge_patience`: `fit` also raises `FloatingPointError`
      when a run diverges to finite values: its (positive) loss above
      `diverge_factor` (default 1e4) times the best loss of the fit, and above its
      first, at `diverge_patience` (default 20) checked steps in a row, in any
      precision. `diverge_factor=None` turns it off.
    - `learning_rate`: a number or an Optax schedule, only for logging, when the
      optimizer is not built with `optax.inject_hyperparams` (whose state is read).
    - `numerics_every=N`: reports in `fit` (`self.numerics`, a `NumericsRecorder`).
    - `devices` (default `jax.devices()`, of all processes): a 1-D `Mesh` "data";
      each batch is split along its leading axis (which must divide by the number of
      devices), gradients averaged by XLA: a step computes the same as on one device.
    - `sharding`: "replicated" (default) or "fsdp": parameters and optimizer state
      split over "data" (`lowtrain.train.array_spec`), gathered by XLA where used.
    - `grad_accum=K`: the gradients of K micro-batches of each batch averaged in
      one step (`lax.scan`; the "Scaling out" guide).

    - `model_state`: the state of a stateful model (`eqx.nn.State`, from
      `eqx.nn.make_with_state`: BatchNorm, spectral norm), carried in
      `TrainState.model_state`, checkpointed and resumed with it; `loss` then takes
      it and returns its new value (see `loss`). A Flax NNX model needs none: what
      its calls change in place (BatchNorm's running statistics, a dropout RNG
      stream's count) is read off it after `loss` and kept in `state.model` where
      the step is applied, as `nnx.jit` writes it back; it is checkpointed with the
      model, so a resumed run continues the RNG stream. With `grad_accum=K` the K
      micro-batches start from the same state (and draw the same dropout masks):
      the floats they leave are averaged (as `model_state`'s), the rest taken from
      the last.

    Override points: `loss(self, model, batch, *, key)` (required) returns a float
    scalar, or `(loss, aux)`; `evaluate(self, model, batch)` returns a dict of scalar
    metrics (default: the loss and the scalars of a dict `aux`, with `key=None`);
    `train_step(self, state, batch)` returns `(new_state, metrics)` for full control.
    Callbacks and loggers: `fit(callbacks=..., loggers=...)`; hooks: `add_hook(fn,
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
    trainer = Regression(model, optax.adam(0.1), precision="fp16")
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
        precision: Precision | Sequence[Precision] | Policy | str | None = None,
        loss_scale: _LossScale | None = None,
        redo_on_nan: int = 0,
        stop_on_nonfinite: bool | None = None,
        learning_rate: Callable[[Any], Any] | float | None = None,
        devices: Sequence[jax.Device] | None = None,
        sharding: str = "replicated",
        grad_accum: int = 1,
        numerics_every: int | None = None,
        max_consecutive_skips: int | None = 20,
        model_state: PyTree = None,
        diverge_factor: float | None = 1e4,
        diverge_patience: int = 20,
    ):
        check_trainer_args(type(self), type(self).loss is Trainer.loss, optimizer)
        self.precision = resolve(precision)
        if loss_scale is None:
            loss_scale = self.precision.default_loss_scale() or NoOpLossScale()
        if not isinstance(loss_scale, _LossScale):
            raise TypeError(
                "Expected a loss scale such as `lowtrain.DynamicLossScale()`, got "
                f"{type(loss_scale).__name__} instead."
            )
        self.model = model
        self.model_state = check_model_state(model_state)
        # A Flax NNX model's state changed in place (BatchNorm statistics, RNG
        # counts) is read after the loss and kept where the step is applied.
        self._inplace = has_inplace_state(model)
        self._stateful = self._inplace or self.model_state is not None
        self.loss_scale = loss_scale
        self.redo_on_nan, self.grad_accum = check_counts(redo_on_nan, grad_accum)
        if stop_on_nonfinite is None:
            stop_on_nonfinite = isinstance(loss_scale, NoOpLossScale)
        self.stop_on_nonfinite = bool(stop_on_nonfinite)
        self.max_consecutive_skips = positive_int(
            max_consecutive_skips, "max_consecutive_skips"
        )
        self._divergence = DivergenceCheck(diverge_factor, diverge_patience)
        self.learning_rate = learning_rate
        self.devices, self.mesh, self.sharding = data_mesh(devices, sharding)
        self.optimizer = skip_nonfinite(optimizer, self.devices)
        self.hooks: list[Hook] = []
        self.numerics = NumericsRecorder(numerics_every)
        self.history: list[dict] = []  # the records the last `fit` logged
        self.fit_plan: FitPlan | None = None  # the `fit` in progress

    # -- override points ---------------------------------------------------------

    def loss(self, model: PyTree, batch: PyTree, *, key: PRNGKeyArray | None) -> Any:
        """The loss of `model` on `batch`: a float scalar, or `(loss, aux)`.

        `model` is `self.precision.wrap_model(state.model)` (see the class
        docstring). `key` is this step's PRNG key (`jax.random.fold_in(state.key,
        state.step)`), or None from the default `evaluate`: use `key is None` to turn
        dropout off. A dict `aux` of scalars is logged next to the loss.

        With a `model_state`, the signature is `loss(self, model, batch, *, key,
        state)` and it returns `(loss, new_state)` or `(loss, aux, new_state)`: the
        new state is kept where the step is applied (a skipped step keeps the old
        one), in the old state's dtypes. With `grad_accum=K`, the float leaves of
        the new state are averaged over the K micro-batches (BatchNorm's running
        statistics: the mean of the K updates), the others taken from the last.
        """
        raise NotImplementedError

    def evaluate(self, model: PyTree, batch: PyTree, **state) -> dict[str, Array]:
        """Metrics of `model` on one eval batch: a dict of scalars (traced, jitted).

        `run_evaluation` averages each over the eval batches, weighted by each
        batch's number of examples. `model` is in inference mode
        (`eqx.nn.inference_mode`: BatchNorm uses its running statistics, Dropout is
        off). The default is `{"loss": loss, **aux}` (the scalars of a dict `aux`)
        from `self.loss(model, batch, key=None)`. With a `model_state` it is also
        passed, as `state=` (a subclass's `evaluate(self, model, batch, *, state)`).
        """
        loss, aux, _ = split_loss(self.loss(model, batch, key=None, **state), state)
        metrics = {"loss": loss}
        if isinstance(aux, dict):
            for name, value in aux.items():
                if jnp.ndim(value) == 0 and str(name) not in metrics:
                    metrics[str(name)] = value
        return metrics

    def train_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        """One step: returns the new state and metrics (traced once, under `jit`).

        The metrics are `loss` (f32), `aux`, `grad_norm` (f32) and `grads_finite`.
        The precision's hooks run in the order `Precision` lists them.
        """
        p = self.precision
        ((loss, aux), grads, extra), loss_scale, finite = self.loss_and_grads(
            state, batch
        )
        model_state, inplace = state.model_state, None
        if self._stateful:
            aux, new, inplace = aux
        if self.model_state is not None:
            model_state = jax.tree.map(
                lambda n, o: jnp.where(finite, n.astype(o.dtype), o),
                new,
                model_state,
            )
        params = eqx.filter(state.model, eqx.is_inexact_array)
        updates, opt_state = self.optimizer.update(
            p.to_optimizer(grads), state.opt_state, p.to_optimizer(params)
        )
        updates = p.from_optimizer(updates, params)
        # apply_if_finite adds zero updates on a skipped step; `where` also keeps the
        # bits (p + 0.0 would turn -0.0 into +0.0).
        model = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old) if eqx.is_array(new) else new,
            eqx.apply_updates(state.model, updates),
            state.model,
        )
        model = p.merge(model, extra)
        if inplace is not None:
            model = keep_inplace_state(model, inplace, state.model, finite)
        new_state = TrainState(
            state.step + 1, model, opt_state, loss_scale, state.key, model_state
        )
        metrics = {
            "loss": loss,
            "aux": aux,
            "grad_norm": global_norm(grads),
            "grads_finite": finite,
            # What `fit` checks one step late, in one transfer: the loss, whether
            # the step was applied, the skips in a row, and whether it was skipped
            # with the loss scale at its floor (backing off can no longer help).
            "health": (
                loss,
                finite,
                _skips_in_a_row(opt_state),
                state.loss_scale.at_floor(),
            ),
        }
        return constrain_state(self.mesh, self.sharding, new_state), metrics

    # -- hooks -------------------------------------------------------------------

    def add_hook(self, fn: Callable[[StepInfo], Any], every: int = 1) -> None:
        """Call `fn(info)` with a `lowtrain.StepInfo` after each step where
        `info.step % every == 0`, during `fit`. Hooks run in the order added."""
        if not callable(fn):
            raise TypeError(f"Expected a callable hook, got {fn!r} instead.")
        self.hooks.append(Hook(fn, positive_int(every, "every", optional=False)))

    def _check_health(self, step: int, health, min_scale) -> None:
        # `health` of the update from `state.step == step` (see `train_step`).
        loss, applied, in_a_row, at_floor = jax.device_get(health)
        loss, applied, in_a_row = float(loss), bool(applied), int(in_a_row)
        if not math.isfinite(loss) and (applied or self.stop_on_nonfinite):
            check_loss(step, loss, applied)
        if at_floor and not applied:
            raise FloatingPointError(
                f"Train step {step + 1} was skipped with the loss scale at its "
                f"minimum ({min_scale:g}): its gradients are not finite "
                "even unscaled, and backing off cannot help. The run diverged or the "
                "batch holds inf/NaN. Lower the learning rate, check batch "
                f"`data({step})`, or train in bf16 (float32's range)."
            )
        self._divergence.update(step, loss)
        limit = self.max_consecutive_skips
        if limit is not None and in_a_row >= limit:
            raise FloatingPointError(
                f"{in_a_row} train steps in a row were skipped (non-finite "
                f"gradients), up to step {step + 1}: the run is not training. "
                "Lower the learning rate, check the data for inf/NaN, start the loss "
                "scale lower, or train in bf16; `max_consecutive_skips` "
                f"(now {limit}) sets this limit."
            )

    # -- state, placement, compiled steps ----------------------------------------

    def init(self, *, key: PRNGKeyArray) -> TrainState:
        """A fresh `TrainState` (step 0) for `self.model`, placed as `sharding` says.

        Parameters are cast (`precision.cast_params`, a copy: the constructor's model
        is never donated), the optimizer state initialised on them as the optimizer
        sees them (`to_optimizer`), and both stored as the precision carries them.
        """
        p = self.precision
        model = p.cast_params(self.model)
        params = eqx.filter(model, eqx.is_inexact_array)
        opt_state = self.optimizer.init(p.to_optimizer(params))
        model, opt_state = p.store(model, opt_state)
        state = TrainState(
            jnp.zeros((), jnp.int32),
            model,
            opt_state,
            self.loss_scale,
            key,
            self.model_state,
        )
        return put_state(self.mesh, self.sharding, state)

    def shard_batch(self, batch: PyTree) -> PyTree:
        """Place `batch` on the devices, split along its leading axis.

        In a multi-process run each process passes its own part of the global batch
        (`jax.make_array_from_process_local_data`).
        """
        return shard_batch(self.devices, self.mesh, batch)

    def loss_and_grads(self, state: TrainState, batch: PyTree):
        """`train_step` up to the gradients (traced, as `train_step` is): returns
        `((loss, aux), grads, extra), new_loss_scale, finite` of the step's loss on
        `batch`, with gradient accumulation, FSDP's gather, loss scaling and redo
        as configured (`extra`: what the precision splits off the gradients; with a
        `model_state` or a Flax NNX model with state, `aux` is `(aux,
        new_model_state, new_nnx_state)`). What `numerics_every` reports on."""
        loss = functools.partial(self._loss_with_aux, model_state=state.model_state)
        value_and_grad = accumulated_value_and_grad(
            loss,
            self.precision,
            grad_accum=self.grad_accum,
            redo_on_nan=self.redo_on_nan,
            mesh=self.mesh,
            sharding=self.sharding,
        )
        key = jax.random.fold_in(state.key, state.step)
        batch = self.precision.inputs(batch)
        return value_and_grad(state.loss_scale, state.model, batch, key=key)

    def _loss_with_aux(self, model, batch, *, key, model_state=None):
        state = {} if self.model_state is None else {"state": model_state}
        out = self.loss(self.precision.wrap_model(model), batch, key=key, **state)
        if not self._stateful:
            return out if isinstance(out, tuple) else (out, None)
        loss, aux, new = split_loss(out, state)
        # A Flax NNX model's calls have set its new state on `model` itself.
        inplace = read_inplace_state(model) if self._inplace else None
        return loss, (aux, new, inplace)

    @functools.cached_property
    def _numerics_step(self) -> Callable:
        # The step's own loss and gradients, as its precision runs them, for a
        # `NumericsRecorder` to track: `(batch, state) -> (grads, {"loss": loss})`.
        def loss_and_grads(batch, state):
            ((loss, _), grads, _), _, _ = self.loss_and_grads(state, batch)
            return grads, {"loss": loss}

        return self.precision.wrap_step(loss_and_grads)

    @functools.cached_property
    def compiled_step(self) -> Callable:
        """`train_step` under the precision's `wrap_step`, compiled once by
        `lowtrain.train.async_filter_jit` (it returns as soon as the step is queued),
        called as `compiled_step(batch, state)`; the arrays of `state` are donated."""
        step = self.precision.wrap_step(lambda batch, s: self.train_step(s, batch))
        return async_filter_jit(step, donate="all-except-first")

    @functools.cached_property
    def _compiled_eval(self) -> Callable:
        def run(model, batch, model_state):
            p = self.precision
            model = p.wrap_model(eqx.nn.inference_mode(model))
            state = {} if self.model_state is None else {"state": model_state}
            return None, self.evaluate(model, p.inputs(batch), **state)

        return eqx.filter_jit(self.precision.wrap_step(run))

    def run_evaluation(self, state: TrainState, data: Iterable[PyTree]) -> dict:
        """The mean of each `evaluate` metric over the batches of `data`, as floats,
        weighted by each batch's number of examples (its leading axis), so a last
        partial batch counts as much as its examples.

        `data` is iterated once (an `ArrayBatches` gives one epoch in order, its
        last partial batch included). A batch that does not divide over the
        devices (a last partial one) is evaluated whole on each of them.
        """

        def evaluate(batch):
            placed = self._eval_batch(batch)
            return self._compiled_eval(state.model, placed, state.model_state)[1]

        return mean_metrics(evaluate, data)

    def _eval_batch(self, batch: PyTree) -> PyTree:
        local = [d for d in self.devices if d.process_index == jax.process_index()]
        sizes = {np.shape(x)[0] if np.ndim(x) else 0 for x in jax.tree.leaves(batch)}
        if jax.process_count() == 1 and any(n % len(local) for n in sizes):
            replicated = jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec()
            )
            return jax.device_put(batch, replicated)
        return self.shard_batch(batch)

    # -- the loop ----------------------------------------------------------------

    def fit(
        self,
        state: TrainState,
        data: Callable[[int], PyTree],
        *,
        steps: int | None = None,
        epochs: int | None = None,
        eval_data: Iterable[PyTree] | None = None,
        eval_every: int | None = None,
        log_every: int = 50,
        metrics_file=None,
        checkpoint_dir=None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        resume: bool | str = False,
        async_checkpoint: bool = False,
        progress: bool = True,
        checkpoint_extra: dict | None = None,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Logger] = (),
        checkpoint_every_minutes: float | None = None,
        stop_signals: Sequence[str | int] | None = DEFAULT_STOP_SIGNALS,
    ) -> TrainState:
        """Train from `state` until `state.step == steps`, and return the new state.

        Nothing is done if `state.step >= steps` already (after `resume`, say).

        - `data(step) -> batch` gives the batch of each step (a function of the step,
          so a resumed run sees the same batches; `lowtrain.ArrayBatches` is one,
          `lowtrain.train.from_iterable` and `from_grain` make one of an iterator
          or a grain dataset). With `epochs=E` instead of `steps`,
          `steps = E * data.steps_per_epoch`.
        - `state` is consumed: its buffers are donated to the compiled step.
        - Every `log_every` steps, at steps that evaluate and at the last step: the
          progress bar (tqdm, on stderr; `progress=False` turns it off) shows the
          loss and loss scale, and a record goes to each of `loggers`
          (`lowtrain.train.Logger`s, on process 0 only) and to `self.history`
          (the records of this `fit`): the fields of `lowtrain.StepInfo` (`step`,
          `loss`, `loss_scale`, `skipped`, ...), the scalars of a dict `aux`, and
          `eval_<name>` when it evaluated. `metrics_file` adds a
          `lowtrain.train.JsonlLogger` writing there.
        - Every `eval_every` steps and at the last step, if `eval_data` (an
          iterable of batches, iterated once each time) is given: `run_evaluation`.
        - Every `checkpoint_every` steps and at the last step, if `checkpoint_dir`
          is given: the `TrainState` is saved (orbax, each process its shards) to
          `checkpoint_dir/ckpt_<step>` with `checkpoint_extra` (JSON data, read by
          `lowtrain.checkpoint_extra`), read back and checked against its
          checksums, keeping the newest `keep_checkpoints` that passed;
          `async_checkpoint=True`: written in the background after the copy to host
          (and checked at the next save or the end). `data` with a
          `get_state()` / `set_state(s)` pair (as `from_iterable` and `from_grain`
          give) has its position saved with each checkpoint and restored on resume.
        - `resume=True` loads the newest checkpoint in `checkpoint_dir` that passes
          its checks into `state`'s structure and shardings (a damaged one is set
          aside with a warning and the one before tried; a mismatched one is
          refused), logs "resumed from step N (path)" on the `lowtrain` logger,
          and goes on from its step exactly: same batches, keys and loss scale.
          Without a checkpoint there it is an error; `resume="auto"` starts anew
          then. Without `resume`, a `checkpoint_dir` that already holds checkpoints
          is an error. A resumed run's `metrics_file` is made one row per step: the
          rows after the checkpoint's step (written before a crash) move to
          `<metrics_file>.replaced`.
        - `callbacks` (`lowtrain.train.Callback`s) and the hooks of `add_hook` run
          after the step's log and save, in the order the `Callback` docstring
          lists; one may stop the run (`info.stop()` or `StopTraining`): that
          step is saved and `fit` returns.
        - `checkpoint_every_minutes`: also save when that many minutes have passed
          since the last save (or the start), checked after every step (in a
          multi-process run, at the steps that log), so a hard kill loses bounded
          time whatever the step time.
        - `stop_signals` (default SIGTERM and SIGINT; add "SIGUSR1" for SLURM's
          notice before a requeue; None: none): on the first, the step in flight
          finishes, is logged and saved (synchronously: pending asynchronous saves
          completed, loggers flushed), and `fit` raises `lowtrain.train.Preempted`
          (the step, the path, the signal; `exit_code` 128 + its number). A second
          one acts at once, as without the watch. `resume=True` continues exactly.
          In a multi-process run the processes agree at the next step that logs:
          any one signalled stops them all at the same step.
        - A run that stops training raises `FloatingPointError` (see `Trainer`:
          `stop_on_nonfinite`, `max_consecutive_skips`). It is checked one step
          late, so the device never waits for it, except at steps that log,
          evaluate, run hooks or write a checkpoint, where it is checked first.
        """
        plan = plan_fit(
            state,
            data,
            steps=steps,
            epochs=epochs,
            eval_data=eval_data,
            eval_every=eval_every,
            log_every=log_every,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            resume=resume,
            checkpoint_every_minutes=checkpoint_every_minutes,
        )
        watch = SignalWatch(check_stop_signals(stop_signals))
        callbacks = check_callbacks(callbacks)
        loggers = check_loggers(loggers)
        is_main = jax.process_index() == 0
        # One run per checkpoint folder (process 0 holds it for the run's processes).
        lock = RunLock(plan.checkpoint_dir) if plan.checkpoint_dir and is_main else None
        if lock is not None:
            lock.acquire()
        try:
            state, saver, resumed = resume_or_check_empty(
                state, plan, resume, async_checkpoint
            )
            restore_data_position(data, resumed)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        start = int(state.step)
        if metrics_file and is_main:
            from ._loggers import JsonlLogger

            loggers = [JsonlLogger(metrics_file, after_step=start), *loggers]
        if not is_main:
            loggers = []
        self.history, self.fit_plan = [], plan
        step_callbacks = [c for c in callbacks if overrides(c, "on_step_end")]
        bar = tqdm(
            total=plan.total,
            initial=min(start, plan.total),
            disable=not (progress and is_main),  # one bar per run, not per process
            unit="step",
        )
        clock = (start, time.perf_counter())  # (step, time) the throughput window began
        pending = None  # (step, loss) not yet checked by stop_on_nonfinite
        extra = lambda: with_data_position(checkpoint_extra, data)
        single = jax.process_count() == 1
        last_save, saved, signum = time.monotonic(), None, None
        try:
            watch.install()
            self._divergence.reset()
            for c in callbacks:
                c.on_fit_start(self, state)
            for s in range(start, plan.total):
                batch = data(s)
                if any(np.shape(x)[:1] == (0,) for x in jax.tree.leaves(batch)):
                    raise ValueError(
                        f"Expected a batch with at least one row from `data({s})`, "
                        "got 0 rows. Check the data source (a filter that removed "
                        "everything, a dataset smaller than one batch)."
                    )
                batch = step_batch(self.devices, self.mesh, batch)
                self.numerics.maybe_record(
                    self._numerics_step, state, batch, s, metrics_file
                )
                state, metrics = self.compiled_step(batch, state)
                done = s + 1
                bar.update(1)
                hooks = [h for h in self.hooks if done % h.every == 0]
                calls = [c for c in step_callbacks if done % c.every == 0]
                log_now, eval_now = plan.log_at(done), plan.eval_at(done)
                save_now = plan.save_at(done)
                sync = bool(hooks or calls) or log_now or eval_now or save_now
                # A stop signal, a save on time: looked at every step by one
                # process; agreed at the steps every process syncs at by many.
                due = plan.save_due(time.monotonic() - last_save)
                if single:
                    signum = watch.received
                elif sync:
                    signum, due = agree(watch.received, due)
                else:
                    due = False
                save_now = save_now or due or plan.can_save(signum is not None)
                log_now = log_now or signum is not None
                sync = sync or save_now or log_now
                if pending is not None:
                    self._check_health(*pending)
                floor = getattr(state.loss_scale, "min_scale", None)
                pending = (s, metrics["health"], floor)
                if sync:  # we wait for the device here anyway
                    self._check_health(*pending)
                    pending = None
                if not sync:
                    continue
                info = step_info(self, state, metrics, batch, clock, done)
                if eval_now:
                    results = self.run_evaluation(state, plan.eval_data)
                    info = dataclasses.replace(info, eval=results)
                if log_now or eval_now:
                    info = dataclasses.replace(info, record=record(info))
                    bar.set_postfix(
                        loss=f"{info.loss:.4g}", scale=f"{info.loss_scale:g}"
                    )
                    self.history.append(info.record)
                    for logger in loggers:
                        logger.log_metrics(info.record, done)
                if save_now:  # every process: each writes its shards
                    saved = self._save(saver, info, extra(), callbacks)
                    last_save = time.monotonic()
                if signum is not None:
                    break  # no callbacks: the run is being stopped from outside
                try:
                    if eval_now:
                        for c in callbacks:
                            c.on_eval_end(self, info)
                    for c in calls:
                        c.on_step_end(self, info)
                    for hook in hooks:
                        hook.fn(info)
                except StopTraining as e:
                    info.stop(str(e) or "StopTraining raised")
                if info.stopping:
                    log.info("stopping at step %d: %s", done, "; ".join(info._stop))
                    if plan.checkpoint_dir is not None and not save_now:
                        self._save(saver, info, extra(), callbacks)
                    break
                clock = (done, time.perf_counter())  # not counting logs, evals, saves
            if pending is not None:
                self._check_health(*pending)
            saver.close()  # waits for an asynchronous save and checks it
            if signum is not None:
                raise Preempted(signum, int(state.step), saved)
            for c in callbacks:
                c.on_fit_end(self, state)
        finally:
            watch.restore()
            bar.close()
            saver.close()
            for logger in loggers:
                flush = getattr(logger, "flush", None)
                if flush is not None:
                    flush()
            if metrics_file and is_main:
                loggers[0].close()  # the JsonlLogger made here
            self.fit_plan = None
            if lock is not None:
                lock.release()
        return state

    def _save(self, saver, info: StepInfo, extra, callbacks) -> pathlib.Path:
        path = saver.save(info.step, info.state, extra)
        for c in callbacks:
            c.on_checkpoint(self, info, path)
        return path


def check_trainer_args(cls: type, no_loss: bool, optimizer) -> None:
    """The `Trainer` constructor's checks of its class (`no_loss`: it does not
    define `loss`) and of its optimizer."""
    if no_loss:
        raise TypeError(
            f"Expected a subclass of `lowtrain.Trainer` that defines "
            f"`loss(self, model, batch, *, key)`, got {cls.__name__} "
            "without one instead. Subclass it: `class MyTrainer(lowtrain.Trainer)"
            ": def loss(self, model, batch, *, key): ...`."
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            "Expected an Optax optimizer such as `optax.adam(1e-3)`, got "
            f"{type(optimizer).__name__} instead."
        )


def check_loss(step: int, loss, applied: bool = False) -> None:
    value = float(loss)
    if math.isfinite(value):
        return
    where = (
        f"at train step {step + 1} (the update from `state.step == {step}`, on batch "
        f"`data({step})`)"
    )
    if applied:
        raise FloatingPointError(
            f"The loss is {value} {where}, but its gradients were finite, so the "
            "step was applied: the loss reads values its gradients do not, such as "
            "labels outside the number of classes (a gather out of range gives NaN) "
            "or a log of 0. Check the batch's labels and the loss."
        )
    raise FloatingPointError(
        f"The loss is {value} {where}. Expected a finite loss: without loss scaling "
        "this means the run diverged or the batch holds inf/NaN. Lower the learning "
        "rate, check that batch, train with a `lowtrain.DynamicLossScale`, or pass "
        "`stop_on_nonfinite=False` to the Trainer to skip such steps (non-finite "
        "gradients leave the model unchanged and count in `state.skipped`)."
    )


def _skips_in_a_row(opt_state) -> Array:
    # The Trainer's optimizer state is `optax.apply_if_finite`'s (or lowtrain's
    # select version of it): `notfinite_count` counts the skips in a row.
    return jnp.asarray(getattr(opt_state, "notfinite_count", 0), jnp.int32)


def _batch_size(batch: PyTree) -> int:
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves else 0


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """`Trainer.fit`'s arguments, checked: the last step and what happens when.

    `log_at(step)`, `eval_at(step)`, `save_at(step)` say whether `fit` logs,
    evaluates or writes a checkpoint after the step that makes `state.step == step`
    (always after the last one, when there is anything to do it with).
    """

    total: int
    log_every: int | None
    eval_every: int | None
    eval_data: Iterable[PyTree] | None
    checkpoint_every: int | None
    checkpoint_dir: pathlib.Path | None
    keep_checkpoints: int
    checkpoint_every_minutes: float | None = None

    def log_at(self, step: int) -> bool:
        return bool(self.log_every and step % self.log_every == 0) or step == self.total

    def eval_at(self, step: int) -> bool:
        if self.eval_data is None:
            return False
        every = bool(self.eval_every and step % self.eval_every == 0)
        return every or step == self.total

    def save_at(self, step: int) -> bool:
        if self.checkpoint_dir is None:
            return False
        every = bool(self.checkpoint_every and step % self.checkpoint_every == 0)
        return every or step == self.total

    def save_due(self, seconds_since_save: float) -> bool:
        """Whether `checkpoint_every_minutes` have passed since the last save."""
        minutes = self.checkpoint_every_minutes
        return self.can_save(bool(minutes) and seconds_since_save >= 60 * minutes)

    def can_save(self, wanted: bool) -> bool:
        return wanted and self.checkpoint_dir is not None


def plan_fit(
    state: Any,
    data: Any,
    *,
    steps,
    epochs,
    eval_data,
    eval_every,
    log_every,
    checkpoint_dir,
    checkpoint_every,
    keep_checkpoints,
    resume,
    checkpoint_every_minutes=None,
) -> FitPlan:
    """Check `Trainer.fit`'s arguments (see there) and return its `FitPlan`."""
    if not callable(data):
        raise TypeError(
            "Expected `data` to be a function of the step, `data(step) -> batch` "
            f"(e.g. `lowtrain.ArrayBatches`), got {type(data).__name__} instead. "
            "A function of the step lets a resumed run see the same batches."
        )
    if not isinstance(state, TrainState):
        raise TypeError(
            f"Expected a `lowtrain.TrainState` (from `trainer.init(key=...)`), got "
            f"{type(state).__name__} instead."
        )
    if (steps is None) == (epochs is None):
        raise ValueError(
            f"Expected exactly one of `steps` and `epochs`, got steps={steps!r} and "
            f"epochs={epochs!r} instead."
        )
    if epochs is not None:
        per_epoch = getattr(data, "steps_per_epoch", None)
        if per_epoch is None:
            raise ValueError(
                "Expected `data` with a `steps_per_epoch` attribute (such as "
                "`lowtrain.ArrayBatches`) to train for `epochs`, got "
                f"{type(data).__name__} instead. Pass `steps=` instead."
            )
        steps = positive_int(epochs, "epochs") * per_epoch
    total = positive_int(steps, "steps", optional=False)
    log_every = positive_int(log_every, "log_every")
    eval_every = positive_int(eval_every, "eval_every")
    checkpoint_every = positive_int(checkpoint_every, "checkpoint_every")
    keep_checkpoints = positive_int(keep_checkpoints, "keep_checkpoints")
    if eval_every and eval_data is None:
        raise ValueError("Expected `eval_data` with `eval_every`, got None instead.")
    if resume not in (True, False, "auto"):
        raise ValueError(
            f'Expected `resume` True, False or "auto", got {resume!r} instead.'
        )
    minutes = finite_number(
        checkpoint_every_minutes, "checkpoint_every_minutes", above=0
    )
    if (checkpoint_every or minutes or resume) and checkpoint_dir is None:
        raise ValueError(
            "Expected a `checkpoint_dir` with `checkpoint_every`, "
            "`checkpoint_every_minutes` or `resume`, got None instead."
        )
    return FitPlan(
        total=total,
        log_every=log_every,
        eval_every=eval_every,
        eval_data=eval_data,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=None if checkpoint_dir is None else pathlib.Path(checkpoint_dir),
        keep_checkpoints=keep_checkpoints,
        checkpoint_every_minutes=minutes,
    )


def resume_or_check_empty(
    state, plan: FitPlan, resume: bool | str, asynchronous: bool = False
) -> tuple[Any, Checkpoints, pathlib.Path | None]:
    """The state to start from: with `resume`, the newest checkpoint in
    `plan.checkpoint_dir` that passes its checks (none: an error, or `state` for
    `resume="auto"`), else `state`; a directory that holds checkpoints without
    `resume` is an error. And the `Checkpoints` that `fit` saves with (`close`
    it), and the path resumed from (or None)."""
    ckpt_dir = plan.checkpoint_dir
    saver = lambda: Checkpoints(ckpt_dir, plan.keep_checkpoints, asynchronous)
    if ckpt_dir is None:
        return state, saver(), None
    if resume:
        found = restore_latest(ckpt_dir, state)
        if found is not None:
            resumed, path = found
            log.info("resumed from step %d (%s)", int(resumed.step), path)
            return resumed, saver(), path
        if resume != "auto":
            raise ValueError(
                f"Expected a checkpoint to resume from in {ckpt_dir}, got none there. "
                "Check the run directory (a typo starts a new run), pass "
                '`resume="auto"` to start anew when there is none, or drop `resume`.'
            )
        return state, saver(), None
    if latest_checkpoint(ckpt_dir) is not None:
        raise ValueError(
            f"Expected an empty `checkpoint_dir` for a new run, got "
            f"{len(list_checkpoints(ckpt_dir))} checkpoints in {ckpt_dir} "
            "instead. Pass `resume=True` to continue that run, or use another "
            "directory."
        )
    return state, saver(), None


def step_info(trainer, state, metrics, batch, clock, done) -> StepInfo:
    """The `StepInfo` after step `done` (`clock`: the window's `(step, time)`)."""
    loss = float(metrics["loss"])  # waits for the step to finish
    elapsed = max(time.perf_counter() - clock[1], 1e-12)
    steps_per_second = (done - clock[0]) / elapsed
    skipped = int(state.skipped)
    if isinstance(state.loss_scale, NoOpLossScale):
        scale = 1.0
    else:
        scale = float(state.loss_scale.loss_scale)
    # Kept on the Trainer: the states of its optimizer share one structure.
    rates = vars(trainer).setdefault("_learning_rates", LearningRates())
    return StepInfo(
        step=done,
        state=state,
        loss=loss,
        aux=metrics["aux"],
        loss_scale=scale,
        skipped=skipped,
        grad_norm=float(metrics["grad_norm"]),
        learning_rate=rates(state.opt_state, trainer.learning_rate, done - skipped),
        steps_per_second=steps_per_second,
        examples_per_second=steps_per_second * _batch_size(batch),
    )


def record(info: StepInfo) -> dict:
    """The line of the metrics file for `info`."""
    record = {
        name: getattr(info, name)
        for name in (
            "step",
            "loss",
            "loss_scale",
            "skipped",
            "grad_norm",
            "learning_rate",
            "steps_per_second",
            "examples_per_second",
        )
    }
    if isinstance(info.aux, dict):  # scalar metrics returned next to the loss
        for name, value in info.aux.items():
            if np.ndim(value) == 0 and name not in record:
                record[str(name)] = float(value)
    for name, value in (info.eval or {}).items():
        record[f"eval_{name}"] = value
    return record


def mean_metrics(evaluate: Callable[[PyTree], dict], data: Iterable[PyTree]) -> dict:
    """The mean of each metric `evaluate(batch)` returns over the batches of `data`,
    each batch weighted by its number of examples (the leading axis of its first
    leaf; 1 for a batch without one)."""
    totals: dict[str, float] = {}
    count = 0
    for batch in data:
        metrics = evaluate(batch)
        if not isinstance(metrics, dict):
            raise TypeError(
                "Expected `evaluate` to return a dict of scalars such as "
                f"{{'loss': loss}}, got {type(metrics).__name__} instead."
            )
        weight = max(_batch_size(batch), 1)
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + weight * float(value)
        count += weight
    if not count:
        raise ValueError("Expected at least one batch in the eval data, got none.")
    return {name: total / count for name, total in totals.items()}


def split_loss(out, state: dict) -> tuple[Any, Any, Any]:
    """`(loss, aux, new_model_state)` of what `Trainer.loss` returned: `loss`,
    `(loss, aux)`, or with a model state (`state` not empty) `(loss, new_state)` or
    `(loss, aux, new_state)` (`new_state` None without one)."""
    if not state:
        if isinstance(out, tuple):
            if len(out) != 2:
                raise TypeError(
                    "Expected `loss` to return a scalar or `(loss, aux)`, got a "
                    f"tuple of {len(out)} instead. A stateful model passes "
                    "`model_state=` to the Trainer."
                )
            return out[0], out[1], None
        return out, None, None
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            "Expected `loss(model, batch, *, key, state)` of a Trainer with a "
            "`model_state` to return `(loss, new_state)` or `(loss, aux, "
            f"new_state)`, got {got} instead. Return the state the model gave back."
        )
    loss, *aux, new = out
    old = state["state"]
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            "Expected the state `loss` returns last to have the structure of the "
            f"model state passed in, got {jax.tree.structure(new)} instead of "
            f"{jax.tree.structure(old)}. Return the state the model gave back."
        )
    return loss, (aux[0] if aux else None), new


def check_model_state(model_state: PyTree) -> PyTree:
    if model_state is None:
        return None
    leaves = jax.tree.leaves(model_state)
    if not leaves or not all(eqx.is_array(x) for x in leaves):
        raise TypeError(
            "Expected `model_state` to be the state of a stateful model, a pytree of "
            "arrays such as `eqx.nn.State` (from `eqx.nn.make_with_state`), got "
            f"{type(model_state).__name__} with "
            f"{'no arrays' if not leaves else 'leaves that are not arrays'} instead."
        )
    return model_state


def check_loggers(loggers) -> list:
    loggers = list(loggers or ())
    for logger in loggers:
        if not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(
                "Expected each logger to have `log_metrics(metrics, step)` (a "
                "`lowtrain.train.Logger` such as `CSVLogger(path)`), got "
                f"{type(logger).__name__} instead."
            )
    return loggers
