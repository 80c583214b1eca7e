"""`uu.unit_scale` (the one-line transform) and `uu.simulate_fp8` (plain FP8 casts)."""

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lowtrain
import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U

from .helpers import iter_eqns


def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))


def mlp_loss(ws, x, labels):
    # Plain JAX, written without unit scaling: N(0, 1) weights, GELU, mean CE.
    for w in ws[:-1]:
        x = jax.nn.gelu(x @ w)
    logp = jax.nn.log_softmax(x @ ws[-1])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


def mlp_args(key, sizes=(784, 512, 512, 512, 10), batch=128):
    keys = jax.random.split(key, len(sizes))
    ws = [jax.random.normal(k, (n, m)) for k, n, m in zip(keys, sizes, sizes[1:])]
    x = jax.random.normal(keys[-1], (batch, sizes[0]))
    return ws, x, jnp.arange(batch) % sizes[-1]


def test_mlp_gradients_become_unit_scaled(getkey):
    args = mlp_args(getkey())
    plain = [rms(g) for g in jax.grad(mlp_loss)(*args)]
    unit = [rms(g) for g in jax.grad(uu.unit_scale(mlp_loss))(*args)]
    assert all(0.25 <= r <= 4 for r in unit), unit
    assert max(plain) > 40 or min(plain) < 1 / 40, plain  # far outside without it


def test_values_and_loss(getkey):
    x, w = jax.random.normal(getkey(), (8, 64)), jax.random.normal(getkey(), (64, 16))
    # No residual add: the matmul's output scale is exactly 1/sqrt(fan_in) = 1/8.
    np.testing.assert_allclose(uu.unit_scale(jnp.matmul)(x, w), (x @ w) / 8, rtol=1e-6)
    # A mean loss keeps its value; its gradient comes back unit (not 1/N).
    loss = lambda v: jnp.mean(v**2)  # noqa: E731
    v = jax.random.normal(getkey(), (1000,))
    np.testing.assert_allclose(uu.unit_scale(loss)(v), loss(v), rtol=1e-6)
    g = jax.grad(uu.unit_scale(loss))(v)
    np.testing.assert_allclose(g, v, rtol=1e-6)  # d(mean(v**2)) = 2v/N, unscaled: v


def test_matmul_backward_scales(getkey):
    x, w = jax.random.normal(getkey(), (32, 64)), jax.random.normal(getkey(), (64, 16))
    out, vjp = jax.vjp(uu.unit_scale(jnp.matmul), x, w)
    gx, gw = vjp(jnp.ones_like(out))
    # Unconstrained: x's gradient over fan-out 16, w's over the batch of 32.
    np.testing.assert_allclose(gx, jnp.ones((32, 16)) @ w.T / 4, rtol=1e-4)
    np.testing.assert_allclose(gw, x.T @ jnp.ones((32, 16)) / 32**0.5, rtol=1e-4)


def test_residual_stack_stays_unit(getkey):
    # 8 residual MLP layers: the adds are found by dependency analysis and become
    # unit-scaled (`U.residual_split` / `U.residual_add`).
    keys = jax.random.split(getkey(), 17)
    ws = [
        (
            jax.random.normal(keys[2 * i], (128, 256)),
            jax.random.normal(keys[2 * i + 1], (256, 128)),
        )
        for i in range(8)
    ]
    x = jax.random.normal(keys[16], (64, 128))

    def net(ws, x, probes):  # `probes` (zeros) read each layer's cotangent
        outs = []
        for (w1, w2), probe in zip(ws, probes):
            x = x + jax.nn.gelu(x @ w1) @ w2 + probe
            outs.append(x)
        return outs

    probes = [jnp.zeros_like(x)] * 8
    assert max(rms(o) for o in net(ws, x, probes)) > 1e6  # exploding without it
    outs = uu.unit_scale(net)(ws, x, probes)
    assert all(0.5 <= rms(o) <= 2 for o in outs), [rms(o) for o in outs]
    target = jax.random.normal(getkey(), x.shape)
    loss = lambda ws, x, p: jnp.mean((net(ws, x, p)[-1] - target) ** 2)  # noqa: E731
    cts = jax.grad(uu.unit_scale(loss), argnums=2)(ws, x, probes)
    top = rms(cts[-1])  # the loss's own gradient, out - target: about sqrt(2)
    # Measured: each layer down multiplies the cotangent by 1.1-1.2 (tau = 1 for
    # every residual add, as the reference's `unit_scale`): 2.3-2.7x over 8 layers.
    assert all(0.5 <= rms(c) / top <= 3 for c in cts), [rms(c) for c in cts]


def test_composes_with_jit_grad_and_scan(getkey):
    ws = jax.random.normal(getkey(), (3, 32, 32))

    def loss(ws, x):
        x, _ = lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws)
        return jnp.mean(x**2)

    x = jax.random.normal(getkey(), (16, 32))
    g = jax.jit(jax.grad(uu.unit_scale(loss)))(ws, x)
    assert g.shape == ws.shape and bool(jnp.isfinite(g).all())
    assert 0.05 < rms(g) < 20


