"""`lowtrain.unit_scaling`'s Equinox modules and `lowtrain.unit_scaling.optim`.

Modules: shapes, dtypes and unit initialization; unit scale through blocks and a
stack of 8 residual layers; composition with `lowtrain.amp`. Optimizers: the u-μP
learning-rate multiplier of each parameter kind (numbers derived from the rule table)
and the exact first updates.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U

from .helpers import eqns_of, float_in_dtypes

LOOSE = (0.5, 2.0)


def rms(x):
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float32)))))


def assert_rms(*arrays, lo_hi=LOOSE):
    for x in arrays:
        assert lo_hi[0] <= rms(x) <= lo_hi[1], rms(x)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def normal(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def unit_grad(model, x, rng):
    """The output of `model(x)`, and the gradients of `x` and of the model for a
    unit-normal cotangent, compiled as one program."""
    out = eqx.filter_eval_shape(model, x)
    cot = normal(rng, *out.shape)

    @eqx.filter_jit
    def run(model, x):
        y, vjp = eqx.filter_vjp(lambda m, x: m(x), model, x)
        return y, vjp(cot)

    y, (gmodel, gx) = run(model, x)
    return y, gx, gmodel


# Widths are 64 throughout (vocab 64, MLP 256): eager initialization compiles one
# program per new weight shape, and these few are shared by every test.


@pytest.fixture(scope="module")
def gpt():
    return uu.TransformerDecoder(64, 64, layers=2, heads=4, key=jax.random.key(1))


def abstract(cls, *args, **kwargs):
    """The module's shapes and dtypes, without running its initializers."""
    return eqx.filter_eval_shape(cls, *args, **kwargs)


def test_layer_shapes_dtypes_and_unit_init(getkey):
    layer = uu.Linear(64, 256, key=getkey())
    assert layer.weight.shape == (256, 64) and layer.bias.shape == (256,)
    assert layer.weight.dtype == jnp.float32 and (layer.bias == 0).all()
    assert 0.95 < float(jnp.std(layer.weight)) < 1.05  # N(0, 1), not 1/sqrt(in)
    half = abstract(uu.Linear, 4, 3, use_bias=False, dtype=jnp.bfloat16, key=getkey())
    assert half.weight.dtype == jnp.bfloat16 and half.bias is None
    assert abstract(uu.LinearReadout, 8, 3, key=getkey()).bias is None
    emb = abstract(uu.Embedding, 100, 16, key=getkey())
    assert emb.weight.shape == (100, 16)
    ids = jax.ShapeDtypeStruct((2, 3, 4), jnp.int32)
    assert eqx.filter_eval_shape(emb, ids).shape == (2, 3, 4, 16)
    assert uu.LayerNorm(16).weight is None and uu.LayerNorm(16).bias is None
    ln = uu.LayerNorm((4, 16), use_weight=True, use_bias=True)
    assert ln.weight.shape == ln.bias.shape == (4, 16) and (ln.weight == 1).all()
    assert uu.RMSNorm(16, use_weight=True).weight.shape == (16,)


def test_layers_call_the_functional_ops(rng, getkey):
    x = normal(rng, 4, 8, 64)
    layer = uu.Linear(64, 64, key=getkey())
    np.testing.assert_allclose(layer(x), U.linear(x, layer.weight, layer.bias))
    head = uu.LinearReadout(64, 64, key=getkey())
    np.testing.assert_allclose(head(x), U.linear_readout(x, head.weight))
    ln = uu.LayerNorm(64, use_weight=True, use_bias=True)
    np.testing.assert_allclose(ln(x), U.layer_norm(x, ln.weight, ln.bias), 1e-6)
    np.testing.assert_allclose(uu.RMSNorm(64)(x), U.rms_norm(x), rtol=1e-6)


def test_vmap_gives_the_wrong_weight_gradient(rng, getkey):
    # The documented caveat: under vmap each call sees a batch of one, so the weight
    # gradient comes out sqrt(batch) times too large.
    layer = uu.Linear(64, 64, key=getkey())
    x, cot = normal(rng, 64, 64), normal(rng, 64, 64)
    whole = jax.grad(lambda m: jnp.sum(m(x) * cot))(layer)
    mapped = jax.grad(lambda m: jnp.sum(jax.vmap(m)(x) * cot))(layer)
    np.testing.assert_allclose(mapped.weight, whole.weight * 8.0, rtol=1e-4)


