"""Stop signals and time-based saves: a run told to stop finishes its step, saves it,
says so in one line and exits with the signal's status; the resume continues as if
nothing happened. Real signals to real processes (the Python API and the CLI)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import lowtrain
from lowtrain.train import Preempted
from lowtrain.train._checkpoint import list_checkpoints
from lowtrain.train._preemption import SignalWatch, check_stop_signals

from .helpers import ROOT, SGD, Mse, fake_mnist, make_data, make_model
from .test_recipes import TINY_MNIST

_CHILD = """
import sys, pathlib, jax
sys.path.insert(0, {root!r})
from lowtrain.train import Preempted
from tests.helpers import Mse, SGD, make_data, make_model
folder, steps, resume = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
trainer = Mse(make_model(), SGD(0.05))
state = trainer.init(key=jax.random.key(0))
try:
    state = trainer.fit(state, make_data(), steps=steps, checkpoint_dir=folder / "ckpt",
                        checkpoint_every=10_000, metrics_file=folder / "metrics.jsonl",
                        log_every=1, progress=False, resume=resume == "resume")
except Preempted as e:
    print(e, file=sys.stderr)
    sys.exit(e.exit_code)
import equinox as eqx, numpy as np
leaves = jax.tree.leaves(eqx.filter(state.model, eqx.is_array))
np.save(folder / "final.npy", np.concatenate([np.ravel(x) for x in leaves]))
"""


def _rows(metrics: pathlib.Path) -> int:
    return metrics.read_text().count("\n") if metrics.exists() else 0


def _signal_when_running(child, metrics, signum, rows=3) -> None:
    # Sent once the run is past its compile and logging: mid-run, between steps.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if _rows(metrics) >= rows:
            break
        time.sleep(0.02)
    assert child.poll() is None, "the run ended before the signal"
    child.send_signal(signum)


def _losses(metrics: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), "a step logged twice"
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_the_resume_matches(tmp_path, signum):
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=str(ROOT)))
    run = lambda folder, *how: subprocess.run(
        [sys.executable, str(script), str(folder), "3000", *how],
        capture_output=True,
        text=True,
    )
    folder = tmp_path / "stopped"
    child = subprocess.Popen(
        [sys.executable, str(script), str(folder), "3000", "new"],
        stderr=subprocess.PIPE,
        text=True,
    )
    _signal_when_running(child, folder / "metrics.jsonl", signum)
    err = child.communicate(timeout=120)[1]
    assert child.returncode == 128 + signum
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"stopped by {signal.Signals(signum).name} at step ")
    step = int(line.split(" at step ")[1].split(",")[0])
    assert 3 <= step < 3000
    assert lowtrain.latest_checkpoint(folder / "ckpt").name.endswith(f"{step:06d}")
    assert max(_losses(folder / "metrics.jsonl")) == step  # the last step logged

    resumed = run(folder, "resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = run(tmp_path / "whole", "new")
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert _losses(folder / "metrics.jsonl") == _losses(
        tmp_path / "whole/metrics.jsonl"
    )
    np.testing.assert_array_equal(
        np.load(folder / "final.npy"), np.load(tmp_path / "whole/final.npy")
    )


def test_a_second_signal_acts_at_once():
    # The first is noted; the second of the same kind does what it did before the
    # watch (SIGINT: KeyboardInterrupt), and leaving the watch restores the handler.
    before = signal.getsignal(signal.SIGINT)
    with SignalWatch(check_stop_signals(["SIGINT"])) as watch:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # delivered between bytecodes
        assert watch.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_signals_are_checked():
    assert check_stop_signals(["SIGUSR1", 15]) == (signal.SIGUSR1, signal.SIGTERM)
    assert check_stop_signals(None) == ()
    with pytest.raises(ValueError, match="SIGTERM"):
        check_stop_signals(["SIGTERN"])
    with pytest.raises(ValueError, match="no process can"):
        check_stop_signals(["SIGKILL"])


def test_a_signal_without_a_checkpoint_dir_stops_and_says_nothing_was_saved():
    trainer = Mse(make_model(), SGD(0.05))
    state = trainer.init(key=jax.random.key(0))

    def interrupt(info):
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)

    trainer.add_hook(interrupt)
    with pytest.raises(Preempted, match="at step 3, not saved") as e:
        trainer.fit(
            state, make_data(), steps=50, progress=False, stop_signals=["SIGUSR1"]
        )
    assert e.value.exit_code == 128 + signal.SIGUSR1 and e.value.path is None
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_checkpoints_on_time(tmp_path):
    # `checkpoint_every_minutes`: a save whenever that long has passed since the
    # last; here (a microsecond) after every step.
    trainer = Mse(make_model(), SGD(0.05))
    state = trainer.init(key=jax.random.key(0))
    trainer.fit(
        state,
        make_data(),
        steps=4,
        checkpoint_dir=tmp_path,
        checkpoint_every_minutes=1e-8,
        keep_checkpoints=10,
        progress=False,
    )
    saved = [step for step, _ in list_checkpoints(tmp_path)]
    assert saved == [1, 2, 3, 4]
    for bad in (0, -1.0, float("inf"), "5"):
        with pytest.raises(ValueError, match="checkpoint_every_minutes"):
            trainer.fit(
                trainer.init(key=jax.random.key(0)),
                make_data(),
                steps=2,
                checkpoint_dir=tmp_path / "x",
                checkpoint_every_minutes=bad,
            )


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_cli_stopped_by_a_signal_says_so_and_resumes_exactly(tmp_path, signum):
    # A real `python -m lowtrain` run: one line, the signal's status, a checkpoint
    # of the step reached; the resume command it prints continues the run, which
    # then has the per-step losses and final metrics of the run that did not stop.
    folder = fake_mnist(tmp_path / "idx")
    args = [
        "recipe=mnist",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY_MNIST,
        "trainer.steps=1500",
        "trainer.log_every=1",
        "trainer.eval_every=null",
        "trainer.checkpoint_every=null",
        "trainer.prefetch=0",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cli = lambda *more: [sys.executable, "-m", "lowtrain", *args, *more]
    child = subprocess.Popen(
        cli("hydra.run.dir=stopped"),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _signal_when_running(child, tmp_path / "stopped/metrics.jsonl", signum, rows=5)
    err = child.communicate(timeout=300)[1]
    assert child.returncode == 128 + signum, err[-2000:]
    line = err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert line.startswith(f"lowtrain: stopped by {name} at step "), line
    assert "trainer.resume=true" in line and "Traceback" not in err
    again = line.split("resume with: ")[1].split()
    assert again[:3] == ["python", "-m", "lowtrain"]
    resumed = subprocess.run(
        [sys.executable, *again[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = subprocess.run(
        cli("hydra.run.dir=whole"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    ours = _losses(tmp_path / "stopped/metrics.jsonl")
    assert ours == _losses(tmp_path / "whole/metrics.jsonl") and len(ours) == 1500
    summary = lambda d: json.loads((tmp_path / d / "summary.json").read_text())["final"]
    assert summary("stopped") == summary("whole")
