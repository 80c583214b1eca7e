"""`FitRun`: one `Trainer.fit`, its loop state and one method per phase.

`Trainer` keeps the model's side (its state, loss, compiled step and evaluation);
a `FitRun` owns what one `fit` needs besides: its `Schedule` (what happens at which
step), the checkpoint saver and the run folder's lock, loggers, the progress bar,
the throughput clock, the health check one step behind, and the stop signals. Its
`__call__` is the loop, and the order of one step is the code of `after_step`:

1. the train step (`step`); the previous step's health check (`check_health`);
2. if an eval is due: `evaluate` (`Trainer.run_evaluation`);
3. if a log is due or it evaluated: `log` (the loggers, the metrics file and
   `trainer.history`);
4. if a checkpoint is due: `save`, then `on_checkpoint`;
5. `call_back`: if it evaluated, `on_eval_end` of every callback, in the order
   given; `on_step_end` of the callbacks whose `due(step)` says so, then the hooks
   of `Trainer.add_hook` (in the order added) where their `every` divides the step;
6. if anything in 5 asked to stop (`info.stop()`, or raised `StopTraining`, which
   skips the callbacks and hooks after it at this step): a checkpoint of this step
   is saved unless 4 saved one, then `on_checkpoint`, and the run ends here;
7. after the last step (or a stop): `on_fit_end` (`finish`).

`on_fit_start` runs once before the first step, after a resume (`start`).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jaxtyping import PyTree
from tqdm import tqdm

from ._callbacks import Callback, StopTraining, check_callbacks, overrides
from ._checkpoint import (
    Checkpoints,
    latest_checkpoint,
    list_checkpoints,
    restore_latest,
)
from ._data import restore_data_position, with_data_position
from ._health import HealthCheck
from ._hooks import StepInfo, finite_number, positive_int
from ._lock import RunLock
from ._metrics import LearningRates, batch_size
from ._placement import step_batch
from ._preemption import Preempted, SignalWatch, agree, check_stop_signals
from ._state import TrainState

if TYPE_CHECKING:
    from ._loggers import Logger

log = logging.getLogger("lowtrain")


class FitRun:
    """One `Trainer.fit` in progress: `trainer.fit_run` while it runs.

    Built by `fit` from its arguments; callbacks reach it as `trainer.fit_run` to
    read the run (`schedule`, `data`, `start_step`, `resumed`, `metrics_file`) or
    add to it (`log_event`). Calling it trains from `state` and returns the new
    state; the phases are its methods, in the order of the module docstring of
    `lowtrain/train/_loop.py`. What it does:

    - **Logging.** At the steps `schedule.log_every` divides, at steps that
      evaluate and at the last: the progress bar shows the loss and loss scale,
      and a record goes to each logger (process 0 only) and to `history`.
    - **Checkpoints.** At the steps due and at the last, the `TrainState` is saved
      (orbax, each process its shards) to `checkpoint_dir/ckpt_<step>` with
      `checkpoint_extra`, read back and checked against its checksums, and the
      newest `keep_checkpoints` that passed are kept. With `async_checkpoint` it
      is written in the background once copied to host. `data` with
      `get_state()` / `set_state(s)` has its position saved with each
      checkpoint and restored on resume.
    - **Resume.** The newest checkpoint that passes its checks is loaded into
      `state`'s structure and shardings (a damaged one is set aside with a warning
      and the one before tried; a mismatched one is refused), "resumed from step N
      (path)" is logged on the `lowtrain` logger, and the run goes on exactly: the
      same batches, keys and loss scale. Its `metrics_file` is made one row per
      step: the rows after the checkpoint's step (written before a crash) move to
      `<metrics_file>.replaced`.
    - **Callbacks.** They and the Trainer's hooks run after the step's log and
      save. One that stops the run has that step saved, and `fit` returns.
    - **Signals.** On the first of `stop_signals` (add "SIGUSR1" for SLURM's
      notice before a requeue) the step in flight finishes, is logged and saved
      synchronously (pending asynchronous saves completed, loggers flushed), and
      `fit` raises `lowtrain.train.Preempted` (the step, the path, the signal;
      `exit_code` 128 + its number). A second one acts at once. In a
      multi-process run the processes agree at the next step that logs: any one
      signalled stops them all at the same step.
    - **Health.** A step's health (see `Trainer`) is checked one step late, so the
      device never waits for it, except at steps that log, evaluate, run hooks or
      save, where it is checked first; `checkpoint_every_minutes` is checked after
      every step (in a multi-process run, at the steps that log).

    **Arguments:**

    - `trainer`: the `Trainer` whose `compiled_step` it runs.
    - `data`: `data(step) -> batch`, as `fit` takes it.
    - `schedule`: the run's `Schedule` (`schedule_fit` of `fit`'s arguments).
    - `callbacks`, `loggers`, `metrics_file`, `checkpoint_extra`, `resume`,
      `async_checkpoint`, `progress`, `stop_signals`: as `Trainer.fit` takes them.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    class Watch(lowtrain.train.Callback):
        def on_fit_start(self, trainer, state):
            run = trainer.fit_run  # the fit in progress
            self.seen = (run.schedule.total, run.start_step, run.resumed)

    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    watch = Watch()
    trainer.fit(trainer.init(key=jax.random.key(1)), lambda s: data, steps=3,
                callbacks=[watch], progress=False)
    assert watch.seen == (3, 0, None) and trainer.fit_run is None  # after fit
    ```
    """

    def __init__(
        self,
        trainer,
        data: Callable[[int], PyTree],
        schedule: Schedule,
        *,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Logger] = (),
        metrics_file=None,
        checkpoint_extra: dict | None = None,
        resume: bool | str = False,
        async_checkpoint: bool = False,
        progress: bool = True,
        stop_signals: Sequence[str | int] | None = None,
    ):
        self.trainer, self.data, self.schedule = trainer, data, schedule
        self.callbacks = check_callbacks(callbacks)
        self.loggers = check_loggers(loggers)
        self.metrics_file = metrics_file
        self.checkpoint_extra = checkpoint_extra
        self.resume, self.asynchronous = resume, async_checkpoint
        self.progress = progress
        self.watch = SignalWatch(check_stop_signals(stop_signals))
        self.is_main = jax.process_index() == 0
        self.single = jax.process_count() == 1
        self.history: list[dict] = []  # the records this run logged
        self.start_step = 0
        self.resumed: pathlib.Path | None = None  # the checkpoint resumed from
        self.saver: Checkpoints | None = None
        self.lock: RunLock | None = None
        self.bar = None
        self._own_logger = None  # the JsonlLogger of `metrics_file`
        self.health: HealthCheck | None = None  # made at `start`
        self.pending = None  # (step, health, min scale) not yet checked
        self.clock = (0, 0.0)  # (step, time) the throughput window began
        self.last_save = time.monotonic()
        self.saved: pathlib.Path | None = None  # the last checkpoint written
        self.signum: int | None = None
        self._step_callbacks = [
            c for c in self.callbacks if overrides(c, "on_step_end")
        ]

    # -- the loop ----------------------------------------------------------------

    def __call__(self, state: TrainState) -> TrainState:
        state = self.start(state)
        try:
            self.watch.install()
            for c in self.callbacks:
                c.on_fit_start(self.trainer, state)
            for s in range(self.start_step, self.schedule.total):
                state, metrics, batch = self.step(s, state)
                info = self.after_step(s + 1, state, metrics, batch)
                if info is not None and (info.stopping or self.signum is not None):
                    break
            self.finish(state)
        finally:
            self.close()
        return state

    def after_step(self, done: int, state, metrics, batch) -> StepInfo | None:
        """Everything after the step that makes `state.step` equal `done`, in order; the
        `StepInfo` where anything ran (None: a step that syncs nothing).
        `metrics` and `batch` are the step's (`step` returns them)."""
        when, trainer = self.schedule, self.trainer
        hooks = [h for h in trainer.hooks if done % h.every == 0]
        calls = [c for c in self._step_callbacks if c.due(done)]
        log_now, eval_now = when.log_at(done), when.eval_at(done)
        save_now = when.save_at(done)
        sync = bool(hooks or calls) or log_now or eval_now or save_now
        # A stop signal, a save on time: looked at every step by one process;
        # agreed at the steps every process syncs at by many.
        due = when.save_due(time.monotonic() - self.last_save)
        if self.single:
            self.signum = self.watch.received
        elif sync:
            self.signum, due = agree(self.watch.received, due)
        else:
            due = False
        save_now = save_now or due or when.can_save(self.signum is not None)
        log_now = log_now or self.signum is not None
        sync = sync or save_now or log_now
        self.check_health(done - 1, metrics["health"], state, sync)
        if not sync:
            return None
        info = self.info(state, metrics, batch, done)
        if eval_now:
            info = self.evaluate(info)
        if log_now or eval_now:
            info = self.log(info)
        if save_now:  # every process: each writes its shards
            self.save(info)
        if self.signum is not None:
            return info  # no callbacks: the run is being stopped from outside
        self.call_back(info, eval_now, calls, hooks)
        if info.stopping:
            log.info("stopping at step %d: %s", done, "; ".join(info._stop))
            if when.checkpoint_dir is not None and not save_now:
                self.save(info)
        self.clock = (done, time.perf_counter())  # not counting logs, evals, saves
        return info

    # -- the phases --------------------------------------------------------------

    def start(self, state: TrainState) -> TrainState:
        """Lock the checkpoint folder (one run per folder; process 0 holds it for
        the run's processes), resume into `state` or check the folder is empty,
        restore the data's position, open the metrics file and the progress bar;
        returns the state to start from."""
        when = self.schedule
        if when.checkpoint_dir and self.is_main:
            self.lock = RunLock(when.checkpoint_dir)
            self.lock.acquire()
        try:
            state, self.saver, self.resumed = resume_or_check_empty(
                state, when, self.resume, self.asynchronous
            )
            restore_data_position(self.data, self.resumed)
        except BaseException:
            self._release()
            raise
        self.start_step = start = int(state.step)
        if self.metrics_file and self.is_main:
            from ._loggers import JsonlLogger

            self._own_logger = JsonlLogger(self.metrics_file, after_step=start)
            self.loggers = [self._own_logger, *self.loggers]
        if not self.is_main:
            self.loggers = []
        self.bar = tqdm(
            total=when.total,
            initial=min(start, when.total),
            disable=not (self.progress and self.is_main),  # one bar per run
            unit="step",
        )
        self.clock = (start, time.perf_counter())
        self.last_save = time.monotonic()
        trainer = self.trainer
        self.health = HealthCheck(
            trainer.stop_on_nonfinite,
            trainer.max_consecutive_skips,
            trainer._divergence,
        )
        return state

    def step(self, s: int, state: TrainState) -> tuple[TrainState, dict, PyTree]:
        """The train step from `state` (at step `s`) on `data(s)`: its batch
        checked and placed, the numerics recorded when due, the compiled step
        queued; returns the new state, the step's metrics and the placed batch."""
        trainer = self.trainer
        batch = self.data(s)
        if any(np.shape(x)[:1] == (0,) for x in jax.tree.leaves(batch)):
            raise ValueError(
                f"Expected a batch with at least one row from `data({s})`, got 0 "
                "rows. Check the data source (a filter that removed everything, a "
                "dataset smaller than one batch)."
            )
        batch = step_batch(trainer.layout, batch)
        trainer.numerics.maybe_record(
            trainer._numerics_step, state, batch, s, self.metrics_file
        )
        state, metrics = trainer.compiled_step(batch, state)
        self.bar.update(1)
        return state, metrics, batch

    def check_health(self, step: int, health, state, now: bool) -> None:
        """Check the step before's health, and this one's (`step`, its `health`
        metric, the loss scale of `state`) when `now` (a step that syncs waits for
        the device anyway); otherwise it waits for the next."""
        if self.pending is not None:
            self.health(*self.pending)
        floor = state.loss_scale.floor()
        self.pending = (step, health, floor)
        if now:
            self.health(*self.pending)
            self.pending = None

    def info(self, state, metrics, batch, done: int) -> StepInfo:
        """The `StepInfo` of `state` after step `done`, with the step's `metrics`
        and its throughput since `self.clock` (examples: `batch`'s leading axis)."""
        loss = float(metrics["loss"])  # waits for the step to finish
        elapsed = max(time.perf_counter() - self.clock[1], 1e-12)
        steps_per_second = (done - self.clock[0]) / elapsed
        skipped = int(state.skipped)
        scale = float(state.loss_scale.value)
        # Kept on the Trainer: the states of its optimizer share one structure.
        trainer = self.trainer
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
            examples_per_second=steps_per_second * batch_size(batch),
        )

    def evaluate(self, info: StepInfo) -> StepInfo:
        """`info` with `eval`: `Trainer.run_evaluation` of its state on the eval
        data."""
        results = self.trainer.run_evaluation(info.state, self.schedule.eval_data)
        return dataclasses.replace(info, eval=results)

    def log(self, info: StepInfo) -> StepInfo:
        """`info` with its `record`, logged to the progress bar, `history` and the
        loggers."""
        info = dataclasses.replace(info, record=record(info))
        self.bar.set_postfix(loss=f"{info.loss:.4g}", scale=f"{info.loss_scale:g}")
        self.history.append(info.record)
        for logger in self.loggers:
            logger.log_metrics(info.record, info.step)
        return info

    def log_event(self, row: dict, step: int) -> None:
        """`row`, a record that is not a step's metrics (`{"event": ..., ...}`,
        such as the autopilot's plans), to the metrics file at `step`, where there
        is one."""
        if self._own_logger is not None:
            self._own_logger.log_metrics(row, step)

    def save(self, info: StepInfo) -> pathlib.Path:
        """Save `info.state` (with the checkpoint's extra data and the data's
        position), then `on_checkpoint`."""
        extra = with_data_position(self.checkpoint_extra, self.data)
        self.saved = path = self.saver.save(info.step, info.state, extra)
        self.last_save = time.monotonic()
        for c in self.callbacks:
            c.on_checkpoint(self.trainer, info, path)
        return path

    def call_back(self, info: StepInfo, evaluated: bool, calls, hooks) -> None:
        """The callbacks' `on_eval_end` (if `evaluated`), then `on_step_end` of
        `calls` (the callbacks due) and the `hooks` due, with `info`; a
        `StopTraining` raised by one stops the run (`info.stop`)."""
        trainer = self.trainer
        try:
            if evaluated:
                for c in self.callbacks:
                    c.on_eval_end(trainer, info)
            for c in calls:
                c.on_step_end(trainer, info)
            for hook in hooks:
                hook.fn(info)
        except StopTraining as e:
            info.stop(str(e) or "StopTraining raised")

    def finish(self, state: TrainState) -> None:
        """The last health check, the last save checked; `Preempted` after a stop
        signal, else `on_fit_end` with the final `state`."""
        if self.pending is not None:
            self.health(*self.pending)
            self.pending = None
        self.saver.close()  # waits for an asynchronous save and checks it
        if self.signum is not None:
            raise Preempted(self.signum, int(state.step), self.saved)
        for c in self.callbacks:
            c.on_fit_end(self.trainer, state)

    def close(self) -> None:
        """Put back the signal handlers, close the bar and the saver, flush the
        loggers (closing the metrics file's), release the lock. Idempotent."""
        self.watch.restore()
        if self.bar is not None:
            self.bar.close()
        if self.saver is not None:
            self.saver.close()
        for logger in self.loggers:
            flush = getattr(logger, "flush", None)
            if flush is not None:
                flush()
        if self._own_logger is not None:
            self._own_logger.close()
        self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@dataclasses.dataclass(frozen=True)
class Schedule:
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


def schedule_fit(
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
) -> Schedule:
    """Check `Trainer.fit`'s arguments (see there) and return its `Schedule`."""
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
    return Schedule(
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
    state, when: Schedule, resume: bool | str, asynchronous: bool = False
) -> tuple[Any, Checkpoints, pathlib.Path | None]:
    """The state to start from: with `resume`, the newest checkpoint in
    `when.checkpoint_dir` that passes its checks (none: an error, or `state` for
    `resume="auto"`), else `state`; a directory that holds checkpoints without
    `resume` is an error. And the `Checkpoints` that `fit` saves with (`close`
    it), and the path resumed from (or None)."""
    ckpt_dir = when.checkpoint_dir
    saver = lambda: Checkpoints(ckpt_dir, when.keep_checkpoints, asynchronous)
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