@pytest.mark.parametrize("activation", ["silu_glu", "gelu"])
def test_mlp_unit_scale(rng, getkey, activation):
    mlp = uu.MLP(64, activation=activation, key=getkey())
    assert (mlp.linear_gate is None) == (activation == "gelu")
    y, gx, g = unit_grad(mlp, normal(rng, 8, 32, 64), rng)
    assert y.shape == (8, 32, 64)
    assert_rms(y, gx, g.linear_1.weight, g.linear_2.weight)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_mhsa_unit_scale(rng, getkey, is_causal):
    attn = uu.MHSA(64, 4, is_causal=is_causal, key=getkey())
    y, gx, g = unit_grad(attn, normal(rng, 8, 32, 64), rng)
    assert y.shape == (8, 32, 64)
    assert_rms(y, gx, g.linear_o.weight)
    with pytest.raises(ValueError, match="dividing"):
        abstract(uu.MHSA, 64, 3, key=getkey())


def test_stack_of_8_transformer_layers_stays_unit(rng, getkey):
    # Causal layers with the decoder's depth rule, as in `TransformerDecoder`.
    tau = uu.transformer_residual_scaling_rule()
    keys = jax.random.split(getkey(), 8)
    layers = [
        uu.TransformerLayer(
            64,
            4,
            mhsa_tau=tau(2 * i, 16),
            mlp_tau=tau(2 * i + 1, 16),
            is_causal=True,
            key=k,
        )
        for i, k in enumerate(keys)
    ]
    y, gx, g = unit_grad(uu.DepthSequential(layers), normal(rng, 4, 32, 64), rng)
    assert_rms(y, gx)
    for layer in g.layers:
        assert_rms(layer.mlp.linear_1.weight, layer.mlp.linear_2.weight)
        # Flat attention at initialization makes its outputs alike across positions,
        # so the output projection's gradient, a sum over positions, is larger.
        attn = layer.mhsa
        assert_rms(attn.linear_qkv.weight, attn.linear_o.weight, lo_hi=(0.5, 4))


def test_stack_of_8_residual_mlps_stays_unit(rng, getkey):
    mlps = [uu.MLP(64, key=k) for k in jax.random.split(getkey(), 8)]

    def stack(mlps, x):
        for i, mlp in enumerate(mlps):
            x = U.residual_apply(mlp, x, tau=(8 + i) ** -0.5)
        return x

    x, cot = normal(rng, 8, 32, 64), normal(rng, 8, 32, 64)
    run = jax.jit(lambda m, x: (stack(m, x), jax.vjp(stack, m, x)[1](cot)))
    y, (gm, gx) = run(mlps, x)
    assert_rms(y, gx)
    # SwiGLU's input feeds two linears, so its (exact) input gradient has RMS about
    # sqrt(2): the gradient grows towards the first layers, and with it their
    # weight gradients.
    for g in gm:
        weights = g.linear_1.weight, g.linear_gate.weight, g.linear_2.weight
        assert_rms(*weights, lo_hi=(0.5, 2.5))


def test_decoder_shapes_loss_and_gradients(getkey, gpt):
    tokens = jax.random.randint(getkey(), (8, 16), 0, 64)
    logits = eqx.filter_eval_shape(lambda m, t: m(t), gpt, tokens)
    assert logits.shape == (8, 16, 64) and logits.dtype == jnp.float32
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: m.loss(tokens)))(
        gpt
    )
    assert abs(float(loss) - math.log(64)) < 0.2  # small readout: near-uniform
    layer = grads.layers.layers[0]
    assert_rms(layer.mlp.linear_2.weight, grads.projection.weight)


def test_decoder_stream_is_the_unit_scaled_one_up_to_a_factor(getkey, gpt):
    # The decoder passes its stream on with a factor per layer folded in
    # (`stream_scale`); the same layers unit-scaled at every add are the same model:
    # loss and every gradient equal up to rounding and the norms' eps.
    layers = gpt.layers.layers
    scales = [layer.stream_scale for layer in layers]
    expected = 1.0
    for layer, c in zip(layers, scales):
        assert c == pytest.approx(expected)
        expected *= math.sqrt((1 + layer.mhsa_tau**2) * (1 + layer.mlp_tau**2))

    def normalised(layer):
        fresh = abstract(
            uu.TransformerLayer,
            64,
            4,
            mhsa_tau=layer.mhsa_tau,
            mlp_tau=layer.mlp_tau,
            is_causal=True,
            key=getkey(),
        )
        parts = lambda m: (m.mhsa_norm, m.mhsa, m.mlp_norm, m.mlp)
        return eqx.tree_at(parts, fresh, parts(layer))

    reference = eqx.tree_at(
        lambda m: m.layers, gpt, uu.DepthSequential([normalised(x) for x in layers])
    )
    assert all(x.stream_scale is None for x in reference.layers.layers)
    with pytest.raises(ValueError, match="positive"):
        abstract(uu.TransformerLayer, 64, 4, stream_scale=-1.0, key=getkey())
    tokens = jax.random.randint(getkey(), (8, 16), 0, 64)
    run = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: m.loss(tokens)))
    (loss, grads), (ref_loss, ref_grads) = run(gpt), run(reference)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 1e-3


