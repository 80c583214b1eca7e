"""Models with state (`eqx.nn.State`: BatchNorm) trained by the Trainer, written the
way Equinox's docs write them (`eqx.nn.make_with_state`, `jax.vmap(model,
axis_name="batch", in_axes=(0, None), out_axes=(0, None))`), and a Flax linen model
with BatchNorm and dropout (its `batch_stats` as the model state)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's adam (`b1 ** count`) and flax are not strict-promotion clean.
    with jax.numpy_dtype_promotion("standard"):
        yield


class Net(eqx.Module):
    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(4, 16, key=k1)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", momentum=0.9, mode="ema")
        self.linear2 = eqx.nn.Linear(16, 2, key=k2)

    def __call__(self, x, state):
        x = self.linear1(x)
        x, state = self.norm(x, state)
        return self.linear2(jax.nn.relu(x)), state


def _batched(model):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))


class Classify(lowtrain.Trainer):
    def loss(self, model, batch, *, key, state):
        logits, state = _batched(model)(batch["x"], state)
        logits = logits.astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss.mean(), {"accuracy": accuracy}, state


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32) * 3 + 5  # far from N(0, 1)
    y = (x[:, 0] > 5).astype(np.int32)
    return {"x": x, "y": y}


def _running(state, model):
    return state.get(model.norm.ema_state_index)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_batchnorm_trains_under_every_precision(precision):
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    trainer = Classify(model, optax.adam(1e-2), precision=precision, model_state=state)
    data = lowtrain.ArrayBatches(_data(), 32, seed=0)
    train_state = trainer.init(key=jax.random.key(1))
    before = np.asarray(_running(train_state.model_state, model)[0])  # donated below
    train_state = trainer.fit(train_state, data, steps=40, progress=False)
    mean, var = _running(train_state.model_state, model)
    # The running statistics moved toward the batch statistics of the first
    # layer's output, and stayed float32 (the dtype the state started in).
    assert mean.dtype == jnp.float32 and var.dtype == jnp.float32
    assert not np.allclose(mean, before) and np.all(np.isfinite(var))
    x = jnp.asarray(_data()["x"])
    h = jax.vmap(train_state.model.linear1)(x).astype(jnp.float32)
    # An average over the last ~10 steps' weights: it follows the data's statistics.
    assert np.corrcoef(mean, h.mean(0))[0, 1] > 0.95
    metrics = trainer.run_evaluation(
        train_state, lowtrain.ArrayBatches(_data(64, 1), 64)
    )
    assert metrics["accuracy"] > 0.9 and metrics["loss"] < 0.5


def test_eval_uses_running_statistics_and_leaves_state_alone():
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    trainer = Classify(model, optax.sgd(0.0), model_state=state)
    train_state = trainer.init(key=jax.random.key(1))
    one = {"x": _data()["x"][:1], "y": _data()["y"][:1]}
    # A batch of one: batch statistics would make the normalised input 0; the
    # running statistics (inference mode) give the model's output.
    metrics = trainer.run_evaluation(train_state, [one])
    inference = eqx.nn.inference_mode(train_state.model)
    logits, _ = _batched(inference)(jnp.asarray(one["x"]), train_state.model_state)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, one["y"])
    np.testing.assert_allclose(metrics["loss"], float(expected[0]), rtol=1e-6)


def test_skipped_step_keeps_the_state():
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    trainer = Classify(
        model,
        optax.sgd(0.1),
        model_state=state,
        stop_on_nonfinite=False,
        max_consecutive_skips=None,
    )
    train_state = trainer.init(key=jax.random.key(1))
    bad = _data(32)
    bad["x"] = bad["x"].copy()
    bad["x"][0, 0] = np.inf
    before = jax.tree.map(np.asarray, train_state.model_state)
    out = trainer.fit(train_state, lambda s: bad, steps=1, progress=False)
    assert int(out.skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, before, out.model_state)


def test_state_checkpointed_and_resumed_exactly(tmp_path):
    data = lowtrain.ArrayBatches(_data(), 32, seed=0)

    def run(steps, resume):
        model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
        trainer = Classify(model, optax.adam(1e-2), model_state=state)
        s = trainer.init(key=jax.random.key(1))
        return trainer.fit(
            s,
            data,
            steps=steps,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=5,
            resume=resume,
            progress=False,
        )

    run(5, False)
    resumed = run(10, True)
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    trainer = Classify(model, optax.adam(1e-2), model_state=state)
    straight = trainer.fit(
        trainer.init(key=jax.random.key(1)), data, steps=10, progress=False
    )
    jax.tree.map(
        np.testing.assert_array_equal, straight.model_state, resumed.model_state
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        eqx.filter(straight.model, eqx.is_array),
        eqx.filter(resumed.model, eqx.is_array),
    )


def test_grad_accum_averages_float_state():
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    batch = {k: v[:32] for k, v in _data().items()}
    results = {}
    for k in (1, 2):
        trainer = Classify(model, optax.sgd(0.0), model_state=state, grad_accum=k)
        s = trainer.fit(
            trainer.init(key=jax.random.key(1)),
            lambda _: batch,
            steps=1,
            progress=False,
        )
        results[k] = _running(s.model_state, model)[0]
    h = jax.vmap(model.linear1)(jnp.asarray(batch["x"]))
    # A first call sets the running mean to the batch mean; two micro-batches each
    # from the same old state: the mean of their two updates.
    halves = (h[:16].mean(0) + h[16:].mean(0)) / 2
    np.testing.assert_allclose(results[2], halves, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[1], h.mean(0), rtol=1e-5, atol=1e-5)


def test_loss_that_forgets_the_state_is_a_clear_error():
    class Forgets(lowtrain.Trainer):
        def loss(self, model, batch, *, key, state):
            logits, _ = _batched(model)(batch["x"], state)
            return jnp.mean(logits)

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    trainer = Forgets(model, optax.sgd(0.1), model_state=state)
    with pytest.raises(TypeError, match=r"\(loss, new_state\)"):
        trainer.fit(
            trainer.init(key=jax.random.key(1)),
            lambda s: _data(32),
            steps=1,
            progress=False,
        )
    with pytest.raises(TypeError, match="eqx.nn.State"):
        Forgets(model, optax.sgd(0.1), model_state={"a": "not an array"})


@pytest.mark.parametrize("order", ["vmap_of_amp", "amp_of_vmap"])
def test_amp_composes_with_vmap_axis_name_in_both_orders(order):
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    x = jnp.asarray(_data(32)["x"])
    axes = dict(axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    if order == "vmap_of_amp":
        f = jax.vmap(lowtrain.amp(model, "bf16"), **axes)
    else:  # Equinox's vmap: a Module, so amp's wrapper holds the parameters
        f = lowtrain.amp(eqx.filter_vmap(model, **axes), "bf16")
    out, new = f(x, state)
    ref, ref_state = jax.vmap(model, **axes)(x, state)
    # The matmuls ran in bfloat16 (the jaxpr's dots), and the result is close.
    jaxpr = jax.make_jaxpr(f)(x, state)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    if not dots:  # inside a jit or vmap'd call
        text = str(jaxpr)
        assert "dot_general" in text and "bf16" in text
    np.testing.assert_allclose(out, ref, rtol=0.05, atol=0.05)
    assert not np.array_equal(out, ref)
    mean, _ = _running(new, model)
    np.testing.assert_allclose(
        mean, _running(ref_state, model)[0], rtol=0.02, atol=0.02
    )


@pytest.mark.parametrize("policy", ["bf16", "fp16", "fp8"])
def test_flax_linen_batchnorm_and_dropout_trained_by_the_trainer(policy):
    nn = pytest.importorskip("flax.linen")

    class LinenNet(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(16)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.Dropout(0.1, deterministic=not train)(jax.nn.relu(x))
            return nn.Dense(2)(x)

    net = LinenNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, 4)), train=False)

    class LinenTrainer(lowtrain.Trainer):
        # Flax's `apply` under amp inside the loss: the params dict is not callable.
        def loss(self, params, batch, *, key, state):
            def apply(params, stats, x):
                return net.apply(
                    {"params": params, "batch_stats": stats},
                    x,
                    train=key is not None,
                    mutable=["batch_stats"] if key is not None else [],
                    rngs={"dropout": key} if key is not None else {},
                )

            logits, updates = lowtrain.amp(apply, policy)(params, state, batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["y"]
            ).mean()
            return loss, updates.get("batch_stats", state) if updates else state

    # amp inside the loss: the Trainer's own precision stays fp32, so fp16's loss
    # scale is passed by hand.
    scale = lowtrain.DynamicLossScale() if policy == "fp16" else None
    trainer = LinenTrainer(
        variables["params"],
        optax.adam(1e-2),
        model_state=variables["batch_stats"],
        loss_scale=scale,
    )
    s = trainer.init(key=jax.random.key(1))
    s = trainer.fit(s, lowtrain.ArrayBatches(_data(), 32), steps=40, progress=False)
    mean = s.model_state["BatchNorm_0"]["mean"]
    assert mean.dtype == jnp.float32 and float(jnp.abs(mean).max()) > 0.5
    assert (
        trainer.run_evaluation(s, lowtrain.ArrayBatches(_data(64, 1), 64))["loss"] < 0.5
    )
