"""What the recipes (`mnist.py`, `gpt.py`) share: the Trainer's options from the
config, the step count, the optimizer, and `fit` with the run's outputs."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import hydra.utils
import jax
from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

import lowtrain
import lowtrain.numerics

from ._config import Config
from ._prefetch import Prefetch

log = logging.getLogger("lowtrain")


def trainer_options(config: Config) -> dict[str, Any]:
    """`lowtrain.Trainer` keyword arguments from the config: the precision (built
    by the factory `precision._target_` names, from the other `precision` fields;
    `precision.name` only names the run), `trainer.redo_on_nan`, `trainer.sharding`,
    `trainer.grad_accum` and `trainer.numerics_every`."""
    fields = dataclasses.asdict(config.precision)
    fields.pop("name")
    t = config.trainer
    return {
        "precision": hydra.utils.instantiate(fields),
        "redo_on_nan": t.redo_on_nan,
        "sharding": t.sharding,
        "grad_accum": t.grad_accum,
        "numerics_every": t.numerics_every,
    }


def total_steps(config: Config, steps_per_epoch: int | None) -> int:
    """`trainer.steps` if set, else `trainer.epochs` passes over the data."""
    t = config.trainer
    if t.steps is not None:
        steps = t.steps
    elif t.epochs is not None and steps_per_epoch:
        steps = t.epochs * steps_per_epoch
    else:
        raise ValueError(
            f"Expected `trainer.steps` (or `trainer.epochs` for {config.task}), got "
            f"steps={t.steps} and epochs={t.epochs} instead. Pass trainer.steps=N."
        )
    if steps < 1:
        raise ValueError(f"Expected at least one train step, got {steps} instead.")
    return steps


def optimizer(cfg: DictConfig, steps: int, decay_mask: Callable, model: Any):
    """The `optimizer` group instantiated (a partial) and completed with what only
    the recipe knows: the step count, the weight-decay mask and the model (u-μP's
    per-parameter learning rates are read from it)."""
    return hydra.utils.instantiate(cfg.optimizer)(
        total_steps=steps, decay_mask=decay_mask, model=model
    )


def count_parameters(model) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def final_loss_scale(state: lowtrain.TrainState) -> float:
    scale = getattr(state.loss_scale, "loss_scale", None)  # None: NoOpLossScale
    return 1.0 if scale is None else float(scale)


def fit(
    trainer: lowtrain.Trainer,
    config: Config,
    data: Callable[[int], Any],
    eval_data: Iterable,
    steps: int,
    out: pathlib.Path,
    *,
    key: jax.Array,
) -> lowtrain.TrainState:
    """`trainer.fit` with the run's outputs: `metrics.jsonl`, `checkpoints/`, a
    progress bar, and a log line per evaluation."""
    t = config.trainer

    def report(info: lowtrain.StepInfo) -> None:
        if info.eval is not None:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in info.eval.items())
            log.info(
                "step %d/%d: eval %s (train loss %.4f)",
                info.step,
                steps,
                shown,
                info.loss,
            )

    trainer.add_hook(report, every=t.eval_every or steps)
    trainer.numerics.fmt = t.numerics_format
    state = trainer.init(key=key)
    source = Prefetch(data, t.prefetch) if t.prefetch else data
    try:
        with logging_redirect_tqdm():  # log lines above the progress bar
            state = trainer.fit(
                state,
                source,
                steps=steps,
                eval_data=eval_data,
                eval_every=t.eval_every,
                log_every=t.log_every,
                metrics_file=out / "metrics.jsonl",
                checkpoint_dir=out / "checkpoints",
                checkpoint_every=t.checkpoint_every,
                keep_checkpoints=t.keep_checkpoints,
                async_checkpoint=t.async_checkpoint,
                resume=t.resume,
                progress=t.progress,
            )
    finally:
        if isinstance(source, Prefetch):
            source.close()
    return state


def numerics_summary(out: pathlib.Path, fmt: str) -> dict | None:
    """The five worst tensors for `fmt` in the last report of `out/numerics.jsonl`
    (written with `trainer.numerics_every`), or None if there is none."""
    path = out / "numerics.jsonl"
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as f:
        last = [line for line in f if line.strip()][-1]
    record = json.loads(last)
    worst = lowtrain.numerics.Report(record["rows"]).worst(5, fmt)
    keys = ("name", "pass", "dtype", "shape", "rms", "absmax")
    return {
        "step": record["step"],
        "format": fmt,
        "worst": [
            {k: r[k] for k in keys}
            | {"underflow": r["underflow"][fmt], "overflow": r["overflow"][fmt]}
            for r in worst
        ],
    }
