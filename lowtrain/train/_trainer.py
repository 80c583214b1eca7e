"""`Trainer`: the model's side of training, a plain class with a few override points
(`loss`, `evaluate`, `train_step`): its state, the compiled step, evaluation and
the precision it runs. The step's update is `_step.py`'s; `fit` checks its
arguments into a `Schedule` and hands the loop to a `FitRun` (`_loop.py`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._amp import Policy
from .._loss_scale import AbstractLossScale, NoOpLossScale
from ._accumulate import accumulated_value_and_grad, check_counts
from ._callbacks import Callback
from ._finite import skip_nonfinite
from ._health import DivergenceCheck
from ._hooks import Hook, StepInfo, positive_int
from ._jit import async_filter_jit
from ._layer import check_remat
from ._loop import FitRun, schedule_fit
from ._metrics import mean_metrics
from ._named import resolve, resolve_loss_scale
from ._nnx import has_inplace_state, read_inplace_state
from ._numerics import NumericsRecorder
from ._placement import eval_batch, make_layout, shard_batch
from ._precisions import check_stored_alike
from ._preemption import DEFAULT_STOP_SIGNALS
from ._protocol import Precision
from ._state import TrainState, check_model_state
from ._step import apply_update, split_loss, step_metrics

if TYPE_CHECKING:
    from ._loggers import Logger

log = logging.getLogger("lowtrain")


class Trainer:
    """Trains an Equinox model with an Optax optimizer; subclass it and define `loss`.

    Override `loss(self, model, batch, *, key)` (required), and if you like
    `evaluate` and `train_step`; `fit` runs the loop. The step is traced once,
    reading the attributes set here: to change them, build a new Trainer (only the
    precision can change during a run: `use_precision`).

    **Arguments:**

    - `model`: the Equinox model (any pytree `loss` takes).
    - `optimizer`: an Optax `GradientTransformation`, wrapped in
      `optax.apply_if_finite` (`self.optimizer`; on GPUs
      `lowtrain.train.apply_if_finite`, the same without a branch): a step whose
      gradients are not all finite leaves the model and the optimizer state bit for
      bit unchanged and counts in `state.skipped`; only the loss scale backs off.
    - `precision`: a `lowtrain.train.Precision` (`Amp`, `Scalify`, `DelayedFp8`,
      `Rewrite`, your own), or a list of them (their `Chain`), or a policy: a
      `lowtrain.Policy` or its name ("fp32", the default, "bf16", "fp16", "fp8",
      "fp8_delayed", ...; `lowtrain.train.precision_names()` lists them), which
      means `[Amp(policy), DelayedFp8()]`. Under a policy other than "fp32",
      parameters are stored in `param_dtype` and `loss` and `evaluate` receive
      `lowtrain.amp(model, policy)`, called as the model is (`model.__wrapped__`
      is the model); a model that is not callable needs "fp32" and `amp` inside
      `loss`.
    - `loss_scale`: an `AbstractLossScale`; default the precision's
      `default_loss_scale()` (`DynamicLossScale()` where an `Amp` policy computes
      in float16), else `NoOpLossScale()`.
    - `redo_on_nan`: redone attempts of a step whose gradients are not finite
      (`lowtrain.scaled_value_and_grad`); default 0.
    - `stop_on_nonfinite`: `fit` raises `FloatingPointError` on a non-finite loss
      (default: exactly when the loss scale is a `NoOpLossScale`).
    - `learning_rate`: a number or an Optax schedule, for logging only, when the
      optimizer is not built with `optax.inject_hyperparams` (whose state is read).
    - `devices`: the devices to train on (default `jax.devices()`, of every
      process): each batch is split along its leading axis, which must divide by
      their number (by the data axes' devices on a `mesh`), and the gradients
      averaged by XLA.
    - `mesh`: the devices as a mesh with named axes, a dict of sizes such as
      `{"data": 2, "fsdp": 2, "tensor": 2}` (one size may be -1: the devices
      left) or a `jax.sharding.Mesh` of those axis names; default one axis
      "data". "data" and "fsdp" split the batch; "fsdp" also splits the state;
      "tensor" splits the arrays `axis_names` names (tensor parallelism), its
      devices seeing the same batch. `Trainer.layout` holds the result.
    - `sharding`: "replicated" or "fsdp": parameters and optimizer state split
      over the mesh's "fsdp" axis (or "data" on a mesh without one), gathered
      where used: a layer at a time where the model calls
      `lowtrain.train.gather_layer`, else the whole model before the loss.
      Default: "fsdp" on a mesh with an "fsdp" axis, else "replicated".
    - `axis_names`: the logical axis names of the model's arrays: a dict (or
      pairs) from a regular expression searched in an array's path (such as
      `r"qkv\\.kernel$"`, which also matches its optimizer moments) to the names
      of its last dimensions (`("embed", "heads")`). The arrays they match are
      split as `axis_rules` say; the others by the shape rule of
      `lowtrain.train.array_spec`. Needed for a "tensor" axis.
    - `axis_rules`: a dict from logical axis names to mesh axes (a name, a tuple
      of names, or None: whole), over the defaults `lowtrain.train.AXIS_RULES`
      ("embed" over "fsdp"; "heads", "mlp" and "vocab" over "tensor";
      "batch" over "data" and "fsdp").
    - `remat`: what the backward pass of a layer under
      `lowtrain.train.remat_layer` recomputes instead of saving: "none" (the
      default), "dots" (all but the matmuls' outputs) or "full" (all but the
      layer's inputs).
    - `grad_accum`: the gradients of that many micro-batches of each batch averaged
      in one step (a `lax.scan`); default 1.
    - `numerics_every`: `fit` records the casts' numerics every that many steps
      (`self.numerics`, a `lowtrain.train.NumericsRecorder`); default None: never.
    - `max_consecutive_skips`: `fit` raises `FloatingPointError` after that many
      skipped steps in a row (default 20; None: no limit). It also raises on a step
      skipped with a `DynamicLossScale` at its `min_scale`, and on a non-finite
      loss whose gradients were finite (such as labels outside the classes).
    - `model_state`: the state of a stateful Equinox model (`eqx.nn.State`, from
      `eqx.nn.make_with_state`), carried in `TrainState.model_state`; `loss` then
      takes it and returns its new value (see `loss`). A Flax NNX model needs none:
      what its calls change in place (BatchNorm statistics, RNG counts) is kept in
      `state.model` where the step is applied, as `nnx.jit` writes it back.
    - `diverge_factor`, `diverge_patience`: `fit` raises `FloatingPointError` when
      the (positive) loss stays above `diverge_factor` (default 1e4) times the best
      of the fit, and above its first, for `diverge_patience` (default 20) checked
      steps in a row. `diverge_factor=None` turns it off.

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
        mesh: Mapping[str, int] | Mesh | None = None,
        sharding: str | None = None,
        axis_names: Mapping[str, Sequence[str | None]] | None = None,
        axis_rules: Mapping[str, str | Sequence[str] | None] | None = None,
        remat: str = "none",
        grad_accum: int = 1,
        numerics_every: int | None = None,
        max_consecutive_skips: int | None = 20,
        model_state: PyTree = None,
        diverge_factor: float | None = 1e4,
        diverge_patience: int = 20,
    ):
        check_trainer_args(type(self), type(self).loss is Trainer.loss, optimizer)
        self.precision = resolve(precision)
        self.loss_scale = loss_scale = resolve_loss_scale(self.precision, loss_scale)
        self.model = model
        self.model_state = check_model_state(model_state)
        # A Flax NNX model's state changed in place (BatchNorm statistics, RNG
        # counts) is read after the loss and kept where the step is applied.
        self._inplace = has_inplace_state(model)
        self._stateful = self._inplace or self.model_state is not None
        self.redo_on_nan, self.grad_accum = check_counts(redo_on_nan, grad_accum)
        if stop_on_nonfinite is None:
            stop_on_nonfinite = isinstance(loss_scale, NoOpLossScale)
        self.stop_on_nonfinite = bool(stop_on_nonfinite)
        self.max_consecutive_skips = positive_int(
            max_consecutive_skips, "max_consecutive_skips"
        )
        self._divergence = DivergenceCheck(diverge_factor, diverge_patience)
        self.learning_rate = learning_rate
        self.devices, self.layout = make_layout(
            devices, mesh, sharding, axis_names, axis_rules
        )
        self.mesh: Mesh = self.layout.mesh
        self.sharding: str = self.layout.sharding
        self.remat = check_remat(remat)
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
        """Metrics of `model` on one eval batch `batch`: a dict of scalars (traced,
        jitted).

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
        """One step from `state` on `batch`: returns the new state and metrics
        (traced once, under `jit`).

        The metrics are `loss` (f32), `aux`, `grad_norm` (f32) and `grads_finite`.
        The precision's hooks run in the order `Precision` lists them.
        """
        ((loss, aux), grads, extra), loss_scale, finite = self.loss_and_grads(
            state, batch
        )
        aux, model_state, inplace = aux if self._stateful else (aux, None, None)
        new = apply_update(
            self.optimizer,
            self.precision,
            state,
            grads,
            extra,
            loss_scale,
            finite,
            model_state=model_state,
            inplace=inplace,
        )
        metrics = step_metrics(loss, aux, grads, finite, state, new)
        return self.layout.constrain(new), metrics

    # -- hooks -------------------------------------------------------------------

    def add_hook(self, fn: Callable[[StepInfo], Any], every: int = 1) -> None:
        """Call `fn(info)` with a `lowtrain.StepInfo` during `fit`, after each step
        that `every` (a positive int, default 1) divides. Hooks run in the order
        added."""
        if not callable(fn):
            raise TypeError(f"Expected a callable hook, got {fn!r} instead.")
        self.hooks.append(Hook(fn, positive_int(every, "every", optional=False)))

    # -- state, placement, compiled steps ----------------------------------------

    def init(self, *, key: PRNGKeyArray) -> TrainState:
        """A fresh `TrainState` (step 0) for `self.model`, with `key` as its base
        PRNG key, placed as `sharding` says.

        Parameters are cast (`precision.cast_params`, a copy: the constructor's model
        is never donated), the optimizer state initialised on them as the optimizer
        sees them (`to_optimizer`), and both stored as the precision carries them.
        """
        state = self._fresh_state(self.precision, key)
        return self.layout.put(state)

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
        from the next step; a callback may call it, as `lowtrain.train.Autopilot`
        does; the Trainer guide has an example).

        The step, the evaluation and the numerics program are traced again for it
        (compiled once, at their next call); the state, its loss scale included,
        stays where it is, in memory.

        **Arguments:**

        - `precision`: what `Trainer` takes as `precision`.
        - `state`: when given, checked to have the structure, shapes and dtypes
          `precision` stores: one that stores the model differently (such as
          `DelayedFp8` added to a model without its layers) is refused, naming
          what differs, and needs a new Trainer and state. Without it, the next
          `fit` finds out.
        """
        resolved = resolve(precision)
        if state is not None:
            expected = eqx.filter_eval_shape(self._fresh_state, resolved, state.key)
            check_stored_alike(resolved, state, expected)
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
        return shard_batch(self.layout, batch)

    def loss_and_grads(self, state: TrainState, batch: PyTree):
        """`train_step` up to the gradients (traced, as `train_step` is): returns
        `((loss, aux), grads, extra), new_loss_scale, finite` of the step's loss
        from `state` on `batch`, with gradient accumulation, FSDP's gather, loss
        scaling and redo as configured (`extra`: what the precision splits off the
        gradients; with a `model_state` or a Flax NNX model with state, `aux` is
        `(aux, new_model_state, new_nnx_state)`). What `numerics_every` reports
        on."""
        loss = functools.partial(self._loss_with_aux, model_state=state.model_state)
        value_and_grad = accumulated_value_and_grad(
            loss,
            self.precision,
            grad_accum=self.grad_accum,
            redo_on_nan=self.redo_on_nan,
            layout=self.layout,
            remat=self.remat,
            # A Flax NNX model changes in place: not traced twice.
            layered=not self._inplace,
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
        """The mean of each `evaluate` metric of the model of `state` over the
        batches of `data`, as floats,
        weighted by each batch's number of examples (its leading axis), so a last
        partial batch counts as much as its examples.

        `data` is iterated once (an `ArrayBatches` gives one epoch in order, its
        last partial batch included). A batch that does not divide over the
        devices (a last partial one) is evaluated whole on each of them.
        """

        def evaluate(batch):
            placed = eval_batch(self.layout, batch)
            return self._compiled_eval(state.model, placed, state.model_state)[1]

        return mean_metrics(evaluate, data)

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
        """Train from `state` until `state.step == steps`; return the new state.

        Nothing is done if `state.step >= steps` already (after `resume`, say). What
        a run does at each step, in which order, is `lowtrain.train.FitRun`'s
        (`self.fit_run` while it runs); `self.history` is the records it logged.

        **Arguments:**

        - `state`: the `TrainState` to start from; consumed (its buffers are donated
          to the compiled step).
        - `data`: `data(step) -> batch`, the batch of each step, so a resumed run
          sees the same batches (`lowtrain.ArrayBatches` is one;
          `lowtrain.train.from_iterable` and `from_grain` make one). With a
          `get_state()` / `set_state(s)` pair its position is checkpointed too.
        - `steps`: the step to train to; or `epochs`: `epochs *
          data.steps_per_epoch` steps.
        - `eval_data`, `eval_every`: an iterable of batches, iterated once by
          `run_evaluation` every `eval_every` steps and at the last.
        - `log_every`: a record (the fields of `lowtrain.StepInfo`, the scalars of
          a dict `aux`, `eval_<name>`) to each logger, the progress bar and
          `self.history` every that many steps (default 50), at steps that evaluate
          and at the last.
        - `metrics_file`: a path; adds a `lowtrain.train.JsonlLogger` writing there.
        - `loggers`: `lowtrain.train.Logger`s (on process 0 only).
        - `checkpoint_dir`, `checkpoint_every`, `checkpoint_every_minutes`: save a
          verified checkpoint there (`ckpt_<step>`) every that many steps, or
          minutes since the last save, and at the last step.
        - `keep_checkpoints`: how many of the newest verified checkpoints stay
          (default 3).
        - `resume`: True: continue exactly from the newest checkpoint in
          `checkpoint_dir` that passes its checks (an error without one); "auto":
          the same, or start anew without one; False (default): a folder that
          holds checkpoints is an error.
        - `async_checkpoint`: write checkpoints in the background after the copy to
          host (checked at the next save or the end).
        - `progress`: show a tqdm progress bar on stderr (default True).
        - `checkpoint_extra`: JSON data saved with each checkpoint
          (`lowtrain.checkpoint_extra` reads it).
        - `callbacks`: `lowtrain.train.Callback`s: they may stop the run
          (`info.stop()`, `StopTraining`) or change its precision
          (`use_precision`).
        - `stop_signals`: on the first of these (default SIGTERM and SIGINT; None:
          none), the step in flight finishes and is saved, and `fit` raises
          `lowtrain.train.Preempted`; `resume=True` continues exactly.

        A run that stops training raises `FloatingPointError` (see `Trainer`).
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
