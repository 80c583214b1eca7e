"""Loggers: where a run's metrics go. A logger is anything with `log_metrics(metrics,
step)`, `log_hyperparams(params)` and `close()` (the `Logger` protocol, as
Lightning's loggers have it); lowtrain ships one per common destination: a JSONL
file, a CSV file, TensorBoard, Weights & Biases and MLflow.

The `Trainer` calls its loggers on process 0 only (`jax.process_index() == 0`), with
the record it writes to the metrics file: the step, the loss, the loss scale, ...
The loggers of optional packages (`tensorboardX`, `wandb`, `mlflow`) import them
when constructed and start their writer, run or client at first use, so building
one costs little and a logger never used writes nothing.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._metrics import JsonlWriter, to_json


@runtime_checkable
class Logger(Protocol):
    """What the `Trainer` logs to: anything with these three methods.

    - `log_metrics(metrics, step)`: one record of scalar metrics (floats, ints or
      0-d NumPy/JAX arrays; None for a value not known, which loggers skip) at
      train step `step`.
    - `log_hyperparams(params)`: the run's configuration, a nested dict; each logger
      flattens it as its destination needs (`{"optimizer": {"lr": 0.1}}` as
      `optimizer.lr`).
    - `close()`: flush and release; the logger is not used after it.

    Subclass `LoggerBase` to write only `log_metrics`.

    ```python
    import lowtrain

    class Printer:
        def log_metrics(self, metrics, step):
            print(step, metrics)

        def log_hyperparams(self, params):
            pass

        def close(self):
            pass

    assert isinstance(Printer(), lowtrain.train.Logger)
    ```
    """

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one record.

        **Arguments:**

        - `metrics`: scalar metrics by name: floats, ints or 0-d NumPy/JAX arrays;
          None for a value not known.
        - `step`: the train step of the record, an int.
        """

    def log_hyperparams(self, params: dict) -> None:
        """Log the run's configuration `params`, a nested dict, flattened as the
        destination needs (`{"optimizer": {"lr": 0.1}}` as `optimizer.lr`)."""

    def close(self) -> None: ...


class LoggerBase:
    """A `Logger` to subclass: write `log_metrics`; `log_hyperparams`, `flush` (which
    `Trainer.fit` calls at its end, where a logger has it) and `close` do nothing
    unless overridden. A logger is also a context manager that closes it.

    ```python
    import lowtrain

    class Collect(lowtrain.train.LoggerBase):
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics["loss"]))

    with Collect() as logger:
        logger.log_hyperparams({"lr": 0.1})
        logger.log_metrics({"loss": 0.5}, step=10)
    assert logger.rows == [(10, 0.5)]
    assert isinstance(logger, lowtrain.train.Logger)
    ```
    """

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one record; a subclass defines it (here it raises
        `NotImplementedError`).

        **Arguments:**

        - `metrics`: scalar metrics by name: floats, ints or 0-d NumPy/JAX arrays;
          None for a value not known. A `"step"` entry is ignored: `step` is used.
        - `step`: the train step of the record, an int.
        """
        raise NotImplementedError(
            f"Expected `{type(self).__name__}` to define `log_metrics(metrics, "
            "step)`, got none. Write it in the subclass."
        )

    def log_hyperparams(self, params: dict) -> None:
        """Log the run's configuration `params`, a nested dict; here it does
        nothing."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- helpers ---------------------------------------------------------------------------


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """`metrics` as `{name: float}`: None values and a `"step"` entry left out (the
    step is the x axis every logger has)."""
    out = {}
    for name, value in metrics.items():
        if value is None or name == "step":
            continue
        if np.ndim(value) != 0:
            raise TypeError(
                f"Expected scalar metrics (floats, ints or 0-d arrays), got "
                f"`{name}` of shape {np.shape(value)} instead. Log a summary of it "
                "(its mean or norm)."
            )
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"Expected scalar metrics (floats, ints or 0-d arrays), got `{name}` "
                f"= {value!r} instead. Log numbers only."
            ) from None
    return out


