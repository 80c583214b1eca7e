"""Loss scales: the exact GradScaler rule, bounds under jit, unscaling, redo-on-NaN."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain

from .helpers import eqns_of, float_in_dtypes

F16, F32 = np.dtype("float16"), np.dtype("float32")


def gradscaler_reference(scale, finite_seq, *, interval, growth, backoff, lo, hi):
    """The rule as documented, in float32 numpy: (scale, counter) after each step."""
    scale, counter, out = np.float32(scale), 0, []
    for finite in finite_seq:
        if not finite:
            scale, counter = max(scale * np.float32(backoff), np.float32(lo)), 0
        else:
            counter += 1
            if counter == interval:
                grown = min(scale * np.float32(growth), np.float32(hi))
                scale = grown if np.isfinite(grown) else scale
                counter = 0
        out.append((float(scale), counter))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        # powers of two, hitting the max bound then the min bound
        dict(scale=8.0, interval=2, growth=2.0, backoff=0.5, lo=2.0, hi=32.0),
        # factors that round in float32
        dict(scale=1000.0, interval=3, growth=3.0, backoff=0.3, lo=7.0, hi=1e5),
    ],
)
def test_dynamic_trajectory_is_gradscalers(kw, maybe_jit):
    seq = [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1]
    seq += [1] * 12
    ls = lowtrain.DynamicLossScale(
        scale=kw["scale"],
        growth_interval=kw["interval"],
        growth_factor=kw["growth"],
        backoff_factor=kw["backoff"],
        min_scale=kw["lo"],
        max_scale=kw["hi"],
    )
    adjust = maybe_jit(lambda ls, f: ls.adjust(f))
    got = []
    for finite in seq:
        ls = adjust(ls, jnp.array(bool(finite)))
        assert ls.loss_scale.dtype == F32 and ls.counter.dtype == np.int32
        got.append((float(ls.loss_scale), int(ls.counter)))
    kw = dict(kw)  # the parameters are shared between the eager and jit runs
    want = gradscaler_reference(kw.pop("scale"), seq, **kw)
    assert got == want
    scales = [s for s, _ in got]
    assert min(scales) == kw["lo"] and max(scales) <= kw["hi"]


def test_scale_never_grows_to_inf():
    ls = lowtrain.DynamicLossScale(
        scale=2.0**127, growth_interval=1, max_scale=math.inf
    )
    ls = jax.jit(lambda ls: ls.adjust(jnp.array(True)))(ls)
    assert float(ls.loss_scale) == 2.0**127 and int(ls.counter) == 0


def test_bounds_survive_jit_scan_and_flatten():
    ls = lowtrain.DynamicLossScale(
        scale=64.0, growth_interval=1, min_scale=4.0, max_scale=256.0
    )
    leaves, treedef = jax.tree.flatten(ls)
    assert len(leaves) == 2  # only the scale and the counter are traced
    again = jax.tree.unflatten(treedef, leaves)
    assert (again.min_scale, again.max_scale, again.growth_interval) == (4.0, 256.0, 1)

    @jax.jit
    def run(ls, finite_seq):
        def body(ls, finite):
            ls = ls.adjust(finite)
            return ls, ls.loss_scale

        return jax.lax.scan(body, ls, finite_seq)

    ls2, down = run(ls, jnp.zeros(10, bool))
    assert down.tolist() == [32.0, 16.0, 8.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert (ls2.min_scale, ls2.max_scale) == (4.0, 256.0)
    _, up = run(ls2, jnp.ones(10, bool))
    assert up.tolist() == [8.0, 16.0, 32.0, 64.0, 128.0] + [256.0] * 5


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_kept_in_float32(dtype):
    for ls in (
        lowtrain.DynamicLossScale(scale=jnp.asarray(2.0**15, dtype)),
        lowtrain.StaticLossScale(jnp.asarray(2.0**15, dtype)),
    ):
        assert ls.loss_scale.dtype == F32 and float(ls.loss_scale) == 2.0**15
    # An fp16 scale that backs off and grows stays an exact f32 power of two.
    ls = lowtrain.DynamicLossScale(scale=jnp.float16(2.0**15), growth_interval=1)
    ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2.0**17  # above the f16 maximum, fine in f32


def test_scale_and_unscale_dtypes():
    ls = lowtrain.StaticLossScale(2.0**15)
    scaled = ls.scale(jnp.float16(100.0))
    assert scaled.dtype == F32 and float(scaled) == 100.0 * 2.0**15  # no f16 overflow
    tree = {
        "h": jnp.full(3, 2.0**14, jnp.float16),
        "b": jnp.ones(2, jnp.bfloat16),
        "i": jnp.arange(3),
        "n": None,
    }
    out = ls.unscale(tree)
    assert out["h"].dtype == F16 and out["h"].tolist() == [0.5, 0.5, 0.5]
    assert out["b"].dtype == jnp.bfloat16 and out["i"] is not None
    assert out["i"].tolist() == [0, 1, 2] and out["n"] is None
    divs = eqns_of(ls.unscale, tree, prim="div")
    assert len(divs) == 2 and all(float_in_dtypes(e) == {F32} for e in divs)
    noop = lowtrain.NoOpLossScale()
    assert noop.unscale(tree) is tree and noop.scale(tree) is tree
    assert noop.adjust(jnp.array(False)) is noop and ls.adjust(False) is ls


def test_all_finite():
    assert lowtrain.all_finite({}).dtype == np.bool_ and bool(lowtrain.all_finite({}))
    assert bool(lowtrain.all_finite({"a": jnp.ones(2, jnp.float16), "i": 3}))
    assert not bool(lowtrain.all_finite([jnp.ones(2), jnp.array([jnp.nan])]))
    assert not bool(lowtrain.all_finite(jnp.array([1.0, -jnp.inf], jnp.bfloat16)))
    assert bool(jax.jit(lowtrain.all_finite)((jnp.zeros(3), jnp.arange(3))))


def mlp_loss(model, x, *, target):
    return jnp.mean((jax.vmap(model)(x) - target) ** 2)


def test_matches_filter_value_and_grad(getkey, maybe_jit):
    model = eqx.nn.MLP(3, 2, 8, 1, key=getkey())
    x, t = jax.random.normal(getkey(), (5, 3)), jnp.ones((5, 2))
    want_loss, want = maybe_jit(eqx.filter_value_and_grad(mlp_loss))(model, x, target=t)
    g = maybe_jit(lowtrain.scaled_value_and_grad(mlp_loss))
    for ls in (
        lowtrain.NoOpLossScale(),
        lowtrain.StaticLossScale(2.0**8),
        lowtrain.DynamicLossScale(),
    ):
        (loss, grads), new_ls, finite = g(ls, model, x, target=t)
        assert loss.dtype == F32 and float(loss) == float(want_loss)
        assert bool(finite) and type(new_ls) is type(ls)
        assert jax.tree.structure(grads) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_growth_step_returns_true_grads(maybe_jit):
    # Unscaling with the adjusted (doubled) scale would halve these (mpx's bug).
    fn = lambda w, x: jnp.sum(w * x) ** 2
    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
    ls = lowtrain.DynamicLossScale(scale=2.0**10, growth_interval=1)
    (loss, grads), new_ls, finite = maybe_jit(lowtrain.scaled_value_and_grad(fn))(
        ls, w, x
    )
    assert float(new_ls.loss_scale) == 2.0**11  # this was a growth step
    assert np.array_equal(grads, jax.grad(fn)(w, x)) and grads.tolist() == [6.0, -2.0]
    assert float(loss) == 1.0 and bool(finite)


def test_nan_in_aux_does_not_change_scale(maybe_jit):
    fn = lambda w: (jnp.sum(w**2), {"bad": jnp.log(-w), "n": 3})
    ls = lowtrain.DynamicLossScale(scale=2.0**4, growth_interval=3)
    g = maybe_jit(lowtrain.scaled_value_and_grad(fn, has_aux=True))
    ((loss, aux), grads), new_ls, finite = g(ls, jnp.ones(2))
    assert bool(jnp.all(jnp.isnan(aux["bad"]))) and aux["n"] == 3
    assert bool(finite) and grads.tolist() == [2.0, 2.0] and float(loss) == 2.0
    assert float(new_ls.loss_scale) == 2.0**4 and int(new_ls.counter) == 1


def overflowing(w):
    # The f16 cotangent of the output is the loss scale; times 8 it overflows f16
    # (max 65504) for every scale above 2**12.
    return jnp.sum(w * jnp.float16(8.0)).astype(jnp.float32)


def test_fp16_backward_overflow_backs_off(maybe_jit):
    w = jnp.ones(4, jnp.float16)
    g = maybe_jit(lowtrain.scaled_value_and_grad(overflowing))
    (loss, grads), ls, finite = g(lowtrain.DynamicLossScale(scale=2.0**15), w)
    assert not bool(finite) and bool(jnp.all(jnp.isinf(grads)))
    assert float(ls.loss_scale) == 2.0**14 and float(loss) == 32.0


def test_redo_on_nan_acceptance(maybe_jit):
    w = jnp.ones(4, jnp.float16)
    g = maybe_jit(lowtrain.scaled_value_and_grad(overflowing, redo_on_nan=3))
    ls = lowtrain.DynamicLossScale(scale=2.0**15, growth_interval=5)
    (loss, grads), new_ls, finite = g(ls, w)  # one call: 2**15, 14, 13 fail; 12 ok
    assert bool(finite) and grads.dtype == F16 and grads.tolist() == [8.0] * 4
    assert float(new_ls.loss_scale) == 2.0**12 and int(new_ls.counter) == 1
    assert loss.dtype == F32 and float(loss) == 32.0
    jaxpr = jax.make_jaxpr(g)(ls, w)
    assert "while" in str(jaxpr)


def test_redo_on_nan_gives_up_after_n(maybe_jit):
    w = jnp.ones(4, jnp.float16)
    g = maybe_jit(lowtrain.scaled_value_and_grad(overflowing, redo_on_nan=1))
    (_, grads), ls, finite = g(lowtrain.DynamicLossScale(scale=2.0**15), w)
    # Tried 2**15 and 2**14; the last (failed) scale backs off once more.
    assert not bool(finite) and float(ls.loss_scale) == 2.0**13
    # A static scale cannot change, so it is not redone.
    g = lowtrain.scaled_value_and_grad(overflowing, redo_on_nan=3)
    (_, grads), ls, finite = g(lowtrain.StaticLossScale(2.0**15), w)
    assert not bool(finite) and float(ls.loss_scale) == 2.0**15


def test_scaled_loss_multiplied_in_float32():
    g = lowtrain.scaled_value_and_grad(lambda w: jnp.sum(w * w))
    w = jnp.ones(3, jnp.float16)
    (loss, grads), _, _ = g(lowtrain.StaticLossScale(2.0**10), w)
    assert loss.dtype == F32 and grads.dtype == F16 and grads.tolist() == [2.0] * 3
    muls = eqns_of(lambda ls, w: g(ls, w), lowtrain.StaticLossScale(2.0**10), w)
    scale_muls = [
        e for e in muls if e.primitive.name == "mul" and F32 in float_in_dtypes(e)
    ]
    assert scale_muls and all(float_in_dtypes(e) == {F32} for e in scale_muls)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(growth_factor=0.5), r"Expected `growth_factor` in \(1, inf\)"),
        (dict(backoff_factor=1.0), r"Expected `backoff_factor` in \(0, 1\)"),
        (dict(min_scale=8.0, max_scale=4.0), r"Expected `max_scale` in \[8.0, inf\]"),
        (dict(scale=0.0), "Expected a positive finite scalar for `scale`"),
        (dict(scale=math.inf), "Expected a positive finite scalar for `scale`"),
        (dict(growth_interval=0), r"Expected `growth_interval` in \[1, "),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lowtrain.DynamicLossScale(**kwargs)


def test_call_errors():
    g = lowtrain.scaled_value_and_grad(lambda w: w * 2)
    with pytest.raises(TypeError, match=r"Expected `fn` to return a float scalar"):
        g(lowtrain.NoOpLossScale(), jnp.ones(3))
    with pytest.raises(TypeError, match="Expected a loss scale"):
        g(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="Expected a non-negative int `redo_on_nan`"):
        lowtrain.scaled_value_and_grad(lambda w: w, redo_on_nan=-1)
