"""What `Trainer.fit` needs besides its loop: its arguments validated into a `FitPlan`
(what happens at which step), the non-finite loss check, `StepInfo`s and metric
records."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from .._loss_scale import NoOpLossScale
from ._checkpoint import (
    Checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from ._hooks import StepInfo
from ._metrics import LearningRates
from ._state import TrainState


def _positive_int(value, what: str, *, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected an int `{what}` >= 1, got {value!r} instead.")
    return value


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


def check_loss(step: int, loss) -> None:
    value = float(loss)
    if not math.isfinite(value):
        raise FloatingPointError(
            f"The loss is {value} at train step {step + 1} (the update from "
            f"`state.step == {step}`, on batch `data({step})`). Expected a finite "
            "loss: without loss scaling this means the run diverged or the batch "
            "holds inf/NaN. Lower the learning rate, check that batch, train with a "
            "`lowtrain.DynamicLossScale`, or pass `stop_on_nonfinite=False` to the "
            "Trainer to skip such steps (non-finite gradients leave the model "
            "unchanged and count in `state.skipped`)."
        )


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
        steps = _positive_int(epochs, "epochs") * per_epoch
    total = _positive_int(steps, "steps", optional=False)
    log_every = _positive_int(log_every, "log_every")
    eval_every = _positive_int(eval_every, "eval_every")
    checkpoint_every = _positive_int(checkpoint_every, "checkpoint_every")
    keep_checkpoints = _positive_int(keep_checkpoints, "keep_checkpoints")
    if eval_every and eval_data is None:
        raise ValueError("Expected `eval_data` with `eval_every`, got None instead.")
    if (checkpoint_every or resume) and checkpoint_dir is None:
        raise ValueError(
            "Expected a `checkpoint_dir` with `checkpoint_every` or `resume`, got "
            "None instead."
        )
    return FitPlan(
        total=total,
        log_every=log_every,
        eval_every=eval_every,
        eval_data=eval_data,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=None if checkpoint_dir is None else pathlib.Path(checkpoint_dir),
        keep_checkpoints=keep_checkpoints,
    )


def resume_or_check_empty(
    state, plan: FitPlan, resume: bool, asynchronous: bool = False
) -> tuple[Any, Checkpoints]:
    """The state to start from: the newest checkpoint in `plan.checkpoint_dir` if
    `resume` (and there is one), else `state`; a directory that holds checkpoints
    without `resume` is an error. And the `Checkpoints` that `fit` saves with
    (`close` it)."""
    ckpt_dir = plan.checkpoint_dir
    saver = lambda: Checkpoints(ckpt_dir, plan.keep_checkpoints, asynchronous)
    if ckpt_dir is None:
        return state, saver()
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None and resume:
        return load_checkpoint(latest, state), saver()
    if latest is not None:
        raise ValueError(
            f"Expected an empty `checkpoint_dir` for a new run, got "
            f"{len(list_checkpoints(ckpt_dir))} checkpoints in {ckpt_dir} "
            "instead. Pass `resume=True` to continue that run, or use another "
            "directory."
        )
    return state, saver()


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
    """The mean of each metric `evaluate(batch)` returns over the batches of `data`."""
    totals: dict[str, float] = {}
    count = 0
    for batch in data:
        metrics = evaluate(batch)
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
