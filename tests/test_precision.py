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


@pytest.mark.parametrize(
    "name", ["fp8_delayed", "fp8_naive", "scalify_fp16", "scalify_fp8"]
)
def test_a_recipe_precision_name_in_python_names_its_factory(name):
    # The CLI's `precision=fp8_delayed` is a factory of the recipes, not a policy:
    # in Python the name says which factory builds it, and that factory does.
    from lowtrain.recipes import precisions
    from lowtrain.train._precisions import RECIPE_PRECISIONS, resolve

    with pytest.raises(ValueError, match=r"lowtrain\.recipes\.precisions\."):
        resolve(name)
    call = RECIPE_PRECISIONS[name]
    built = eval(f"precisions.{call}", {"precisions": precisions})
    assert isinstance(resolve(built), lowtrain.train.Precision)
