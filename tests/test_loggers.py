"""Loggers: what each one writes reads back, with its own destination's reader, as
the values logged: JSONL and CSV files (`csv.DictReader`), TensorBoard event files
(TensorBoard's `EventAccumulator`), a W&B offline run (its `.wandb` records, parsed
with wandb's protobuf schema) and an MLflow file store (`MlflowClient`)."""

import csv
import json
import math
import os
import pathlib
import struct
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain
from lowtrain.train import (
    CSVLogger,
    JsonlLogger,
    Logger,
    LoggerBase,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    make_logger,
)

NAN, INF = float("nan"), float("inf")

# Three records as the Trainer writes them: Python and NumPy/JAX scalars, a step key,
# a value not known (None), non-finite values.
RECORDS = [
    (1, {"step": 1, "loss": 2.5, "loss_scale": 32768, "learning_rate": None}),
    (2, {"loss": jnp.float32(0.1), "grad_norm": np.float64(INF), "skipped": 1}),
    (3, {"loss": 0.1 + 0.2, "grad_norm": NAN, "eval_loss": jnp.asarray(1.25)}),
]


def _expected() -> dict[str, list[tuple[int, float]]]:
    # {name: [(step, value)]}: what every logger but JSONL logs (floats, no None).
    out: dict[str, list] = {}
    for step, metrics in RECORDS:
        for name, value in metrics.items():
            if name != "step" and value is not None:
                out.setdefault(name, []).append((step, float(value)))
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _log_all(logger):
    for step, metrics in RECORDS:
        logger.log_metrics(metrics, step)


# -- the protocol -------------------------------------------------------------------


def test_every_logger_is_a_logger(tmp_path):
    class Collect(LoggerBase):
        def log_metrics(self, metrics, step):
            pass

    assert isinstance(Collect(), Logger)
    assert not isinstance(object(), Logger)
    with pytest.raises(NotImplementedError, match="define `log_metrics"):
        LoggerBase().log_metrics({"loss": 1.0}, 0)
    for name in ("jsonl", "csv"):
        with make_logger(name, tmp_path) as logger:
            assert isinstance(logger, Logger)


def test_make_logger_names_and_places(tmp_path):
    jsonl = make_logger("jsonl", tmp_path)
    assert isinstance(jsonl, JsonlLogger) and jsonl.path == tmp_path / "metrics.jsonl"
    jsonl.close()
    csv_logger = make_logger("csv", tmp_path)
    assert isinstance(csv_logger, CSVLogger)
    assert csv_logger.path == tmp_path / "metrics.csv"
    csv_logger.close()
    if _installed("tensorboardX"):
        tb = make_logger("tensorboard", tmp_path)
        assert (
            isinstance(tb, TensorBoardLogger) and tb.logdir == tmp_path / "tensorboard"
        )
    if _installed("wandb"):
        wb = make_logger("wandb", tmp_path)
        assert isinstance(wb, WandbLogger) and wb.dir == tmp_path
    if _installed("mlflow"):
        ml = make_logger("mlflow", tmp_path)
        assert isinstance(ml, MLflowLogger)
        assert ml.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    # Nothing is started or written before the first record.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.csv",
        "metrics.jsonl",
    ]
    with pytest.raises(ValueError, match=r"among 'jsonl', 'csv', .*got 'neptune'"):
        make_logger("neptune", tmp_path)
    # A resumed run's file loggers drop the rows after its step.
    for name in ("jsonl", "csv"):
        with make_logger(name, tmp_path) as logger:
            logger.log_metrics({"loss": 1.0}, 1)
        make_logger(name, tmp_path, after_step=0).close()
        assert (tmp_path / f"metrics.{name}.replaced").exists()


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "cls, module, extra, args",
    [
        (TensorBoardLogger, "tensorboardX", "tensorboard", ("tb",)),
        (WandbLogger, "wandb", "wandb", ()),
        (MLflowLogger, "mlflow", "mlflow", ("file:///tmp/none",)),
    ],
)
def test_a_missing_extra_is_named(cls, module, extra, args, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=rf"pip install 'lowtrain\[{extra}\]'"):
        cls(*args)


def test_non_scalar_metrics_are_refused(tmp_path):
    with CSVLogger(tmp_path / "m.csv") as logger:
        with pytest.raises(TypeError, match=r"got `acts` of shape \(3,\) instead"):
            logger.log_metrics({"acts": jnp.zeros(3)}, 0)
        with pytest.raises(TypeError, match="got `name` = 'x' instead"):
            logger.log_metrics({"name": "x"}, 0)


