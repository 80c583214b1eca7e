"""`lowtrain.train.apply_if_finite`: `optax.apply_if_finite` bit for bit, without a
branch in the compiled step."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowtrain.train import apply_if_finite
from lowtrain.train._finite import skip_nonfinite

from .helpers import SGD, Mse, iter_eqns, make_model


def _inner():
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)
    )


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
        yield


def test_matches_optax_bit_for_bit():
    # Jitted on its own (eagerly, optax's branch is one compiled computation and
    # this is op by op, so the last bits may differ). Finite steps, skipped steps
    # (NaN, inf) and the give-up after `max_consecutive_errors` skips in a row: the
    # same updates and states.
    params = {"a": jnp.linspace(-1, 1, 300).reshape(30, 10), "b": jnp.arange(7.0)}
    ours, ref = apply_if_finite(_inner(), 2), optax.apply_if_finite(_inner(), 2)
    s_ours, s_ref = ours.init(params), ref.init(params)
    assert type(s_ours) is optax.ApplyIfFiniteState
    up_ours, up_ref = jax.jit(ours.update), jax.jit(ref.update)
    key = jax.random.key(0)
    skipped = []
    for i in range(10):
        key, ka, kb = jax.random.split(key, 3)
        g = {"a": 3 * jax.random.normal(ka, (30, 10)), "b": jax.random.normal(kb, 7)}
        if i in (2, 5, 6, 7):
            g["b"] = g["b"].at[1].set(jnp.inf if i == 6 else jnp.nan)
        u_ours, s_ours = up_ours(g, s_ours, params)
        u_ref, s_ref = up_ref(g, s_ref, params)
        for x, y in zip(
            jax.tree.leaves((u_ours, s_ours)), jax.tree.leaves((u_ref, s_ref))
        ):
            np.testing.assert_array_equal(x, y)
        skipped.append(bool((u_ours["a"] == 0).all()))
        params = optax.apply_updates(params, u_ours)
    # 2 skipped; 5, 6 skipped, 7 the third in a row: given up on, applied.
    assert skipped == [
        False,
        False,
        True,
        False,
        False,
        True,
        True,
        False,
        False,
        False,
    ]
    assert int(s_ours.total_notfinite) == 4


def test_no_branch():
    params = {"w": jnp.ones(3)}
    opt = apply_if_finite(_inner(), 5)
    state = opt.init(params)
    jaxpr = jax.make_jaxpr(opt.update)(params, state, params)
    assert "cond" not in {e.primitive.name for e in iter_eqns(jaxpr)}
    ref = optax.apply_if_finite(_inner(), 5)
    jaxpr = jax.make_jaxpr(ref.update)(params, ref.init(params), params)
    assert "cond" in {e.primitive.name for e in iter_eqns(jaxpr)}  # what it replaces


def test_the_trainer_skips_by_select_on_gpus_only():
    # A GPU stops its host at every `conditional` (see lowtrain/train/_finite.py);
    # elsewhere the Trainer keeps optax's, as the recipes' records were made.
    params = {"w": jnp.ones(3)}

    def prims(devices):
        opt = skip_nonfinite(_inner(), devices)
        jaxpr = jax.make_jaxpr(opt.update)(params, opt.init(params), params)
        return {e.primitive.name for e in iter_eqns(jaxpr)}

    assert "cond" not in prims([SimpleNamespace(platform="gpu")])
    assert "cond" in prims(jax.devices("cpu"))
    opt = Mse(make_model(), SGD(0.1)).optimizer  # a Trainer on this CPU
    jaxpr = jax.make_jaxpr(opt.update)(params, opt.init(params), params)
    assert "cond" in {e.primitive.name for e in iter_eqns(jaxpr)}
