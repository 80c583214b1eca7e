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


class _NNXClassifier(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.dropout(jax.nn.relu(self.bn(self.l1(x)))))


class _NNXTrainer(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        return _ce(model(batch["x"]), batch["y"])


def _nnx_batches(n):
    keys = jax.random.split(jax.random.key(7), n)
    x = [jax.random.normal(k, (32, 4)) + 0.5 for k in keys]
    return [{"x": xi, "y": jnp.argmax(xi[:, :3], 1)} for xi in x]


def _nnx_reference(model, batches, lr):
    # The NNX way, by hand: `nnx.value_and_grad` differentiates the Params and
    # writes the rest back to the module; the state goes through `jax.jit` split.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.sgd(lr)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, rest, opt_state, batch):
        m = nnx.merge(graphdef, params, rest)
        loss = lambda m: _ce(m(batch["x"]), batch["y"])
        value, grads = nnx.value_and_grad(loss)(m)
        updates, opt_state = opt.update(grads, opt_state, params)
        rest = nnx.state(m, nnx.Not(nnx.Param))
        return optax.apply_updates(params, updates), rest, opt_state, value

    losses = []
    for batch in batches:
        params, rest, opt_state, value = step(params, rest, opt_state, batch)
        losses.append(float(value))
    return nnx.merge(graphdef, params, rest), losses


def _run(trainer, state, batches):
    losses = []
    for batch in batches:
        state, metrics = trainer.compiled_step(trainer.shard_batch(batch), state)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("policy", ["fp32", *POLICIES])
def test_nnx_state_is_kept_by_the_trainer(policy):
    # The Trainer keeps what NNX's calls change in place, as NNX's own functional
    # step does: in float32 the same losses and statistics as the hand-written NNX
    # loop; under every policy BatchNorm's running statistics move (float32, near
    # the float32 run's) and the dropout stream advances one draw per step.
    batches = _nnx_batches(6)
    ref, ref_losses = _nnx_reference(_NNXClassifier(nnx.Rngs(0)), batches, 0.1)
    trainer = _NNXTrainer(_NNXClassifier(nnx.Rngs(0)), optax.sgd(0.1), precision=policy)
    state, losses = _run(trainer, trainer.init(key=jax.random.key(0)), batches)
    model = state.model
    assert int(model.dropout.rngs.count[...]) == len(batches)
    assert model.bn.mean[...].dtype == F32 and model.bn.var[...].dtype == F32
    assert not np.allclose(model.bn.mean[...], 0.0)
    if policy == "fp32":
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        np.testing.assert_allclose(model.bn.mean[...], ref.bn.mean[...], rtol=1e-5)
        np.testing.assert_allclose(model.bn.var[...], ref.bn.var[...], rtol=1e-5)
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=0.1)
        _close(model.bn.mean[...], ref.bn.mean[...])
    # Dropout differs from step to step: the same batch twice, two masks.
    again, (a, b) = _run(trainer, state, [batches[0], batches[0]])
    assert a != b and int(again.model.dropout.rngs.count[...]) == len(batches) + 2


def test_nnx_state_resumes_where_it_stopped(tmp_path):
    # A run stopped and resumed from its checkpoint continues the RNG stream and the
    # statistics: the same model, bit for bit, as the run that did not stop.
    batches = _nnx_batches(6)
    data = lambda step: batches[step % len(batches)]

    def fit(steps, ckpt, resume=False):
        trainer = _NNXTrainer(_NNXClassifier(nnx.Rngs(0)), optax.sgd(0.1))
        state = trainer.init(key=jax.random.key(0))
        return trainer.fit(
            state,
            data,
            steps=steps,
            checkpoint_dir=ckpt,
            checkpoint_every=3,
            resume=resume,
            progress=False,
        )

    whole = fit(6, tmp_path / "whole")
    fit(3, tmp_path / "split")
    resumed = fit(6, tmp_path / "split", resume=True)
    assert int(resumed.model.dropout.rngs.count[...]) == 6
    for a, b in zip(jax.tree.leaves(whole.model), jax.tree.leaves(resumed.model)):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)


def test_nnx_state_written_back_by_rewrite_and_unit_scale():
    # Every model transform sets a call's in-place changes on the caller's module.
    x = jax.random.normal(jax.random.key(1), (16, 4)) + 1.0
    for wrap in (lowtrain.unit_scaling.unit_scale, lambda m: lowtrain.rewrite(m, {})):
        model = _NNXNet(nnx.Rngs(0))
        wrap(model)(x)
        assert int(model.dropout.rngs.count[...]) == 1
        assert not np.allclose(model.bn.mean[...], 0.0)


def test_nnx_state_change_under_vmap_is_refused():
    # A per-example call cannot keep a change in place: an error that says what to
    # do, not a silently frozen mask.
    model = _NNXNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 1, 4))
    with pytest.raises(TypeError, match="nnx.vmap"):
        jax.vmap(lowtrain.amp(model, "bf16"))(x)
    assert int(model.dropout.rngs.count[...]) == 0


# -- block-scaled precisions -----------------------------------------------------------

DN = (((1,), (0,)), ((), ()))


def _nvfp4_product(x, kernel, weight):
    # The NVFP4 recipe's product of `x` and `kernel`, `weight` naming the weight.
    y = lowtrain.fp8.block_recipe_dot(
        x, kernel, DN, "nvfp4", weight=weight, out_dtype=jnp.bfloat16
    )
    return y.astype(F32)


def test_nnx_linear_under_nvfp4_has_its_kernel_as_the_weight():
    # An NNX module is a pytree: its kernel is a parameter, so NVFP4 quantizes it in
    # 16x16 tiles (the activations in 1x16 blocks), as for an Equinox model.
    layer = nnx.Linear(64, 32, use_bias=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    out = lowtrain.amp(layer, "nvfp4")(x)
    kernel = layer.kernel[...]
    assert jnp.array_equal(out, _nvfp4_product(x, kernel, "rhs"))
    assert not jnp.array_equal(out, _nvfp4_product(x, kernel, None))


def test_linen_dense_under_nvfp4_with_its_variables_bound():
    # `model.apply` takes the variables as an argument, which `amp` cannot tell from
    # an input: bound in an `eqx.Partial` (a pytree), they are the parameters.
    import equinox as eqx

    model = linen.Dense(32, use_bias=False)
    x = jax.random.normal(jax.random.key(1), (8, 64))
    variables = model.init(jax.random.key(0), x)
    kernel = variables["params"]["kernel"]
    bound = lowtrain.amp(eqx.Partial(model.apply, variables), "nvfp4")(x)
    assert jnp.array_equal(bound, _nvfp4_product(x, kernel, "rhs"))
    # Passed as an argument, the kernel is quantized as an activation (1x16).
    loose = lowtrain.amp(model.apply, "nvfp4")(variables, x)
    assert jnp.array_equal(loose, _nvfp4_product(x, kernel, None))


def test_nnx_model_trains_with_the_trainer_in_mxfp8():
    class Regression(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(32, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):  # a batch
            return self.l2(jax.nn.relu(self.l1(x)))

    x = jax.random.normal(jax.random.key(1), (64, 32))
    data = lowtrain.ArrayBatches({"x": x, "y": jnp.sum(x[:, :4], 1)}, 16, seed=0)
    trainer = Regression(Net(nnx.Rngs(0)), optax.sgd(0.02), precision="mxfp8")
    state = trainer.init(key=jax.random.key(2))
    before = trainer.run_evaluation(state, data)["loss"]
    state = trainer.fit(state, data, steps=60, progress=False)
    after = trainer.run_evaluation(state, data)["loss"]
    assert after < 0.3 * before
