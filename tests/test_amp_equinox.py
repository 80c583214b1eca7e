"""`lowtrain.amp` on models written the way Equinox code is written: per-example
modules under `jax.vmap` (the batched program, not one per example), collectives
over the vmap's axis, `eqx.nn.BatchNorm` with `eqx.nn.State`, a GRU in `lax.scan`,
a sinusoidal time embedding (inputs cast where they are used), constant outputs."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowtrain

from .helpers import iter_eqns

POLICIES = ["fp32", "bf16", "fp16", "fp8"]
F32 = jnp.float32


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


def _readme_mlp(batch=256):
    mlp = eqx.nn.MLP(784, 10, 512, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch, 784))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    return mlp, x, y


def _per_example_dots(text: str, batch: int) -> list[str]:
    # A dot_general whose result is weight-shaped per example: (batch, out, in).
    shapes = [f"{batch}x512x784", f"{batch}x784x512", f"{batch}x512x512"]
    shapes += [f"{batch}x10x512", f"{batch}x512x10"]
    return [
        d
        for d in re.findall(r"stablehlo\.dot_general.*", text)
        if any(f"-> tensor<{s}x" in d for s in shapes)
    ]


@pytest.mark.parametrize("policy", ["fp16", "bf16", "fp8"])
def test_vmap_of_amp_is_the_batched_program(policy):
    # The README's pattern, `jax.vmap(amp(model))`, compiles to what
    # `amp(jax.vmap(model))` does: no weight gradient per example, the same
    # temporaries, the same gradients to the last bit.
    mlp, x, y = _readme_mlp()
    losses = {
        "vmap(amp)": lambda m: _ce(jax.vmap(lowtrain.amp(m, policy))(x), y),
        "amp(vmap)": lambda m: _ce(lowtrain.amp(eqx.filter_vmap(m), policy)(x), y),
    }
    grads, temp = {}, {}
    for name, loss in losses.items():
        step = eqx.filter_jit(eqx.filter_grad(loss))
        lowered = step.lower(mlp)
        assert not _per_example_dots(lowered.as_text(), 256), name
        compiled = lowered.compile()
        temp[name] = compiled.compiled.memory_analysis().temp_size_in_bytes
        grads[name] = jax.tree.leaves(step(mlp))
    assert temp["vmap(amp)"] <= 1.2 * temp["amp(vmap)"]
    for a, b in zip(grads["vmap(amp)"], grads["amp(vmap)"]):
        assert a.dtype == F32
        np.testing.assert_array_equal(a, b)


def test_vmap_of_amp_nested_and_under_vmap_of_grad(getkey):
    # Two vmaps around amp (both peeled), and per-example gradients
    # (`jax.vmap(jax.grad(...))`), against float32.
    mlp = eqx.nn.MLP(6, 3, 16, 1, key=getkey())
    x = jax.random.normal(getkey(), (4, 5, 6))
    amp_mlp = lowtrain.amp(mlp, "bf16")
    out = jax.vmap(jax.vmap(amp_mlp))(x)
    np.testing.assert_allclose(out, jax.vmap(jax.vmap(mlp))(x), rtol=0.05, atol=0.02)
    per_example = jax.vmap(
        lambda x: eqx.filter_grad(lambda m: jnp.sum(lowtrain.amp(m, "bf16")(x)))(mlp),
    )(x[0])
    ref = jax.vmap(lambda x: eqx.filter_grad(lambda m: jnp.sum(m(x)))(mlp))(x[0])
    for a, b in zip(jax.tree.leaves(per_example), jax.tree.leaves(ref)):
        assert a.shape == b.shape and a.dtype == F32
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05)


def test_vmap_of_amp_inside_scan(getkey):
    w = jax.random.normal(getkey(), (8, 8)) / 8**0.5
    xs = jax.random.normal(getkey(), (3, 4, 8))
    layer = lambda w, x: jnp.tanh(x @ w)

    def loss(w, layer_fn):
        def body(carry, x):
            return carry + jnp.sum(jax.vmap(layer_fn, in_axes=(None, 0))(w, x)), None

        return lax.scan(body, 0.0, xs)[0]

    g = jax.jit(jax.grad(lambda w: loss(w, lowtrain.amp(layer, "bf16"))))(w)
    ref = jax.grad(lambda w: loss(w, layer))(w)
    assert g.dtype == F32
    np.testing.assert_allclose(g, ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("policy", POLICIES)
def test_collectives_over_the_vmap_axis_forward_and_backward(policy):
    x = jnp.arange(12.0).reshape(4, 3) / 4

    def f(x):
        centred = x - lax.pmean(x, "i")
        gathered = lax.all_gather(x, "i")  # (4, 3): every member's row
        return centred * lax.psum(jnp.sum(x), "i") + jnp.sum(gathered, 0)

    def loss(fn):
        return lambda x: jnp.sum(jax.vmap(fn, axis_name="i")(x) ** 2)

    value, grad = jax.value_and_grad(loss(lowtrain.amp(f, policy)))(x)
    ref_value, ref_grad = jax.value_and_grad(loss(f))(x)
    tol = {"fp32": 1e-6, "bf16": 2e-2, "fp16": 2e-3, "fp8": 2e-2}[policy]
    np.testing.assert_allclose(value, ref_value, rtol=tol)
    np.testing.assert_allclose(grad, ref_grad, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("policy", POLICIES)
def test_constant_outputs_pass_through(policy):
    key = jax.random.key(3)
    f = lambda x: (x * 2, jnp.array(False), jnp.int32(7), key, x > 0)
    y, flag, count, k, positive = lowtrain.amp(f, policy)(jnp.ones(3))
    assert flag.dtype == jnp.bool_ and not bool(flag)
    assert count.dtype == jnp.int32 and int(count) == 7
    assert jnp.array_equal(jax.random.key_data(k), jax.random.key_data(key))
    assert positive.dtype == jnp.bool_ and bool(positive.all())
    grad = jax.grad(lambda x: jnp.sum(lowtrain.amp(f, policy)(x)[0]))(jnp.ones(3))
    np.testing.assert_array_equal(grad, 2.0)


def _time_embedding(t, dim=64):
    # The UNet score model's sinusoidal embedding (Equinox's example), t in [0, 1000].
    freqs = jnp.exp(
        jnp.arange(dim // 2, dtype=F32) * -(jnp.log(10000.0) / (dim // 2 - 1))
    )
    angles = t * freqs
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)])


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_inputs_are_cast_where_used_so_a_time_embedding_stays_exact(policy):
    # `t` is used only by ops that run in float32 or in the widest of their float32
    # inputs: it is never rounded to half (bfloat16(999.0) == 1000).
    t = jnp.linspace(0.0, 1000.0, 1001)
    out = jax.vmap(lowtrain.amp(_time_embedding, policy))(t)
    ref = jax.vmap(_time_embedding)(t)
    assert float(jnp.abs(out - ref).max()) < 1e-2
    # A matmul still casts it (and the table) to the compute dtype where it uses it.
    w = jnp.ones((64, 8))
    jaxpr = jax.make_jaxpr(lowtrain.amp(lambda t: _time_embedding(t) @ w, policy))
    dots = [
        e for e in iter_eqns(jaxpr(t[5]).jaxpr) if e.primitive.name == "dot_general"
    ]
    compute = lowtrain.get_policy(policy).compute_dtype
    assert dots and all(v.aval.dtype == compute for e in dots for v in e.invars)


def test_pin_a_field_to_float32_with_a_scope():
    # A table a matmul uses is cast there; a policy scope keeps that matmul (and so
    # the table) in float32: the documented way to pin a field.
    class Embed(eqx.Module):
        table: jax.Array

        def __call__(self, onehot):
            with jax.named_scope("time_table"):
                return onehot @ self.table

    model = Embed(jnp.full((4, 2), 1.0 + 2.0**-10))
    onehot = jnp.eye(4)[1]
    assert lowtrain.amp(model, "bf16")(onehot)[0] == 1.0  # rounded in bf16
    pinned = lowtrain.get_policy("bf16").with_scopes({"time_table": "float32"})
    assert lowtrain.amp(model, pinned)(onehot)[0] == 1.0 + 2.0**-10


class _BatchNormNet(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, mode, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(8, 16, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode=mode)
        self.out = eqx.nn.Linear(16, 2, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(jax.nn.relu(self.lin(x)), state)
        return self.out(h), state


@pytest.mark.parametrize("mode", ["batch", "ema"])
@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_with_state_the_equinox_way(mode, policy, getkey):
    model, state = eqx.nn.make_with_state(_BatchNormNet)(mode, getkey())
    x = jax.random.normal(getkey(), (32, 8))

    def loss(m, state, amp):
        fn = lowtrain.amp(m, policy) if amp else m
        batched = jax.vmap(fn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        out, state = batched(x, state)
        return jnp.mean(out.astype(F32) ** 2), state

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (value, new_state), grads = step(model, state, True)
    (ref, ref_state), ref_grads = step(model, state, False)
    tol = {"fp32": 1e-5, "bf16": 0.05, "fp16": 0.01, "fp8": 0.1}[policy]
    np.testing.assert_allclose(value, ref, rtol=tol)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert a.dtype == F32
        np.testing.assert_allclose(a, b, rtol=5 * tol, atol=5 * tol)
    # The state is updated from the whole batch, in its own dtype.
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


class _GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(4, 16, key=k1)
        self.head = eqx.nn.Linear(16, 1, key=k2)

    def __call__(self, xs):  # (time, 4), one sequence
        h, _ = lax.scan(lambda h, x: (self.cell(x, h), None), jnp.zeros(16), xs)
        return self.head(h)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_gru_in_scan_the_equinox_way(policy, getkey):
    model = _GRU(getkey())
    xs = jax.random.normal(getkey(), (32, 12, 4))
    y = jax.random.normal(getkey(), (32,))

    def loss(m, batched):
        return jnp.mean((batched(m)(xs) - y) ** 2)

    ways = {
        "vmap(amp)": lambda m: jax.vmap(lowtrain.amp(m, policy)),
        "amp(vmap)": lambda m: lowtrain.amp(eqx.filter_vmap(m), policy),
    }
    grads = {
        name: eqx.filter_grad(lambda m, w=way: loss(m, w))(model)
        for name, way in ways.items()
    }
    ref = eqx.filter_grad(lambda m: loss(m, jax.vmap))(model)
    err = {}
    for name, g in grads.items():
        num = sum(
            float(jnp.sum((a - b) ** 2))
            for a, b in zip(*map(jax.tree.leaves, (g, ref)))
        )
        den = sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(ref))
        err[name] = (num / den) ** 0.5
    # The per-example form is the batched one: no per-example rounding of the
    # weight gradients before they are summed.
    assert err["vmap(amp)"] == pytest.approx(err["amp(vmap)"], rel=1e-6)
    assert (
        err["vmap(amp)"]
        < {"fp32": 1e-6, "bf16": 0.05, "fp16": 0.01, "fp8": 0.2}[policy]
    )


def test_trainer_with_a_per_example_loss_is_the_batched_step(getkey):
    # A Trainer whose `loss` vmaps the model the Equinox way runs the batched
    # program: no (batch, out, in) weight gradient in its step.
    import optax

    class PerExample(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return _ce(jax.vmap(model)(batch["x"]), batch["y"])

    mlp, x, y = _readme_mlp(64)
    trainer = PerExample(mlp, optax.sgd(1e-3), precision="fp16")
    state = trainer.init(key=getkey())
    text = trainer.compiled_step.lower({"x": x, "y": y}, state).as_text()
    assert not _per_example_dots(text, 64)


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_a_weakly_typed_scalar_parameter_is_a_parameter(policy, getkey):
    # `eqx.nn.PReLU`'s slope is made from a Python float: a weakly typed 0-d array.
    # It is a learnable float32 parameter like any other: never rounded to the
    # compute dtype (1 + 2**-12 is 1.0 in bf16 and in fp16), and its op stays
    # float32, where a float32 input keeps it. A true Python constant
    # (the 2.0 below) still follows the other inputs.
    slope = 1.0 + 2**-12
    prelu = eqx.nn.PReLU(slope)
    assert prelu.negative_slope.weak_type  # as Equinox makes it
    scale = jnp.array(1.0 + 2**-12)  # weakly typed too
    linear = eqx.nn.Linear(4, 4, use_bias=False, key=getkey())  # output in half

    def f(model, x):
        linear, prelu, scale = model
        h = linear(x)
        return prelu(h) * scale, h * 2.0, h

    x = -jnp.abs(jax.random.normal(getkey(), (4,)))
    out, doubled, h = lowtrain.amp(f, policy)((linear, prelu, scale), x)
    assert out.dtype == jnp.float32
    half = lowtrain.get_policy(policy).compute_dtype
    h = h.astype(jnp.float32)  # the half-precision product, exactly
    expected = jnp.where(h >= 0, h, slope * h) * (1.0 + 2**-12)
    np.testing.assert_allclose(out, expected, rtol=1e-7)
    assert not np.allclose(out, jnp.where(h >= 0, h, h), rtol=1e-5)  # not rounded
    # The gradient of the slope is float32 and not rounded either.
    grad = eqx.filter_grad(lambda m: jnp.sum(lowtrain.amp(f, policy)(m, x)[0]))(
        (linear, prelu, scale)
    )
    assert grad[1].negative_slope.dtype == jnp.float32
    # The constant 2.0 followed the half-precision product: the doubling ran in half.
    jaxpr = jax.make_jaxpr(lowtrain.amp(f, policy))((linear, prelu, scale), x)
    muls = [
        e
        for e in iter_eqns(jaxpr)
        if e.primitive.name == "mul" and any(hasattr(v, "val") for v in e.invars)
    ]
    assert muls and all(e.outvars[0].aval.dtype == half for e in muls)