# -- JSONL ---------------------------------------------------------------------------


def test_jsonl_logger_writes_the_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlLogger(path) as logger:
        _log_all(logger)
    rows = lowtrain.train._metrics.read_jsonl(path)
    assert rows[0] == {
        "step": 1,
        "loss": 2.5,
        "loss_scale": 32768,
        "learning_rate": None,
    }
    assert rows[1]["loss"] == float(np.float32(0.1)) and rows[1]["grad_norm"] == INF
    assert rows[1]["skipped"] == 1 and isinstance(rows[1]["skipped"], int)
    assert math.isnan(rows[2]["grad_norm"]) and rows[2]["eval_loss"] == 1.25
    assert "NaN" in path.read_text() and "Infinity" in path.read_text()


def test_jsonl_logger_resumes_after_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlLogger(path) as logger:
        _log_all(logger)
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # torn by a crash
    with JsonlLogger(path, after_step=2) as logger:
        logger.log_metrics({"loss": 0.5}, 3)
    steps = [r["step"] for r in lowtrain.train._metrics.read_jsonl(path)]
    assert steps == [1, 2, 3]
    replaced = lowtrain.train._metrics.read_jsonl(f"{path}.replaced")
    assert [r["step"] for r in replaced] == [3]


# -- CSV -----------------------------------------------------------------------------


def _read_csv(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def test_csv_logger_reads_back_exactly(tmp_path):
    path = tmp_path / "metrics.csv"
    with CSVLogger(path) as logger:
        _log_all(logger)
    columns, rows = _read_csv(path)
    assert columns == [
        "step", "loss", "loss_scale", "grad_norm", "skipped", "eval_loss"
    ]  # fmt: skip
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for name, points in _expected().items():
        got = [(int(r["step"]), float(r[name])) for r in rows if r[name] != ""]
        assert len(got) == len(points), name
        assert all(s == t and _same(a, b) for (s, a), (t, b) in zip(got, points))
    assert "learning_rate" not in columns  # only ever None: no column


def test_csv_header_widens_and_old_rows_get_empty_cells(tmp_path):
    path = tmp_path / "metrics.csv"
    with CSVLogger(path) as logger:
        logger.log_metrics({"loss": 1.0}, 0)
        logger.log_metrics({"loss": 0.5}, 1)
        assert _read_csv(path)[0] == ["step", "loss"]
        logger.log_metrics({"loss": 0.25, "eval_loss": 0.3}, 2)
        logger.log_metrics({"eval_loss": 0.2}, 3)  # no loss: an empty cell
    columns, rows = _read_csv(path)
    assert columns == ["step", "loss", "eval_loss"]
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in rows] == [
        ("0", "1.0", ""),
        ("1", "0.5", ""),
        ("2", "0.25", "0.3"),
        ("3", "", "0.2"),
    ]
    assert path.read_text().count("step") == 1  # one header


def test_csv_logger_resumes_appending_with_its_columns(tmp_path):
    path = tmp_path / "metrics.csv"
    with CSVLogger(path) as logger:
        logger.log_metrics({"loss": 1.0, "acc": 0.1}, 1)
        logger.log_metrics({"loss": 0.5, "acc": 0.2}, 2)
    with CSVLogger(path) as logger:  # the same run, another process
        logger.log_metrics({"acc": 0.3}, 3)
        logger.log_metrics({"loss": 0.1, "lr": 0.01}, 4)
    columns, rows = _read_csv(path)
    assert columns == ["step", "loss", "acc", "lr"]
    assert [(r["step"], r["loss"], r["acc"], r["lr"]) for r in rows] == [
        ("1", "1.0", "0.1", ""),
        ("2", "0.5", "0.2", ""),
        ("3", "", "0.3", ""),
        ("4", "0.1", "", "0.01"),
    ]