class PlainMLP(eqx.Module):
    ws: list

    def __call__(self, x):
        for w in self.ws[:-1]:
            x = jax.nn.gelu(x @ w)
        return x @ self.ws[-1]


def test_unit_scale_precision_trains(getkey):
    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            logp = jax.nn.log_softmax(model(batch["x"]))
            return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], 1))

    ws, x, _ = mlp_args(getkey(), sizes=(32, 64, 64, 4), batch=64)
    batch = {"x": x, "y": (x[:, 0] > 0).astype(jnp.int32)}
    trainer = Fit(PlainMLP(ws), optax.adam(1e-2), precision=lowtrain.train.UnitScale())
    state = trainer.init(key=getkey())
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
        losses = []
        for _ in range(30):
            state, metrics = trainer.compiled_step(trainer.shard_batch(batch), state)
            losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_simulate_fp8_casts_every_matmul(getkey):
    x = jnp.array([[1000.0, 0.3, 1e-4]])
    w = jnp.ones((3, 1))
    f = uu.simulate_fp8(jnp.matmul)
    assert float(f(x, w)[0, 0]) == 448.0 + 0.3125  # saturated, rounded, flushed
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: f(x, w).sum()))(x)
    casts = {
        str(e.params["new_dtype"]) for e in iter_eqns(jaxpr) if "new_dtype" in e.params
    }
    assert {"float8_e4m3fn", "float8_e5m2"} <= casts


def test_fp8_cast_op_saves_its_operands_as_fp8_bytes():
    # The backward pass keeps the E4M3-rounded operands as their bytes (uint8), not
    # as copies in the operands' dtype: under amp's bf16 that dtype is the traced
    # float32, 4 bytes a value. The gradients are those of `op` at the rounded
    # operands for the E5M2-rounded cotangent, bit for bit, also when
    # `jax.checkpoint` saves the residuals (values above 240, which its float
    # rounding of E4M3 would turn into NaN).
    x = jnp.linspace(-300.0, 300.0, 8 * 16).reshape(8, 16)
    w = jnp.linspace(-2.0, 2.0, 16 * 4).reshape(16, 4)
    g = jnp.linspace(-1.0, 1e-5, 8 * 4).reshape(8, 4)
    e4, e5 = lowtrain.fp8.E4M3, lowtrain.fp8.E5M2
    rnd = lambda a, d: a.astype(d).astype(jnp.float32)  # noqa: E731 (in range)
    _, ref_vjp = jax.vjp(jnp.matmul, rnd(x, e4), rnd(w, e4))
    expected = ref_vjp(rnd(g, e5))
    cast = lambda x, w: uu.fp8_cast_op(jnp.matmul, x, w)  # noqa: E731
    for fn in (
        cast,
        jax.checkpoint(cast, policy=jax.checkpoint_policies.everything_saveable),
    ):
        _, vjp = jax.vjp(fn, x, w)
        for got, want in zip(vjp(g), expected):
            np.testing.assert_array_equal(got, want)
    saved = lowtrain._compat.saved_residual_avals(cast, x, w)
    assert sorted((str(a.dtype), a.size) for a in saved) == [
        ("uint8", w.size),
        ("uint8", x.size),
    ]
    # In the unit_fp8 placement (the rewrite, then amp's bf16), every operand of
    # the model's FP8 matmuls is saved as bytes, none as a float32 copy.
    gpt = uu.TransformerDecoder(32, 16, layers=1, heads=2, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, 16)
    params, static = eqx.partition(gpt, eqx.is_array)
    model = lambda p: lowtrain.amp(uu.simulate_fp8(eqx.combine(p, static)), "bf16")  # noqa: E731
    loss = lambda p: U.cross_entropy(model(p)(tokens)[:, :-1], tokens[:, 1:])  # noqa: E731
    saved = lowtrain._compat.saved_residual_avals(loss, params)
    fp8_bytes = sum(a.size for a in saved if a.dtype == jnp.uint8)
    # 1 layer, 4 x 12 tokens (48 rows) of width 32, 2 heads of 16, MLP width 128,
    # vocabulary 16: each matmul's two operands, one byte a value.
    rows, heads = 48 * 32, 4 * 2 * 12
    operands = {
        "qkv": rows + 96 * 32,
        "q @ k.T": 2 * heads * 16,
        "p @ v": heads * 12 + heads * 16,
        "out": rows + 32 * 32,
        "up": rows + 128 * 32,
        "gate": rows + 128 * 32,
        "down": 48 * 128 + 32 * 128,
        "readout": rows + 16 * 32,
    }
    assert fp8_bytes == sum(operands.values())


