"""What every recipe shares: the validated config, the precision, the optimizer, the
training loop with its outputs (metrics, checkpoints, summary, plots)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import hydra.utils
import jax
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

import lowtrain

from ._config import TASKS, Config, LossScale, PrecisionConfig, Transform
from ._plots import plot_metrics
from ._prefetch import Prefetch

log = logging.getLogger("lowtrain")


def _check_keys(node: DictConfig, where: str = "") -> None:
    # Hydra lets `+key=value` add keys to a structured config; refuse them here.
    schema = OmegaConf.get_type(node)
    fields = getattr(schema, "__dataclass_fields__", None)
    for key in node.keys():
        name = f"{where}{key}"
        if fields is not None and key not in fields:
            raise ValueError(
                f"Unknown config key `{name}`: expected one of the keys of "
                f"{schema.__name__} ({', '.join(fields)}), got `{key}` instead. Remove "
                f"the `+{name}=...` override, or fix its name."
            )
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _check_keys(child, f"{name}.")


def to_config(cfg: DictConfig) -> Config:
    """The composed config as typed dataclasses (`Config`): every key checked."""
    _check_keys(cfg)
    config = OmegaConf.to_object(cfg)
    if config.task not in TASKS:
        raise ValueError(
            f"Expected `task` to be one of {', '.join(TASKS)}, got {config.task!r} "
            "instead. Pick a recipe: `recipe=mnist` or `recipe=gpt`."
        )
    return config


def trainer_options(precision: PrecisionConfig) -> dict[str, Any]:
    """`lowtrain.Trainer` keyword arguments for a precision: policy, loss scale."""
    policy = lowtrain.get_policy(precision.policy)
    if precision.scalify_fp8 and precision.transform is not Transform.scalify:
        raise ValueError(
            "Expected `precision.transform=scalify` with `precision.scalify_fp8`, got "
            f"transform={precision.transform.name}. Use `precision=scalify_fp8`."
        )
    if precision.naive_fp8 and policy == lowtrain.get_policy("fp8"):
        raise ValueError(
            "Expected `precision.naive_fp8` with a policy that leaves matmuls to the "
            f"model (e.g. bf16), got policy {precision.policy!r} instead, which would "
            "quantize them twice. Use `precision=fp8_naive`."
        )
    scale = {
        LossScale.none: lambda: lowtrain.NoOpLossScale(),
        LossScale.static: lambda: lowtrain.StaticLossScale(precision.init_scale),
        LossScale.dynamic: lambda: lowtrain.DynamicLossScale(
            precision.init_scale, growth_interval=precision.growth_interval
        ),
    }[precision.loss_scale]()
    return {
        "policy": policy,
        "loss_scale": scale,
        "redo_on_nan": precision.redo_on_nan,
        "transform": precision.transform.value,
    }


def fp8_path_of(precision: PrecisionConfig) -> str | None:
    """How the models' matmuls go through FP8: None, "naive" or "scalify"."""
    if precision.naive_fp8:
        return "naive"
    return "scalify" if precision.scalify_fp8 else None


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


def optimizer(cfg: DictConfig, steps: int, decay_mask: Callable):
    """The `optimizer` group instantiated (a partial) and completed."""
    return hydra.utils.instantiate(cfg.optimizer)(
        total_steps=steps, decay_mask=decay_mask
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
                resume=t.resume,
                progress=t.progress,
            )
    finally:
        if isinstance(source, Prefetch):
            source.close()
    return state


def run(cfg: DictConfig, output_dir) -> dict:
    """Train the recipe `cfg` names; write everything to `output_dir`; return the
    summary (also in `output_dir/summary.json`)."""
    from . import gpt, mnist

    config = to_config(cfg)
    out = pathlib.Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    title = f"{config.task} {config.precision.name}"
    log.info("%s: outputs in %s", title, out)
    start = time.perf_counter()
    recipe = {"mnist": mnist, "gpt": gpt}[config.task]
    results = recipe.train(config, cfg, out)
    seconds = time.perf_counter() - start
    plots = plot_metrics(out / "metrics.jsonl", out, title)
    summary = {
        "task": config.task,
        "precision": config.precision.name,
        "policy": config.precision.policy,
        **results,
        "seconds": round(seconds, 1),
        "output_dir": str(out),
        "plots": [p.name for p in plots],
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json))
    metric, value = next(iter(results["final"].items()))
    shown = f"{value:.2%}" if "accuracy" in metric else f"{value:.4f}"
    print(
        f"{metric.replace('_', ' ')}: {shown} ({title}, {results['steps']} steps, "
        f"{seconds:.0f} s)"
    )
    print(
        f"outputs: {out} (summary.json, metrics.jsonl, "
        f"{', '.join(p.name for p in plots)}, checkpoints/)"
    )
    return summary


def _json(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if hasattr(value, "name"):  # an Enum
        return value.name
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
