"""`Trainer.fit`'s loop around the step: callbacks and their order with logs and
saves, stopping (a checkpoint of that step), `EarlyStopping`, `BestCheckpoint`,
`history`, loggers; evaluation (aux metrics, example-weighted means, the last
partial batch); data from iterators and grain, resumed exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
from lowtrain.train import (
    BestCheckpoint,
    Callback,
    EarlyStopping,
    StopTraining,
    best_checkpoint,
)


class Fit(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        err = jax.vmap(model)(batch["x"]) - batch["y"]
        loss = jnp.mean(err**2)
        return loss, {"mae": jnp.mean(jnp.abs(err))}


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.ones((3, 1), np.float32)}


def _trainer(lr=0.05):
    return Fit(eqx.nn.Linear(3, 1, key=jax.random.key(0)), optax.sgd(lr))


def _fit_with(callbacks, steps=3):
    trainer = _trainer()
    return trainer.fit(
        trainer.init(key=jax.random.key(1)),
        lowtrain.ArrayBatches(_data(), 8),
        steps=steps,
        callbacks=callbacks,
        progress=False,
    )


class Recorder(Callback):
    def __init__(self, events, every=1):
        self.events, self.every = events, every

    def on_fit_start(self, trainer, state):
        self.events.append(("fit_start", int(state.step)))

    def on_step_end(self, trainer, info):
        self.events.append(("step_end", info.step))

    def on_eval_end(self, trainer, info):
        self.events.append(("eval_end", info.step))

    def on_checkpoint(self, trainer, info, path):
        assert path.is_dir() and path.name.endswith(f"{info.step:08d}")
        self.events.append(("checkpoint", info.step))

    def on_fit_end(self, trainer, state):
        self.events.append(("fit_end", int(state.step)))


class RecordingLogger:
    def __init__(self, events):
        self.events = events

    def log_metrics(self, metrics, step):
        self.events.append(("log", step))


def test_order_of_logs_saves_callbacks_and_hooks(tmp_path):
    events = []
    trainer = _trainer()
    trainer.add_hook(lambda info: events.append(("hook", info.step)), every=2)
    data = lowtrain.ArrayBatches(_data(), 8)
    trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=4,
        log_every=2,
        eval_data=data,
        eval_every=4,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=2,
        callbacks=[Recorder(events, every=2)],
        loggers=[RecordingLogger(events)],
        progress=False,
    )
    assert events == [
        ("fit_start", 0),
        ("log", 2),
        ("checkpoint", 2),
        ("step_end", 2),
        ("hook", 2),
        ("log", 4),
        ("checkpoint", 4),
        ("eval_end", 4),
        ("step_end", 4),
        ("hook", 4),
        ("fit_end", 4),
    ]
    assert [r["step"] for r in trainer.history] == [2, 4]
    assert "eval_loss" in trainer.history[-1] and "eval_mae" in trainer.history[-1]


@pytest.mark.parametrize("how", ["raise", "info.stop"])
def test_stopping_saves_that_step_and_returns(tmp_path, how):
    events = []

    class Stop(Callback):
        def on_step_end(self, trainer, info):
            if info.step == 3:
                if how == "raise":
                    raise StopTraining("enough at 3")
                info.stop("enough at 3")

    trainer = _trainer()
    state = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        lowtrain.ArrayBatches(_data(), 8),
        steps=10,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=5,
        callbacks=[Stop(), Recorder(events)],
        progress=False,
    )
    assert int(state.step) == 3
    # `info.stop()` lets the callbacks after it run; raising skips them. Then the
    # step is saved, then on_fit_end.
    ran = [("step_end", 3)] if how == "info.stop" else [("step_end", 2)]
    assert events[-3:] == [*ran, ("checkpoint", 3), ("fit_end", 3)]
    path = lowtrain.latest_checkpoint(tmp_path / "ckpt")
    assert path.name == "ckpt_00000003"
    like = _trainer().init(key=jax.random.key(1))
    restored = lowtrain.load_checkpoint(path, like)
    np.testing.assert_array_equal(restored.model.weight, state.model.weight)


def test_stop_at_a_step_that_saved_saves_once(tmp_path):
    trainer = _trainer()
    trainer.add_hook(lambda info: info.stop(), every=5)
    saves = []

    class Count(Callback):
        def on_checkpoint(self, trainer, info, path):
            saves.append(info.step)

    trainer.fit(
        trainer.init(key=jax.random.key(1)),
        lowtrain.ArrayBatches(_data(), 8),
        steps=10,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=5,
        callbacks=[Count()],
        progress=False,
    )
    assert saves == [5]


def test_other_exceptions_from_callbacks_propagate():
    class Broken(Callback):
        def on_step_end(self, trainer, info):
            raise RuntimeError("a bug in my callback")

    with pytest.raises(RuntimeError, match="a bug in my callback"):
        _fit_with([Broken()])


def test_callbacks_and_loggers_are_checked():
    trainer = _trainer()
    state = trainer.init(key=jax.random.key(1))
    data = lowtrain.ArrayBatches(_data(), 8)
    with pytest.raises(TypeError, match="add_hook"):
        trainer.fit(state, data, steps=1, callbacks=[lambda i: None], progress=False)
    with pytest.raises(TypeError, match="log_metrics"):
        trainer.fit(state, data, steps=1, loggers=[object()], progress=False)


def test_step_end_without_overrides_costs_no_sync():
    # A callback that only watches evals does not make every step build a StepInfo.
    built = []

    class EvalOnly(Callback):
        def on_eval_end(self, trainer, info):
            built.append(info.step)

    trainer = _trainer()
    data = lowtrain.ArrayBatches(_data(), 8)
    original = lowtrain.train.FitRun.info

    def counting(*args):
        built.append("info")
        return original(*args)

    lowtrain.train.FitRun.info = counting
    try:
        trainer.fit(
            trainer.init(key=jax.random.key(1)),
            data,
            steps=6,
            log_every=None,
            eval_data=data,
            eval_every=3,
            callbacks=[EvalOnly()],
            progress=False,
        )
    finally:
        lowtrain.train.FitRun.info = original
    assert built == ["info", 3, "info", 6]


def test_early_stopping_modes_patience_and_delta():
    def run(values, **kw):
        stop = EarlyStopping(**kw)
        stop.on_fit_start(None, None)
        for step, v in enumerate(values, 1):
            info = lowtrain.StepInfo(
                step, None, 0.0, None, 1.0, 0, 0.0, None, 0.0, 0.0,
                record={"eval_loss": v, "eval_accuracy": v},
            )  # fmt: skip
            stop.on_eval_end(None, info)
            if info.stopping:
                return step, stop.best
        return None, stop.best

    assert run([3, 2, 2.5, 2.1, 2.2], patience=3) == (5, 2)
    assert run([3, 2, 2.5, 2.1, 2.2], patience=4) == (None, 2)
    assert run([3, 2.95, 2.9, 2.85], patience=2, min_delta=0.1) == (3, 3)
    assert run([1, 2, 3, 3, 3], mode="max", monitor="eval_accuracy", patience=2) == (
        5,
        3,
    )
    assert run([1, float("nan"), float("nan")], patience=2) == (3, 1)
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(mode="lowest")
    with pytest.raises(ValueError, match=r"`EarlyStopping\(patience=\)` >= 1, got 0"):
        EarlyStopping(patience=0)
    with pytest.raises(
        ValueError, match=r"`BestCheckpoint\(keep_checkpoints=\)` >= 1, got True"
    ):
        BestCheckpoint(keep_checkpoints=True)
    with pytest.raises(KeyError, match="eval_los"):
        run([1], monitor="eval_los")


def test_early_stopping_in_fit_saves_the_stopped_step(tmp_path):
    trainer = _trainer(lr=0.0)  # never improves
    data = lowtrain.ArrayBatches(_data(), 8)
    stop = EarlyStopping(patience=2)
    state = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=100,
        eval_data=data,
        eval_every=4,
        checkpoint_dir=tmp_path / "ckpt",
        callbacks=[stop],
        progress=False,
    )
    assert stop.stopped_step == 12 and int(state.step) == 12
    assert lowtrain.latest_checkpoint(tmp_path / "ckpt").name == "ckpt_00000012"


def test_best_checkpoint_keeps_the_best_and_finds_them_after_a_restart(tmp_path):
    values = iter([5.0, 3.0, 4.0, 1.0, 2.0, 6.0])

    class Scripted(Fit):
        def evaluate(self, model, batch):
            return {"loss": jnp.float32(0.0)}

    def evaluation(state, data):  # a scripted eval_loss per evaluation
        return {"loss": next(values)}

    ckpt = tmp_path / "ckpt"
    trainer = Scripted(eqx.nn.Linear(3, 1, key=jax.random.key(0)), optax.sgd(0.05))
    trainer.run_evaluation = evaluation
    best = BestCheckpoint(keep_checkpoints=2)
    data = lowtrain.ArrayBatches(_data(), 8)
    trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=8,
        eval_data=data,
        eval_every=2,
        checkpoint_dir=ckpt,
        callbacks=[best],
        progress=False,
    )  # evals at 2, 4, 6, 8: values 5, 3, 4, 1
    assert [(v, s) for v, s, _ in best.kept] == [(1.0, 8), (3.0, 4)]
    assert sorted(p.name for p in (ckpt / "best").iterdir()) == [
        "ckpt_00000004",
        "ckpt_00000008",
    ]
    assert best_checkpoint(ckpt) == ckpt.resolve() / "best" / "ckpt_00000008"
    # Resumed: it reads the kept values back; 2.0 at step 10 replaces 3.0.
    again = BestCheckpoint(keep_checkpoints=2)
    trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=12,
        eval_data=data,
        eval_every=2,
        checkpoint_dir=ckpt,
        resume=True,
        callbacks=[again],
        progress=False,
    )  # evals at 10, 12: values 2, 6
    assert [(v, s) for v, s, _ in again.kept] == [(1.0, 8), (2.0, 10)]
    assert lowtrain.checkpoint_extra(best_checkpoint(ckpt))["best"] == {
        "monitor": "eval_loss",
        "mode": "min",
        "value": 1.0,
    }
    # `fit`'s own rotation never touches them.
    assert lowtrain.latest_checkpoint(ckpt).name == "ckpt_00000012"


def test_best_checkpoint_needs_a_directory():
    with pytest.raises(ValueError, match="checkpoint_dir"):
        _fit_with([BestCheckpoint()])


def test_callbacks_that_act_at_evaluations_need_eval_data(tmp_path):
    # Without eval data they would never act: said when `fit` starts.
    for callback in (EarlyStopping(), BestCheckpoint(directory=tmp_path)):
        with pytest.raises(ValueError, match=r"expected `fit\(eval_data=...\)`"):
            _fit_with([callback])


# -- evaluation ----------------------------------------------------------------


def test_default_evaluate_reports_aux_and_weights_by_examples():
    trainer = _trainer()
    state = trainer.init(key=jax.random.key(1))
    data = _data(10)
    batches = lowtrain.ArrayBatches(data, 4, shuffle=False)  # 4, 4 and 2 rows
    assert [len(b["x"]) for b in batches] == [4, 4, 2] and len(batches) == 3
    got = trainer.run_evaluation(state, batches)
    err = jax.vmap(state.model)(jnp.asarray(data["x"])) - data["y"]
    np.testing.assert_allclose(got["loss"], float(jnp.mean(err**2)), rtol=1e-5)
    np.testing.assert_allclose(got["mae"], float(jnp.mean(jnp.abs(err))), rtol=1e-5)


PARTIAL_ON_TWO = """
import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax, lowtrain

