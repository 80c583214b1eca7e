"""Callbacks: what `Trainer.fit` calls around its steps, how one stops a run, and two
built-ins, `EarlyStopping` and `BestCheckpoint`.

The order of one step is the code of `lowtrain.train.FitRun.after_step` (its module
docstring, `lowtrain/train/_loop.py`, lists it). `on_fit_start` runs once before
the first step, after a resume. A callback's `due(step)` (default: `every`, 1,
divides the step) thins its `on_step_end`; a callback that does not override
`on_step_end` costs no device wait at steps that do nothing else.
"""

from __future__ import annotations

import logging
import math
import pathlib
import shutil
from typing import TYPE_CHECKING

import jax

from ._checkpoint import checkpoint_extra, list_checkpoints, save_checkpoint
from ._hooks import positive_int

if TYPE_CHECKING:
    from ._hooks import StepInfo
    from ._state import TrainState

log = logging.getLogger("lowtrain")


class StopTraining(Exception):
    """Raise it from a callback or hook to end `Trainer.fit` after this step: the
    step's checkpoint is saved (with a `checkpoint_dir`) and `fit` returns the state,
    as `info.stop()` does. Its message goes to the `lowtrain` logger.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    def stop_at_3(info):
        if info.step == 3:
            raise lowtrain.train.StopTraining("enough")

    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
    trainer.add_hook(stop_at_3)
    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    state = trainer.fit(trainer.init(key=jax.random.key(1)), lambda s: data,
                        steps=10, progress=False)
    assert int(state.step) == 3
    ```
    """


class Callback:
    """The base of `Trainer.fit(callbacks=[...])`: override what you need.

    Each method gets the `Trainer` and a `lowtrain.StepInfo` (the state after the
    step, its loss, `eval` results, `record`: the logged metrics) or, at the start
    and end, the `TrainState`. `lowtrain.train.FitRun` (and the Trainer guide) gives
    the order of callbacks, logs and saves in a step.
    To end the run, call `info.stop(reason)` or raise `StopTraining`.

    - `on_fit_start(trainer, state)`: once, before the first step (after a resume).
    - `on_step_end(trainer, info)`: after steps where `self.due(info.step)` (by
      default, where `info.step % self.every == 0`).
    - `on_eval_end(trainer, info)`: after each evaluation; `info.eval` holds it.
    - `on_checkpoint(trainer, info, path)`: after a checkpoint of `fit` is saved.
    - `on_fit_end(trainer, state)`: once, when `fit` returns (also after a stop).

    `trainer.fit_run` (a `lowtrain.train.FitRun`: its `schedule` with the last step and
    the checkpoint directory, its `data`, ...) is the run in progress, and
    `trainer.use_precision(...)` changes the precision from the next step.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    class StopBelow(lowtrain.train.Callback):
        every = 2

        def on_step_end(self, trainer, info):
            if info.loss < 0.05:
                info.stop(f"loss {info.loss:.3f} < 0.05")

    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    state = trainer.fit(trainer.init(key=jax.random.key(1)), lambda s: data,
                        steps=100, callbacks=[StopBelow()], progress=False)
    assert int(state.step) < 100 and int(state.step) % 2 == 0
    ```
    """

    every: int = 1

    def due(self, step: int) -> bool:
        """Whether `on_step_end` runs after `step` (default: `step % every == 0`).
        Steps where no callback, hook, log, eval or save is due do not wait for the
        device."""
        return step % self.every == 0

    def on_fit_start(self, trainer, state: TrainState) -> None:
        """Once, before the first step (after a resume): `trainer` is the `Trainer`
        whose `fit` runs, `state` the `TrainState` it starts from."""

    def on_step_end(self, trainer, info: StepInfo) -> None:
        """After each step where `self.due(info.step)`: `trainer` is the `Trainer`,
        `info` the `lowtrain.StepInfo` of the step (`info.state` after it)."""

    def on_eval_end(self, trainer, info: StepInfo) -> None:
        """After each evaluation of `trainer`: `info.eval` holds its metrics."""

    def on_checkpoint(self, trainer, info: StepInfo, path: pathlib.Path) -> None:
        """After a checkpoint of `trainer`'s `fit` is saved, at the step of `info`,
        to the folder `path`."""

    def on_fit_end(self, trainer, state: TrainState) -> None:
        """Once, when `trainer`'s `fit` returns (also after a stop), with the final
        `state`."""


def overrides(callback: Callback, name: str) -> bool:
    """Whether `callback`'s class defines its own `name` method."""
    return getattr(type(callback), name) is not getattr(Callback, name)