def test_csv_logger_resume_drops_a_torn_row_and_later_steps(tmp_path):
    path = tmp_path / "metrics.csv"
    with CSVLogger(path) as logger:
        for step in range(1, 5):
            logger.log_metrics({"loss": 1 / step}, step)
    with open(path, "a") as f:
        f.write("5,0.2")  # torn by a crash
    with CSVLogger(path, after_step=2) as logger:
        logger.log_metrics({"loss": 0.3}, 3)
    assert [(r["step"], r["loss"]) for r in _read_csv(path)[1]] == [
        ("1", "1.0"),
        ("2", "0.5"),
        ("3", "0.3"),
    ]
    columns, replaced = _read_csv(f"{path}.replaced")
    assert columns == ["step", "loss"]
    assert [r["step"] for r in replaced] == ["3", "4"]
    path.write_text("st")  # a header torn mid-write: the file starts anew
    with CSVLogger(path) as logger:
        logger.log_metrics({"loss": 1.0}, 1)
    assert _read_csv(path) == (["step", "loss"], [{"step": "1", "loss": "1.0"}])


# -- TensorBoard ---------------------------------------------------------------------


def test_tensorboard_logger_reads_back_with_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from tensorboard.util import tensor_util

    logdir = tmp_path / "tb"
    logger = TensorBoardLogger(logdir)
    assert not logdir.exists()  # the writer starts at first use
    logger.log_hyperparams({"optimizer": {"lr": 0.1, "name": "adamw"}, "steps": 3})
    _log_all(logger)
    logger.close()

    events = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    expected = _expected()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for name, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(name)]
        # TensorBoard keeps scalars as float32.
        want = [(s, float(np.float32(v))) for s, v in points]
        assert len(got) == len(want), name
        assert all(s == t and _same(a, b) for (s, a), (t, b) in zip(got, want))
    (text,) = events.Tensors("hyperparams/text_summary")
    table = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert "| optimizer.lr | 0.1 |" in table and '| optimizer.name | "adamw" |' in table


# -- Weights & Biases ------------------------------------------------------------------


def _wandb_records(path: pathlib.Path):
    """The records of a `.wandb` file, parsed with wandb's protobuf schema. The file
    is a LevelDB-style log: a 7-byte header (`:W&B`, magic, version), then 32 KiB
    blocks of chunks, each a 7-byte header (CRC-32, length, type: full, first,
    middle, last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    i, chunks = 7, []
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a header: padding
            i += 32768 - i % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[i : i + 7])
        if kind == 0:
            break
        chunks.append(data[i + 7 : i + 7 + length])
        i += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def test_wandb_logger_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    # mode= rather than WANDB_MODE: wandb reads its environment once per process, so
    # an earlier run in this worker (the docs example) would hide the variable.
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="lowtrain", name="test", dir=tmp_path, mode="offline")
    assert not (tmp_path / "wandb").exists()  # the run starts at first use
    logger.log_hyperparams({"optimizer": {"lr": 0.1}, "steps": 3})
    _log_all(logger)
    run = logger.run
    logger.close()
    assert logger.run is run and run.name == "test"  # no second run after `close`
    logger.close()  # twice: nothing more

    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            values = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            for name, value in values.items():
                if not name.startswith("_"):  # wandb's own: _step, _runtime, ...
                    history.setdefault(name, []).append((values["_step"], value))
        elif kind == "config":
            config |= {
                u.key or "/".join(u.nested_key): json.loads(u.value_json)
                for u in record.config.update
            }
    expected = _expected()
    assert sorted(history) == sorted(expected)
    for name, points in expected.items():
        got = history[name]
        assert len(got) == len(points), name
        assert all(s == t and _same(a, b) for (s, a), (t, b) in zip(got, points))
    assert config == {"optimizer": {"lr": 0.1}, "steps": 3}


# -- MLflow ----------------------------------------------------------------------------


def test_mlflow_logger_reads_back_with_mlflow_client(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # The logger opts in to MLflow's file store for a `file:` URI, where unset.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLflowLogger(uri, run_name="test")
    assert not (tmp_path / "mlruns").exists()  # the run starts at first use
    logger.log_hyperparams({"optimizer": {"lr": 0.1, "name": "adamw"}, "steps": 3})
    _log_all(logger)
    run_id = logger.run_id
    logger.close()
    assert logger.run_id == run_id  # no second run after `close`
    logger.close()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "test"
    assert client.get_experiment(run.info.experiment_id).name == "lowtrain"
    params = run.data.params
    assert params == {"optimizer.lr": "0.1", "optimizer.name": "adamw", "steps": "3"}
    expected = _expected()
    assert sorted(run.data.metrics) == sorted(expected)
    for name, points in expected.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert len(got) == len(points), name
        assert all(s == t and _same(a, b) for (s, a), (t, b) in zip(got, points))