def test_decoder_taus_follow_the_depth_rule(getkey):
    gpt = abstract(uu.TransformerDecoder, 16, 8, layers=3, heads=2, key=getkey())
    taus = [(x.mhsa_tau, x.mlp_tau) for x in gpt.layers.layers]
    expected = [((3 + 2 * i) ** -0.5, (4 + 2 * i) ** -0.5) for i in range(3)]
    np.testing.assert_allclose(taus, expected)
    assert all(x.mhsa.is_causal for x in gpt.layers.layers)


def test_dropout_needs_a_key_unless_inference(rng, getkey):
    layer = uu.TransformerLayer(64, 4, dropout_p=0.1, key=getkey())
    call = lambda layer, x, key: layer(x, key=key)
    x = normal(rng, 2, 8, 64)
    with pytest.raises(ValueError, match="key"):
        eqx.filter_eval_shape(call, layer, x, None)
    y = eqx.filter_jit(call)(layer, x, getkey())
    assert y.shape == x.shape and 0.5 < rms(y) < 2
    frozen = eqx.nn.inference_mode(layer)
    assert frozen.inference and eqx.filter_eval_shape(call, frozen, x, None).shape


def test_amp_runs_unit_scaled_matmuls_in_bf16(getkey, gpt):
    tokens = jax.random.randint(getkey(), (4, 8), 0, 64)
    half = lowtrain.amp(gpt, "bf16")
    logits = half(tokens)
    want = eqx.filter_jit(lambda m, t: m(t))(gpt, tokens)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, want, rtol=0.1, atol=0.05 * rms(want))
    forward = eqns_of(half, tokens, prim="dot_general")
    assert len(forward) == 15  # per layer: qkv, q @ k, p @ v, o, the MLP's 3; readout
    assert all(float_in_dtypes(e) == {np.dtype(jnp.bfloat16)} for e in forward)

    def loss(model, tokens):
        logits = lowtrain.amp(model, "bf16")(tokens)
        return U.cross_entropy(logits[:, :-1], tokens[:, 1:])

    grad_fn = eqx.filter_grad(loss)
    both = eqns_of(grad_fn, gpt, tokens, prim="dot_general")
    assert len(both) == 3 * len(forward)  # forward, and two per matmul backward
    assert all(float_in_dtypes(e) == {np.dtype(jnp.bfloat16)} for e in both)
    grads = eqx.filter_eval_shape(grad_fn, gpt, tokens)
    assert grads.layers.layers[0].mhsa.linear_qkv.weight.dtype == jnp.float32


def _small_model(key, readout_constraint=None):
    def build(key):
        kemb, kstack, kout = jax.random.split(key, 3)
        return [
            uu.Embedding(2**8, 2**4, key=kemb),
            uu.DepthSequential(
                [uu.Linear(16, 16, key=k) for k in jax.random.split(kstack, 3)]
            ),
            uu.LinearReadout(16, 2**10, constraint=readout_constraint, key=kout),
            uu.LayerNorm(16, use_weight=True, use_bias=True),
        ]

    return eqx.filter_eval_shape(build, key)


def test_lr_multipliers_per_kind(getkey):
    # The unit-scaling library's own check: embedding (256, 16), three depth-scaled
    # Linear(16, 16) with biases, readout (1024, 16); plus a norm outside the stack.
    model = _small_model(getkey())
    emb, stack, out, norm = uu.optim.lr_multipliers(model)
    sqrt3 = math.sqrt(3)
    assert emb.weight == pytest.approx(1 / 4)  # width 16 ** -0.5
    for layer in stack.layers:
        assert layer.weight == pytest.approx(1 / 4 / sqrt3)  # fan-in, depth 3
        assert layer.bias == pytest.approx(1 / sqrt3)
    assert out.weight == 1.0 and norm.weight == 1.0 and norm.bias == 1.0
    info = uu.optim.param_info(model)
    assert info[1].layers[0].weight == uu.optim.ParamInfo("weight", (16, 16), 3)
    assert info[0].weight.kind == "embedding" and info[2].weight.kind == "output"


def test_lr_multipliers_sgd_rules(getkey):
    rule = uu.optim.lr_scale_sgd(uu.constraints.to_output_scale)
    model = _small_model(getkey(), uu.constraints.to_output_scale)
    emb, stack, out, norm = uu.optim.lr_multipliers(model, rule)
    sqrt3 = math.sqrt(3)
    assert emb.weight == pytest.approx(4.0)  # width 16 ** 0.5
    assert stack.layers[0].weight == pytest.approx(4 / sqrt3)
    assert stack.layers[0].bias == pytest.approx(16 / sqrt3)  # shape[0] = 16
    assert out.weight == 1.0 and norm.weight == 16.0
    assert uu.optim.lr_scale_sgd(None) is uu.optim.lr_scale_adam
    with pytest.raises(ValueError, match="None or"):
        uu.optim.lr_scale_sgd(uu.constraints.gmean)


