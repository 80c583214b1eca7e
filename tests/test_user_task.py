"""A user's own task from the command line: `tests/user_task/cnn_bn.py` (a small CNN
with BatchNorm on MNIST, defined outside lowtrain, with its own config group) trains
in fp32, bf16, fp16 and fp8, stops early, keeps its best checkpoint, which loads with
`lowtrain.load_model` and round-trips through safetensors bit for bit."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import pytest

import lowtrain

from .helpers import fake_mnist

ROOT = pathlib.Path(__file__).resolve().parent.parent
USER = ROOT / "tests" / "user_task"


def _cli(tmp_path, *overrides, multirun=False):
    folder = fake_mnist(tmp_path / "idx", n_train=512, n_test=128)
    command = [
        sys.executable,
        "-m",
        "lowtrain",
        *(["-m"] if multirun else []),
        "--config-dir",
        str(USER / "conf"),
        "task=cnn_bn.CnnBnTask",
        "model=cnn_bn",
        "model.eval_examples=128",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.epochs=null",
        "trainer.batch_size=32",
        "trainer.eval_every=4",
        "trainer.log_every=4",
        "trainer.checkpoint_every=null",
        "trainer.progress=false",
        "trainer.monitor=eval_accuracy",
        "trainer.monitor_mode=max",
        "trainer.early_stopping=2",
        "trainer.keep_best=1",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(USER)}
    return subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900
    )


def _like(precision: str):
    """The model and state the task builds, as the Trainer stores them."""
    sys.path.insert(0, str(USER))
    try:
        import cnn_bn
    finally:
        sys.path.remove(str(USER))
    model, state = eqx.nn.make_with_state(cnn_bn.CnnBn)((8, 16), key=jax.random.key(0))
    return model, state


def test_user_task_stops_early_and_its_best_checkpoint_round_trips(tmp_path):
    run = tmp_path / "run"
    done = _cli(tmp_path, "precision=fp8", "trainer.steps=400", f"hydra.run.dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    log = (run / "lowtrain.log").read_text()
    assert "stopping at step" in log and "early stopping" in log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early_at"] < 400 and summary["steps"] < 400
    assert summary["final"]["eval_accuracy"] > 0.5  # the fake digits are easy
    rows = lowtrain.train._metrics.read_jsonl(run / "metrics.jsonl")
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    best_step, best_value = max(evals, key=lambda e: (e[1], -e[0]))
    # Early stopping: the last two evals are no better than the best before them.
    assert (
        all(v <= best_value for _, v in evals[-2:]) and evals[-1][0] == summary["steps"]
    )

    best = lowtrain.train.best_checkpoint(run / "checkpoints")
    assert best.name == f"ckpt_{best_step:08d}"
    like_model, like_state = _like("fp8")
    model, state = lowtrain.load_model(best, like_model, like_state)
    assert state.get(model.norms[0].ema_state_index)[0].dtype == np.float32
    path = tmp_path / "model.safetensors"
    lowtrain.save_safetensors(model, path)
    again = lowtrain.load_safetensors(path, like_model)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(again, eqx.is_array)),
        strict=True,
    ):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()

    # `mode=evaluate` reads the run's best checkpoint and gives its accuracy again.
    done = _cli(
        tmp_path, "precision=fp8", "mode=evaluate", f"checkpoint={run}",
        f"hydra.run.dir={tmp_path / 'eval'}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shown = float(done.stdout.split("eval accuracy:")[1].split()[0])
    assert shown == pytest.approx(best_value, abs=1e-6)
    assert not (tmp_path / "eval").exists()  # nothing kept from an evaluation


@pytest.mark.slow  # four runs in one sweep: about 30 s on two cores
def test_user_task_trains_in_every_precision(tmp_path):
    done = _cli(
        tmp_path,
        "precision=fp32,bf16,fp16,fp8",
        "trainer.steps=40",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        multirun=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(runs) == 4
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["final"]["eval_accuracy"] > 0.5, run.name
        assert summary["skipped_steps"] <= 2, run.name  # fp16: a few at most
