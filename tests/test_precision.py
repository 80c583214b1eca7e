"""The `Precision` protocol: the Trainer's only way to know about precision."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
from lowtrain.train import Amp, Chain, DelayedFp8, Precision, Rewrite, Scalify

from .helpers import SGD, Regression, make_data, make_model


def _steps(trainer, n=3):
    data = make_data()
    state = trainer.init(key=jax.random.key(1))
    losses = []
    for step in range(n):
        state, metrics = trainer.compiled_step(trainer.shard_batch(data(step)), state)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_policy_means_amp_and_delayed_fp8():
    trainer = Regression(make_model(), SGD(0.1), precision="bf16")
    assert isinstance(trainer.precision, Chain)
    amp, delayed = trainer.precision.parts
    assert amp.policy == lowtrain.get_policy("bf16") and isinstance(delayed, DelayedFp8)
    policy = Regression(make_model(), SGD(0.1), precision=lowtrain.get_policy("bf16"))
    assert policy.precision.parts[0].policy == amp.policy


def test_precision_is_the_one_way_to_choose_it():
    # No `policy=` or `transform=`: one argument says what the step runs in.
    for old in ({"policy": "bf16"}, {"transform": "scalify"}):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            Regression(make_model(), SGD(0.1), **old)


def test_not_a_precision_is_an_error():
    with pytest.raises(TypeError, match="Expected a `lowtrain.train.Precision`"):
        Regression(make_model(), SGD(0.1), precision=3)
    with pytest.raises(TypeError, match="to chain, got int"):
        Chain(Amp(), 3)


def test_a_precision_of_your_own_changes_the_step():
    # Written without touching the Trainer: halve every gradient the optimizer sees.
    class HalfGradients(Precision):
        def to_optimizer(self, tree):
            return jax.tree.map(lambda x: x / 2, tree)

    lr = 0.1
    base = Regression(make_model(), optax.sgd(lr))
    halved = Regression(make_model(), optax.sgd(2 * lr), precision=HalfGradients())
    a, _ = _steps(base, 1)
    b, _ = _steps(halved, 1)
    # sgd(2 lr) on g/2 is sgd(lr) on g (the params' halves are exact in float32).
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    for x, y in zip(arrays(a.model), arrays(b.model)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_chain_order_and_extras():
    log = []

    class Tag(Precision):
        name: str = eqx.field(static=True)

        def wrap_model(self, model):
            log.append(self.name)
            return model

        def split_gradients(self, grads):
            return grads, self.name

        def merge(self, model, extra):
            log.append(("merge", extra))
            return model

    chain = Chain(Tag("a"), Tag("b"))
    chain.wrap_model(None)
    grads, extras = chain.split_gradients({})
    chain.merge(None, extras)
    assert log == ["a", "b", ("merge", "a"), ("merge", "b")]
    assert extras == ("a", "b")


def test_amp_loss_scale_and_default():
    assert isinstance(Amp("fp16").default_loss_scale(), lowtrain.DynamicLossScale)
    assert isinstance(Amp("bf16").default_loss_scale(), lowtrain.NoOpLossScale)
    static = Amp("fp16", loss_scale=lowtrain.StaticLossScale(4.0))
    trainer = Regression(make_model(), SGD(0.1), precision=static)
    assert float(trainer.loss_scale.loss_scale) == 4.0
    with pytest.raises(TypeError, match="Expected a loss scale"):
        Amp("fp16", loss_scale=4.0)


def test_rewrite_precision_reaches_every_matmul():
    calls = []

    def counted(op, a, b):
        calls.append(a.shape)
        return op(a, b)

    trainer = Regression(
        make_model(), SGD(0.1), precision=Rewrite({"dot_general": counted})
    )
    _, losses = _steps(trainer, 1)
    assert len(calls) == 2  # the MLP's two layers, traced once
    with pytest.raises(TypeError, match="to map primitive names"):
        Rewrite({"dot_general": None})


def test_scalify_exports_plain_values():
    trainer = Regression(make_model(), SGD(0.1), precision=Scalify("p=f32,c=f16"))
    state, _ = _steps(trainer, 2)
    plain = trainer.precision.export(state.model)
    leaves = jax.tree.leaves(plain, is_leaf=lowtrain.scalify.is_scaled)
    assert not any(lowtrain.scalify.is_scaled(x) for x in leaves)
    assert all(
        x.dtype == jnp.float32 for x in jax.tree.leaves(eqx.filter(plain, eqx.is_array))
    )


@pytest.mark.parametrize("name", ["fp8_naive", "scalify_fp16", "scalify_fp8"])
def test_a_precision_name_builds_in_python_what_the_cli_builds(name):
    # `Trainer(precision=name)` and `python -m lowtrain precision=name`: the same
    # precision, field for field.
    from lowtrain.recipes import _common, _run

    from .test_recipes import make_config

    config = _run.to_config(make_config("recipe=mnist", f"precision={name}"))
    cli = _common.trainer_options(config)["precision"]
    python = Regression(make_model(), SGD(0.1), precision=name).precision
    assert eqx.tree_equal(cli, python)


def test_fp8_delayed_by_name_trains_an_equinox_model_as_the_cli_precision(getkey):
    # The recipes' `fp8_delayed` swaps their own `Linear` and, as the library's
    # does, `eqx.nn.Linear`: on an Equinox MLP the two train bit for bit alike.
    from lowtrain.recipes import precisions

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    mlp = eqx.nn.MLP(8, 2, 32, 2, key=getkey())
    x = jax.random.normal(getkey(), (16, 8))
    data = {"x": x, "y": x[:, :2] * 2.0}
    states = []
    for precision in ("fp8_delayed", precisions.delayed_fp8()):
        trainer = Fit(mlp, optax.sgd(0.05), precision=precision)
        state = trainer.init(key=jax.random.key(0))
        layers = state.model.layers
        assert all(isinstance(layer, lowtrain.fp8.Fp8Linear) for layer in layers)
        assert all(layer.x_scale is not None for layer in layers)  # delayed
        states.append(trainer.fit(state, lambda s: data, steps=4, progress=False))
    assert eqx.tree_equal(states[0], states[1])
    history = states[0].model.layers[0].x_scale.amax_history
    # The last step's input, as the policy gives it (bfloat16).
    assert float(history[0]) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=1e-2)
    assert float(states[0].loss_scale.value) == 1.0  # E4M3/E5M2 need none


def test_fp8_delayed_by_name_says_what_a_model_without_linears_needs(getkey):
    conv = eqx.nn.Conv2d(1, 2, 3, key=getkey())
    with pytest.raises(ValueError, match=r"eqx\.nn\.Linear.*delayed_fp8\(\)"):
        lowtrain.train.delayed_fp8().parts[0].cast_params(conv)