def check_callbacks(callbacks) -> list[Callback]:
    callbacks = list(callbacks or ())
    for c in callbacks:
        if not isinstance(c, Callback):
            raise TypeError(
                "Expected each callback to be a `lowtrain.train.Callback` (subclass "
                f"it and override `on_step_end`, ...), got {type(c).__name__} "
                "instead. For a plain function use `trainer.add_hook(fn, every=N)`."
            )
        every = getattr(c, "every", 1)
        positive_int(every, f"{type(c).__name__}.every", optional=False)
    return callbacks


def _monitored(info: StepInfo, monitor: str, who: str) -> float:
    record = info.record or {}
    if monitor not in record:
        raise KeyError(
            f"{who}: expected the metric {monitor!r} in the evaluation's record, got "
            f"{', '.join(sorted(record)) or 'none'} instead. Monitor one of those "
            "(eval metrics are named `eval_<name>`)."
        )
    return float(record[monitor])


def _check_evaluates(trainer, monitor: str, who: str) -> None:
    # A callback that acts at evaluations, in a fit that never evaluates, would
    # never act: said at the start, not discovered after the run.
    run = getattr(trainer, "fit_run", None)  # None: called outside `fit`
    if run is not None and run.schedule.eval_data is None:
        raise ValueError(
            f"{who}: expected `fit(eval_data=...)` to watch {monitor!r} (it acts at "
            "each evaluation), got no eval data: it would never act. Pass "
            "`eval_data` (and `eval_every`) to `fit`."
        )


def _check_mode(mode: str, who: str) -> None:
    if mode not in ("min", "max"):
        raise ValueError(f'{who}: expected mode "min" or "max", got {mode!r} instead.')


class EarlyStopping(Callback):
    """Stop `fit` when `monitor` (a key of the logged record: `eval_loss`,
    `eval_accuracy`, ...) has not improved by more than `min_delta` for `patience`
    evaluations in a row; `mode="max"` for metrics that grow. As Lightning's and
    Keras' `EarlyStopping`, checked at each evaluation (`on_eval_end`). The stopped
    step is saved as a checkpoint when `fit` has a `checkpoint_dir`.
    `stopped_step` is the step it stopped at (None if it did not), `best` the best
    value seen. A non-finite value counts as no improvement.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.0))
    stop = lowtrain.train.EarlyStopping(patience=2)  # lr 0: the loss never improves
    trainer.fit(trainer.init(key=jax.random.key(1)), lambda s: data, steps=50,
                eval_data=[data], eval_every=5, callbacks=[stop], progress=False)
    assert stop.stopped_step == 15  # best at 5; no better at 10, 15
    ```
    """

    def __init__(
        self,
        monitor: str = "eval_loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
    ):
        _check_mode(mode, "EarlyStopping")
        positive_int(patience, "EarlyStopping(patience=)", optional=False)
        if not (isinstance(min_delta, int | float) and min_delta >= 0):
            raise ValueError(
                f"EarlyStopping: expected `min_delta` >= 0, got {min_delta!r} instead."
            )
        self.monitor, self.mode = monitor, mode
        self.patience, self.min_delta = patience, float(min_delta)
        self.best: float | None = None
        self.wait = 0
        self.stopped_step: int | None = None

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_fit_start(self, trainer, state) -> None:
        _check_evaluates(trainer, self.monitor, "EarlyStopping")
        self.wait, self.stopped_step = 0, None

    def on_eval_end(self, trainer, info) -> None:
        value = _monitored(info, self.monitor, "EarlyStopping")
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_step = info.step
            info.stop(
                f"early stopping: {self.monitor} has not improved on {self.best:.6g} "
                f"for {self.wait} evaluations"
            )


_BEST = "best"  # BestCheckpoint's folder inside the checkpoint directory


