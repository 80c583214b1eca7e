"""`lowtrain.fp8`: hardware-exact casts, scaled FP8 matmuls, the fp8 policy."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowtrain
import lowtrain.fp8 as fp8

from .helpers import (
    gpt_batches,
    gpt_loss,
    gpt_matmuls,
    gpt_value_and_grad,
    make_jaxpr,
    tiny_gpt,
)

F8 = {np.dtype(fp8.E4M3), np.dtype(fp8.E5M2)}
DN = (((1,), (0,)), ((), ()))


def test_formats():
    assert fp8.E4M3 == jnp.float8_e4m3fn and fp8.E5M2 == jnp.float8_e5m2
    assert (fp8.E4M3_MAX, fp8.E5M2_MAX) == (448.0, 57344.0)
    with pytest.raises(ValueError, match="Expected an FP8 dtype.*float16"):
        fp8.fp8_max(jnp.float16)


@pytest.mark.parametrize(
    "dtype, ref",
    [(fp8.E4M3, ml_dtypes.float8_e4m3fn), (fp8.E5M2, ml_dtypes.float8_e5m2)],
)
def test_quantize_matches_ml_dtypes_in_range(dtype, ref, getkey):
    fmax = fp8.fp8_max(dtype)
    # Every magnitude from below the smallest subnormal to the max.
    mags = jnp.exp2(
        jax.random.uniform(getkey(), (4096,), minval=-20, maxval=np.log2(fmax))
    )
    x = mags * jnp.sign(jax.random.normal(getkey(), (4096,)))
    ours = np.asarray(fp8.quantize(x, dtype)).view(np.uint8)
    theirs = np.asarray(x).astype(ref).view(np.uint8)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_saturates_finite_values_and_keeps_nonfinite_ones(dtype):
    # Finite values beyond the format saturate; an infinity (an overflowed tensor)
    # stays non-finite, so the step's finiteness check sees it: NaN in E4M3 (no
    # infinity there), +-inf in E5M2. NaN stays NaN.
    fmax = fp8.fp8_max(dtype)
    x = jnp.array([fmax, 2 * fmax, 1e30, -3 * fmax, jnp.inf, -jnp.inf, jnp.nan])
    out = fp8.quantize(x, dtype).astype(jnp.float32)
    np.testing.assert_array_equal(out[:4], [fmax, fmax, fmax, -fmax])
    if dtype == fp8.E4M3:
        assert jnp.isnan(out[4:]).all()
    else:
        assert out[4] == jnp.inf and out[5] == -jnp.inf and jnp.isnan(out[6])
    # The bare cast is what goes wrong: NaN for E4M3, inf for E5M2.
    bare = x[1:2].astype(dtype).astype(jnp.float32)
    assert not jnp.isfinite(bare[0])


def test_round_to_nearest_even_and_subnormals():
    # E4M3 spacing at 1 is 1/8: ties go to the even mantissa.
    x = jnp.array([1.0625, 1.1875, 2.0**-9, 3 * 2.0**-9, 2.0**-10, 0.75 * 2.0**-9])
    out = fp8.quantize(x, fp8.E4M3).astype(jnp.float32).tolist()
    assert out == [1.0, 1.25, 2.0**-9, 3 * 2.0**-9, 0.0, 2.0**-9]


def test_scale_direction():
    # value = data * scale: quantize divides, dequantize multiplies.
    data = fp8.quantize(jnp.array([12.0]), fp8.E4M3, scale=4.0)
    assert data.astype(jnp.float32)[0] == 3.0
    assert fp8.dequantize(data, 4.0)[0] == 12.0


def test_compute_scale():
    assert fp8.compute_scale(448.0, fp8.E4M3) == 1.0
    assert fp8.compute_scale(448.0, fp8.E4M3, margin=1) == 2.0
    assert fp8.compute_scale(500.0, fp8.E4M3, pow2=True) == 2.0
    assert fp8.compute_scale(0.0, fp8.E4M3, last=3.0) == 3.0
    assert fp8.compute_scale(jnp.nan, fp8.E5M2, last=3.0) == 3.0
    x = jnp.array([-57344.0 * 4, 1.0])
    assert fp8.current_scale(x, fp8.E5M2) == 4.0


def _rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("magnitude", [1e-4, 1e4])
def test_fp8_dot_accuracy_needs_scaling(magnitude, getkey):
    x = jax.random.normal(getkey(), (32, 64)) * magnitude
    w = jax.random.normal(getkey(), (64, 16)) * magnitude
    ref = x @ w
    assert _rel_err(fp8.fp8_dot_general(x, w, DN), ref) < 0.05
    # The same inputs cast without scaling underflow (1e-4) or saturate (1e4).
    naive = fp8.dequantize(fp8.quantize(x, fp8.E4M3)) @ fp8.dequantize(
        fp8.quantize(w, fp8.E4M3)
    )
    assert _rel_err(naive, ref) > 0.5


def test_fp8_dot_batched_einsum_and_grads(getkey):
    q = jax.random.normal(getkey(), (2, 5, 8))
    k = jax.random.normal(getkey(), (2, 7, 8)) * 300.0
    dn = (((2,), (2,)), ((0,), (0,)))  # "bqd,bkd->bqk"

    def f(q, k, dot):
        return jnp.sum(jnp.tanh(dot(q, k, dn) / 300.0))

    ours = jax.grad(f, argnums=(0, 1))(q, k, fp8.fp8_dot_general)
    ref = jax.grad(f, argnums=(0, 1))(q, k, jax.lax.dot_general)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _rel_err(a, b) < 0.1


# (lhs shape, rhs shape, dimension numbers): plain, transposed, attention-like with
# batch dimensions that do not lead, two contracting dimensions.
DOTS = [
    ((6, 8), (8, 5), (((1,), (0,)), ((), ()))),
    ((8, 6), (5, 8), (((0,), (1,)), ((), ()))),
    ((2, 5, 3, 4), (2, 7, 3, 4), (((3,), (3,)), ((0, 2), (0, 2)))),
    ((2, 3, 5, 7), (2, 7, 3, 4), (((3,), (1,)), ((0, 1), (0, 2)))),
    ((3, 4, 5), (5, 2, 4), (((1, 2), (2, 0)), ((), ()))),
]


@pytest.mark.parametrize("shapes", DOTS, ids=range(len(DOTS)))
def test_f8_dot_and_its_transposes_are_dot_generals(shapes, getkey):
    # The GPU lowering writes the matmul and both gradients as dots of the FP8 arrays;
    # in float32 they must be exactly `dot_general` and JAX's own transpose rules.
    from lowtrain.fp8 import _dot

    sa, sb, dn = shapes
    a, b = jax.random.normal(getkey(), sa), jax.random.normal(getkey(), sb)
    out, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), a, b)
    g = jax.random.normal(getkey(), out.shape)
    da, db = vjp(g)
    (ac, bc), (ab, bb) = dn
    np.testing.assert_allclose(_dot._f8_dot(a, b, dn), out, rtol=1e-6, atol=1e-6)
    mine_a = _dot._dot_grad(g, a, b, dn, swap=False)
    mine_b = _dot._dot_grad(g, b, a, ((bc, ac), (bb, ab)), swap=True)
    np.testing.assert_allclose(mine_a, da, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mine_b, db, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shapes", DOTS[1:4], ids=range(3))
def test_gpu_lowering_matches_the_dequantized_one(shapes, getkey, monkeypatch):
    # The two lowerings of `fp8_dot_general` use the same FP8 operands; they differ
    # only in where the scales are applied (and the dequantized operands' rounding).
    from lowtrain.fp8 import _dot

    sa, sb, dn = shapes
    a = (jax.random.normal(getkey(), sa) * 30.0).astype(jnp.bfloat16)
    b = (jax.random.normal(getkey(), sb) * 1e-3).astype(jnp.bfloat16)

    def f(a, b):
        return jnp.sum(jnp.tanh(fp8.fp8_dot_general(a, b, dn).astype(jnp.float32)))

    ref = jax.value_and_grad(f, argnums=(0, 1))(a, b)
    monkeypatch.setattr(_dot, "f8_dot_lowering", lambda: True)
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(a, b)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    dots += [
        e
        for sub in _subjaxprs(jaxpr.jaxpr)
        for e in sub.eqns
        if e.primitive.name == "dot_general"
    ]
    # Forward and both gradients: FP8 operands (E5M2 cotangent), float32 results.
    assert len(dots) == 3
    for e in dots:
        assert {np.dtype(v.aval.dtype) for v in e.invars} <= F8
        assert np.dtype(e.outvars[0].aval.dtype) == np.float32
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(a, b)
    np.testing.assert_allclose(value, ref[0], rtol=2e-2)
    for mine, theirs in zip(grads, ref[1]):
        assert mine.dtype == theirs.dtype == jnp.bfloat16
        assert _rel_err(mine.astype(jnp.float32), theirs.astype(jnp.float32)) < 2e-2


def _operand_sources(jaxpr):
    """For every dot/conv in every sub-jaxpr: the FP8 dtypes its operands come from."""
    out = []
    for sub in [jaxpr.jaxpr, *_subjaxprs(jaxpr.jaxpr)]:
        producer = {v: e for e in sub.eqns for v in e.outvars}
        for e in sub.eqns:
            if e.primitive.name not in ("dot_general", "conv_general_dilated"):
                continue
            srcs = []
            for v in e.invars:
                srcs.append(_fp8_source(v, producer))
            out.append(tuple(srcs))
    return out


def _subjaxprs(jaxpr):
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for e in jaxpr.eqns:
        for v in e.params.values():
            for s in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(s, (ClosedJaxpr, Jaxpr)):
                    s = s.jaxpr if isinstance(s, ClosedJaxpr) else s
                    yield s
                    yield from _subjaxprs(s)


def _fp8_source(var, producer):
    """The FP8 dtype a dequantized operand (`convert(data_f8) * scale`) came from."""
    eqn = producer.get(var)
    # Layout-only ops between the dequantize and the matmul (a conv transpose reverses
    # the kernel) do not change the values.
    while eqn is not None and eqn.primitive.name in ("rev", "transpose", "reshape"):
        eqn = producer.get(eqn.invars[0])
    if eqn is not None and eqn.primitive.name == "mul":
        for v in eqn.invars:
            src = producer.get(v)
            if src is not None and src.primitive.name == "convert_element_type":
                if src.invars[0].aval.dtype in F8:
                    return str(src.invars[0].aval.dtype)
    return None


def test_backward_cotangent_is_e5m2(getkey):
    x = jax.random.normal(getkey(), (4, 8))
    w = jax.random.normal(getkey(), (8, 3))
    f = lambda x, w: jnp.sum(fp8.fp8_dot_general(x, w, DN) ** 2)
    sources = _operand_sources(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
    assert ("float8_e4m3fn", "float8_e4m3fn") in sources  # forward
    backward = [s for s in sources if "float8_e5m2" in s]
    assert len(backward) == 2  # both input gradients, each with the E5M2 cotangent
    assert all(set(s) == {"float8_e4m3fn", "float8_e5m2"} for s in backward)


def _check_all_dots_fp8(jaxpr, min_dots):
    sources = _operand_sources(jaxpr)
    assert len(sources) >= min_dots
    for s in sources:
        assert None not in s, f"a matmul with a non-FP8 operand: {s}"
    return sources


@pytest.mark.parametrize("delayed", [False, True])
def test_under_checkpoint_the_saved_fp8_operands_keep_their_values(delayed, getkey):
    # `jax.checkpoint` passes every float residual it saves through
    # `reduce_precision` with the format's exponent and mantissa bits, IEEE-style:
    # for E4M3 (no infinities, largest 448) that maps values above 240 to NaN. The
    # FP8 ops save their operands as bits, so checkpointed gradients are the same.
    layer = fp8.Fp8Linear(16, 4, delayed=delayed, key=getkey())
    x = jax.random.normal(getkey(), (8, 16))
    if delayed:  # scales from these very tensors: their largest entries near 448
        layer = eqx.tree_at(
            lambda m: (m.x_scale, m.w_scale),
            layer,
            (
                layer.x_scale.update(fp8.amax(x)),
                layer.w_scale.update(fp8.amax(layer.weight)),
            ),
        )
    # (current scaling: each operand's amax quantizes to 448 anyway)
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
    saving = jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable)
    g_plain = jax.grad(loss, (0, 1))(layer, x)
    g_checkpointed = jax.grad(saving, (0, 1))(layer, x)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_checkpointed)):
        assert jnp.isfinite(b).all()
        np.testing.assert_array_equal(a, b)


def test_fp8_policy(getkey):
    policy = lowtrain.get_policy("fp8")
    assert policy.compute_dtype == jnp.bfloat16
    assert policy.action("dot_general", ()) == "fp8"
    assert policy.action("exp", ()) == "float32"
    with pytest.raises(ValueError, match="'fp8' action applies to dot_general"):
        lowtrain.Policy(rules={"exp": "fp8"})


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_amp_fp8_every_dot_is_fp8(model_name, maybe_jit, getkey):
    if model_name == "mlp":
        model, n_dots = eqx.nn.MLP(8, 4, 16, 2, key=getkey()), 3
        x = jax.random.normal(getkey(), (5, 8))
        loss = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
        reference = eqx.filter_value_and_grad(loss)
    else:
        # The recipes' GPT, its blocks under `lax.scan`, and the cross-entropy.
        model = tiny_gpt(getkey())
        n_dots = gpt_matmuls(model)
        ((tokens, targets),) = gpt_batches(getkey(), 1, batch_size=2, length=6)
        loss = lambda m: gpt_loss(m, tokens, targets)
        reference = lambda m: gpt_value_and_grad(m, tokens, targets)
    amp_model = lowtrain.amp(model, "fp8")
    _check_all_dots_fp8(make_jaxpr(maybe_jit(loss))(amp_model), n_dots)
    grad_fn = maybe_jit(eqx.filter_value_and_grad(loss))
    sources = _check_all_dots_fp8(make_jaxpr(grad_fn)(amp_model), 3 * n_dots - 1)
    # Every backward matmul takes the E5M2 cotangent: both input gradients of each
    # matmul but the first layer's (whose input needs none).
    backward = [s for s in sources if "float8_e5m2" in s]
    assert len(backward) >= 2 * n_dots - 1
    assert all(set(s) == {"float8_e4m3fn", "float8_e5m2"} for s in backward)
    value, grads = grad_fn(amp_model)
    ref_value, ref_grads = reference(model)
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(value, ref_value, rtol=0.1)
    # E4M3 keeps 3 mantissa bits and E5M2 2: per-leaf gradient errors of 10-20% on
    # these tiny layers, much less over the whole gradient.
    ours, ref = jax.tree.leaves(grads.fn), jax.tree.leaves(ref_grads)
    assert len(ours) == len(ref)
    assert all(g.dtype == jnp.float32 for g in ours)
    assert all(_rel_err(g, r) < 0.3 for g, r in zip(ours, ref))
    flat = lambda t: jnp.concatenate([jnp.ravel(v) for v in t])
    assert _rel_err(flat(ours), flat(ref)) < 0.1


def test_fp8_conv(getkey):
    conv = eqx.nn.Conv2d(2, 3, 3, key=getkey())
    x = jax.random.normal(getkey(), (2, 8, 8))
    y = lowtrain.amp(conv, "fp8")(x)
    assert _rel_err(y, conv(x)) < 0.05
    grad = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))
    _check_all_dots_fp8(make_jaxpr(grad)(lowtrain.amp(conv, "fp8")), 3)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_fp8_sites_take_operands_of_mixed_float_dtypes(dims, getkey):
    # A bias-free conv, a PReLU, then a conv (Equinox's U-Net and DCGAN): the second
    # conv's input is already bf16 where its kernel is float32. Each operand is cast
    # to its FP8 format on its own, as every other policy casts, and so is a dot of
    # a bf16 activation with a float32 weight.
    conv1 = eqx.nn.Conv(dims, 2, 4, 3, use_bias=False, padding=1, key=getkey())
    conv2 = eqx.nn.Conv(dims, 4, 3, 3, key=getkey())
    prelu = eqx.nn.PReLU()
    w = jax.random.normal(getkey(), (3, 5))
    x = jax.random.normal(getkey(), (2, *(6,) * dims))

    def loss(model, x):
        conv1, prelu, conv2, w = model
        y = conv2(prelu(conv1(x)))  # (3, ...)
        z = jnp.einsum("c...,cd->d...", y, w)  # a dot of a bf16 and a float32 operand
        return jnp.mean(z**2)

    model = (conv1, prelu, conv2, w)
    value, grads = eqx.filter_value_and_grad(lowtrain.amp(loss, "fp8"))(model, x)
    ref_value, ref_grads = eqx.filter_value_and_grad(loss)(model, x)
    assert _rel_err(value, ref_value) < 0.1
    flat = lambda t: jnp.concatenate(
        [jnp.ravel(v) for v in jax.tree.leaves(eqx.filter(t, eqx.is_inexact_array))]
    )
    assert flat(grads).dtype == jnp.float32
    assert _rel_err(flat(grads), flat(ref_grads)) < 0.15
    jaxpr = make_jaxpr(eqx.filter_grad(lowtrain.amp(loss, "fp8")))(model, x)
    _check_all_dots_fp8(jaxpr, 9)  # 3 matmuls, forward and both gradients


def test_fp8_linear_current_scaling(getkey):
    layer = fp8.Fp8Linear(16, 4, key=getkey())
    x = jax.random.normal(getkey(), (3, 5, 16)) * 1e3
    ref = x @ layer.weight.T + layer.bias[None, None]
    assert _rel_err(layer(x), ref) < 0.05
    with pytest.raises(ValueError, match=r"Expected input of shape \(\.\.\., 16\)"):
        layer(jnp.ones((3, 4)))


def test_delayed_scaling_recurrence(getkey):
    history, steps = 3, 5
    layer = fp8.Fp8Linear(
        4, 2, use_bias=False, delayed=True, history=history, key=getkey()
    )
    opt = optax.sgd(0.05)
    opt_state = opt.init(eqx.filter(layer, eqx.is_inexact_array))
    xs = [jax.random.normal(getkey(), (3, 4)) * (i + 1) for i in range(steps)]
    amaxes = {"x": [], "w": [], "g": []}

    @eqx.filter_jit
    def step(layer, opt_state, x):
        loss = lambda m: jnp.sum(m(x) ** 2)
        grads = eqx.filter_grad(loss)(layer)
        grads, scales = fp8.pop_scales(grads, layer)
        updates, opt_state = opt.update(grads, opt_state)
        return fp8.put_scales(eqx.apply_updates(layer, updates), scales), opt_state

    for x in xs:
        y = layer(x)
        amaxes["x"].append(float(jnp.max(jnp.abs(x))))
        amaxes["w"].append(float(jnp.max(jnp.abs(layer.weight))))
        amaxes["g"].append(float(jnp.max(jnp.abs(2 * y))))  # d(sum y^2)/dy
        layer, opt_state = step(layer, opt_state, x)

    for name, fmt in [("x", fp8.E4M3), ("w", fp8.E4M3), ("g", fp8.E5M2)]:
        state = getattr(layer, f"{name}_scale")
        expected = amaxes[name][::-1][:history]
        np.testing.assert_allclose(state.amax_history, expected, rtol=1e-6)
        np.testing.assert_allclose(
            state.scale, max(expected) / fp8.fp8_max(fmt), rtol=1e-6
        )


def _with_history(layer, history):
    """`layer` with every delayed-scaling state's history set to `history` (and the
    scale that history gives), as after earlier steps."""
    for name in ("x_scale", "w_scale", "g_scale"):
        s = getattr(layer, name)
        h = jnp.asarray(history, jnp.float32)
        s = eqx.tree_at(lambda s: s.amax_history, s, h)
        s = eqx.tree_at(lambda s: s.scale, s, fp8.compute_scale(jnp.max(h), s.dtype))
        layer = eqx.tree_at(lambda m, n=name: getattr(m, n), layer, s)
    return layer


def _check_advanced_by(scales, layer, sums, rtol):
    """Each new state in `scales` is `layer`'s with `sums[name]` pushed as the newest
    amax: the older entries as they were, the scale of the new history."""
    for n, total in sums.items():
        new, old = getattr(scales, f"{n}_scale"), getattr(layer, f"{n}_scale")
        history = [total, *old.amax_history[:-1].tolist()]
        np.testing.assert_allclose(new.amax_history, history, rtol=rtol)
        scale = fp8.compute_scale(max(history), old.dtype)
        np.testing.assert_allclose(new.scale, scale, rtol=rtol)


def _amax(x):
    return float(jnp.max(jnp.abs(x)))


def test_delayed_layer_called_twice_records_the_sum_of_its_amaxes(getkey):
    # A shared layer's records add up, as its weight's gradients do: the new amax is
    # the sum of the calls' (at least their max, so no overflow), and the older
    # entries stay as they were (summed states had doubled them every step).
    layer = _with_history(
        fp8.Fp8Linear(4, 3, use_bias=False, delayed=True, history=3, key=getkey()),
        [3.0, 2.0, 1.0],
    )
    x1, x2 = (
        jax.random.normal(getkey(), (2, 5, 4)) * jnp.array([2.0, 5.0])[:, None, None]
    )
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x1) ** 2) + jnp.sum(m(x2) ** 2))(layer)
    grads, scales = fp8.pop_scales(grads, layer)
    assert grads.x_scale.scale == 0 and not grads.x_scale.amax_history.any()
    sums = {
        "x": _amax(x1) + _amax(x2),
        "w": 2 * _amax(layer.weight),
        "g": _amax(2 * layer(x1)) + _amax(2 * layer(x2)),  # d(sum y^2)/dy
    }
    _check_advanced_by(scales, layer, sums, rtol=1e-6)


def test_delayed_layer_closed_over_by_scan_records_its_calls(getkey):
    # An RNN-style use: the layer is a constant of the `lax.scan` body, so JAX sums
    # its records over the iterations (the transpose of a loop constant).
    steps = 4
    layer = _with_history(
        fp8.Fp8Linear(4, 4, delayed=True, history=2, key=getkey()), [7.0, 0.5]
    )
    xs = (
        jax.random.normal(getkey(), (steps, 3, 4)) * jnp.arange(1.0, 5.0)[:, None, None]
    )

    def loss(m):
        ys = jax.lax.scan(lambda c, x: (c, m(x)), None, xs)[1]
        return jnp.sum(ys**2)

    _, scales = fp8.pop_scales(eqx.filter_grad(loss)(layer), layer)
    sums = {
        "x": sum(_amax(x) for x in xs),
        "w": steps * _amax(layer.weight),
        "g": sum(_amax(2 * layer(x)) for x in xs),
    }
    _check_advanced_by(scales, layer, sums, rtol=1e-5)


def test_delayed_layer_not_called_in_a_step_keeps_its_state(getkey):
    # The branch not taken gives its layer zero cotangents: no call, no record. (As
    # the new state itself, zeros had set its scale to 0, and its next call to NaN.)
    a, b = (
        _with_history(fp8.Fp8Linear(4, 3, delayed=True, history=3, key=k), [4.0, 1, 2])
        for k in (getkey(), getkey())
    )
    x = jax.random.normal(getkey(), (5, 4))
    loss = lambda ab, x: jnp.sum(
        jax.lax.cond(jnp.sum(x) > 1e9, lambda: ab[0](x), lambda: ab[1](x)) ** 2
    )
    _, scales = fp8.pop_scales(eqx.filter_grad(loss)((a, b), x), (a, b))
    new_a, new_b = fp8.put_scales((a, b), scales)
    for n in ("x_scale", "w_scale", "g_scale"):
        for f in ("amax_history", "scale"):
            before = getattr(getattr(a, n), f)
            np.testing.assert_array_equal(getattr(getattr(new_a, n), f), before)
    assert new_b.x_scale.amax_history[0] == _amax(x)
    y, g = jax.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(new_a)
    assert np.isfinite(y) and all(np.isfinite(v).all() for v in jax.tree.leaves(g))


def test_pop_scales_needs_the_model_the_gradients_are_of(getkey):
    layer = fp8.Fp8Linear(4, 3, delayed=True, key=getkey())
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones((2, 4)))))(layer)
    with pytest.raises(ValueError, match="the model the gradients were taken of"):
        fp8.pop_scales(grads, eqx.nn.Linear(4, 3, key=getkey()))
    plain = eqx.tree_at(lambda m: m.x_scale, layer, jnp.zeros(16))
    with pytest.raises(ValueError, match="with a `DelayedScale` where they have one"):
        fp8.pop_scales(grads, plain)


def test_trainer_keeps_weight_decay_off_delayed_scaling_state(getkey):
    # Weight decay updates every parameter, the states' leaves too; the Trainer
    # zeroes those updates, so each history holds the batches' amaxes exactly. (sgd
    # with decoupled decay, as adamw's: adam's step count fails strict promotion.)
    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    layer = fp8.Fp8Linear(4, 1, delayed=True, history=4, key=getkey())
    decay = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(1e-2))
    trainer = Fit(layer, decay)
    state = trainer.init(key=getkey())
    xs = [jax.random.normal(getkey(), (8, 4)) * (i + 1) for i in range(3)]
    for x in xs:
        state, _ = trainer.train_step(
            state, {"x": x, "y": jnp.sum(x, 1, keepdims=True)}
        )
    history = state.model.x_scale.amax_history
    np.testing.assert_array_equal(history, [*[_amax(x) for x in xs[::-1]], 0.0])
    expected = fp8.compute_scale(_amax(xs[-1]), fp8.E4M3)
    np.testing.assert_allclose(state.model.x_scale.scale, expected, rtol=1e-6)


def _state_grads(loss, layer):
    """The gradients of `loss` for `layer`: the weights', and the new delayed-scaling
    states (their amax histories)."""
    g = eqx.filter_grad(loss)(layer)
    return [g.weight, *(getattr(g, f"{n}_scale").amax_history for n in "xwg")]


# Each takes the layer and a batch (5, 4) and returns its output (5, 3).
_VMAPPED = {
    "vmap": lambda m, x: jax.vmap(m)(x),
    "jit(vmap)": lambda m, x: eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(m, x),
    "vmap(jit)": lambda m, x: jax.vmap(eqx.filter_jit(m))(x),
    "vmap(vmap)": lambda m, x: jax.vmap(jax.vmap(m))(x[:, None])[:, 0],
}


@pytest.mark.parametrize("how", sorted(_VMAPPED))
def test_delayed_scaling_under_vmap_records_the_whole_batch(how, getkey):
    # One state for the whole vmapped batch: the recorded amaxes are the batch's, as
    # when the layer is called on it. (JAX's default would record each example's and
    # sum them, the state being a cotangent.)
    layer = fp8.Fp8Linear(4, 3, delayed=True, key=getkey())
    x = jax.random.normal(getkey(), (5, 4)) * jnp.arange(1.0, 6.0)[:, None]
    on_batch = _state_grads(lambda m: jnp.sum(m(x) ** 3), layer)
    vmapped = _state_grads(lambda m: jnp.sum(_VMAPPED[how](m, x) ** 3), layer)
    for a, b in zip(vmapped, on_batch):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert float(vmapped[1][0]) == float(jnp.max(jnp.abs(x)))


def test_delayed_scaling_of_a_vmapped_stack_keeps_one_state_per_layer(getkey):
    # A stack of layers (states batched with them), each on its own input: each
    # state records its own layer's tensors, as when each layer is called alone.
    keys = jax.random.split(getkey(), 2)
    stack = eqx.filter_vmap(lambda k: fp8.Fp8Linear(4, 3, delayed=True, key=k))(keys)
    xs = jax.random.normal(getkey(), (2, 5, 4)) * jnp.array([1.0, 7.0])[:, None, None]
    call = eqx.filter_vmap(lambda m, x: m(x))
    stacked = _state_grads(lambda s: jnp.sum(call(s, xs) ** 3), stack)
    for i, x in enumerate(xs):
        layer = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, stack)
        alone = _state_grads(lambda m, x=x: jnp.sum(m(x) ** 3), layer)
        for a, b in zip(stacked, alone):
            np.testing.assert_allclose(a[i], b, rtol=1e-6)


def test_delayed_scaling_under_vmap_inside_amp(getkey):
    # Under a vmap that batches its input only, the layer's op runs once on the
    # whole batch (`amp` finds it and gives its product the compute dtype); the
    # states record the whole batch's amaxes, in float32.
    layer = fp8.Fp8Linear(4, 3, delayed=True, key=getkey())
    x = jax.random.normal(getkey(), (5, 4)) * 3.0
    loss = lambda m, x: jnp.sum(jax.vmap(m)(x).astype(jnp.float32) ** 3)
    _, xs, ws, gs = _state_grads(lambda m: lowtrain.amp(loss, "bf16")(m, x), layer)
    on_batch = lambda m: jnp.sum(lowtrain.amp(m, "bf16")(x).astype(jnp.float32) ** 3)
    ref = _state_grads(on_batch, layer)
    # Inputs enter `amp` as they are: the amaxes of x and of the weight themselves.
    assert float(xs[0]) == float(jnp.max(jnp.abs(x)))
    for a, b in zip((xs, ws, gs), ref[1:]):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)


def test_delayed_scaling_under_vmap_around_amp(getkey):
    # A `jax.vmap` around `amp` runs the batched program: the layer's op on the
    # whole batch, its records the whole batch's (the output cotangent's too:
    # batched example by example, JAX would sum the examples').
    model = lowtrain.amp(fp8.Fp8Linear(4, 3, delayed=True, key=getkey()), "bf16")
    x = jax.random.normal(getkey(), (5, 4)) * jnp.arange(1.0, 6.0)[:, None]
    f32 = lambda y: y.astype(jnp.float32)
    around = eqx.filter_grad(lambda m: jnp.sum(f32(jax.vmap(m)(x)) ** 3))(model)
    on_batch = eqx.filter_grad(lambda m: jnp.sum(f32(m(x)) ** 3))(model)
    for n in "xwg":
        a = getattr(around.fn, f"{n}_scale").amax_history
        b = getattr(on_batch.fn, f"{n}_scale").amax_history
        assert a.dtype == jnp.float32 and float(a[0]) > 0
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_fp8_gemm_on_hopper(monkeypatch):
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if (
        not gpus
        or "H100" not in gpus[0].device_kind
        and "H200" not in gpus[0].device_kind
    ):
        pytest.skip("needs a Hopper GPU (H100/H200) for FP8 GEMMs")
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "scripts"))
    from benchlib.throughput import count_fp8_gemms

    def fp8_gemms(fn, *args):  # cuBLASLt calls + Triton GEMM fusions of FP8 operands
        return sum(count_fp8_gemms(jax.jit(fn).lower(*args).compile().as_text())[:2])

    x = jax.random.normal(jax.random.key(0), (256, 256), jnp.bfloat16)
    assert fp8_gemms(lambda a, b: fp8.fp8_dot_general(a, b, DN), x, x) == 1
    # Backward: both gradients too (E5M2 cotangent times an E4M3 operand). The loss
    # must not be linear: XLA turns a dot with a constant cotangent into a reduction.
    loss = lambda a, b: jnp.sum(jnp.tanh(fp8.fp8_dot_general(a, b, DN)))
    assert fp8_gemms(jax.value_and_grad(loss, argnums=(0, 1)), x, x) == 3
