"""`Trainer.fit`: the training loop, with logging, evaluation and checkpoints."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jaxtyping import PyTree
from tqdm import tqdm

from .._loss_scale import NoOpLossScale
from ._checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from ._hooks import StepInfo
from ._metrics import JsonlWriter, learning_rate
from ._state import TrainState


def _positive_int(value, what: str, *, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected an int `{what}` >= 1, got {value!r} instead.")
    return value


def _check_loss(step: int, loss) -> None:
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
    resume: bool = False,
    progress: bool = True,
) -> TrainState:
    """Train from `state` until `state.step == steps`, and return the new state.

    Nothing is done if `state.step >= steps` already (after `resume`, say).

    - `data(step) -> batch` gives the batch of each step (a function of the step, so a
      resumed run sees the same batches; `lowtrain.ArrayBatches` is one). With
      `epochs=E` instead of `steps`, `steps = E * data.steps_per_epoch`.
    - `state` is consumed: its buffers are donated to the compiled step.
    - Every `log_every` steps and at the last step: the progress bar (tqdm, on
      stderr; `progress=False` turns it off) shows the loss and loss scale next to
      its steps/s, and if `metrics_file` is given one JSON line is appended to it
      with `step`, `loss`, `loss_scale`, `skipped`, `grad_norm`, `learning_rate`,
      `steps_per_second`, `examples_per_second`, the scalars of a dict `aux`, and
      `eval_<name>` when it evaluated (the fields of `lowtrain.StepInfo`).
    - Every `eval_every` steps and at the last step, if `eval_data` (an iterable of
      batches, iterated once each time) is given: `run_evaluation`.
    - Every `checkpoint_every` steps and at the last step, if `checkpoint_dir` is
      given: the full `TrainState` is written atomically to
      `checkpoint_dir/ckpt_<step>.lowtrain` (8 digits), keeping the newest
      `keep_checkpoints`. In a multi-process run, process 0 writes.
    - `resume=True` loads the newest checkpoint in `checkpoint_dir` into `state`'s
      structure if there is one (refusing a corrupt or mismatched file), and goes on
      from its step exactly: same batches, same keys, same loss scale. Without
      `resume`, a `checkpoint_dir` that already holds checkpoints is an error.
    - Hooks run after the above, in the order added.
    - With `stop_on_nonfinite`, a non-finite loss raises `FloatingPointError`. It is
      checked one step late, so the device never waits for it, except at steps that
      log, evaluate, run hooks or write a checkpoint, where it is checked first.
    """
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
    ckpt_dir = None if checkpoint_dir is None else pathlib.Path(checkpoint_dir)
    if ckpt_dir is not None:
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None and resume:
            state = load_checkpoint(latest, state)
        elif latest is not None:
            raise ValueError(
                f"Expected an empty `checkpoint_dir` for a new run, got "
                f"{len(list_checkpoints(ckpt_dir))} checkpoints in {ckpt_dir} "
                "instead. Pass `resume=True` to continue that run, or use another "
                "directory."
            )
    start = int(state.step)
    is_main = jax.process_index() == 0
    writer = JsonlWriter(metrics_file) if metrics_file and is_main else None
    bar = tqdm(
        total=total,
        initial=min(start, total),
        disable=not (progress and is_main),  # one bar per run, not per process
        unit="step",
    )
    clock = (start, time.perf_counter())  # (step, time) the throughput window began
    pending = None  # (step, loss) not yet checked by stop_on_nonfinite
    try:
        for s in range(start, total):
            batch = self.shard_batch(data(s))
            state, metrics = self.compiled_step(batch, state)
            done = s + 1
            bar.update(1)
            last = done == total
            hooks = [h for h in self.hooks if done % h.every == 0]
            log_now = bool(log_every and done % log_every == 0) or last
            eval_now = eval_data is not None and (
                bool(eval_every and done % eval_every == 0) or last
            )
            save_now = ckpt_dir is not None and (
                bool(checkpoint_every and done % checkpoint_every == 0) or last
            )
            sync = bool(hooks) or log_now or eval_now or save_now
            if self.stop_on_nonfinite:
                if pending is not None:
                    _check_loss(*pending)
                pending = (s, metrics["loss"])
                if sync:  # we wait for the device here anyway
                    _check_loss(*pending)
                    pending = None
            if not sync:
                continue
            if hooks or log_now or eval_now:
                info = _step_info(self, state, metrics, batch, clock, done)
                if eval_now:
                    results = self.run_evaluation(state, eval_data)
                    info = dataclasses.replace(info, eval=results)
                if log_now or eval_now:
                    bar.set_postfix(
                        loss=f"{info.loss:.4g}", scale=f"{info.loss_scale:g}"
                    )
                    if writer is not None:
                        writer.write(_record(info))
                for hook in hooks:
                    hook.fn(info)
            if save_now and is_main:
                save_checkpoint(checkpoint_path(ckpt_dir, done), state)
                prune_checkpoints(ckpt_dir, keep_checkpoints)
            clock = (done, time.perf_counter())  # not counting logs, evals, saves
        if pending is not None:
            _check_loss(*pending)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    return state


def _step_info(self, state, metrics, batch, clock, done) -> StepInfo:
    loss = float(metrics["loss"])  # waits for the step to finish
    elapsed = max(time.perf_counter() - clock[1], 1e-12)
    steps_per_second = (done - clock[0]) / elapsed
    skipped = int(state.skipped)
    if isinstance(state.loss_scale, NoOpLossScale):
        scale = 1.0
    else:
        scale = float(state.loss_scale.loss_scale)
    return StepInfo(
        step=done,
        state=state,
        loss=loss,
        aux=metrics["aux"],
        loss_scale=scale,
        skipped=skipped,
        grad_norm=float(metrics["grad_norm"]),
        learning_rate=learning_rate(
            state.opt_state, self.learning_rate, done - skipped
        ),
        steps_per_second=steps_per_second,
        examples_per_second=steps_per_second * _batch_size(batch),
    )


def _record(info: StepInfo) -> dict:
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
