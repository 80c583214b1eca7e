"""`Trainer`: the model's side of training, a plain class with a few override points
(`loss`, `evaluate`, `train_step`): its state, the compiled step, evaluation and
the precision it runs. `fit` checks its arguments into a `Schedule` and hands the
loop to a `FitRun` (`_loop.py`). Below it, the checks of what `loss` returns and of
a model state, and the weighted mean of eval metrics."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._amp import Policy
from .._loss_scale import AbstractLossScale, NoOpLossScale
from ._accumulate import accumulated_value_and_grad, check_counts
from ._callbacks import Callback
from ._finite import skip_nonfinite
from ._health import DivergenceCheck, skips_in_a_row
from ._hooks import Hook, StepInfo, positive_int
from ._jit import async_filter_jit
from ._loop import FitRun, batch_size, schedule_fit
from ._metrics import global_norm
from ._nnx import has_inplace_state, keep_inplace_state, read_inplace_state
from ._numerics import NumericsRecorder
from ._placement import constrain_state, data_mesh, put_state, shard_batch
from ._precisions import resolve
from ._preemption import DEFAULT_STOP_SIGNALS
from ._protocol import Precision
from ._state import TrainState

if TYPE_CHECKING:
    from ._loggers import Logger

log = logging.getLogger("lowtrain")


class Trainer:
    """Trains an Equinox model with an Optax optimizer; subclass it and define `loss`.

    **Arguments:**

    - `model`: the Equinox model (any pytree the loss takes); `optimizer`: an Optax
      `GradientTransformation`.
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
        loss_scale: AbstractLossScale | None = None,
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
        if not isinstance(loss_scale, AbstractLossScale):
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
        self.fit_run: FitRun | None = None  # the `fit` in progress

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
                skips_in_a_row(opt_state),
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

    # -- state, placement, compiled steps ----------------------------------------

    def init(self, *, key: PRNGKeyArray) -> TrainState:
        """A fresh `TrainState` (step 0) for `self.model`, placed as `sharding` says.

        Parameters are cast (`precision.cast_params`, a copy: the constructor's model
        is never donated), the optimizer state initialised on them as the optimizer
        sees them (`to_optimizer`), and both stored as the precision carries them.
        """
        state = self._fresh_state(self.precision, key)
        return put_state(self.mesh, self.sharding, state)

    def _fresh_state(self, precision: Precision, key) -> TrainState:
        model = precision.cast_params(self.model)
        params = eqx.filter(model, eqx.is_inexact_array)
        opt_state = self.optimizer.init(precision.to_optimizer(params))
        model, opt_state = precision.store(model, opt_state)
        step = jnp.zeros((), jnp.int32)
        return TrainState(
            step, model, opt_state, self.loss_scale, key, self.model_state
        )

    def use_precision(
        self,
        precision: Precision | Sequence[Precision] | Policy | str,
        state: TrainState | None = None,
    ) -> None:
        """Train with `precision` from now on, over the same state (during `fit`:
        from the next step; a callback may call it, as `Autopilot` does).

        The step, the evaluation and the numerics program are traced again for it
        (compiled once, at their next call); the state stays where it is, in
        memory. `state`, when given, is checked to have the structure, shapes and
        dtypes `precision` stores (a precision that stores the model differently,
        such as `DelayedFp8` added to a model without its layers, needs a new
        Trainer and state instead); without it, it is the next `fit` that finds
        out. The loss scale in the state is kept.

        ```python
        import equinox as eqx
        import jax
        import optax
        import lowtrain

        class Fit(lowtrain.Trainer):
            def loss(self, model, batch, *, key):
                return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

        class Bf16After(lowtrain.train.Callback):
            def on_step_end(self, trainer, info):
                if info.step == 2:
                    trainer.use_precision("bf16", info.state)

        trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
        data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
        state = trainer.fit(trainer.init(key=jax.random.key(1)), lambda s: data,
                            steps=4, callbacks=[Bf16After()], progress=False)
        amp = trainer.precision.parts[0]  # "bf16": Amp, then DelayedFp8
        assert amp.policy.compute_dtype == jax.numpy.bfloat16
        assert int(state.step) == 4
        ```
        """
        resolved = resolve(precision)
        if state is not None:
            expected = eqx.filter_eval_shape(self._fresh_state, resolved, state.key)
            mismatch = _structure_mismatch(state, expected)
            if mismatch:
                raise ValueError(
                    f"Expected a precision that stores the state as it is, got "
                    f"{type(resolved).__name__}, which stores it otherwise: "
                    f"{mismatch}. Build a new Trainer with it and start from "
                    "`trainer.init` (or a checkpoint of that precision) instead."
                )
        self.precision = resolved
        # Every program the Trainer (or a subclass) compiled for the old one.
        for cls in type(self).__mro__:
            for name, attr in vars(cls).items():
                if isinstance(attr, functools.cached_property):
                    self.__dict__.pop(name, None)

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
        # `NumericsRecorder` and the `Autopilot` to track: `(batch, state) ->
        # (grads, {"loss": loss})`.
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

        **Arguments:**

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
          after the step's log and save, in the order `lowtrain.train.FitRun`
          lists (`self.fit_run` is the run while it lasts); one may stop the run
          (`info.stop()` or `StopTraining`): that step is saved and `fit`
          returns, or change its precision (`use_precision`).
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
        schedule = schedule_fit(
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
        run = FitRun(
            self,
            data,
            schedule,
            callbacks=callbacks,
            loggers=loggers,
            metrics_file=metrics_file,
            checkpoint_extra=checkpoint_extra,
            resume=resume,
            async_checkpoint=async_checkpoint,
            progress=progress,
            stop_signals=stop_signals,
        )
        self.fit_run, self.history = run, run.history
        try:
            return run(state)
        finally:
            self.fit_run = None


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
        weight = max(batch_size(batch), 1)
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


def _structure_mismatch(state, expected) -> str:
    # What differs between `state` and the abstract `expected` (its structure, or
    # the first array whose shape or dtype does), or "" where nothing does.
    ours, tree = jax.tree_util.tree_flatten_with_path(state)
    want, want_tree = jax.tree.flatten(expected)
    if tree != want_tree:
        return "another pytree structure"
    for (path, a), b in zip(ours, want):
        if not isinstance(b, jax.ShapeDtypeStruct):
            continue
        if np.shape(a) != b.shape or jnp.result_type(a) != b.dtype:
            return (
                f"state{jax.tree_util.keystr(path)} is {jnp.result_type(a)}"
                f"{list(np.shape(a))}, expected {b.dtype}{list(b.shape)}"
            )
    return ""
