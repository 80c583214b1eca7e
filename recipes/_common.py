"""What every task shares (the built-in `mnist.py`, `gpt.py` and a user's own):
`train`, a task trained as the config says: the Trainer's options, the step count,
the optimizer, and `fit` with the run's outputs, loggers and callbacks."""

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
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

import lowtrain
import lowtrain.numerics

from . import _autopilot
from ._config import Config
from ._prefetch import Prefetch
from ._task import Task, split_model

log = logging.getLogger("lowtrain")


# Config keys a resumed run may change: they decide what is logged, saved and shown,
# not what is computed. Any other difference from the run's first launch is refused
# unless `trainer.resume_allow` names it (or a prefix of it, e.g. `precision`).
FREE_ON_RESUME = (
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.checkpoint_every_minutes",
    "trainer.stop_signals",
    "trainer.keep_checkpoints",
    "trainer.async_checkpoint",
    "trainer.progress",
    "trainer.prefetch",
    "trainer.resume",
    "trainer.resume_allow",
    "trainer.numerics_every",
    "trainer.numerics_format",
    "trainer.max_consecutive_skips",
    "trainer.diverge_factor",
    "trainer.diverge_patience",
    "trainer.loggers",
    "trainer.early_stopping",
    "trainer.min_delta",
    "trainer.keep_best",
    "trainer.compile_cache",
    # Which kernels run the GEMMs, not what they compute (XLA's autotuner can pick
    # other kernels at any launch anyway).
    "trainer.triton_gemm",
    "mode",
    "checkpoint",
    "sample",
    "data.cache_dir",
    "distributed",
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _covered(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def resume_differences(saved: dict, current: dict, allow=()) -> list[str]:
    """What a resume would change that breaks exactness: the keys of the run's
    config (`saved["config"]`, the first launch's, resolved) that `current` gives
    another value, and the data's fingerprint and vocabulary (`saved["data"]`),
    leaving out `FREE_ON_RESUME` and `allow`; one line each."""
    lines = []
    old, new = _flat(saved.get("config", {})), _flat(current.get("config", {}))
    for key in sorted(set(old) | set(new)):
        if _covered(key, FREE_ON_RESUME) or _covered(key, allow):
            continue
        if old.get(key, "<unset>") != new.get(key, "<unset>"):
            lines.append(
                f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
            )
    if not _covered("data", allow):
        old_data, new_data = saved.get("data", {}), current.get("data", {})
        for key in sorted(set(old_data) | set(new_data)):
            if old_data.get(key) != new_data.get(key):
                lines.append(f"the data's {key} differs from the first launch's")
    return lines


def trainer_options(config: Config) -> dict[str, Any]:
    """`lowtrain.Trainer` keyword arguments from the config: the precision (built
    by the factory `precision._target_` names, from the other `precision` fields;
    `precision.name` only names the run), `trainer.redo_on_nan`, `trainer.mesh`,
    `trainer.sharding`, `trainer.axis_rules`, `trainer.remat`,
    `trainer.grad_accum`, `trainer.numerics_every` and the checks that stop a run
    (`max_consecutive_skips`, `diverge_factor`, `diverge_patience`)."""
    fields = dataclasses.asdict(config.precision)
    fields.pop("name")
    t = config.trainer
    return {
        "precision": hydra.utils.instantiate(fields),
        "redo_on_nan": t.redo_on_nan,
        "mesh": t.mesh.sizes(),
        "sharding": t.sharding,
        "axis_rules": dict(t.axis_rules),
        "remat": t.remat,
        "grad_accum": t.grad_accum,
        "numerics_every": t.numerics_every,
        "max_consecutive_skips": t.max_consecutive_skips,
        "diverge_factor": t.diverge_factor,
        "diverge_patience": t.diverge_patience,
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
    return float(state.loss_scale.value)


def fit_options(config: Config) -> dict[str, Any]:
    """`lowtrain.Trainer.fit` keyword arguments from `trainer.*` of the config: the
    schedule (`eval_every`, `log_every`, `checkpoint_every`,
    `checkpoint_every_minutes`), `keep_checkpoints`, `async_checkpoint`, `resume`,
    `stop_signals` and `progress`."""
    t = config.trainer
    return {
        "eval_every": t.eval_every,
        "log_every": t.log_every,
        "checkpoint_every": t.checkpoint_every,
        "checkpoint_every_minutes": t.checkpoint_every_minutes,
        "keep_checkpoints": t.keep_checkpoints,
        "async_checkpoint": t.async_checkpoint,
        "resume": t.resume,
        "stop_signals": list(t.stop_signals),
        "progress": t.progress,
    }


def fit(
    trainer: lowtrain.Trainer,
    config: Config,
    data: Callable[[int], Any],
    eval_data: Iterable,
    steps: int,
    out: pathlib.Path,
    *,
    key: jax.Array,
    cfg: DictConfig | None = None,
    data_fingerprint: dict | None = None,
    callbacks: list | None = None,
) -> tuple[lowtrain.TrainState, dict | None]:
    """`trainer.fit` with the run's outputs: `metrics.jsonl` and the loggers
    `trainer.loggers` names, `checkpoints/` (and `checkpoints/best/` with
    `trainer.keep_best`), a progress bar, and a log line per evaluation; early
    stopping with `trainer.early_stopping`, the FP8 autopilot with
    `precision.auto` (`recipes/_autopilot.py`), and `callbacks`. Each checkpoint
    holds the run's resolved config (`cfg`) and `data_fingerprint` (the data's
    digest, the vocabulary); a resume that would change them is refused
    (`resume_differences`) before anything is loaded.

    Returns the final state and the autopilot's summary (None without it); the
    Trainer ends with the precision it trained with last (the last plan's)."""
    t = config.trainer
    resolved = (
        {}
        if cfg is None
        else OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    )
    extra = {"config": resolved, "data": data_fingerprint or {}}
    latest = _check_resume(out, extra, t)
    trainer.add_hook(_eval_line(steps), every=t.eval_every or steps)
    trainer.numerics.fmt = t.numerics_format
    auto = getattr(config.precision, "auto", False)
    pilot = _autopilot.autopilot(config.precision, out) if auto else None
    callbacks = [
        *run_callbacks(config),
        *([pilot] if pilot else []),
        *(callbacks or ()),
    ]
    loggers = _loggers(t.loggers, out, latest, resolved)
    source = Prefetch(data, t.prefetch) if t.prefetch else data
    try:
        with logging_redirect_tqdm():  # log lines above the progress bar
            state = trainer.fit(
                trainer.init(key=key),
                source,
                steps=steps,
                eval_data=eval_data,
                metrics_file=out / "metrics.jsonl",
                checkpoint_dir=out / "checkpoints",
                checkpoint_extra=extra,
                callbacks=callbacks,
                loggers=loggers,
                **fit_options(config),
            )
    finally:
        if isinstance(source, Prefetch):
            source.close()
        for logger in loggers:
            logger.close()
    return state, (None if pilot is None else pilot.summary(steps))


def _eval_line(steps: int) -> Callable[[lowtrain.StepInfo], None]:
    # A hook that logs a line per evaluation: "step 500/2000: eval loss 1.7 ...".
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

    return report


def _loggers(names, out: pathlib.Path, latest, config: dict) -> list:
    # The loggers `trainer.loggers` names, on process 0 (metrics.jsonl is always
    # written: `fit`'s `metrics_file`), each given the run's config.
    if jax.process_index() != 0:
        return []
    after = None if latest is None else int(latest.name.rsplit("_", 1)[1])
    loggers = [
        lowtrain.train.make_logger(name, out, after_step=after)
        for name in names
        if name != "jsonl"
    ]
    for logger in loggers:
        logger.log_hyperparams(config)
    return loggers


def _check_resume(out: pathlib.Path, extra: dict, t) -> pathlib.Path | None:
    # The newest intact checkpoint a resume would load (a damaged one is set
    # aside, as the resume would), refused if its config or data differ.
    if not t.resume:
        return None
    latest = lowtrain.latest_checkpoint(out / "checkpoints", check_files=True)
    changes = (
        []
        if latest is None
        else resume_differences(
            lowtrain.checkpoint_extra(latest), extra, t.resume_allow
        )
    )
    if changes:
        raise ValueError(
            f"Expected a resume of the run in {out} with what it was trained with, "
            f"got {len(changes)} change(s) that would break its exactness: "
            + "; ".join(changes)
            + ". Resume with the first launch's settings (its config is "
            f"{out / 'config.yaml'}), start a new run in another directory, or "
            "list the keys to change on purpose: trainer.resume_allow=[key,...]."
        )
    return latest


def run_callbacks(config: Config) -> list:
    """The callbacks `trainer.early_stopping` (patience in evaluations) and
    `trainer.keep_best` ask for, on `trainer.monitor` (`trainer.monitor_mode`)."""
    t = config.trainer
    callbacks = []
    if t.early_stopping is not None:
        callbacks.append(
            lowtrain.train.EarlyStopping(
                t.monitor, t.monitor_mode, t.early_stopping, t.min_delta
            )
        )
    if t.keep_best:
        callbacks.append(
            lowtrain.train.BestCheckpoint(t.monitor, t.monitor_mode, t.keep_best)
        )
    return callbacks


def train(task: Task, config: Config, cfg: DictConfig, out: pathlib.Path) -> dict:
    """Train `task` as `config` says, writing to `out`; return its results
    (`Task.results`, with the step count, parameters, skipped steps and final loss
    scale added)."""
    t = config.trainer
    data = task.data(config)
    steps = total_steps(config, getattr(data.train, "steps_per_epoch", None))
    trainer, key = build_trainer(task, config, cfg, steps)
    state, auto = fit(
        trainer,
        config,
        data.train,
        data.eval,
        steps,
        out,
        key=key,
        cfg=cfg,
        data_fingerprint=dict(data.fingerprint),
        callbacks=task.callbacks(config),
    )
    results = dict(task.results(trainer, state, data, config, out))
    if auto is not None:
        results["auto"] = auto
    results.setdefault("steps", int(state.step))
    if t.early_stopping is not None and int(state.step) < steps:
        results["stopped_early_at"] = int(state.step)
    results.setdefault("parameters", count_parameters(trainer.model))
    results.setdefault("skipped_steps", int(state.skipped))
    results.setdefault("final_loss_scale", final_loss_scale(state))
    return results


def build_trainer(
    task: Task, config: Config, cfg: DictConfig, steps: int
) -> tuple[lowtrain.Trainer, jax.Array]:
    """The task's Trainer for `config` (its model from the seed's first key), and
    the key its state starts from (the second)."""
    model_key, state_key = jax.random.split(jax.random.key(config.trainer.seed))
    model, model_state = split_model(task.model(config, key=model_key))
    trainer_class = task.trainer_class(config, model)
    options = trainer_options(config)
    options["axis_names"] = task.axis_names(config, model)
    if model_state is not None:
        options["model_state"] = model_state
    trainer = trainer_class(
        model, optimizer(cfg, steps, task.decay_mask, model), **options
    )
    return trainer, state_key


def numerics_summary(out: pathlib.Path, fmt: str) -> dict | None:
    """The five worst tensors of the last report in `out/numerics.jsonl` (written
    with `trainer.numerics_every`), or None if there is none. A casts report (what a
    low precision casts) ranks its casts by what each loses in its own format, with
    `lowtrain.numerics.worst_casts`' advice; a report of every tensor (a float32
    step) ranks them against `fmt` (`trainer.numerics_format`)."""
    path = out / "numerics.jsonl"
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as f:
        last = [line for line in f if line.strip()][-1]
    record = json.loads(last)
    report = lowtrain.numerics.Report(record["rows"], kind=record.get("kind", "all"))
    if report.kind == "casts":
        return {
            "step": record["step"],
            "kind": "casts",
            "worst": lowtrain.numerics.worst_casts(report, 5),
        }
    keys = ("name", "pass", "dtype", "shape", "rms", "absmax")
    return {
        "step": record["step"],
        "kind": "all",
        "format": fmt,
        "worst": [
            {k: r[k] for k in keys}
            | {"underflow": r["underflow"][fmt], "overflow": r["overflow"][fmt]}
            for r in report.worst(5, fmt)
        ],
    }