class BestCheckpoint(Callback):
    """Keep the `keep_checkpoints` best checkpoints by `monitor` (a key of the
    logged record, `eval_loss` by default; `mode="max"` for accuracy), as
    Lightning's `ModelCheckpoint(monitor=...)`: at each evaluation that is among the
    best so far, the state is saved (and checked) to `<directory>/ckpt_<step>`, and
    a worse one beyond `keep_checkpoints` is deleted. `directory` defaults to
    `best/` inside `fit`'s `checkpoint_dir`, apart from the newest-N checkpoints
    `fit` rotates.
    Each carries its value in its `extra` (`{"monitor", "mode", "value"}`, see
    `lowtrain.checkpoint_extra`); `lowtrain.train.best_checkpoint(directory)` finds
    the best again, also after a restart (the values kept are read back then).

    ```python
    import pathlib, tempfile
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
    run = pathlib.Path(tempfile.mkdtemp())
    trainer.fit(trainer.init(key=jax.random.key(1)), lambda s: data, steps=6,
                eval_data=[data], eval_every=2, checkpoint_dir=run / "ckpt",
                callbacks=[lowtrain.train.BestCheckpoint()], progress=False)
    best = lowtrain.train.best_checkpoint(run / "ckpt")
    assert best.name == "ckpt_00000006" and best.parent.name == "best"
    ```
    """

    def __init__(
        self,
        monitor: str = "eval_loss",
        mode: str = "min",
        keep_checkpoints: int = 1,
        directory=None,
    ):
        _check_mode(mode, "BestCheckpoint")
        positive_int(
            keep_checkpoints, "BestCheckpoint(keep_checkpoints=)", optional=False
        )
        self.monitor, self.mode = monitor, mode
        self.keep_checkpoints = keep_checkpoints
        self._given = None if directory is None else pathlib.Path(directory)
        self.directory: pathlib.Path | None = self._given
        self.kept: list[tuple[float, int, pathlib.Path]] = []  # best first

    def on_fit_start(self, trainer, state) -> None:
        directory = self._given
        if directory is None:
            parent = trainer.fit_run.schedule.checkpoint_dir
            if parent is None:
                raise ValueError(
                    "BestCheckpoint: expected `fit(checkpoint_dir=...)` or "
                    "`BestCheckpoint(directory=...)`, got neither. Pass one."
                )
            directory = parent / _BEST
        _check_evaluates(trainer, self.monitor, "BestCheckpoint")
        self.directory = directory.resolve()
        self.kept = _ranked(self.directory, self.mode)  # a resumed run's

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def on_eval_end(self, trainer, info) -> None:
        value = _monitored(info, self.monitor, "BestCheckpoint")
        if not math.isfinite(value):
            return
        worst = self.kept[-1][0] if self.kept else None
        if len(self.kept) >= self.keep_checkpoints and not self._better(value, worst):
            return
        path = self.directory / f"ckpt_{info.step:08d}"  # as `fit` names them
        extra = {"monitor": self.monitor, "mode": self.mode, "value": value}
        save_checkpoint(path, info.state, extra={_BEST: extra})
        self.kept = [k for k in self.kept if k[2] != path]
        self.kept.append((value, info.step, path))
        self.kept.sort(key=_rank_key(self.mode))
        for _, _, old in self.kept[self.keep_checkpoints :]:
            if jax.process_index() == 0:
                shutil.rmtree(old, ignore_errors=True)
        self.kept = self.kept[: self.keep_checkpoints]
        log.info("best %s %.6g at step %d: %s", self.monitor, value, info.step, path)


def _ranked(directory: pathlib.Path, mode: str) -> list:
    """The (value, step, path) of the `BestCheckpoint` checkpoints in `directory`,
    best first (read from their metadata)."""
    found = []
    for step, path in list_checkpoints(directory):
        extra = checkpoint_extra(path).get(_BEST)
        if extra is not None:
            found.append((float(extra["value"]), step, path))
    return sorted(found, key=_rank_key(mode))


def _rank_key(mode: str):
    # (value, step, path) best first: by value in `mode`, ties to the newest step.
    sign = 1 if mode == "min" else -1
    return lambda k: (sign * k[0], -k[1])


def best_checkpoint(directory) -> pathlib.Path | None:
    """The best checkpoint `BestCheckpoint` kept: in `directory/best` (a `fit`
    checkpoint directory) or in `directory` itself, by the value and mode saved
    with each; None if there is none.

    ```python
    import tempfile
    import lowtrain

    assert lowtrain.train.best_checkpoint(tempfile.mkdtemp()) is None
    ```
    """
    directory = pathlib.Path(directory)
    if (directory / _BEST).is_dir():
        directory = directory / _BEST
    found = list_checkpoints(directory)
    if not found:
        return None
    modes = {(checkpoint_extra(p).get(_BEST) or {}).get("mode") for _, p in found}
    if None in modes or len(modes) != 1:
        got = "some without a value" if None in modes else "several modes"
        raise ValueError(
            "Expected checkpoints written by one `lowtrain.train.BestCheckpoint` in "
            f"{directory}, got {got} instead. Pick the best by hand, or clear it."
        )
    return _ranked(directory, modes.pop())[0][2]
