"""A run of `python -m lowtrain`: the config validated, the task it names trained
(or a trained checkpoint evaluated or sampled: `mode=`), the summary and plots
written. (What tasks share is in `_common.py`; this module imports them, they never
import it.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import time

import hydra.utils
import jax
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

import lowtrain

from . import _common, _distributed
from ._common import numerics_summary
from ._config import SCHEMAS, Config, TrainerConfig
from ._plots import plot_metrics
from ._task import Task, load_task

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
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # a value of the wrong type, from the CLI
        raise ValueError(str(e).splitlines()[0]) from None
    load_task(config.task)  # importable, a Task: a clear error now, not later
    return config


def check(cfg: DictConfig) -> Config:
    """Everything about `cfg` that can be checked before a run starts: its keys and
    values (`to_config`), and the precision and optimizer it builds. Raises
    `ValueError` (or `TypeError`) saying what was expected and how to fix it."""
    config = to_config(cfg)
    fields = dataclasses.asdict(config.precision)
    fields.pop("name")
    try:
        hydra.utils.instantiate(fields)  # the precision factory's own checks
        hydra.utils.instantiate(cfg.optimizer)  # a partial: its keys and types
    except InstantiationException as e:  # Hydra's wrapper: the factory's own error
        cause = e.__cause__ or e
        raise ValueError(str(cause).splitlines()[0]) from None
    return config


def launch_records(out: pathlib.Path, cfg: DictConfig) -> None:
    """`config.yaml` (the run's: written by its first launch, never replaced) and
    `launches/<n>.yaml`, the resolved config of every launch into `out`."""
    text = OmegaConf.to_yaml(cfg, resolve=True)
    launches = out / "launches"
    launches.mkdir(parents=True, exist_ok=True)
    n = len(list(launches.glob("*.yaml"))) + 1
    (launches / f"{n:03d}.yaml").write_text(text)
    if not (out / "config.yaml").exists():
        (out / "config.yaml").write_text(text)


def compile_options(config: Config) -> None:
    """How this launch compiles: XLA's GEMM kernels (`trainer.triton_gemm`), then
    JAX's persistent compilation cache (`trainer.compile_cache`)."""
    t = config.trainer
    if not lowtrain.train.use_triton_gemm(t.triton_gemm):
        log.info(
            "trainer.triton_gemm=%s not applied: XLA_FLAGS sets it, or JAX had "
            "started its backends before the run",
            t.triton_gemm,
        )
    folder = lowtrain.train.use_compilation_cache(t.compile_cache)
    log.info("compilation cache: %s", folder or "off")


def run(cfg: DictConfig, output_dir, overrides: list[str] | None = None) -> dict:
    """Train the recipe `cfg` names; write everything to `output_dir`; return the
    summary (also in `output_dir/summary.json`).

    With a `distributed` config, `jax.distributed` starts first; every process calls
    `run`, trains its share of each batch and writes its checkpoint shards, in process
    0's `output_dir` (see `_distributed.py`); process 0 alone writes the config,
    metrics, plots and summary.

    `mode=evaluate|sample` with `overrides` (the command line's): the model, data,
    precision, optimizer and trainer are the checkpoint's own (its saved config;
    `from_checkpoint`), changed only where `overrides` change them."""
    if cfg.mode != "train" and overrides is not None and cfg.checkpoint is not None:
        cfg = from_checkpoint(cfg, checkpoint_path(cfg.checkpoint), overrides)
    config = check(cfg)
    compile_options(config)  # before JAX uses a device: XLA reads its flags then
    _distributed.initialize(config.distributed)  # before any JAX computation
    task = load_task(config.task)
    if config.mode != "train":
        return use_checkpoint(task, config, cfg)
    out = _distributed.shared_run_dir(pathlib.Path(output_dir).resolve())
    main = jax.process_index() == 0
    out.mkdir(parents=True, exist_ok=True)
    # One launch per run folder: taken before anything is written into it.
    lock = lowtrain.train.RunLock(out).acquire() if main else None
    try:
        return _train(task, config, cfg, out, main)
    finally:
        if lock is not None:
            lock.release()


def _train(task: Task, config: Config, cfg: DictConfig, out: pathlib.Path, main: bool):
    if main:
        launch_records(out, cfg)
    title = f"{config.task} {config.precision.name}"
    log.info("%s: outputs in %s", title, out)
    start = time.perf_counter()
    results = _common.train(task, config, cfg, out)
    seconds = time.perf_counter() - start
    plots = plot_metrics(out / "metrics.jsonl", out, title) if main else []
    summary = {
        "task": config.task,
        "precision": config.precision.name,
        "policy": getattr(config.precision, "policy", None),
        **results,
        "seconds": round(seconds, 1),
        "output_dir": str(out),
        "plots": [p.name for p in plots],
        "numerics": numerics_summary(out, config.trainer.numerics_format),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if not main:
        return summary
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json))
    metric, value = next(iter(results["final"].items()))
    shown = f"{value:.2%}" if "accuracy" in metric else f"{value:.4f}"
    skipped = results.get("skipped_steps", 0)
    print(
        f"{metric.replace('_', ' ')}: {shown} ({title}, {results['steps']} steps"
        + (f", {skipped} skipped" if skipped else "")
        + f", {seconds:.0f} s)"
    )
    if results.get("auto"):
        auto = results["auto"]
        shares = auto.get("shares") or {}
        if set(shares) - {"fp8", "wide"}:  # formats chosen per matmul
            what = ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
            print(
                f"autopilot: matmul FLOPs at the end {what} ({auto['plans']} plans); "
                "plan.json, plan.txt"
            )
        else:
            print(
                f"autopilot: FP8 on {auto['fp8_share']:.1%} of matmul FLOPs at the "
                f"end ({auto['fp8_share_run']:.1%} over the run, {auto['plans']} "
                "plans); plan.json, plan.txt"
            )
    print(
        f"outputs: {out} (summary.json, metrics.jsonl, "
        f"{', '.join(p.name for p in plots)}, checkpoints/)"
    )
    return summary