class Fit(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

assert len(jax.devices()) == 2
trainer = Fit(eqx.nn.Linear(3, 1, key=jax.random.key(0)), optax.sgd(0.1))
state = trainer.init(key=jax.random.key(1))
x = np.random.default_rng(0).normal(size=(9, 3)).astype(np.float32)
data = {"x": x, "y": x.sum(1, keepdims=True)}
got = trainer.run_evaluation(state, lowtrain.ArrayBatches(data, 4, shuffle=False))
err = jax.vmap(state.model)(jnp.asarray(x)) - data["y"]
np.testing.assert_allclose(got["loss"], float(jnp.mean(err**2)), rtol=1e-5)
print("ok")
"""


def test_partial_batch_that_does_not_divide_over_devices_is_replicated(tmp_path):
    # 9 rows in batches of 4 on 2 devices: the last batch of 1 is evaluated whole.
    path = tmp_path / "child.py"
    path.write_text(PARTIAL_ON_TWO)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    child = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr


# -- data ------------------------------------------------------------------------


def _reference(steps):
    trainer = _trainer()
    data = lowtrain.ArrayBatches(_data(), 8, seed=3)
    return trainer.fit(trainer.init(key=jax.random.key(1)), data, steps=steps,
                       progress=False)  # fmt: skip


def _epochs():
    data = lowtrain.ArrayBatches(_data(), 8, seed=3)
    epoch = 0
    while True:  # what a seeded loader does: the same order each time it is made
        for i in range(data.steps_per_epoch):
            yield data(epoch * data.steps_per_epoch + i)
        epoch += 1


def test_from_iterable_trains_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer = _trainer()
    trainer.fit(
        trainer.init(key=jax.random.key(1)),
        lowtrain.train.from_iterable(_epochs),
        steps=7,
        checkpoint_dir=ckpt,
        progress=False,
    )
    resumed = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        lowtrain.train.from_iterable(_epochs),  # a new process: read from 0, skip 7
        steps=12,
        checkpoint_dir=ckpt,
        resume=True,
        progress=False,
    )
    np.testing.assert_array_equal(resumed.model.weight, _reference(12).model.weight)


def test_from_iterable_errors():
    plain = lowtrain.train.from_iterable(iter([{"x": 1}, {"x": 2}]))
    assert plain(0) == {"x": 1}
    with pytest.raises(ValueError, match="cannot go back"):
        plain(0)
    with pytest.raises(ValueError, match="ran out at step 2"):
        plain(2)
    with pytest.raises(TypeError, match="iterable"):
        lowtrain.train.from_iterable(3)


def test_grain_iterator_position_saved_and_restored(tmp_path):
    grain = pytest.importorskip("grain")
    rows = _data()
    source = grain.MapDataset.source(
        [{"x": rows["x"][i], "y": rows["y"][i]} for i in range(len(rows["x"]))]
    )
    pipeline = lambda: source.shuffle(seed=3).repeat().to_iter_dataset().batch(8)
    ckpt = tmp_path / "ckpt"

    def run(steps, resume):
        trainer = _trainer()
        return trainer.fit(
            trainer.init(key=jax.random.key(1)),
            lowtrain.train.from_grain(pipeline()),
            steps=steps,
            checkpoint_dir=ckpt if resume is not None else None,
            checkpoint_every=3 if resume is not None else None,
            resume=bool(resume),
            progress=False,
        )

    straight = run(10, None)
    run(6, False)
    extra = lowtrain.checkpoint_extra(lowtrain.latest_checkpoint(ckpt))
    assert extra["data_position"]["next"] == 6
    resumed = run(10, True)
    np.testing.assert_array_equal(resumed.model.weight, straight.model.weight)


def test_grain_map_dataset_by_index_per_process():
    grain = pytest.importorskip("grain")
    examples = grain.MapDataset.source(np.arange(16.0)).map(lambda x: {"x": x})
    parts = [
        lowtrain.train.from_grain(
            examples, batch_size=8, process_index=i, process_count=2
        )(1)["x"].tolist()
        for i in range(2)
    ]
    assert parts == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]
    with pytest.raises(ValueError, match="batch_size"):
        lowtrain.train.from_grain(examples.to_iter_dataset(), batch_size=4)
    with pytest.raises(TypeError, match="from_iterable"):
        lowtrain.train.from_grain([1, 2, 3])


def test_from_iterable_passes_the_epoch_to_a_function_that_takes_it():
    data = lowtrain.train.from_iterable(lambda epoch: iter([{"e": epoch}] * 2))
    assert [data(s)["e"] for s in range(5)] == [0, 0, 1, 1, 2]
    assert data(1)["e"] == 0  # back to the start: made anew from epoch 0
