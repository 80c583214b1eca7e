"""`lowtrain.amp` on Flax models as they are: `amp(model.apply, policy)` for linen
(mutable `batch_stats`, dropout rngs) and NNX modules (pytrees), every matmul and
convolution in the compute dtype, float32 gradients; an NNX model given to the
Trainer. Flax is an optional test dependency: skipped with a reason when absent."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain

from .helpers import iter_eqns

flax = pytest.importorskip("flax", reason="Flax is not installed (`pip install flax`)")
linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

F32 = jnp.float32
POLICIES = ["bf16", "fp16", "fp8"]


class _CNN(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool):
        x = linen.Conv(8, (3, 3))(x)
        x = linen.BatchNorm(use_running_average=not train)(x)
        x = linen.relu(x)
        x = linen.Dropout(0.25, deterministic=not train)(x)
        x = x.reshape((x.shape[0], -1))
        return linen.Dense(10)(x)


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


def _matmul_dtypes(jaxpr):
    ops = ("dot_general", "conv_general_dilated")
    return {
        np.dtype(v.aval.dtype)
        for e in iter_eqns(jaxpr)
        if e.primitive.name in ops
        for v in e.invars
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_linen_with_batch_stats_and_dropout(policy):
    model = _CNN()
    x = jax.random.normal(jax.random.key(0), (16, 8, 8, 1))
    y = jax.random.randint(jax.random.key(1), (16,), 0, 10)
    keys = {"params": jax.random.key(2), "dropout": jax.random.key(3)}
    variables = model.init(keys, x, train=False)

    def loss(params, apply):
        logits, updates = apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            x,
            train=True,
            rngs={"dropout": jax.random.key(4)},
            mutable=["batch_stats"],
        )
        return _ce(logits, y), updates

    step = jax.value_and_grad(loss, has_aux=True)
    (value, updates), grads = step(
        variables["params"], lowtrain.amp(model.apply, policy)
    )
    (ref, ref_updates), ref_grads = step(variables["params"], model.apply)
    np.testing.assert_allclose(value, ref, rtol=0.05)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=0.2, atol=0.05)
    # The running statistics come back in their own dtype, close to float32's.
    for u, r in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates)):
        assert u.dtype == F32
        np.testing.assert_allclose(u, r, rtol=0.05, atol=0.02)
    # Every convolution and matmul in the compute dtype (FP8: on FP8 operands).
    jaxpr = jax.make_jaxpr(lambda p: loss(p, lowtrain.amp(model.apply, policy))[0])
    dtypes = _matmul_dtypes(jaxpr(variables["params"]).jaxpr)
    expected = lowtrain.get_policy(policy).compute_dtype
    if policy == "fp8":  # dequantized FP8 values on a CPU, in float32
        assert dtypes <= {np.dtype(expected), np.dtype(F32)}
    else:
        assert dtypes == {np.dtype(expected)}


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):  # one example
        return self.l2(jax.nn.relu(self.l1(x)))[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_module_under_amp(policy):
    model = _NNXMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    out = jax.vmap(lowtrain.amp(model, policy))(x)
    ref = jax.vmap(model)(x)
    assert out.dtype == F32
    np.testing.assert_allclose(out, ref, rtol=0.1, atol=0.05)
    grads = jax.grad(lambda m: jnp.sum(jax.vmap(lowtrain.amp(m, policy))(x)))(model)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_module_trains_with_the_trainer(policy):
    class Regression(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    x = jax.random.normal(jax.random.key(1), (64, 8))
    data = lowtrain.ArrayBatches({"x": x, "y": jnp.sum(x, 1)}, 16, seed=0)
    trainer = Regression(_NNXMLP(nnx.Rngs(0)), optax.sgd(0.05), precision=policy)
    state = trainer.init(key=jax.random.key(2))
    before = trainer.run_evaluation(state, data)["loss"]
    state = trainer.fit(state, data, steps=60, progress=False)
    after = trainer.run_evaluation(state, data)["loss"]
    assert after < 0.5 * before
    assert all(p.dtype == F32 for p in jax.tree.leaves(state.model))


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):  # a batch
        return self.dropout(self.bn(self.linear(x)))


def _close(a, b):
    # Statistics of a half-precision product: close to the plain call's, relative
    # to their scale (a running mean near 0 has no meaningful relative error).
    np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * float(np.abs(b).max()))


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_state_changes_in_place_under_amp(policy):
    # NNX's semantics: a call in training mode updates BatchNorm's running statistics
    # and advances the dropout RNG stream, on the module itself. Under amp the same
    # happens, the statistics float32 and equal to the plain call's to rounding;
    # eagerly, inside `nnx.jit`, and the functional way (`nnx.split`/`merge`).
    x = jax.random.normal(jax.random.key(1), (16, 4)) + 1.0
    plain = _NNXNet(nnx.Rngs(0))
    plain(x)
    model = _NNXNet(nnx.Rngs(0))
    mean0 = model.bn.mean[...]
    half = lowtrain.amp(model, policy)
    y1, y2 = half(x), half(x)
    assert model.bn.mean[...].dtype == F32
    assert not np.allclose(model.bn.mean[...], mean0)
    assert int(model.dropout.rngs.count[...]) == 2  # one draw per call, as plain
    assert not np.allclose(y1, y2)  # another mask each call
    twice = _NNXNet(nnx.Rngs(0))
    twice(x), twice(x)
    _close(model.bn.mean[...], twice.bn.mean[...])
    _close(model.bn.var[...], twice.bn.var[...])

    jitted = _NNXNet(nnx.Rngs(0))
    nnx.jit(lambda m, x: lowtrain.amp(m, policy)(x))(jitted, x)
    _close(jitted.bn.mean[...], plain.bn.mean[...])
    assert int(jitted.dropout.rngs.count[...]) == 1

    graphdef, state = nnx.split(_NNXNet(nnx.Rngs(0)))

    @jax.jit
    def step(state, x):
        model = nnx.merge(graphdef, state)
        return lowtrain.amp(model, policy)(x), nnx.state(model)

    _, state = step(state, x)
    merged = nnx.merge(graphdef, state)
    _close(merged.bn.mean[...], plain.bn.mean[...])
    assert int(merged.dropout.rngs.count[...]) == 1