def checkpoint_path(given: str) -> pathlib.Path:
    """The checkpoint `checkpoint=` names: a run directory (its `checkpoints/`), a
    checkpoint folder, or one checkpoint; in a folder, the best kept
    (`trainer.keep_best`) if any, else the newest."""
    path = pathlib.Path(given).expanduser().resolve()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    found = lowtrain.train.best_checkpoint(path) if (path / "best").is_dir() else None
    found = found or lowtrain.latest_checkpoint(path)
    if found is None and (path / "meta").is_dir():
        found = path  # one checkpoint
    if found is None:
        raise ValueError(
            f"Expected a run directory or checkpoint at `checkpoint={given}`, got "
            f"{'nothing there' if not path.exists() else 'no checkpoint in it'}. Pass "
            "the run directory a training run printed (outputs: ...)."
        )
    return found


# The nodes of a run's config that make its model what it is: taken from the
# checkpoint by `mode=evaluate|sample`.
_TRAINED = ("task", "model", "data", "optimizer", "precision", "trainer")


def from_checkpoint(cfg: DictConfig, path: pathlib.Path, overrides: list[str]):
    """`cfg` with the nodes of `_TRAINED` replaced by those of the config saved with
    the checkpoint at `path` (the run's resolved config), each typed by its schema,
    and the command line's `overrides` of their keys applied on top; a node whose
    group the command line selects (`model=cnn`) stays as composed. A checkpoint
    without a saved config leaves `cfg` as it is."""
    saved = lowtrain.checkpoint_extra(path).get("config") or {}
    if not saved:
        return cfg
    parsed = OverridesParser.create().parse_overrides(overrides)
    given = {o.key_or_group: o for o in parsed if not o.is_delete()}
    cfg = cfg.copy()
    for node in _TRAINED:
        if node not in saved or node in given:
            continue
        if node == "task":
            cfg.task = saved["task"]
            continue
        typed = _typed(node, saved[node])
        with open_dict(typed):
            for key, o in given.items():
                if key.startswith(f"{node}."):
                    OmegaConf.update(typed, key.split(".", 1)[1], o.value(), merge=True)
        cfg[node] = typed
    return cfg


def _typed(node: str, values: dict) -> DictConfig:
    # `values` (a saved node, plain JSON) under the schema of its group whose keys
    # it has: the checks and types a composed node gets.
    if node == "trainer":
        schemas = [TrainerConfig]
    else:
        schemas = [c for path, c in SCHEMAS.items() if path.split("/")[0] == node]
    keys = lambda c: {f.name for f in dataclasses.fields(c)}
    schema = max(
        schemas, key=lambda c: len(keys(c) & set(values)) - len(keys(c) ^ set(values))
    )
    known = {k: v for k, v in values.items() if k in keys(schema)}
    return OmegaConf.merge(OmegaConf.structured(schema), known)


def use_checkpoint(task: Task, config: Config, cfg: DictConfig) -> dict:
    """`mode=evaluate`: the task's eval metrics of the checkpoint's model, printed;
    `mode=sample`: the task's sample, printed. The model is built as the config
    says and its arrays read from the checkpoint (`lowtrain.load_model`: a config
    that builds another model is an error naming the first array that differs)."""
    path = checkpoint_path(config.checkpoint)
    # The optimizer is built as training built it, but never used.
    steps = config.trainer.steps or config.optimizer.warmup_steps + 1
    trainer, key = _common.build_trainer(task, config, cfg, steps=steps)
    state = trainer.init(key=key)
    if trainer.model_state is None:
        model, model_state = lowtrain.load_model(path, state.model), None
    else:
        model, model_state = lowtrain.load_model(path, state.model, state.model_state)
    state = dataclasses.replace(state, model=model, model_state=model_state)
    log.info("%s of %s", config.mode, path)
    if config.mode == "sample":
        text = task.sample(trainer, state.model, config, path)
        print(text)
        return {"final": {"characters": len(text)}, "checkpoint": str(path)}
    data = task.data(config)
    metrics = trainer.run_evaluation(state, data.eval)
    for name, value in metrics.items():
        print(f"eval {name}: {value:.6g}")
    return {
        "final": {f"eval_{k}": v for k, v in metrics.items()},
        "checkpoint": str(path),
    }


def _json(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if hasattr(value, "name"):  # an Enum
        return value.name
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