def test_simulate_fp8_weights_only_leaves_attention_products():
    # Attention's q @ k.T and p @ v (two activations, rank 3) stay as they are; the
    # matmul with a weight (rank 2) is cast.
    q = jnp.full((2, 4, 8), 2.0**-12)  # below E4M3's 2**-10: cast, it is 0
    w = jnp.ones((8, 8))

    def attention_and_projection(q, w):
        scores = jnp.einsum("bqd,bkd->bqk", q, q)  # 8 * 2**-24
        return scores, q @ w

    scores, proj = uu.simulate_fp8(attention_and_projection, weights_only=True)(q, w)
    np.testing.assert_array_equal(scores, 8 * 2.0**-24)
    np.testing.assert_array_equal(proj, 0.0)
    scores, _ = uu.simulate_fp8(attention_and_projection)(q, w)
    np.testing.assert_array_equal(scores, 0.0)
    fn = lambda q: uu.simulate_fp8(attention_and_projection, weights_only=True)(q, w)
    eqns = iter_eqns(jax.make_jaxpr(fn)(q))
    fp8 = [e for e in eqns if str(e.params.get("new_dtype")) == "float8_e4m3fn"]
    assert len(fp8) == 2  # the projection's two operands only
    # A convolution's kernel is a weight: cast with weights_only too.
    conv = lambda x, k: jax.lax.conv(x, k, (1, 1), "SAME")  # noqa: E731
    x, k = jnp.full((1, 1, 4, 4), 2.0**-12), jnp.ones((1, 1, 3, 3))
    np.testing.assert_array_equal(uu.simulate_fp8(conv, weights_only=True)(x, k), 0.0)
    np.testing.assert_array_equal(conv(x, k)[0, 0, 1, 1], 9 * 2.0**-12)


def _fp8_casts(fn, *args):
    eqns = iter_eqns(jax.make_jaxpr(fn)(*args))
    return collections.Counter(
        str(e.params["new_dtype"])
        for e in eqns
        if e.primitive.name == "convert_element_type"  # not the residuals' bitcasts
        and str(e.params["new_dtype"]).startswith("float8")
    )


def test_simulate_fp8_keep_leaves_the_named_sublayers():
    # TransformerDecoder runs each sublayer in a named scope of its attribute: with
    # keep, the readout ("projection") and the MLPs' down-projections ("linear_2")
    # stay out of FP8, forward and backward; the other matmuls are still cast.
    gpt = uu.TransformerDecoder(32, 16, layers=2, heads=2, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, 16)

    def grads(model):
        loss = lambda m: U.cross_entropy(m(tokens)[:, :-1], tokens[:, 1:])  # noqa: E731
        return eqx.filter_grad(loss)(model)

    # 7 matmuls a layer (qkv, two attention products, out, up, gate, down) and the
    # readout: two E4M3 operands and one E5M2 cotangent each.
    every = _fp8_casts(grads, uu.simulate_fp8(gpt))
    assert every == {"float8_e4m3fn": 2 * 15, "float8_e5m2": 15}
    kept = uu.simulate_fp8(gpt, keep=["linear_2", "projection"])
    assert _fp8_casts(grads, kept) == {"float8_e4m3fn": 2 * 12, "float8_e5m2": 12}
    mlps = uu.simulate_fp8(gpt, keep=["mlp"])  # a whole MLP: 3 matmuls a layer
    assert _fp8_casts(grads, mlps) == {"float8_e4m3fn": 2 * 9, "float8_e5m2": 9}
    # Only the kept matmuls differ from every-matmul FP8: the logits now differ...
    assert not jnp.array_equal(kept(tokens), uu.simulate_fp8(gpt)(tokens))
    # ...and keeping every scope with a matmul gives the model as written (up to
    # float32 rounding of the compiled program; one FP8 cast would be ~1e-2 off).
    names = ["linear_qkv", "attention", "linear_o", "mlp", "projection"]
    out = uu.simulate_fp8(gpt, keep=names)(tokens)
    np.testing.assert_allclose(out, gpt(tokens), rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="list of `jax.named_scope` names"):
        uu.simulate_fp8(gpt, keep="projection")


def test_unit_scaling_rescues_plain_fp8():
    # Plain FP8 casts (scale 1) of a standard net: its tensors leave E4M3/E5M2's
    # range (N(0, 1) weights grow them, a GPT-style 0.02 init shrinks them) and the
    # gradients are far off; unit-scaled, the same casts cost little.
    sizes = (64, 128, 128, 128, 128, 10)
    ws, x, labels = mlp_args(jax.random.key(0), sizes=sizes, batch=64)

    def error(fn, ws):  # the FP8 gradients against the same function's float32 ones
        fp8 = jax.grad(uu.simulate_fp8(fn))(ws, x, labels)
        ref = jax.grad(fn)(ws, x, labels)
        return np.mean(
            [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(fp8, ref)]
        )

    assert error(uu.unit_scale(mlp_loss), ws) < 0.2  # measured: 0.12-0.14
    assert error(mlp_loss, ws) > 0.45  # 0.58-0.77 over seeds
    assert error(mlp_loss, [w * 0.02 for w in ws]) > 0.45  # 0.76-0.77


@pytest.mark.parametrize("bad", [None, 3])
def test_bad_input(bad):
    with pytest.raises(TypeError, match="Expected a function or callable module"):
        uu.unit_scale(bad)
