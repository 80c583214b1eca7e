"""`lowtrain.unit_scaling.functional`: each op's output and gradient scales.

The acceptance check of every op: unit-normal inputs and a unit-normal cotangent give
an output and input gradients of RMS in [0.75, 1.33] (linear, matmul: equal fan-in
and fan-out) or [0.5, 2] (nonlinearities, norms, softmax, losses); where the op is
the plain one up to scale, its values and gradients equal the plain op's (computed
in NumPy) times the scales its docstring gives.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U

C = uu.constraints
TIGHT = (0.75, 1.33)
LOOSE = (0.5, 2.0)


def rms(x):
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float32)))))


def assert_rms(lo_hi, *arrays):
    lo, hi = lo_hi
    for x in arrays:
        assert lo <= rms(x) <= hi, rms(x)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def normal(rng, *shape):
    # Test data from NumPy: no compiled program per shape, as jax.random needs.
    return rng.standard_normal(shape, dtype=np.float32)


def unit_vjp(f, rng, *args):
    """`f(*args)`, a unit-normal cotangent and the gradients of `f`'s inputs for it,
    as NumPy arrays, computed by one compiled program (`test_eager_matches_jit`
    covers the eager path)."""
    out = jax.eval_shape(f, *args)
    cot = normal(rng, *out.shape).astype(out.dtype)

    def run(cot, *args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(cot)

    out, grads = jax.jit(run)(cot, *args)
    return np.asarray(out), cot, tuple(np.asarray(g) for g in grads)


def softmax(z, axis=-1):
    e = np.exp(z - z.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def test_linear_unit_scales(rng):
    x, w, b = normal(rng, 512, 256), normal(rng, 256, 256), np.zeros(256, np.float32)
    y, cot, (gx, gw, gb) = unit_vjp(U.linear, rng, x, w, b)
    assert_rms(TIGHT, y, gx, gw, gb)
    np.testing.assert_allclose(y * 16.0, x @ w.T, rtol=1e-4, atol=1e-3)
    # The weight and bias gradients are the plain ones times batch ** -0.5 (512 rows),
    # whatever the leading axes.
    np.testing.assert_allclose(gw, cot.T @ x / math.sqrt(512), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gb, cot.sum(0) / math.sqrt(512), rtol=1e-4, atol=1e-4)
    x3, cot3 = x.reshape(8, 64, 256), cot.reshape(8, 64, 256)
    gw3 = jax.jit(jax.grad(lambda w: jnp.sum(U.linear(x3, w, b) * cot3)))(w)
    np.testing.assert_allclose(gw3, gw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "constraint, out_scale, grad_scale",
    [
        (None, 256**-0.5, 64**-0.5),
        (C.gmean, (256 * 64) ** -0.25, (256 * 64) ** -0.25),
        (C.to_output_scale, 256**-0.5, 256**-0.5),
        (C.to_grad_input_scale, 64**-0.5, 64**-0.5),
    ],
    ids=["none", "gmean", "to_output_scale", "to_grad_input_scale"],
)
def test_linear_constraints(rng, constraint, out_scale, grad_scale):
    # fan_in 256, fan_out 64: the constraint decides which of the two scales wins.
    x, w = normal(rng, 128, 256), normal(rng, 64, 256)
    f = lambda x: U.linear(x, w, constraint=constraint)
    y, cot, (gx,) = unit_vjp(f, rng, x)
    np.testing.assert_allclose(y, out_scale * (x @ w.T), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gx, grad_scale * (cot @ w), rtol=1e-4, atol=1e-5)
    if constraint is None:
        assert_rms(TIGHT, y, gx)


def test_linear_readout(rng):
    x, w = normal(rng, 256, 128), normal(rng, 32, 128)
    y, cot, (gx, gw) = unit_vjp(U.linear_readout, rng, x, w)
    np.testing.assert_allclose(y, (x @ w.T) / 128, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gx, (cot @ w) / math.sqrt(32), rtol=1e-4, atol=1e-5)
    assert_rms(TIGHT, gx, gw)
    assert 0.75 <= rms(y) * math.sqrt(128) <= 1.33  # u-μP's small readout
    tied = lambda x: U.linear_readout(x, w, constraint=C.to_output_scale)
    _, cot, (gx,) = unit_vjp(tied, rng, x)
    np.testing.assert_allclose(gx, (cot @ w) / 128, rtol=1e-4, atol=1e-6)


def test_linear_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        U.linear(jnp.ones((4, 8)), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="bias of shape"):
        U.linear(jnp.ones((4, 8)), jnp.ones((3, 8)), jnp.ones(8))


def test_matmul_unit_scales(rng):
    a, b = normal(rng, 256, 256), normal(rng, 256, 256)
    y, _, (ga, gb) = unit_vjp(U.matmul, rng, a, b)
    assert_rms(TIGHT, y, ga, gb)
    np.testing.assert_allclose(y * 16.0, a @ b, rtol=1e-4, atol=1e-3)


def test_matmul_unconstrained_scales(rng):
    a, b = normal(rng, 4, 64, 256), normal(rng, 4, 256, 128)
    f = lambda a, b: U.matmul(a, b, constraint=None)
    y, cot, (ga, gb) = unit_vjp(f, rng, a, b)
    assert_rms(TIGHT, y, ga, gb)
    bt, at = np.swapaxes(b, -1, -2), np.swapaxes(a, -1, -2)
    np.testing.assert_allclose(ga, cot @ bt / math.sqrt(128), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gb, at @ cot / 8.0, rtol=1e-4, atol=1e-5)


# u-μP's models at mult=1 (alpha = 0.8 for the gate, 0.5 for silu's gradient):
_RELU_OUT = math.sqrt(2 / (1 - 1 / math.pi))
_GELU = (2**0.2 * _RELU_OUT**0.8, 2**0.6)  # (output scale, gradient scale)
_SILU = (2**0.2 * _RELU_OUT**0.8, 2**0.75)


@pytest.mark.parametrize(
    "op, plain, scales",
    [
        (U.gelu, lambda x: jax.nn.gelu(x, approximate=False), _GELU),
        (U.silu, jax.nn.silu, _SILU),
        (U.softmax, jax.nn.softmax, (256**0.9, 256**0.9)),
    ],
    ids=["gelu", "silu", "softmax"],
)
@pytest.mark.parametrize(
    "constraint", [None, C.gmean, C.to_output_scale], ids=["none", "gmean", "output"]
)
def test_elementwise_scales(rng, op, plain, scales, constraint):
    x = normal(rng, 64, 256)
    y, cot, (gx,) = unit_vjp(lambda x: op(x, constraint=constraint), rng, x)
    out_scale, grad_scale = C.apply(constraint, *scales)
    plain_y, (plain_gx,) = jax.jit(lambda x: (plain(x), jax.vjp(plain, x)[1](cot)))(x)
    np.testing.assert_allclose(y, out_scale * plain_y, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gx, grad_scale * plain_gx, rtol=1e-4, atol=1e-6)
    assert_rms(LOOSE, y, gx)


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("op", [U.gelu, U.silu], ids=["gelu", "silu"])
def test_gated_activations_unit_for_any_mult(rng, op, mult):
    x = normal(rng, 4096)
    y, _, (gx,) = unit_vjp(lambda x: op(x, mult=mult, constraint=None), rng, x)
    assert_rms(LOOSE, y, gx)


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
def test_silu_glu(rng, mult):
    x, gate = normal(rng, 4096), normal(rng, 4096)
    y, _, (gx, gg) = unit_vjp(lambda x, g: U.silu_glu(x, g, mult), rng, x, gate)
    assert_rms(LOOSE, y, gx, gg)
    ratio = y / (x * gate / (1 + np.exp(-mult * gate)))
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-4)


@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_axis_and_mult(rng, axis):
    # Away from mult=1 the output and gradient scales differ (here by 4x): unit
    # both ways only unconstrained; gmean puts each off by the same factor 2.
    x = normal(rng, 256, 256)
    f = lambda x: U.softmax(x, axis, mult=0.25, constraint=None)
    y, cot, (gx,) = unit_vjp(f, rng, x)
    assert_rms(LOOSE, y, gx)
    alpha = 1 / (1 + 4 / 0.25**2)
    out_scale = 256 ** (1 - alpha) * 16**alpha
    grad_scale = 1024 ** (1 - alpha) * 32**alpha
    p = softmax(0.25 * x, axis)
    np.testing.assert_allclose(y, out_scale * p, rtol=1e-4, atol=1e-6)
    # softmax's true gradient, with the chain rule's mult; times the model's scale.
    plain_gx = 0.25 * p * (cot - np.sum(cot * p, axis, keepdims=True))
    np.testing.assert_allclose(gx, grad_scale * plain_gx, rtol=1e-3, atol=1e-6)
    tied = jax.jit(lambda x: U.softmax(x, axis, mult=0.25))(x)  # gmean
    np.testing.assert_allclose(tied, (out_scale * grad_scale) ** 0.5 * p, 1e-4, 1e-6)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout(rng, getkey, p):
    x, key = normal(rng, 8192), getkey()
    y, cot, (gx,) = unit_vjp(lambda x: U.dropout(x, p, key=key), rng, x)
    assert_rms(LOOSE, y, gx)
    kept = y != 0
    assert abs(float(np.mean(kept)) - (1 - p)) < 0.03
    np.testing.assert_allclose(y[kept], x[kept] / math.sqrt(1 - p), rtol=1e-5)
    np.testing.assert_allclose(gx, np.where(kept, cot / math.sqrt(1 - p), 0), 1e-5)
    inference = U.dropout(x, p, key=None, inference=True)
    np.testing.assert_allclose(inference, x * math.sqrt(1 - p), rtol=1e-6)


def test_dropout_errors():
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        U.dropout(jnp.ones(3), 1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="inference=True"):
        U.dropout(jnp.ones(3), 0.5, key=None)


def test_layer_norm(rng):
    x, w, b = normal(rng, 256, 128), normal(rng, 128), np.zeros(128, np.float32)
    y, cot, (gx, gw, gb) = unit_vjp(U.layer_norm, rng, x, w, b)
    assert_rms(LOOSE, y, gx, gw, gb)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, xhat * w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, np.sum(cot * xhat, 0) / 16.0, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(gb, np.sum(cot, 0) / 16.0, rtol=1e-4, atol=1e-5)
    y0, _, (gx0,) = unit_vjp(U.layer_norm, rng, x)  # no affine
    assert_rms(LOOSE, y0, gx0)


def test_rms_norm(rng):
    x, w = normal(rng, 8, 32, 128), normal(rng, 128)
    y, cot, (gx, gw) = unit_vjp(U.rms_norm, rng, x, w)
    assert_rms(LOOSE, y, gx, gw)
    xhat = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, xhat * w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, np.sum(cot * xhat, (0, 1)) / 16.0, 1e-3, 1e-4)
    # Two trailing axes, given by the weight's shape.
    y2 = jax.jit(U.rms_norm)(x, jnp.ones((32, 128)))
    np.testing.assert_allclose(jnp.mean(y2**2, (1, 2)), 1.0, rtol=1e-3)


def test_norm_shape_errors():
    with pytest.raises(ValueError, match="trailing axes are"):
        U.layer_norm(jnp.ones((4, 8)), normalized_shape=16)
    with pytest.raises(ValueError, match="weight or bias of shape"):
        U.rms_norm(jnp.ones((4, 8)), jnp.ones(8), normalized_shape=(4, 8))


def test_embedding(rng):
    ids = rng.integers(0, 256, (16, 32)).astype(np.int32)
    table = normal(rng, 256, 64)
    y, cot, (gt,) = unit_vjp(lambda t: U.embedding(ids, t), rng, table)
    assert (y == table[ids]).all()
    assert_rms(LOOSE, y, gt)
    plain = np.zeros_like(table)
    np.add.at(plain, ids.reshape(-1), cot.reshape(-1, 64))
    np.testing.assert_allclose(gt, plain * math.sqrt(256 / 512), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="integer `ids`"):
        U.embedding(jnp.ones(3), table)


@pytest.mark.parametrize("tau", [0.2, 1.0, 3.0])
def test_residual(rng, tau):
    x, w = normal(rng, 256, 256), normal(rng, 256, 256)

    def layer(x, w):
        residual, skip = U.residual_split(x, tau)
        return U.residual_add(U.linear(residual, w), skip, tau)

    y, cot, (gx, gw) = unit_vjp(layer, rng, x, w)
    assert_rms(TIGHT, y, gx, gw)
    expected = (tau * (x @ w.T) / 16 + x) / math.sqrt(1 + tau**2)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    # The branch weight is applied to the gradient at the split, so the gradient
    # reaching the branch is the output's, unscaled.
    expected_gx = (tau * (cot @ w) / 16 + cot) / math.sqrt(1 + tau**2)
    np.testing.assert_allclose(gx, expected_gx, rtol=1e-4, atol=1e-4)
    apply = jax.jit(lambda x, w: U.residual_apply(lambda h: U.linear(h, w), x, tau))
    np.testing.assert_allclose(apply(x, w), y, rtol=1e-5, atol=1e-6)


def test_residual_apply_with_stream_scale_is_the_same_layer(rng):
    # On a stream carrying a factor c, a pre-norm branch (blind to that factor) gives
    # the unit-scaled layer times c * sqrt(1 + tau**2), the branch's weight gradient
    # of the unit-scaled layer, and the input gradient divided by c.
    tau, c = 0.5, 1.7
    d = math.sqrt(1 + tau**2)
    x, w = normal(rng, 64, 64), normal(rng, 64, 64)
    branch = lambda w: lambda h: U.linear(U.rms_norm(h), w)
    y, cot, (gx, gw) = unit_vjp(
        lambda x, w: U.residual_apply(branch(w), x, tau), rng, x, w
    )

    def folded(x, w):
        return U.residual_apply(branch(w), x, tau, stream_scale=c)

    z, vjp = jax.vjp(folded, c * x, w)
    fx, fw = vjp(cot / (c * d))  # the stream's gradient after a folded layer
    np.testing.assert_allclose(z, c * d * y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fw, gw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fx, gx / c, rtol=1e-4, atol=1e-4)
    # Nothing multiplies the stream: the skip is added as it is.
    jaxpr = jax.make_jaxpr(folded)(x, w).jaxpr
    last = jaxpr.eqns[-1]
    assert last.primitive.name == "add" and last.invars[0] is jaxpr.invars[0]
    with pytest.raises(ValueError, match="Expected `stream_scale` None .* or positive"):
        U.residual_apply(branch(w), x, tau, stream_scale=0.0)


def test_transformer_residual_scaling_rule():
    layers = 4
    tau = uu.transformer_residual_scaling_rule()
    taus = [tau(i, 2 * layers) for i in range(2 * layers)]
    np.testing.assert_allclose(taus, [(layers + i) ** -0.5 for i in range(8)])
    # Follow the variance of each contribution through the stack: embedding,
    # attention and MLP each end with a third.
    var = {"emb": 1.0, "attn": 0.0, "mlp": 0.0}
    for i, t in enumerate(taus):
        var = {k: v / (1 + t**2) for k, v in var.items()}
        var["attn" if i % 2 == 0 else "mlp"] += t**2 / (1 + t**2)
    np.testing.assert_allclose(list(var.values()), [1 / 3] * 3, rtol=1e-6)
    ratio = uu.transformer_residual_scaling_rule(residual_mult=2.0)
    var = 1.0
    for i in range(8):
        var /= 1 + ratio(i, 8) ** 2
    # Attention and MLP each 4x the embedding (mult**2): 1 / (1 + 4 + 4).
    np.testing.assert_allclose(var, 1 / 9, rtol=1e-6)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_attention(rng, is_causal):
    q, k, v = (normal(rng, 4, 2, 128, 64) for _ in range(3))
    f = lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    y, cot, (gq, gk, gv) = unit_vjp(f, rng, q, k, v)
    assert y.shape == (4, 2, 128, 64)
    assert_rms(LOOSE, y, gv)
    assert rms(gq) < 0.5 and rms(gk) < 0.5  # nearly flat attention at init
    logits = q @ np.swapaxes(k, -1, -2) / 64  # u-μP: 1/d, not 1/sqrt(d)
    if is_causal:
        logits = np.where(np.tril(np.ones((128, 128), bool)), logits, -np.inf)
    # Flat-attention RMS sqrt(spread / seq), interpolated towards 1 with weight
    # alpha = 1 / (1 + 4 d / mult^2) = 1 / 257.
    spread = sum(1 / i for i in range(1, 129)) if is_causal else 1.0
    scale = (spread / 128) ** (-(1 - 1 / 257) / 2)
    np.testing.assert_allclose(y, softmax(logits) @ v * scale, rtol=1e-4, atol=1e-5)


def test_attention_sharp_mult_scale_moves_to_one(rng):
    q, k, v = (normal(rng, 1, 256, 16) for _ in range(3))
    y = jax.jit(lambda q, k, v: U.scaled_dot_product_attention(q, k, v, mult=64.0))
    assert_rms(LOOSE, y(q, k, v))


def _cross_entropy(logits, labels):  # NumPy: per-row loss and its gradient
    p = softmax(logits.astype(np.float64))
    onehot = np.eye(logits.shape[-1])[labels]
    loss = -np.log(np.sum(p * onehot, -1))
    return loss, p - onehot


def test_cross_entropy(rng):
    logits, labels = normal(rng, 8, 64, 512), rng.integers(0, 512, (8, 64))
    value, grad = jax.jit(jax.value_and_grad(U.cross_entropy))(logits, labels)
    plain, plain_grad = _cross_entropy(logits, labels)
    np.testing.assert_allclose(value, plain.mean(), rtol=1e-5)
    assert value.dtype == jnp.float32
    assert_rms(LOOSE, grad)
    np.testing.assert_allclose(grad, plain_grad * 512 / math.sqrt(511), 1e-4, 1e-6)
    # mult scales the logits in the forward pass only.
    f = lambda z: U.cross_entropy(z, labels, 4.0)
    value4, grad4 = jax.jit(jax.value_and_grad(f))(logits)
    plain4, plain_grad4 = _cross_entropy(4 * logits, labels)
    np.testing.assert_allclose(value4, plain4.mean(), rtol=1e-5)
    np.testing.assert_allclose(grad4, plain_grad4 * 512 / math.sqrt(511), 1e-4, 1e-6)
    with pytest.raises(ValueError, match="integer labels"):
        U.cross_entropy(logits, labels[:, :-1])


def test_mse_loss(rng):
    x, t = normal(rng, 64, 64), normal(rng, 64, 64)
    value, (gx, gt) = jax.jit(jax.value_and_grad(U.mse_loss, (0, 1)))(x, t)
    np.testing.assert_allclose(value, np.mean((x - t) ** 2), rtol=1e-5)
    assert_rms(LOOSE, gx, gt)
    np.testing.assert_allclose(gx, 2 * (x - t) / math.sqrt(8), rtol=1e-5)


def test_half_precision_stays_half(rng):
    x = normal(rng, 32, 64).astype(jnp.bfloat16)
    w = normal(rng, 64, 64).astype(jnp.bfloat16)
    f = lambda x, w: U.rms_norm(U.gelu(U.linear(x, w)))
    y, _, (gx, gw) = unit_vjp(f, rng, x, w)
    assert y.dtype == gx.dtype == gw.dtype == jnp.bfloat16
    loss = jax.eval_shape(U.cross_entropy, y, jnp.zeros(32, jnp.int32))
    assert loss.dtype == jnp.float32


def test_eager_matches_jit(rng, maybe_jit):
    x, w = normal(rng, 16, 32), normal(rng, 8, 32)
    labels = jnp.arange(16) % 8

    def loss(x, w):
        h = U.rms_norm(U.linear(x, w, jnp.zeros(8)))
        return U.cross_entropy(U.softmax(U.gelu(h)), labels)

    value, grads = maybe_jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    want, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for g, h in zip(grads, want_grads):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6)
