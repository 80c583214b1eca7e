"""`Trainer(grad_accum=K)`: K micro-batches, one update, one loss-scale decision."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
import lowtrain.fp8
from lowtrain import _compat
from lowtrain.recipes import _common
from lowtrain.recipes._config import TrainerConfig
from lowtrain.train._accumulate import micro_batches

from .helpers import SGD, Mse, batch_of, eqns_of, make_model, same_bits, snapshot


def train(trainer, batches):
    state = trainer.init(key=jax.random.key(1))
    metrics = []
    for batch in batches:
        state, m = trainer.compiled_step(trainer.shard_batch(batch), state)
        metrics.append(m)
    return state, metrics


def test_four_micro_batches_of_8_update_as_one_batch_of_32():
    batches = [batch_of(32, seed) for seed in range(3)]
    one, one_metrics = train(Mse(make_model(), SGD(0.05)), batches)
    four, four_metrics = train(Mse(make_model(), SGD(0.05), grad_accum=4), batches)
    for a, b in zip(
        snapshot((one.model, one.opt_state)), snapshot((four.model, four.opt_state))
    ):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    for m1, m4 in zip(one_metrics, four_metrics):
        # The logged loss and aux are means over the micro-batches (equal sizes: the
        # batch mean), in float32.
        assert m4["loss"].dtype == jnp.float32
        np.testing.assert_allclose(m4["loss"], m1["loss"], atol=1e-6, rtol=0)
        np.testing.assert_allclose(m4["aux"]["mae"], m1["aux"]["mae"], atol=1e-6)
        np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    # One step on a micro-batch alone is not the same: the test can tell them apart.
    small, _ = train(
        Mse(make_model(), SGD(0.05)),
        [jax.tree.map(lambda x: x[:8], b) for b in batches],
    )
    diff = np.abs(one.model.layers[0].weight - small.model.layers[0].weight)
    assert float(diff.max()) > 1e-3


def test_one_compiled_step_scans_the_micro_batches_in_float32():
    trainer = Mse(make_model(), SGD(0.05), grad_accum=4)
    state = trainer.init(key=jax.random.key(1))
    batch = trainer.shard_batch(batch_of(32))
    scans = eqns_of(trainer.train_step, state, batch, prim="scan")
    (scan,) = [e for e in scans if e.params["length"] == 4]
    # The carry: one float32 accumulator per parameter.
    carry = scan.outvars[: len(_compat.scan_inputs(scan.params, scan.invars)[1])]
    n_params = len(jax.tree.leaves(eqx.filter(trainer.model, eqx.is_inexact_array)))
    assert len(carry) == n_params
    assert {np.dtype(v.aval.dtype) for v in carry} == {np.dtype("float32")}


def test_micro_batch_i_takes_every_kth_row():
    batch = {"x": np.arange(12).reshape(6, 2)}
    parts = micro_batches(batch, 3, 1)
    assert parts["x"].shape == (3, 2, 2)
    np.testing.assert_array_equal(parts["x"][1], [[2, 3], [8, 9]])  # rows 1 and 4


def test_a_nonfinite_micro_batch_skips_the_whole_step_under_fp16():
    trainer = Mse(make_model(), SGD(0.05), precision="fp16", grad_accum=4)
    state = trainer.init(key=jax.random.key(1))
    state, _ = trainer.compiled_step(trainer.shard_batch(batch_of(32)), state)
    before = snapshot((state.model, state.opt_state.inner_state))
    scale = float(state.loss_scale.loss_scale)
    skipped = int(state.skipped)
    bad = batch_of(32, seed=1)
    bad["x"][5, 0] = np.inf  # row 5: micro-batch 1 only
    state, metrics = trainer.compiled_step(trainer.shard_batch(bad), state)
    assert not bool(metrics["grads_finite"])
    assert same_bits(snapshot((state.model, state.opt_state.inner_state)), before)
    assert int(state.skipped) == skipped + 1
    assert float(state.loss_scale.loss_scale) == scale / 2  # halved once, not 4 times
    assert int(state.loss_scale.counter) == 0
    # The next good step goes on, at the halved scale.
    state, metrics = trainer.compiled_step(trainer.shard_batch(batch_of(32, 2)), state)
    assert bool(metrics["grads_finite"]) and int(state.skipped) == skipped + 1
    assert float(state.loss_scale.loss_scale) == scale / 2


def test_redo_on_nan_redoes_all_micro_batches():
    # At 2**24 this float16 backward overflows; redos halve the scale of all 4
    # micro-batches until it does not.
    ls = lowtrain.DynamicLossScale(2.0**24)
    kwargs = dict(precision="fp16", loss_scale=ls, grad_accum=4)
    plain = Mse(make_model(), SGD(0.01), **kwargs)
    state, (metrics,) = train(plain, [batch_of(32)])
    assert not bool(metrics["grads_finite"]) and int(state.skipped) == 1
    assert float(state.loss_scale.loss_scale) == 2.0**23
    redo = Mse(make_model(), SGD(0.01), redo_on_nan=12, **kwargs)
    state, (metrics,) = train(redo, [batch_of(32)])
    assert bool(metrics["grads_finite"]) and int(state.skipped) == 0
    redos = 24 - np.log2(float(state.loss_scale.loss_scale))
    assert redos >= 1 and redos <= 12 and redos == int(redos)  # a backoff per redo


def test_delayed_fp8_history_records_the_amax_of_the_whole_batch():
    layer = lowtrain.fp8.Fp8Linear(4, 2, delayed=True, history=4, key=jax.random.key(0))

    class Fp8Mse(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    batches = [batch_of(32, seed) for seed in range(2)]
    one, _ = train(Fp8Mse(layer, SGD(0.01)), batches)
    four, _ = train(Fp8Mse(layer, SGD(0.01), grad_accum=4), batches)
    expected = [float(np.max(np.abs(b["x"]))) for b in batches[::-1]]
    np.testing.assert_array_equal(four.model.x_scale.amax_history[:2], expected)
    np.testing.assert_array_equal(
        four.model.x_scale.amax_history, one.model.x_scale.amax_history
    )
    np.testing.assert_array_equal(four.model.x_scale.scale, one.model.x_scale.scale)


@pytest.mark.slow
def test_scalify_trains_with_grad_accum():
    policy = lowtrain.Policy("float32", "float16", "float32")
    precision = lowtrain.train.Scalify(policy)
    batches = [batch_of(32)] * 4
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
        one, m1 = train(
            Mse(make_model(), optax.adam(3e-3), precision=precision), batches
        )
        two, m2 = train(
            Mse(make_model(), optax.adam(3e-3), precision=precision, grad_accum=2),
            batches,
        )
    losses1 = [float(m["loss"]) for m in m1]
    losses2 = [float(m["loss"]) for m in m2]
    assert all(m["loss"].dtype == jnp.float32 for m in m2)
    np.testing.assert_allclose(losses2, losses1, rtol=0.02)
    assert losses2[-1] < losses2[0]


def test_grad_accum_errors_and_config():
    trainer = Mse(make_model(), SGD(0.1), grad_accum=3)
    state = trainer.init(key=jax.random.key(1))
    with pytest.raises(ValueError) as info:
        trainer.compiled_step(trainer.shard_batch(batch_of(32)), state)
    assert str(info.value).startswith(
        "Expected every batch array's leading axis to divide by grad_accum x devices "
        "(3 x 1), got shape (32, 4) at `batch['x']` instead. Use a batch size that "
        "is a multiple of 3"
    )
    with pytest.raises(ValueError, match="Expected `grad_accum` >= 1"):
        Mse(make_model(), SGD(0.1), grad_accum=0)
    with pytest.raises(TypeError, match="Expected an int `grad_accum`"):
        Mse(make_model(), SGD(0.1), grad_accum=2.0)
    with pytest.raises(ValueError, match="Expected `trainer.grad_accum` > 0"):
        TrainerConfig(grad_accum=0)
    with pytest.raises(ValueError, match="Expected `trainer.sharding`"):
        TrainerConfig(sharding="zero")


def test_recipes_pass_sharding_and_grad_accum(monkeypatch):
    class Config:
        precision = _common.dataclasses.make_dataclass("P", [("name", str)])("x")
        trainer = TrainerConfig(sharding="fsdp", grad_accum=4)

    monkeypatch.setattr(_common.hydra.utils, "instantiate", lambda fields: fields)
    options = _common.trainer_options(Config())
    assert options["sharding"] == "fsdp" and options["grad_accum"] == 4
