"""`Trainer`: skipped steps, exact resume, atomic checkpoints, data parallelism."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
import lowtrain.fp8

from .helpers import (
    SGD,
    Mse,
    Regression,
    eqns_of,
    make_data,
    make_model,
    same_bits,
    snapshot,
)

F16, F32 = np.dtype("float16"), np.dtype("float32")
ROOT = pathlib.Path(__file__).parent.parent


def read_jsonl(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def poisoned(data, bad_step):
    """`data`, except that the batch of step `bad_step` holds an inf."""

    def batch(step):
        b = data(step)
        if step == bad_step:
            b = dict(b, x=b["x"].copy())
            b["x"][0, 0] = np.inf
        return b

    return batch


def run_child(script, tmp_path, env=None):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, str(path), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("policy", ["fp32", "fp16"])
def test_subclass_overriding_only_loss_trains(policy, tmp_path, capsys):
    data = make_data()
    schedule = optax.linear_schedule(3e-2, 1e-2, 20)
    trainer = Regression(
        make_model(),
        optax.sgd(schedule, momentum=0.9),
        precision=policy,
        learning_rate=schedule,
    )
    steps_seen = []
    trainer.add_hook(lambda info: steps_seen.append(info.step), every=4)
    state = trainer.init(key=jax.random.key(1))
    assert state.model.layers[0].weight.dtype == F32  # param_dtype of both presets
    eval_data = make_data(n=16, seed=1)
    initial = trainer.run_evaluation(state, eval_data)
    # The loss and the scalars of its aux dict (Mse returns the mean abs error).
    assert set(initial) == {"loss", "mae"} and initial["loss"] > 1.0
    state = trainer.fit(
        state,
        data,
        epochs=5,  # 6 steps per epoch
        log_every=5,
        metrics_file=tmp_path / "metrics.jsonl",
        eval_data=eval_data,
        eval_every=15,
    )
    assert int(state.step) == 30 and steps_seen == [4, 8, 12, 16, 20, 24, 28]
    assert state.model.layers[0].weight.dtype == F32 and int(state.skipped) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    print(initial, records[-1])
    assert records[-1]["eval_loss"] < 0.2 * initial["loss"]  # it learns
    assert [("eval_loss" in r) for r in records] == [0, 0, 1, 0, 0, 1]
    want_scale = 2.0**15 if policy == "fp16" else 1.0
    for r in records:
        assert r["loss_scale"] == want_scale and r["skipped"] == 0
        assert r["grad_norm"] > 0 and r["steps_per_second"] > 0 and "mae" in r
        assert r["examples_per_second"] == pytest.approx(8 * r["steps_per_second"])
        assert r["learning_rate"] == pytest.approx(float(schedule(r["step"] - 1)))
    assert "loss=" in capsys.readouterr().err  # the bar ran without a terminal


def test_policy_is_applied_to_the_loss():
    data = make_data()
    for policy, dtype in [("fp16", F16), ("fp32", F32)]:
        trainer = Regression(make_model(), optax.sgd(0.1), precision=policy)
        state = trainer.init(key=jax.random.key(1))
        dots = eqns_of(trainer.train_step, state, data(0), prim="dot_general")
        assert len(dots) >= 5  # 2 layers: 2 forward, 3 or more backward
        for e in dots:
            assert {v.aval.dtype for v in e.invars} == {dtype}, e
    assert isinstance(state.loss_scale, lowtrain.NoOpLossScale)


@pytest.mark.parametrize("scaling", ["none", "dynamic"])
def test_inf_gradient_step_is_skipped_bit_for_bit(scaling, tmp_path):
    k = 4
    data = poisoned(make_data(), k)  # the update from state.step == k gets an inf
    if scaling == "none":
        trainer = Regression(make_model(), SGD(1e-2), stop_on_nonfinite=False)
    else:
        ls = lowtrain.DynamicLossScale(scale=2.0**10, growth_interval=100)
        trainer = Regression(make_model(), SGD(1e-2), loss_scale=ls)
    state = trainer.fit(trainer.init(key=jax.random.key(1)), data, steps=k)
    before = snapshot((state.model, state.opt_state.inner_state))
    scale_before = snapshot(state.loss_scale)
    log = tmp_path / "m.jsonl"
    state = trainer.fit(state, data, steps=k + 1, log_every=1, metrics_file=log)
    assert int(state.step) == k + 1 and int(state.skipped) == 1
    assert int(state.opt_state.notfinite_count) == 1
    assert same_bits(snapshot((state.model, state.opt_state.inner_state)), before)
    (record,) = read_jsonl(log)
    assert record["step"] == k + 1 and record["skipped"] == 1
    assert not np.isfinite(record["loss"]) and not np.isfinite(record["grad_norm"])
    if scaling == "dynamic":
        assert scale_before[0] == 2.0**10 and record["loss_scale"] == 2.0**9
        assert float(state.loss_scale.loss_scale) == 2.0**9
    state = trainer.fit(state, data, steps=k + 2)  # the next good step applies
    assert int(state.skipped) == 1 and int(state.opt_state.notfinite_count) == 0
    after = snapshot(state.model)
    assert not any(np.array_equal(a, b) for a, b in zip(after, before[: len(after)]))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_resume_reproduces_uninterrupted_run(asynchronous, tmp_path):
    data = make_data(n=40)  # 5 steps per epoch: the resume crosses an epoch boundary
    ls = lowtrain.DynamicLossScale(scale=2.0**14, growth_interval=3)  # it moves
    trainer = Regression(make_model(), SGD(1e-2), precision="fp16", loss_scale=ls)
    full = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=14,
        checkpoint_dir=tmp_path / "full",
        checkpoint_every=7,
        keep_checkpoints=5,
    )
    first = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=7,
        checkpoint_dir=tmp_path / "resumed",
        checkpoint_every=7,
        async_checkpoint=asynchronous,  # waited for before `fit` returns
    )
    assert int(first.step) == 7
    # A new Trainer, as a new process would build, from a fresh state's structure.
    again = Regression(make_model(), SGD(1e-2), precision="fp16", loss_scale=ls)
    resumed = again.fit(
        again.init(key=jax.random.key(99)),  # the key comes from the checkpoint
        data,
        steps=14,
        checkpoint_dir=tmp_path / "resumed",
        checkpoint_every=7,
        resume=True,
    )
    assert int(resumed.step) == 14 and float(resumed.loss_scale.loss_scale) > 2.0**14
    assert same_bits(snapshot(resumed), snapshot(full))
    names = lambda d: sorted(p.name for p in (tmp_path / d).iterdir())
    assert names("full") == ["ckpt_00000007", "ckpt_00000014"]
    assert names("resumed") == names("full")
    loaded = [
        lowtrain.load_checkpoint(tmp_path / d / "ckpt_00000014", again.init(key=k))
        for d, k in (("full", jax.random.key(3)), ("resumed", jax.random.key(4)))
    ]
    assert same_bits(snapshot(loaded[0]), snapshot(loaded[1]))
    assert same_bits(snapshot(loaded[0]), snapshot(full))


def test_keeps_last_k_checkpoints(tmp_path):
    trainer = Regression(make_model(), optax.sgd(0.1))
    trainer.fit(
        trainer.init(key=jax.random.key(1)),
        make_data(),
        steps=9,
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
        keep_checkpoints=2,
    )
    found = [step for step, _ in lowtrain.train._checkpoint.list_checkpoints(tmp_path)]
    assert found == [8, 9]  # every 2 steps and the last, newest 2 kept
    assert lowtrain.latest_checkpoint(tmp_path).name == "ckpt_00000009"


def test_stop_on_nonfinite(tmp_path):
    data = poisoned(make_data(), 2)
    trainer = Regression(make_model(), SGD(1e-2))
    assert trainer.stop_on_nonfinite  # the default without loss scaling
    message = r"The loss is inf at train step 3 \(the update from `state.step == 2`"
    for log_every in (1, 100):  # checked at once, or one step late
        with pytest.raises(FloatingPointError, match=message):
            trainer.fit(
                trainer.init(key=jax.random.key(1)),
                data,
                steps=6,
                log_every=log_every,
                metrics_file=tmp_path / f"{log_every}.jsonl",
            )
    assert [r["step"] for r in read_jsonl(tmp_path / "1.jsonl")] == [1, 2]
    half = Regression(make_model(), SGD(1e-2), precision="fp16")
    assert not half.stop_on_nonfinite  # a dynamic loss scale expects overflows
    state = half.fit(half.init(key=jax.random.key(1)), data, steps=4)
    assert int(state.skipped) == 1


def test_learning_rate_from_inject_hyperparams(tmp_path):
    schedule = optax.linear_schedule(1e-2, 0.0, 10)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
    trainer = Regression(make_model(), opt)
    # optax's adam is not strict-promotion clean (see SGD above).
    with jax.numpy_dtype_promotion("standard"):
        trainer.fit(
            trainer.init(key=jax.random.key(1)),
            make_data(),
            steps=6,
            log_every=3,
            metrics_file=tmp_path / "m.jsonl",
        )
    lrs = [r["learning_rate"] for r in read_jsonl(tmp_path / "m.jsonl")]
    assert lrs == pytest.approx([float(schedule(2)), float(schedule(5))])


def test_array_batches_are_a_function_of_the_step():
    data = make_data(n=20, batch_size=6)
    # Training drops 2 examples per epoch; iterating (evaluation) gives them as a
    # fourth, smaller batch.
    assert data.steps_per_epoch == 3 and len(data) == 4
    assert [len(b["x"]) for b in data] == [6, 6, 6, 2]
    x = data.arrays["x"]
    for step in (0, 4, 7):
        epoch, i = divmod(step, 3)
        order = np.random.default_rng((0, epoch)).permutation(20)
        assert np.array_equal(data(step)["x"], x[order[i * 6 : (i + 1) * 6]])
    assert not np.array_equal(data(0)["x"], data(3)["x"])  # reshuffled per epoch
    fresh = make_data(n=20, batch_size=6)
    assert np.array_equal(fresh(7)["y"], data(7)["y"])
    with pytest.raises(ValueError, match=r"share its leading dimension .*\['y'\]: 5"):
        lowtrain.ArrayBatches({"x": np.ones(4), "y": np.ones(5)}, 2)
    # Each process of a multi-process run gets its contiguous share of every batch
    # (also when iterated, as eval data is).
    shares = [make_data(n=20, batch_size=6, process=(k, 3)) for k in range(3)]
    for step in (0, 4, 7):
        parts = [share(step)["x"] for share in shares]
        assert all(part.shape == (2, 4) for part in parts)
        assert np.array_equal(np.concatenate(parts), data(step)["x"])
    assert np.array_equal(list(shares[1])[2]["y"], data(2)["y"][2:4])
    with pytest.raises(ValueError, match="batch size divisible by `process_count`"):
        make_data(n=20, batch_size=6, process=(0, 4))


def test_argument_errors():
    with pytest.raises(TypeError, match="that defines `loss"):
        lowtrain.Trainer(make_model(), optax.sgd(0.1))
    with pytest.raises(TypeError, match="Expected an Optax optimizer"):
        Regression(make_model(), "adam")
    trainer = Regression(make_model(), optax.sgd(0.1))
    state = trainer.init(key=jax.random.key(1))
    with pytest.raises(TypeError, match="Expected `data` to be a function of the step"):
        trainer.fit(state, [make_data()(0)], steps=1)
    with pytest.raises(
        ValueError, match="Expected exactly one of `steps` and `epochs`"
    ):
        trainer.fit(state, make_data(), steps=1, epochs=1)
    with pytest.raises(ValueError, match="with a `steps_per_epoch` attribute"):
        trainer.fit(state, lambda step: None, epochs=1)
    with pytest.raises(ValueError, match="Expected a `checkpoint_dir`"):
        trainer.fit(state, make_data(), steps=1, checkpoint_every=1)
    with pytest.raises(ValueError, match="Expected an int `every` >= 1"):
        trainer.add_hook(print, every=0)


DATA_PARALLEL = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
sys.path.insert(0, ".")
from tests.helpers import SGD, Regression, make_data, make_model

assert len(jax.devices()) == 4
data = make_data()
out = {}
for name, devices in [("four", jax.devices()), ("one", jax.devices()[:1])]:
    trainer = Regression(make_model(), SGD(1e-2), devices=devices)
    state = trainer.fit(trainer.init(key=jax.random.key(1)), data, steps=3,
                        progress=False)
    out[name] = [np.asarray(x).tolist() for x in jax.tree.leaves(state.model)
                 if hasattr(x, "shape")]
    w = state.model.layers[0].weight
    out[name + "_replicated"] = w.sharding.is_fully_replicated
    out[name + "_batch_devices"] = len(trainer.shard_batch(data(0))["x"].devices())
four = Regression(make_model(), optax.sgd(0.1), devices=jax.devices())
try:
    four.shard_batch({"x": np.ones((6, 4))})
except ValueError as e:
    out["error"] = str(e)
diff = max(np.max(np.abs(np.asarray(a) - np.asarray(b)))
           for a, b in zip(out.pop("four"), out.pop("one")))
out["diff"] = float(diff)
print(json.dumps(out))
"""


