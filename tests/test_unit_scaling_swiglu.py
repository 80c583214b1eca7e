"""`uu.MLP`'s SwiGLU path (`_swiglu.swiglu_mlp`): the op-by-op unit-scaled MLP's
values and gradients, from fewer multiplies on the `(..., inner)` tensors, with
the same matmuls for FP8 and `keep=`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U

from .helpers import eqns_of


def op_by_op(mlp, x):
    # `uu.MLP` as the issue writes it: `linear_2(silu_glu(linear_1(x), gate(x)))`.
    def lin(layer, z):
        return U.linear(z, layer.weight, layer.bias, constraint=layer.constraint)

    h = U.silu_glu(lin(mlp.linear_1, x), lin(mlp.linear_gate, x))
    return lin(mlp.linear_2, h)


def loss_and_grads(fn, mlp, x, cot):
    return jax.value_and_grad(lambda m, x: jnp.sum(fn(m, x) * cot), argnums=(0, 1))(
        mlp, x
    )


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture
def data():
    keys = jax.random.split(jax.random.key(1), 2)
    return tuple(jax.random.normal(k, (8, 32, 64)) for k in keys)


def test_values_and_gradients_are_the_op_by_op_ones(data):
    mlp = uu.MLP(64, key=jax.random.key(0))
    x, cot = data
    np.testing.assert_allclose(mlp(x), op_by_op(mlp, x), rtol=2e-5, atol=2e-6)
    (_, (gm, gx)), (_, (rm, rx)) = (
        loss_and_grads(f, mlp, x, cot) for f in (lambda m, x: m(x), op_by_op)
    )
    assert rel(gx, rx) < 2e-6
    for name in ("linear_1", "linear_gate", "linear_2"):
        assert rel(getattr(gm, name).weight, getattr(rm, name).weight) < 2e-6, name


def _const_muls_on(shape, fn, *args):
    # `mul`s by a literal scalar on a tensor of `shape`, forward and backward.
    eqns = eqns_of(fn, *args, prim="mul")
    return sum(
        e.outvars[0].aval.shape == shape and any(hasattr(v, "val") for v in e.invars)
        for e in eqns
    )


def test_inner_activations_get_three_constant_multiplies():
    # Op by op, 8 constants multiply the (..., inner) tensors (the up-projections'
    # output scales, the gated unit's three, the down-projection's input gradient
    # scale...); folded, 3 are left: the gate's input scale (forward and, by the
    # chain rule, backward) and the gated output's scale.
    mlp, x = uu.MLP(16, key=jax.random.key(0)), jnp.ones((4, 8, 16))

    def grad_of(fn):
        return lambda m, x: jax.grad(lambda m, x: jnp.sum(fn(m, x)), (0, 1))(m, x)

    fused = _const_muls_on((4, 8, 64), grad_of(lambda m, x: m(x)), mlp, x)
    assert fused == 3
    assert _const_muls_on((4, 8, 64), grad_of(op_by_op), mlp, x) >= fused + 4


def test_fp8_sees_the_same_matmuls_and_scopes(data):
    mlp = uu.MLP(64, key=jax.random.key(0))
    x, cot = data
    fused, ref = (uu.simulate_fp8(f) for f in (lambda m, x: m(x), op_by_op))
    # Forward: the same operands reach the same three casts.
    np.testing.assert_allclose(fused(mlp, x), ref(mlp, x), rtol=1e-6, atol=1e-6)
    # Backward: the up-projections' output cotangents are rounded to E5M2 at a
    # different scale (swiglu_mlp's docstring), so the FP8 gradients differ from
    # op by op's in rounding only: as far from the float32 ones.
    (_, g32), (_, g8), (_, r8) = (
        loss_and_grads(f, mlp, x, cot) for f in (op_by_op, fused, ref)
    )
    for pick in (lambda g: g[1], lambda g: g[0].linear_gate.weight):
        assert abs(rel(pick(g8), pick(g32)) - rel(pick(r8), pick(g32))) < 0.01

    def e4m3_casts(fn):
        eqns = eqns_of(fn, mlp, x)
        return sum(e.outvars[0].aval.dtype == jnp.float8_e4m3fn for e in eqns)

    # Two operands per matmul, three matmuls; `keep` finds each by its scope.
    assert e4m3_casts(fused) == 6
    for kept in ("linear_1", "linear_gate", "linear_2"):
        assert e4m3_casts(uu.simulate_fp8(lambda m, x: m(x), keep=[kept])) == 4


def test_linears_given_a_constraint_or_bias_run_op_by_op(data):
    x, _ = data
    mlp = uu.MLP(64, key=jax.random.key(0))

    def swap(where, layer, bias=None):
        # `layer` with `mlp`'s weight (and `bias`) in place of `where(mlp)`.
        layer = eqx.tree_at(lambda lin: lin.weight, layer, where(mlp).weight)
        if bias is not None:
            layer = eqx.tree_at(lambda lin: lin.bias, layer, bias)
        return eqx.tree_at(where, mlp, layer)

    key = jax.random.key(2)
    with_gmean = swap(lambda m: m.linear_1, uu.Linear(64, 256, False, key=key))
    with_bias = swap(
        lambda m: m.linear_2,
        uu.Linear(256, 64, constraint=None, key=key),
        bias=jnp.ones(64),
    )
    for m in (with_gmean, with_bias):
        np.testing.assert_allclose(m(x), op_by_op(m, x), rtol=1e-6, atol=1e-6)
        # ...where the folded path (which knows neither) gives other values.
        assert rel(m(x), mlp(x)) > 0.05


def test_fold_scales_false_runs_op_by_op(data):
    x, cot = data
    mlp = uu.MLP(64, fold_scales=False, key=jax.random.key(0))
    (loss, (gm, gx)), (ref, (rm, rx)) = (
        loss_and_grads(f, mlp, x, cot) for f in (lambda m, x: m(x), op_by_op)
    )
    # The same program, so the same bits (the folded one differs in rounding).
    np.testing.assert_array_equal(gx, rx)
    np.testing.assert_array_equal(gm.linear_gate.weight, rm.linear_gate.weight)
    folded = uu.MLP(64, key=jax.random.key(0))
    _, (_, folded_gx) = loss_and_grads(lambda m, x: m(x), folded, x, cot)
    assert not np.array_equal(folded_gx, rx)
    with pytest.raises(TypeError, match="`fold_scales` True or False, got 'no'"):
        uu.MLP(64, fold_scales="no", key=jax.random.key(0))


def test_wrong_input_width_is_a_clear_error():
    mlp = uu.MLP(64, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"\(\.\.\., in\).*got \(8, 32\) and \(256, 64\)"
    ):
        mlp(jnp.ones((8, 32)))
