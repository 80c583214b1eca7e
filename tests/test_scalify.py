"""`lowtrain.scalify`: every rule against float32, scales end to end, training steps."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lowtrain
import lowtrain.fp8 as fp8
import lowtrain.scalify as sc
from lowtrain.train import scalify_fp8_op
from lowtrain.unit_scaling import MATMULS

from .helpers import (
    gpt_batches,
    gpt_loss,
    gpt_matmuls,
    iter_eqns,
    make_jaxpr,
    small_gpt_loss,
    small_gpt_params,
    tiny_gpt,
    tiny_mlp,
)

F16, F32 = jnp.float16, jnp.float32
BIG, TINY = 1e6, 1e-9  # float16 holds neither (max 65504, smallest subnormal 6e-8)


def _rand(key, shape, mag, positive=False):
    x = jax.random.uniform(key, shape, minval=0.5, maxval=2.0) * mag
    return x if positive else x * jnp.sign(jax.random.normal(key, shape) + 0.1)


def _idx():
    return jnp.array([2, 0, 2])


# name -> (function, input makers (key, magnitude) -> array, magnitudes)
U = lambda shape=(4, 6), positive=False: lambda k, m: _rand(k, shape, m, positive)
BOTH = (BIG, TINY)
CASES = {
    "add": (lambda a, b: a + b, [U(), U()], BOTH),
    "sub": (lambda a, b: a - b, [U(), U()], BOTH),
    "add_any": (lambda a: jax.grad(lambda x: jnp.sum(x * a + x * x))(a), [U()], BOTH),
    "mul": (lambda a, b: a * b, [U(), U()], BOTH),
    "div": (lambda a, b: a / b, [U(), U()], BOTH),
    "dot_general": (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        [U((2, 3, 5)), U((2, 5, 4))],
        BOTH,
    ),
    "conv_general_dilated": (
        lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME"),
        [U((1, 2, 5, 5)), U((3, 2, 3, 3))],
        BOTH,
    ),
    "reduce_sum": (lambda a: jnp.sum(a, axis=1), [U()], BOTH),
    "cumsum": (lambda a: jnp.cumsum(a, axis=0), [U()], BOTH),
    "neg": (lambda a: -a, [U()], BOTH),
    "reduce_max": (lambda a: jnp.max(a, axis=0), [U()], BOTH),
    "reduce_min": (lambda a: jnp.min(a, axis=1), [U()], BOTH),
    "cummax": (lambda a: lax.cummax(a, axis=0), [U()], BOTH),
    "cummin": (lambda a: lax.cummin(a, axis=1), [U()], BOTH),
    "reshape": (lambda a: a.reshape(3, 8), [U()], BOTH),
    "transpose": (lambda a: a.T, [U()], BOTH),
    "broadcast_in_dim": (lambda a: jnp.broadcast_to(a, (2, 4, 6)), [U()], BOTH),
    "squeeze": (lambda a: a[None][0, :, :], [U()], BOTH),
    "slice": (lambda a: a[1:3, ::2], [U()], BOTH),
    "rev": (lambda a: jnp.flip(a, 0), [U()], BOTH),
    "copy": (lambda a: lax.copy_p.bind(a), [U()], BOTH),
    "stop_gradient": (lax.stop_gradient, [U()], BOTH),
    # The data's mantissa is rounded; the scale keeps the range (float32's here).
    "reduce_precision": (lambda a: lax.reduce_precision(a, 8, 10), [U()], BOTH),
    "sharding_constraint": (
        lambda a: lax.with_sharding_constraint(
            a, jax.sharding.SingleDeviceSharding(jax.devices()[0])
        ),
        [U()],
        BOTH,
    ),
    # `jax.ad_checkpoint.checkpoint_name` (what `lowtrain.train.gather_layer` names).
    "name": (lambda a: jax.ad_checkpoint.checkpoint_name(a, "x"), [U()], BOTH),
    "reduce_window_max": (
        lambda a: lax.reduce_window(a, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID"),
        [U()],
        BOTH,
    ),
    "reduce_window_min": (
        lambda a: lax.reduce_window(a, jnp.inf, lax.min, (2, 2), (1, 1), "VALID"),
        [U()],
        BOTH,
    ),
    "reduce_window_sum": (
        lambda a: lax.reduce_window(a, 0.0, lax.add, (2, 2), (1, 1), "VALID"),
        [U()],
        BOTH,
    ),
    "abs": (jnp.abs, [U()], BOTH),
    "split": (lambda a: jnp.split(a, 2, axis=1), [U()], BOTH),
    "gather": (lambda a: a[_idx()], [U()], BOTH),
    "dynamic_slice": (lambda a: lax.dynamic_slice(a, (1, 2), (2, 3)), [U()], BOTH),
    "max": (lambda a: jnp.maximum(a, 0.0), [U()], BOTH),
    "min": (lambda a, b: jnp.minimum(a, b), [U(), U()], BOTH),
    "clamp": (
        lambda a, b: lax.clamp(-b[0, 0], a, b[0, 0]),
        [U(), U(positive=True)],
        BOTH,
    ),
    "concatenate": (lambda a, b: jnp.concatenate([a, b]), [U(), U()], BOTH),
    "pad": (lambda a: jnp.pad(a, 1), [U()], BOTH),
    "select_n": (lambda a, b: jnp.where(a > 0, a, b), [U(), U()], BOTH),
    "dynamic_update_slice": (
        lambda a, b: lax.dynamic_update_slice(a, b[:2, :2], (1, 1)),
        [U(), U()],
        BOTH,
    ),
    "scatter": (lambda a, b: a.at[_idx()].set(b[:3]), [U(), U()], BOTH),
    "scatter-add": (lambda a, b: a.at[_idx()].add(b[:3]), [U(), U()], BOTH),
    "scatter-mul": (lambda a, b: a.at[_idx()].multiply(b[:3]), [U(), U()], BOTH),
    "scatter-min": (lambda a, b: a.at[_idx()].min(b[:3]), [U(), U()], BOTH),
    "scatter-max": (lambda a, b: a.at[_idx()].max(b[:3]), [U(), U()], BOTH),
    "convert_element_type": (
        lambda a: (a.astype(jnp.float32), (a > 0).astype(jnp.int32)),
        [U()],
        BOTH,
    ),
    "integer_pow": (lambda a: a**3, [U()], BOTH),
    "square": (jnp.square, [U()], BOTH),
    "sqrt": (jnp.sqrt, [U(positive=True)], BOTH),
    "rsqrt": (lax.rsqrt, [U(positive=True)], BOTH),
    "tanh": (jnp.tanh, [U()], BOTH),
    "erf": (jax.scipy.special.erf, [U()], BOTH),
    "sin": (jnp.sin, [U()], (TINY,)),  # sin(1e6) needs more than 11 bits of input
    "logistic": (jax.nn.sigmoid, [U()], BOTH),
    "cos": (jnp.cos, [U()], (TINY,)),
    "exp": (jnp.exp, [U()], (TINY,)),  # exp(1e6) is inf in any format
    "exp2": (jnp.exp2, [U()], (TINY,)),
    "expm1": (jnp.expm1, [U()], (TINY,)),
    "log": (jnp.log, [U(positive=True)], BOTH),
    "log1p": (jnp.log1p, [U(positive=True)], BOTH),
    "pow": (lambda a: jnp.power(a, 1.5), [U(positive=True)], BOTH),
    "erf_inv": (jax.scipy.special.erfinv, [U()], (TINY,)),
    "erfc": (jax.scipy.special.erfc, [U()], (TINY,)),
    "cbrt": (jnp.cbrt, [U()], BOTH),
    "atan2": (jnp.arctan2, [U(), U()], BOTH),
    "rem": (lambda a, b: lax.rem(a, 4 * b), [U(), U(positive=True)], BOTH),
    "cumlogsumexp": (lambda a: lax.cumlogsumexp(a, axis=0), [U()], (TINY,)),
    "cumprod": (lambda a: jnp.cumprod(a[:2], axis=0), [U()], BOTH),
    "reduce_prod": (lambda a: jnp.prod(a[:2], axis=0), [U()], BOTH),
    "sign": (jnp.sign, [U()], BOTH),
    "floor": (jnp.floor, [U()], (BIG,)),
    "ceil": (jnp.ceil, [U()], (BIG,)),
    "round": (jnp.round, [U()], (BIG,)),
    "eq": (lambda a, b: a == a[0, 0], [U(), U()], BOTH),
    "ne": (lambda a, b: a != a[0, 0], [U(), U()], BOTH),
    "lt": (lambda a, b: a < b, [U(), U()], BOTH),
    "le": (lambda a, b: a <= b, [U(), U()], BOTH),
    "gt": (lambda a, b: a > b, [U(), U()], BOTH),
    "ge": (lambda a, b: a >= b, [U(), U()], BOTH),
    "argmax": (lambda a: jnp.argmax(a, axis=1), [U()], BOTH),
    "argmin": (lambda a: jnp.argmin(a, axis=0), [U()], BOTH),
    "is_finite": (jnp.isfinite, [U()], BOTH),
    "sort": (lambda a: jnp.sort(a, axis=1), [U()], BOTH),
    "scalify_op": (sc.dynamic_rescale_l2, [U()], BOTH),
}
if hasattr(lax, "one_minus_square"):  # a primitive since JAX 0.11
    CASES["one_minus_square"] = (lax.one_minus_square, [U()], BOTH)


def test_every_rule_has_a_case():
    # The `one_minus_square` rule is registered on JAX 0.10 too, where nothing emits it.
    assert set(sc.registered_rules()) - set(CASES) <= {"one_minus_square"}
    assert set(CASES) <= set(sc.registered_rules())


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mag", BOTH, ids=["1e6", "1e-9"])
def test_rule_matches_float32(name, mag, getkey):
    fn, makers, mags = CASES[name]
    if mag not in mags:
        pytest.skip(f"{name} is meaningless at magnitude {mag} (see CASES)")
    xs = [make(getkey(), mag) for make in makers]
    scaled_xs = sc.as_scaled_array(xs, dtype=F16)
    for x in scaled_xs:  # the data really is float16, near unit range
        assert x.data.dtype == F16 and float(jnp.max(jnp.abs(x.data))) <= 2.0
    out = sc.scalify(fn)(*scaled_xs)
    ref = fn(*xs)
    primitives = {e.primitive.name for e in iter_eqns(jax.make_jaxpr(fn)(*xs))}
    assert name in primitives  # the case exercises its rule
    for o, r in zip(jax.tree.leaves(out, is_leaf=sc.is_scaled), jax.tree.leaves(ref)):
        o = sc.asarray(o, jnp.float32) if sc.is_scaled(o) else o
        assert o.shape == r.shape
        if jnp.issubdtype(r.dtype, jnp.floating):
            err = jnp.max(jnp.abs(o - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
            assert float(err) < 2e-2, (name, float(err))
        else:
            np.testing.assert_array_equal(o, r)


def test_registry():
    with pytest.raises(ValueError, match="already registered"):
        sc.register_rule("add")(lambda ctx, eqn, a, b: [a])
    x = sc.as_scaled_array(jnp.ones(3))
    with pytest.raises(NotImplementedError, match="`bessel_i0e`"):
        sc.scalify(jax.scipy.special.i0e)(x)


def test_scaled_array_basics():
    x = sc.ScaledArray(jnp.ones(2, F16), 4.0)
    assert x.scale.dtype == jnp.float32 and x.shape == (2,) and x.dtype == F16
    assert np.asarray(x).tolist() == [4.0, 4.0]
    with pytest.raises(TypeError, match="float `data`"):
        sc.ScaledArray(jnp.ones(2, jnp.int32), 1.0)
    with pytest.raises(ValueError, match="scalar `scale`"):
        sc.ScaledArray(jnp.ones(2), jnp.ones(2))
    # A pytree like any other: through filter_jit and optax.
    y = eqx.filter_jit(lambda t: jax.tree.map(lambda v: v * 2, t))(x)
    assert isinstance(y, sc.ScaledArray) and float(y.scale) == 8.0
    with pytest.raises(ValueError, match="rounding mode"):
        sc.pow2_round(3.0, "sideways")


@pytest.mark.parametrize("mode, expected", [("down", 4.0), ("up", 8.0), ("none", 5.0)])
def test_pow2_modes(mode, expected):
    assert float(sc.pow2_round(5.0, mode)) == expected
    x = sc.as_scaled_array(jnp.array([3.0, 1.0]), dtype=F16)
    out = sc.scalify(lambda a: a @ a, pow2=mode)(x)
    expected = {"down": 4.0, "up": 8.0, "none": 2.0 * 2.0 * 2**0.5}[mode]
    assert float(out.scale) == pytest.approx(expected, rel=1e-6)


def _pow2_reference(x: np.ndarray, mode: str) -> np.ndarray:
    # numpy's frexp in float64 (exact for every float32, subnormals included).
    out = x.astype(np.float64)
    ok = np.isfinite(x) & (x > 0)
    mantissa, exponent = np.frexp(out[ok])
    down = np.ldexp(1.0, exponent - 1)
    out[ok] = down if mode == "down" else np.where(mantissa == 0.5, out[ok], 2 * down)
    with np.errstate(over="ignore"):
        return out.astype(np.float32)


@pytest.mark.parametrize("mode", ["down", "up"])
def test_pow2_round_is_exact_for_every_float32(mode):
    # Random bit patterns over all positive floats, float32's subnormals and largest
    # values, every power of two and its successor, zero, inf, NaN, negatives.
    rng = np.random.default_rng(0)
    bits = np.concatenate(
        [
            rng.integers(0, 0x7F800000, 100_000),
            np.arange(0, 3000),
            np.arange(0x7F800000 - 3000, 0x7F800000),
            [1 << k for k in range(31)],
            [(1 << k) + 1 for k in range(31)],
            [0x7F800000, 0x7FC00000, 0x80000001, 0xBF800000],
        ]
    ).astype(np.uint32)
    x = bits.view(np.float32)
    got = np.asarray(jax.jit(lambda v: sc.pow2_round(v, mode))(x))
    want = _pow2_reference(x, mode)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (
        np.isnan(got) & np.isnan(want)
    )
    assert same.all(), x[~same][:5]


def test_auto_rescale_multiplies_exactly():
    # `fit` multiplies by the reciprocal of a power-of-two factor: bitwise the
    # division, and the values kept (a dot whose data leave the band).
    x = sc.as_scaled_array(jnp.full((4, 64), 30.0), dtype=F16)
    for mode in ("down", "up"):
        out = sc.scalify(lambda a: a @ a.T, pow2=mode)(x)
        assert 0.5 <= float(jnp.sqrt(jnp.mean(out.data.astype(F32) ** 2))) < 2
        np.testing.assert_array_equal(out.to_array(F32), jnp.full((4, 4), 57600.0))


def _relu_matmul(x, w):
    return jnp.sum(jax.nn.relu(x @ w))


def test_grad_with_unscaled_cotangent(getkey):
    # The jax-scalify crash case: the cotangent seeding the backward pass is a plain
    # 1.0 that meets ScaledArrays.
    x = jax.random.normal(getkey(), (4, 8)) * BIG
    w = jax.random.normal(getkey(), (8, 3)) * TINY
    gx, gw = sc.scalify(jax.grad(_relu_matmul, argnums=(0, 1)))(
        *sc.as_scaled_array([x, w], dtype=F16)
    )
    rx, rw = jax.grad(_relu_matmul, argnums=(0, 1))(x, w)
    assert isinstance(gx, sc.ScaledArray) and gx.data.dtype == F16
    np.testing.assert_allclose(
        sc.asarray(gx, jnp.float32), rx, rtol=2e-2, atol=1e-3 * jnp.max(jnp.abs(rx))
    )
    np.testing.assert_allclose(
        sc.asarray(gw, jnp.float32), rw, rtol=2e-2, atol=1e-3 * jnp.max(jnp.abs(rw))
    )


@pytest.mark.parametrize("jit", [False, True])
def test_jax_grad_of_scalify(jit, getkey):
    # Differentiating a scalified function by its leaves (moderate scales: the
    # cotangent of float16 data is a float16 array), custom_jvp and custom_vjp inside.
    @jax.custom_vjp
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, None), lambda _, g: (3 * g,))  # deliberately 3

    def f(x, w):
        return jnp.sum(double(jax.nn.gelu(x @ w)))

    x = jax.random.normal(getkey(), (4, 8))
    w = jax.random.normal(getkey(), (8, 3))

    def via_scalify(x, w):
        out = sc.scalify(f)(sc.ScaledArray(x, 1.0), sc.ScaledArray(w * 2.0, 0.5))
        return out.to_array(jnp.float32)

    grad = jax.grad(via_scalify, argnums=(0, 1))
    grad = jax.jit(grad) if jit else grad
    ref = jax.grad(f, argnums=(0, 1))(x, w)
    for g, r in zip(grad(x, w), ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_vmap(getkey):
    x = sc.as_scaled_array(jax.random.normal(getkey(), (5, 4)) * BIG, dtype=F16)
    f = sc.scalify(lambda v: jnp.sum(v * v))
    out = jax.vmap(lambda d: f(sc.ScaledArray(d, x.scale)))(x.data)
    ref = jnp.sum(sc.asarray(x, jnp.float32) ** 2, axis=1)
    np.testing.assert_allclose(sc.asarray(out, jnp.float32), ref, rtol=2e-2)


def test_control_flow(getkey):
    ws = jax.random.normal(getkey(), (3, 4, 4)) / 2.0

    def f(x, ws):
        def body(h, w):
            h = jnp.tanh(h @ w) * 2.0
            return h, jnp.sum(h)

        h, sums = lax.scan(body, x, ws)
        h = lax.cond(jnp.sum(h) > 0, lambda a: a * 3.0, lambda a: -a, h)
        _, h = lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + c[1]), (0, h)
        )
        return jax.jit(lambda a, s: (a, s))(h, sums)

    x = jax.random.normal(getkey(), (2, 4)) * TINY
    out = sc.scalify(f)(*sc.as_scaled_array([x, ws], dtype=F16))
    ref = f(x, ws)
    for o, r in zip(out, ref):
        assert isinstance(o, sc.ScaledArray)
        np.testing.assert_allclose(
            sc.asarray(o, jnp.float32), r, rtol=2e-2, atol=2e-2 * jnp.max(jnp.abs(r))
        )


def test_dynamic_rescale_and_stop(getkey):
    x = sc.ScaledArray(jnp.full(8, 0.01, F16), 2.0**10)
    # Every norm of a constant 0.01 is 0.01.
    for op in [sc.dynamic_rescale_l1, sc.dynamic_rescale_l2, sc.dynamic_rescale_max]:
        y = sc.scalify(op)(x)
        np.testing.assert_allclose(
            sc.asarray(y, jnp.float32), sc.asarray(x, jnp.float32)
        )
        assert float(y.scale) == 2.0**10 * 2.0**-7  # 0.01 rounded down to 2**-7
    assert float(sc.scalify(sc.dynamic_rescale_l2_grad)(x).scale) == 2.0**10
    # The _grad variant rescales the cotangent: the gradient comes out with the scale
    # of the cotangent's RMS, 2**-7 times the plain one.
    f = lambda v: jnp.sum(sc.dynamic_rescale_l2_grad(v) * 0.01)
    g = sc.scalify(jax.grad(f))(x)
    np.testing.assert_allclose(sc.asarray(g, jnp.float32), 0.01, rtol=1e-3)
    assert float(g.scale) == 2.0**-7  # the plain cotangent 0.01, rescaled
    # Outside scalify they are the identity; stop_scaling gives plain values.
    assert (sc.dynamic_rescale_max(jnp.arange(3.0)) == jnp.arange(3.0)).all()
    out = sc.scalify(lambda v: sc.stop_scaling(v) * 2.0)(x)
    assert not sc.is_scaled(out)


def test_cast_fp8_forward_e4m3_backward_e5m2():
    x = sc.ScaledArray(jnp.array([1.0, 1.0625, 500.0, 0.3]), 2.0**-40)
    y = sc.scalify(sc.cast_fp8)(x)
    assert (
        y.data.tolist() == fp8.quantize(x.data, fp8.E4M3).astype(jnp.float32).tolist()
    )
    assert float(y.scale) == 2.0**-40
    # The cotangent's data is rounded to E5M2 (1.0625 -> 1.0, 1.2 -> 1.25).
    ct = jnp.array([1.0625, 1.2, 70000.0, 3.0])
    g = sc.scalify(jax.grad(lambda v: jnp.sum(sc.cast_fp8(v) * ct)))(x)
    np.testing.assert_array_equal(sc.asarray(g, jnp.float32), [1.0, 1.25, 57344.0, 3.0])


# -- unit scale without user rescales -------------------------------------------------


def _scaled_grads(loss, params, args, pow2, auto_rescale=True):
    """`loss`'s gradients under `scalify` from float16 `ScaledArray` parameters of
    scale 1, and the float32 reference: per leaf, the float16 data's RMS and the L2
    relative error of the values."""
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    ref = eqx.filter_jit(eqx.filter_grad(loss))(params32, *args)
    scaled = jax.tree.map(lambda p: sc.ScaledArray(p.astype(F16), 1.0), params)
    grad = sc.scalify(eqx.filter_grad(loss), pow2=pow2, auto_rescale=auto_rescale)
    grads = eqx.filter_jit(grad)(scaled, *args)
    out = []
    for g, r in zip(jax.tree.leaves(grads, is_leaf=sc.is_scaled), jax.tree.leaves(ref)):
        assert sc.is_scaled(g) and g.data.dtype == F16
        rms = float(jnp.sqrt(jnp.mean(jnp.square(g.data.astype(jnp.float32)))))
        err = jnp.linalg.norm(sc.asarray(g, jnp.float32) - r) / jnp.linalg.norm(r)
        out.append((rms, float(err)))
    return out


def _assert_unit_grads(stats):
    for rms, err in stats:
        assert 2.0**-8 <= rms <= 2.0**8, stats
        assert err < 0.02, stats


def _no_rescales(loss, params, args):
    eqns = iter_eqns(make_jaxpr(jax.grad(loss))(params, *args))
    return not any(e.primitive.name == "scalify_op" for e in eqns)


# Each case compiles a GPT gradient twice (float32, scalified): ~20 s of CPU.
SLOW_POW2 = [pytest.param(m, marks=pytest.mark.slow) for m in ("down", "up", "none")]


@pytest.mark.parametrize("pow2", SLOW_POW2)
def test_small_gpt_grads_keep_unit_scale(pow2, getkey):
    # A GPT-like loss written as a new user would (gather, layer
    # norm, causal attention, GELU MLP, tied readout, mean cross-entropy), scale-1
    # float16 parameters and no `dynamic_rescale_*` anywhere.
    params = small_gpt_params(getkey())
    args = gpt_batches(getkey(), 1, vocab=32)[0]
    assert _no_rescales(small_gpt_loss, params, args)
    _assert_unit_grads(_scaled_grads(small_gpt_loss, params, args, pow2))
    if pow2 == "down":  # (one compilation more)
        # Static rules alone let the data drift into float16 subnormals (RMS ~1e-6).
        static = _scaled_grads(small_gpt_loss, params, args, pow2, auto_rescale=False)
        assert min(rms for rms, _ in static) < 2.0**-8


@pytest.mark.slow
@pytest.mark.parametrize("pow2", ["down", "up", "none"])
def test_recipes_gpt_grads_keep_unit_scale_at_init(pow2, getkey):
    model = tiny_gpt(getkey())
    args = gpt_batches(getkey(), 1)[0]
    assert _no_rescales(gpt_loss, model, args)
    _assert_unit_grads(_scaled_grads(gpt_loss, model, args, pow2))


def test_fit_rescales_only_outside_the_band():
    # A matmul of small data: the static scale (sa * sb * sqrt(K) = 2) leaves data of
    # RMS 2**-19 (a float16 subnormal); `fit` moves 2**-19 to the scale.
    x = sc.ScaledArray(jnp.full((2, 4), 2.0**-10, F16), 1.0)
    gram = lambda v: v @ v.T
    out = sc.scalify(gram)(x)
    assert out.data.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert float(out.scale) == 2.0**-18
    static = sc.scalify(gram, auto_rescale=False)(x)
    assert float(static.scale) == 2.0 and float(static.data[0, 0]) == 2.0**-19
    # Elementwise ops keep their static scales (a check would split XLA's fusions):
    # x - mean(x) of nearly equal values stays at scale 1.
    eps = 2.0**-10
    y = sc.ScaledArray(jnp.array([1.0, 1.0 + eps, 1.0 - eps, 1.0], F16), 1.0)
    centred = sc.scalify(lambda v: v - jnp.mean(v))(y)
    assert float(centred.scale) == 1.0
    assert centred.data.tolist() == [0.0, eps, -eps, 0.0]
    # Inside the band nothing moves: a matmul of unit data keeps sa * sb * sqrt(K).
    y = sc.ScaledArray(jnp.ones((2, 4), F16), 4.0)
    assert float(sc.scalify(lambda a: a @ a.T)(y).scale) == 4.0 * 4.0 * 2.0


# -- training steps --------------------------------------------------------------------


# Every matmul through scalify's FP8 casts, as the recipes' `precision=scalify_fp8`
# does: operands rescaled to unit RMS and cast to E4M3, cotangents to E5M2.
FP8_RULES = dict.fromkeys(MATMULS, scalify_fp8_op)


def _fp8_loss(model, tokens, targets):
    return gpt_loss(lowtrain.rewrite(model, FP8_RULES), tokens, targets)


LOSSES = {"fp16": gpt_loss, "fp8": _fp8_loss}
# Module-level, so that `_compiled_step` finds them again.
ADAM, SGD = optax.adam(3e-3), optax.sgd(0.2)


def _make_step(opt, loss_fn):
    def step(model, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(model, tokens, targets)
        # The optimizer's arithmetic in float32 (Adam squares the gradients: float16
        # data would lose the small entries); the weights stay float16.
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = opt.update(grads, opt_state, model)
        return loss, optax.apply_updates(model, updates), opt_state

    return step


@functools.cache
def _compiled_step(opt, loss_fn, scaled):
    # One per (optimizer, loss, scaled): the float32 reference compiles once for the
    # fp16 and fp8 cases.
    step = _make_step(opt, loss_fn)
    return eqx.filter_jit(sc.scalify(step) if scaled else step)


@eqx.filter_jit  # (one compilation, not one per leaf and operation)
def _init(model, opt, scaled_dtype):
    opt_state = opt.init(model)
    if scaled_dtype is None:
        return model, opt_state
    # Weights in float16 ScaledArrays; Adam's moments as float32 ScaledArrays (a
    # float16 second moment underflows where gradients are small).
    return sc.as_scaled_array(model, dtype=scaled_dtype), sc.as_scaled_array(opt_state)


def _run(model, steps, batches, opt, loss_fn, scaled_dtype=None):
    model, opt_state = _init(model, opt, scaled_dtype)
    step = _compiled_step(opt, loss_fn, scaled_dtype is not None)
    losses = []
    for tokens, targets in batches[:steps]:
        loss, model, opt_state = step(model, opt_state, tokens, targets)
        losses.append(float(sc.asarray(loss, jnp.float32)))
    return losses, model


def _fp8_casts(loss_fn, model, tokens, targets):
    """How many E4M3 (forward) and E5M2 (backward) casts `loss_fn`'s gradient
    program has."""
    grad = jax.grad(loss_fn)
    casts = [
        e
        for e in iter_eqns(make_jaxpr(grad)(model, tokens, targets))
        if e.primitive.name == "scalify_op" and e.params["kind"] == "cast"
    ]
    dtypes = [e.params["dtype"] and np.dtype(e.params["dtype"]) for e in casts]
    return dtypes.count(np.dtype(fp8.E4M3)), dtypes.count(np.dtype(fp8.E5M2))


@pytest.mark.parametrize("fmt", [pytest.param("fp16", marks=pytest.mark.slow), "fp8"])
def test_gpt_train_step_under_scalify(fmt, getkey):
    # The recipes' GPT (blocks under lax.scan, causal attention, GELU MLP, tied head).
    # One block: scans over several are `test_control_flow`'s, and each block more
    # costs seconds of compilation here.
    model = tiny_gpt(getkey())
    batches = gpt_batches(getkey(), 6)
    loss_fn = LOSSES[fmt]
    if fmt == "fp8":
        # Both operands of every matmul cast to E4M3, every output's cotangent to
        # E5M2, inside the scan over the blocks too.
        e4m3, e5m2 = _fp8_casts(loss_fn, model, *batches[0])
        assert (e4m3, e5m2) == (2 * gpt_matmuls(model), gpt_matmuls(model))
    # optax's adam mixes int32 and f32.
    with jax.numpy_dtype_promotion("standard"):
        ref, _ = _run(model, 6, batches, ADAM, gpt_loss)
        ours, trained = _run(model, 6, batches, ADAM, loss_fn, scaled_dtype=F16)
    # Everything stays scaled: parameters come back as float16 ScaledArrays.
    for leaf in jax.tree.leaves(
        eqx.filter(trained, eqx.is_array), is_leaf=sc.is_scaled
    ):
        assert sc.is_scaled(leaf) and leaf.data.dtype == F16
    tol = {"fp16": 0.01, "fp8": 0.05}[fmt]
    np.testing.assert_allclose(ours, ref, atol=tol * ref[0])
    assert ours[-1] < ours[0]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_mlp_train_step_under_scalify(fmt, getkey):
    model = tiny_mlp(getkey(), hidden=(32,))
    x = jax.random.normal(getkey(), (6, 32, 784))
    y = jax.random.randint(getkey(), (6, 32), 0, 10)
    batches = [(x[i], y[i]) for i in range(6)]
    with jax.numpy_dtype_promotion("standard"):  # optax adds f32 updates to f16 weights
        ref, _ = _run(model, 6, batches, SGD, gpt_loss)
        ours, _ = _run(model, 6, batches, SGD, LOSSES[fmt], scaled_dtype=F16)
    np.testing.assert_allclose(
        ours, ref, atol={"fp16": 0.01, "fp8": 0.05}[fmt] * ref[0]
    )