def _flatten(params: Mapping, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """`{"optimizer": {"lr": 0.1}}` as `{"optimizer.lr": 0.1}`: nested mappings
    flattened, keys joined by `sep`, values as JSON-ready Python values."""
    out = {}
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out |= _flatten(value, name, sep)
        else:
            out[name] = to_json(value)
    return out


def _extra(module: str, extra: str, logger: str) -> None:
    """Raise `ImportError` naming the extra that installs `module`, if it is not
    installed."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"Expected the `{module}` package for `{logger}`, got none installed. "
            f"Install it with `pip install 'lowtrain[{extra}]'`."
        )


# -- JSONL and CSV files ---------------------------------------------------------------


class JsonlLogger(LoggerBase):
    """One JSON object per `log_metrics` call, `{"step": step, **metrics}`, appended
    to `path` and flushed: the metrics file of `Trainer.fit`.

    Values are written as given (ints stay ints, None is `null`); non-finite floats
    as `NaN` / `Infinity`, as Python's `json` writes them. With `after_step` (a run
    resumed from that step) the file is first made one row per step again: a torn
    last line is dropped and the rows of later steps move to `<path>.replaced`.
    `log_hyperparams` writes nothing (the metrics file holds metrics only).

    **Arguments:**

    - `path`: the file, a string or path (its folder is made if missing).
    - `after_step`: the step a resumed run goes on from, or None (default): the
      file is appended to as it is.

    ```python
    import json, pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    with lowtrain.train.JsonlLogger(path) as logger:
        logger.log_metrics({"loss": jnp.float32(0.5), "lr": None}, step=1)
    assert json.loads(path.read_text()) == {"step": 1, "loss": 0.5, "lr": None}
    ```
    """

    def __init__(self, path, after_step: int | None = None):
        self.path = pathlib.Path(path)
        self._writer = JsonlWriter(self.path, after_step=after_step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        rest = {k: v for k, v in metrics.items() if k != "step"}
        self._writer.write({"step": int(step), **rest})

    def close(self) -> None:
        self._writer.close()


def _csv_text(columns: list[str], rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _replace_text(path: pathlib.Path, text: str) -> None:
    # Written beside it and renamed: a crash leaves the old file or the new one.
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(text, encoding="utf-8")
    temp.replace(path)


class CSVLogger(LoggerBase):
    """One row per `log_metrics` call in the CSV file `path`, the column `step`
    first, flushed; `csv.DictReader` reads it back.

    A record that brings new metric names widens the file: it is rewritten with the
    new columns appended to its header, and the earlier rows get empty cells there
    (as Lightning's `CSVLogger` does); a metric a record lacks (or logs as None) is
    an empty cell. Floats are written as Python prints them, so they read back
    exactly with `float`; NaN and infinities as `nan`, `inf`, `-inf`. An existing
    file is appended to, keeping its columns; a torn last line (a crash while
    writing it) is dropped. With `after_step` (a run resumed from that step), its
    rows of later steps move to `<path>.replaced` (appended there, header first),
    as `JsonlLogger` does. `log_hyperparams` writes nothing.

    **Arguments:**

    - `path`: the file, a string or path (its folder is made if missing).
    - `after_step`: the step a resumed run goes on from, or None (default): no row
      is moved.

    ```python
    import csv, pathlib, tempfile
    import lowtrain

    path = pathlib.Path(tempfile.mkdtemp()) / "metrics.csv"
    with lowtrain.train.CSVLogger(path) as logger:
        logger.log_metrics({"loss": 0.5}, step=1)
        logger.log_metrics({"loss": 0.25, "eval_loss": 0.3}, step=2)
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert rows[0] == {"step": "1", "loss": "0.5", "eval_loss": ""}
    assert float(rows[1]["eval_loss"]) == 0.3
    ```
    """

    def __init__(self, path, after_step: int | None = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._columns = ["step"]
        if self.path.exists() and self.path.stat().st_size:
            self._resume(after_step)
        self._file = open(self.path, "a", encoding="utf-8", newline="")

    def _resume(self, after_step: int | None) -> None:
        text = self.path.read_text(encoding="utf-8")
        kept = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
        if not kept:  # only a torn header: start the file anew
            _replace_text(self.path, "")
            return
        reader = csv.DictReader(io.StringIO(kept))
        columns = list(reader.fieldnames or [])
        if "step" not in columns:
            raise ValueError(
                f"Expected a CSV file whose header names a `step` column at "
                f"{self.path}, got {columns} instead. Move the file, or log to "
                "another path."
            )
        self._columns = columns
        if after_step is not None:
            rows = list(reader)
            later = [r for r in rows if int(r["step"]) > after_step]
            if later:
                with open(f"{self.path}.replaced", "a", encoding="utf-8") as f:
                    f.write(_csv_text(columns, later))
                rows = [r for r in rows if int(r["step"]) <= after_step]
                kept = _csv_text(columns, rows)
        if kept != text:
            _replace_text(self.path, kept)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": int(step), **_scalars(metrics)}
        new = [name for name in row if name not in self._columns]
        if new:
            self._widen(new)
        writer = csv.DictWriter(
            self._file, self._columns, restval="", lineterminator="\n"
        )
        if self._file.tell() == 0:
            writer.writeheader()
        writer.writerow(row)
        self._file.flush()

    def _widen(self, new: list[str]) -> None:
        # Rewrite the file under the wider header: the earlier rows get empty cells.
        self._file.close()
        text = self.path.read_text(encoding="utf-8")
        self._columns = self._columns + new
        if text:  # else the header is written with the first row
            rows = list(csv.DictReader(io.StringIO(text)))
            _replace_text(self.path, _csv_text(self._columns, rows))
        self._file = open(self.path, "a", encoding="utf-8", newline="")

    def close(self) -> None:
        self._file.close()


# -- TensorBoard, Weights & Biases, MLflow ---------------------------------------------


class TensorBoardLogger(LoggerBase):
    """Scalars in TensorBoard event files under `logdir`, through tensorboardX
    (`pip install 'lowtrain[tensorboard]'`): each metric as `add_scalar(name,
    value, step)`, stored as float32 (TensorBoard's scalars); NaN and infinities
    are written as they are (tensorboardX logs a warning for each).
    `log_hyperparams` writes the flattened parameters as a text summary
    `hyperparams` (a table, shown in the Text tab). The writer (and its event file)
    is made at first use; `flush` (which `Trainer.fit` calls at its end) writes
    what it buffers, `close` flushes and closes it.

    ```python
    import pathlib, tempfile
    import lowtrain

    logdir = pathlib.Path(tempfile.mkdtemp()) / "tensorboard"
    with lowtrain.train.TensorBoardLogger(logdir) as logger:
        logger.log_metrics({"loss": 0.5}, step=1)
    assert list(logdir.glob("events.out.tfevents.*"))
    ```
    """

    def __init__(self, logdir):
        _extra("tensorboardX", "tensorboard", "TensorBoardLogger")
        self.logdir = pathlib.Path(logdir)
        self._writer = None

    @property
    def writer(self):
        """The `tensorboardX.SummaryWriter` (made at first use)."""
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(self.logdir))
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in _scalars(metrics).items():
            self.writer.add_scalar(name, value, int(step))

    def log_hyperparams(self, params: dict) -> None:
        lines = ["| name | value |", "| --- | --- |"]
        lines += [f"| {k} | {json.dumps(v)} |" for k, v in _flatten(params).items()]
        self.writer.add_text("hyperparams", "\n".join(lines), 0)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # flushes first
            self._writer = None


class WandbLogger(LoggerBase):
    """A Weights & Biases run (`pip install 'lowtrain[wandb]'`), started at first
    use by `wandb.init(project=project, name=name, dir=dir, config=config,
    **init_kwargs)`: each record is one `run.log(metrics, step=step)`, NaN and
    infinities as they are (wandb keeps them in the run's history).
    `log_hyperparams` updates the run's config (nested, as given); `close` finishes
    the run. W&B drops a record whose step is below one already logged. Offline
    (`WANDB_MODE=offline`, or `mode="offline"`) the run is written under
    `<dir>/wandb/` for `wandb sync`.

    **Arguments:**

    - `project`: the W&B project; None (default): wandb's default.
    - `name`: the run's display name; None (default): W&B picks one.
    - `dir`: the folder wandb writes under (made if missing); None (default):
      wandb's default.
    - `config`: the run's initial config, a dict; None (default): empty.
    - `**init_kwargs`: any other argument of `wandb.init` (`mode`, `entity`,
      `tags`, ...).

    ```python
    import pathlib, tempfile
    import lowtrain

    out = pathlib.Path(tempfile.mkdtemp())
    # Offline: nothing leaves this machine (as `WANDB_MODE=offline` does).
    logger = lowtrain.train.WandbLogger(project="demo", dir=out, mode="offline")
    logger.log_metrics({"loss": 0.5}, step=1)
    assert logger.run.project == "demo"
    logger.close()
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    ```
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        dir=None,
        config: dict | None = None,
        **init_kwargs,
    ):
        _extra("wandb", "wandb", "WandbLogger")
        self._init = dict(project=project, name=name, config=config, **init_kwargs)
        self.dir = None if dir is None else pathlib.Path(dir)
        self._run = None
        self._finished = False

    @property
    def run(self):
        """The `wandb` run (started at first use; kept, finished, after `close`)."""
        if self._run is None:
            import wandb

            kwargs = dict(self._init)
            if self.dir is not None:
                self.dir.mkdir(parents=True, exist_ok=True)
                kwargs["dir"] = str(self.dir)
            self._run = wandb.init(**kwargs)
        return self._run

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(_scalars(metrics), step=int(step))

    def log_hyperparams(self, params: dict) -> None:
        self.run.config.update(to_json(dict(params)), allow_val_change=True)

    def close(self) -> None:
        if self._run is not None and not self._finished:
            self._run.finish()
            self._finished = True


def _is_local(uri: str) -> bool:
    # A path, or a file: URI: MLflow's file store.
    return "://" not in uri or uri.startswith("file:")


class MLflowLogger(LoggerBase):
    """An MLflow run (`pip install 'lowtrain[mlflow]'`) in the experiment
    `experiment_name` (made if missing) of the tracking server or store at
    `tracking_uri`, started at first use; each record is one `log_batch` of its
    metrics at `step`; NaN and infinities are stored as they are.
    `log_hyperparams` logs the flattened parameters (`optimizer.lr`) as the run's
    params, their values as text; MLflow refuses to change a param already logged.
    `close` ends the run (`FINISHED`).

    A local store (`file:///...`, or a path) is MLflow's file store, which MLflow 3
    opens only with `MLFLOW_ALLOW_FILE_STORE=true` in the environment: for such a
    URI the logger sets it when it is unset. (`sqlite:///mlflow.db` is the database
    store MLflow recommends; it needs the full `mlflow` package.)

    **Arguments:**

    - `tracking_uri`: the tracking server or store: `http(s)://...`,
      `sqlite:///...`, `file:///...` or a path.
    - `experiment_name`: the experiment the run goes in (default "lowtrain").
    - `run_name`: the run's name; None (default): MLflow picks one.

    ```python
    import pathlib, tempfile
    import lowtrain

    uri = (pathlib.Path(tempfile.mkdtemp()) / "mlruns").as_uri()
    with lowtrain.train.MLflowLogger(uri, run_name="demo") as logger:
        logger.log_metrics({"loss": 0.5}, step=1)

    from mlflow.tracking import MlflowClient

    history = MlflowClient(uri).get_metric_history(logger.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5)]
    ```
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str = "lowtrain",
        run_name: str | None = None,
    ):
        _extra("mlflow", "mlflow", "MLflowLogger")
        self.tracking_uri = str(tracking_uri)
        self.experiment_name = experiment_name
        self.run_name = run_name
        self._client = None
        self._run_id = None
        self._ended = False

    @property
    def client(self):
        """The `mlflow.tracking.MlflowClient` of `tracking_uri` (made at first use)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            if _is_local(self.tracking_uri):
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def run_id(self) -> str:
        """The id of the run (started at first use; kept after `close`)."""
        if self._run_id is None:
            client = self.client
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                experiment_id = client.create_experiment(self.experiment_name)
            else:
                experiment_id = experiment.experiment_id
            run = client.create_run(experiment_id, run_name=self.run_name)
            self._run_id = run.info.run_id
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, int(step)) for k, v in _scalars(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_hyperparams(self, params: dict) -> None:
        from mlflow.entities import Param

        batch = [
            Param(k, v if isinstance(v, str) else json.dumps(v))
            for k, v in _flatten(params).items()
        ]
        for i in range(0, len(batch), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=batch[i : i + 100])

    def close(self) -> None:
        if self._run_id is not None and not self._ended:
            self.client.set_terminated(self._run_id)
            self._ended = True


# -- by name ---------------------------------------------------------------------------

LOGGERS = ("jsonl", "csv", "tensorboard", "wandb", "mlflow")


def make_logger(name: str, out_dir, *, after_step: int | None = None) -> Logger:
    """The logger the CLI names `name`, writing under the run directory `out_dir`:

    | name | logger | writes |
    | --- | --- | --- |
    | `jsonl` | `JsonlLogger` | `out_dir/metrics.jsonl` |
    | `csv` | `CSVLogger` | `out_dir/metrics.csv` |
    | `tensorboard` | `TensorBoardLogger` | `out_dir/tensorboard/` |
    | `wandb` | `WandbLogger`, project "lowtrain" | `out_dir/wandb/` |
    | `mlflow` | `MLflowLogger`, experiment "lowtrain" | `out_dir/mlruns/` (`file:`) |

    `after_step` (a run resumed from that step) goes to the file loggers, which
    drop the rows of later steps (see `JsonlLogger`). Another name raises
    `ValueError` listing the names.

    ```python
    import tempfile
    import lowtrain

    logger = lowtrain.train.make_logger("csv", tempfile.mkdtemp())
    assert isinstance(logger, lowtrain.train.CSVLogger)
    logger.close()
    ```
    """
    out = pathlib.Path(out_dir)
    if name == "jsonl":
        return JsonlLogger(out / "metrics.jsonl", after_step=after_step)
    if name == "csv":
        return CSVLogger(out / "metrics.csv", after_step=after_step)
    if name == "tensorboard":
        return TensorBoardLogger(out / "tensorboard")
    if name == "wandb":
        return WandbLogger(project="lowtrain", dir=out)
    if name == "mlflow":
        return MLflowLogger((out / "mlruns").resolve().as_uri())
    raise ValueError(
        f"Expected a logger name among {', '.join(map(repr, LOGGERS))}, got "
        f"{name!r} instead."
    )