def test_data_parallel_step_matches_one_device(tmp_path):
    flags = "--xla_force_host_platform_device_count=4"
    child = run_child(DATA_PARALLEL, tmp_path, env={"XLA_FLAGS": flags})
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["diff"] <= 1e-6
    assert out["four_replicated"] and out["four_batch_devices"] == 4
    assert out["one_batch_devices"] == 1
    assert out["error"].startswith(
        "Expected every batch array's leading axis to divide by the number of "
        "devices it is split over (4), got shape (6, 4) at `batch['x']` instead. "
        "Use a batch size that is a multiple of 4"
    )


class Fp8Regression(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_fp8_delayed_scaling_state_flows_through_the_step():
    layer = lowtrain.fp8.Fp8Linear(4, 2, delayed=True, history=4, key=jax.random.key(0))
    data = make_data()
    trainer = Fp8Regression(layer, SGD(0.01))
    state = trainer.init(key=jax.random.key(1))
    for step in range(3):
        batch = data(step)
        state, metrics = trainer.compiled_step(trainer.shard_batch(batch), state)
    # The input's amax history holds the last three batches' amaxes, newest first,
    # written exactly (not as an optimizer update), and the grad norm ignores it.
    expected = [float(np.max(np.abs(data(s)["x"]))) for s in (2, 1, 0)]
    np.testing.assert_array_equal(state.model.x_scale.amax_history[:3], expected)
    assert state.model.x_scale.amax_history[3] == 0.0
    np.testing.assert_allclose(state.model.x_scale.scale, max(expected) / 448.0)
    assert float(metrics["grad_norm"]) < 100.0


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_scalify_precision_trains(compute):
    policy = lowtrain.Policy("float32", compute, "float32")
    trainer = Regression(
        make_model(), optax.adam(3e-3), precision=lowtrain.train.Scalify(policy)
    )
    ref = Regression(make_model(), optax.adam(3e-3))
    data = make_data()
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
        state = trainer.init(key=jax.random.key(1))
        ref_state = ref.init(key=jax.random.key(1))
        losses, ref_losses = [], []
        for step in range(12):
            batch = trainer.shard_batch(data(step))
            state, metrics = trainer.compiled_step(batch, state)
            ref_state, ref_metrics = ref.compiled_step(batch, ref_state)
            losses.append(float(metrics["loss"]))
            ref_losses.append(float(ref_metrics["loss"]))
    # Weights are ScaledArrays of the compute dtype; the optimizer state float32 ones.
    leaves = jax.tree.leaves(state.model, is_leaf=lowtrain.scalify.is_scaled)
    weights = [x for x in leaves if lowtrain.scalify.is_scaled(x)]
    assert weights and all(w.data.dtype == jnp.dtype(compute) for w in weights)
    assert isinstance(state.loss_scale, lowtrain.NoOpLossScale)
    assert metrics["loss"].dtype == jnp.float32
    np.testing.assert_allclose(losses, ref_losses, rtol=0.05)
    assert losses[-1] < losses[0]


def test_numerics_report_is_of_the_train_step_itself():
    # grad_accum=2: the report's forward rows are of micro-batches (4 of 8 rows),
    # and the tracked step changes nothing: the run equals one without reports.
    runs = []
    for every in (None, 1):
        trainer = Mse(make_model(), SGD(0.01), grad_accum=2, numerics_every=every)
        state = trainer.init(key=jax.random.key(0))
        state = trainer.fit(state, make_data(), steps=2, progress=False)
        runs.append(snapshot(state))
    assert same_bits(*runs)
    rows = trainer.numerics.last.rows
    dots = [r for r in rows if r["primitive"] == "dot_general" and r["pass"] == "fwd"]
    # (vmap puts the batch last: (out, 4))
    assert [r["shape"] for r in dots] == [[16, 4], [2, 4]]
    assert all(r["size"] == 2 * np.prod(r["shape"]) for r in dots)  # both micro-batches


def test_numerics_every_records_reports(tmp_path):
    trainer = Regression(make_model(), SGD(0.01), numerics_every=2)
    state = trainer.init(key=jax.random.key(0))
    metrics = tmp_path / "metrics.jsonl"
    trainer.fit(state, make_data(), steps=5, metrics_file=metrics, progress=False)
    lines = (tmp_path / "numerics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 2, 4]  # before those steps' updates
    rows = records[-1]["rows"]
    assert {r["pass"] for r in rows} == {"fwd", "bwd"}
    assert all(r["dtype"] == "float32" for r in rows)
    assert (tmp_path / "numerics.png").read_bytes()[:4] == b"\x89PNG"
    assert trainer.numerics.last_step == 4
    assert Regression(make_model(), SGD(0.01)).numerics.every is None
    with pytest.raises(ValueError, match="numerics_every"):
        Regression(make_model(), SGD(0.01), numerics_every=0)
