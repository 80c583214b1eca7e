"""Stochastic rounding of the FP8 casts: unbiased, exact in the format, deterministic
given its key (or, keyless, given the tensor), and through the naive-FP8 rules."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowtrain.fp8 as fp8
import lowtrain.unit_scaling as uu


def _values(q):
    return np.asarray(q.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_stochastic_rounding_is_unbiased_in_expectation(dtype):
    # Normals, subnormals and negative values: the mean over keys is the value.
    info = ml_dtypes.finfo(dtype)
    tiny = float(info.smallest_subnormal)
    x = jnp.array([1 + 2**-5, -3.3, 0.7 * tiny, 2.5 * tiny, 100.0, -1e-3, 0.0])
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = jax.vmap(lambda k: fp8.quantize(x, dtype, rounding="stochastic", key=k))(
        keys
    )
    got = _values(draws)
    lower = np.asarray(x.astype(dtype).astype(jnp.float32))  # nearest, for the gap
    np.testing.assert_allclose(got.mean(0), np.asarray(x), rtol=0.02, atol=0.02 * tiny)
    # Each draw is one of the two neighbours of x, exact in the format.
    for value, column, near in zip(np.asarray(x), got.T, lower):
        assert len(set(column.tolist())) <= 2
        assert near in column or value == 0
    assert (got[:, -1] == 0).all()


def test_stochastic_rounding_is_deterministic_given_its_key():
    x = jax.random.normal(jax.random.key(1), (64,))
    a = fp8.quantize(x, fp8.E4M3, rounding="stochastic", key=jax.random.key(2))
    b = fp8.quantize(x, fp8.E4M3, rounding="stochastic", key=jax.random.key(2))
    c = fp8.quantize(x, fp8.E4M3, rounding="stochastic", key=jax.random.key(3))
    np.testing.assert_array_equal(_values(a), _values(b))
    assert not np.array_equal(_values(a), _values(c))


def test_keyless_stochastic_rounding_hashes_each_value_and_its_index():
    # A tensor of one value: its positions round up in the right proportion, and
    # the same tensor rounds the same way every time (no key to thread).
    x = jnp.full(50_000, 1 + 2**-5)  # a quarter of the way from 1 to 1.125
    a = _values(fp8.quantize(x, fp8.E4M3, rounding="stochastic"))
    b = _values(fp8.quantize(x, fp8.E4M3, rounding="stochastic"))
    np.testing.assert_array_equal(a, b)
    assert set(a.tolist()) == {1.0, 1.125}
    assert abs((a == 1.125).mean() - 0.25) < 0.01
    # Saturation and infinities as in nearest rounding.
    big = jnp.array([1e5, -1e5, jnp.inf])
    out = _values(fp8.quantize(big, fp8.E5M2, rounding="stochastic"))
    assert out.tolist() == [57344.0, -57344.0, np.inf]


def test_stochastic_rounding_checks_its_argument():
    with pytest.raises(ValueError, match="rounding"):
        fp8.quantize(jnp.ones(2), fp8.E4M3, rounding="up")
    with pytest.raises(ValueError, match="rounding"):
        uu.fp8_cast_rules(rounding="down")


def test_naive_fp8_rules_round_stochastically_and_stay_deterministic(getkey):
    x = jax.random.normal(getkey(), (32, 16))
    w = jax.random.normal(getkey(), (16, 8))
    nearest = uu.simulate_fp8(lambda x, w: x @ w)
    sr = uu.simulate_fp8(lambda x, w: x @ w, rounding="stochastic")
    exact = x @ w
    err_sr = jnp.abs(sr(x, w) - exact).mean()
    err_nearest = jnp.abs(nearest(x, w) - exact).mean()
    assert not jnp.array_equal(sr(x, w), nearest(x, w))
    assert err_sr < 3 * err_nearest  # the same order of error
    np.testing.assert_array_equal(sr(x, w), sr(x, w))
    # The backward cast too: gradients differ from nearest rounding's, repeatably.
    loss = lambda f: lambda w: jnp.sum(f(x, w) ** 2)  # noqa: E731
    g_sr = jax.grad(loss(sr))(w)
    np.testing.assert_array_equal(g_sr, jax.grad(loss(sr))(w))
    assert not jnp.array_equal(g_sr, jax.grad(loss(nearest))(w))