def test_lr_multipliers_of_the_decoder(getkey):
    gpt = abstract(uu.TransformerDecoder, 32, 16, layers=2, heads=2, key=getkey())
    mults = uu.optim.lr_multipliers(gpt)
    layer = mults.layers.layers[1]
    assert layer.mhsa.linear_qkv.weight == pytest.approx(32**-0.5 * 2**-0.5)
    assert layer.mlp.linear_2.weight == pytest.approx(128**-0.5 * 2**-0.5)
    assert mults.embedding.weight == pytest.approx(32**-0.5)
    assert mults.projection.weight == 1.0
    assert layer.mhsa_norm.weight is None  # no parameter, no multiplier


def test_non_unit_scaled_parameters(getkey):
    model = [
        abstract(uu.Linear, 4, 4, key=getkey()),
        abstract(eqx.nn.Linear, 4, 4, key=getkey()),
    ]
    with pytest.raises(ValueError, match="allow_non_unit_scaling_params"):
        uu.optim.adamw(1e-3, model=model)
    mults = uu.optim.lr_multipliers(model, allow_non_unit_scaling_params=True)
    assert mults[0].weight == 0.5 and mults[1].weight == 1.0
    inner = uu.DepthSequential([abstract(uu.Linear, 4, 4, key=getkey())])
    nested = uu.DepthSequential([inner])
    with pytest.raises(ValueError, match="inside another"):
        uu.optim.param_info(nested)


def test_adamw_first_update(rng, getkey):
    model = uu.Linear(64, 64, key=getkey())
    params = eqx.filter(model, eqx.is_inexact_array)
    x, y = normal(rng, 32, 64), normal(rng, 32, 64)
    grads = jax.grad(lambda m: U.mse_loss(m(x), y))(model)
    # Adam's first step is lr * sign(grad); times the multipliers 64 ** -0.5 and 1.
    opt = uu.optim.adamw(0.1, eps=0.0, model=model)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
        updates, _ = opt.update(grads, opt.init(params), params)
    want = -0.1 / 8 * jnp.sign(grads.weight)
    np.testing.assert_allclose(updates.weight, want, rtol=1e-5)
    np.testing.assert_allclose(updates.bias, -0.1 * jnp.sign(grads.bias), 1e-5)
    # Independent weight decay: weight_decay * p per step, whatever the LR.
    zero = jax.tree.map(jnp.zeros_like, grads)
    opt = uu.optim.adamw(0.1, weight_decay=0.01, model=model)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = opt.update(zero, opt.init(params), params)
    np.testing.assert_allclose(updates.weight, -0.01 * model.weight, rtol=1e-6)
    opt = uu.optim.adamw(
        0.1, weight_decay=0.01, independent_weight_decay=False, model=model
    )
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = opt.update(zero, opt.init(params), params)
    np.testing.assert_allclose(updates.weight, -0.1 / 8 * 0.01 * model.weight, 1e-6)


def test_sgd_updates_and_schedules(rng, getkey):
    model = uu.Linear(64, 64, key=getkey())
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    opt = uu.optim.sgd(0.5, momentum=0.9, model=model)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    np.testing.assert_allclose(updates.weight, -0.5 / 8)
    updates, state = opt.update(grads, state, params)
    np.testing.assert_allclose(updates.weight, -0.5 / 8 * 1.9, rtol=1e-6)
    schedule = optax.linear_schedule(0.0, 1.0, 10)
    with pytest.raises(ValueError, match="peak_learning_rate"):
        uu.optim.adamw(schedule, weight_decay=0.1, model=model)
    opt = uu.optim.adamw(
        schedule, weight_decay=0.1, peak_learning_rate=1.0, model=model
    )
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates.weight, 0.0)  # schedule(0) = 0: no decay
    with pytest.raises(ValueError, match="eqx.is_inexact_array"):
        opt.init({"w": jnp.ones(3)})


def test_decoder_trains_with_umup_adamw(getkey, gpt):
    # A cyclic sequence: each token follows from the one before.
    starts = jax.random.randint(getkey(), (16, 1), 0, 64)
    tokens = (starts + jnp.arange(16)[None]) % 64
    opt = uu.optim.adamw(0.3, model=gpt)  # u-μP's base LRs are O(1)
    state = opt.init(eqx.filter(gpt, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: m.loss(tokens))(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = opt.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, loss

    first = None
    for _ in range(30):
        with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
            gpt, state, loss = step(gpt, state)
        first = loss if first is None else first
    assert float(loss) < 0.1 * float(first)
