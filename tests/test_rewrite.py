"""`lowtrain.rewrite`: chosen primitives replaced everywhere, everything else as is."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowtrain

from .helpers import iter_eqns, make_jaxpr


def _times(k):
    return lambda op, *args: op(*args) * k


def _program(x, w):
    # A matmul in each place the interpreter must reach: plainly, in an inner jit,
    # a scan body, both cond branches, and a custom_vjp function.
    @jax.custom_vjp
    def f(a):
        return a @ w

    f.defvjp(lambda a: (a @ w, None), lambda _, g: (g @ w.T,))
    y = jax.jit(lambda a: a @ w)(x)
    y, _ = lax.scan(lambda c, _: (c @ w, None), y, None, length=2)
    y = lax.cond(jnp.sum(y) > 0, lambda a: a @ w, lambda a: -(a @ w), y)
    return f(y) @ w


def test_every_matmul_is_replaced(maybe_jit):
    x, w = jnp.ones((2, 2)), jnp.eye(2)
    out = maybe_jit(lowtrain.rewrite(_program, {"dot_general": _times(2.0)}))(x, w)
    # Six matmuls, each doubled: 2**6 times the identity's result.
    np.testing.assert_array_equal(out, 64.0 * _program(x, w))


def test_other_ops_and_dtypes_are_unchanged():
    f = lambda x: jnp.tanh(x.astype(jnp.float16)) * 3.0
    g = lowtrain.rewrite(f, {"dot_general": _times(2.0)})
    x = jnp.linspace(-2, 2, 5)
    assert g(x).dtype == jnp.float16
    np.testing.assert_array_equal(g(x), f(x))
    names = [e.primitive.name for e in iter_eqns(make_jaxpr(g)(x))]
    assert "tanh" in names and "dot_general" not in names


def test_gradients_go_through_the_rule():
    w = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    loss = lambda w, x: jnp.sum(x @ w)
    g = jax.grad(lowtrain.rewrite(loss, {"dot_general": _times(3.0)}))(
        w, jnp.ones((1, 2))
    )
    np.testing.assert_allclose(g, 3.0 * jax.grad(loss)(w, jnp.ones((1, 2))))


def test_a_module_keeps_its_parameters():
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    half = lowtrain.rewrite(mlp, {"dot_general": _times(0.5)})
    assert half.__wrapped__ is mlp
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(half, jnp.ones(3))
    assert grads.fn.layers[0].weight.shape == (4, 3)


def test_composes_with_amp():
    # rewrite first, amp around it: the rule's cast survives, the matmul is bf16.
    def round_operands(op, a, b):
        rnd = lambda v: v.astype(jnp.float16).astype(v.dtype)
        return op(rnd(a), rnd(b))

    f = lambda x, w: x @ w
    g = lowtrain.amp(lowtrain.rewrite(f, {"dot_general": round_operands}), "bf16")
    jaxpr = make_jaxpr(g)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    eqns = list(iter_eqns(jaxpr))
    casts = [e.params["new_dtype"] for e in eqns if "new_dtype" in e.params]
    assert jnp.float16 in casts
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


@pytest.mark.parametrize(
    "rules, message",
    [
        ([("dot_general", _times(2))], "Expected `rules` as a mapping"),
        ({"dot_general": 2.0}, "to map primitive names"),
    ],
)
def test_bad_rules(rules, message):
    with pytest.raises(TypeError, match=message):
        lowtrain.rewrite(jnp.sin, rules)


def _scoped_program(x, w):
    # One matmul outside any scope, one in "head", one in "head" inside a scan and
    # a jit (the scope path reaches through both), one in "body/head" (the
    # outermost scope with rules decides).
    y = x @ w
    with jax.named_scope("head"):
        y = y @ w
        y, _ = lax.scan(lambda c, _: (jax.jit(lambda a: a @ w)(c), None), y, None, 1)
    with jax.named_scope("body"), jax.named_scope("head"):
        return y @ w


def test_scope_rules_replace_the_rules_inside_a_scope(maybe_jit):
    x, w = jnp.ones((2, 2)), jnp.eye(2)
    ref = _scoped_program(x, w)
    rules = {"dot_general": _times(2.0)}
    kept = lowtrain.rewrite(_scoped_program, rules, scopes={"head": {}})
    # Doubled outside "head" (1 matmul), as written inside it (3).
    np.testing.assert_array_equal(maybe_jit(kept)(x, w), 2.0 * ref)
    tripled = {"h*": {"dot_general": _times(3.0)}}  # a glob, with its own rules
    out = maybe_jit(lowtrain.rewrite(_scoped_program, rules, scopes=tripled))(x, w)
    np.testing.assert_array_equal(out, 2.0 * 3.0**3 * ref)
    # The outermost scope wins: "body" has rules of its own, so "body/head" uses them.
    both = {"head": {}, "body": {"dot_general": _times(5.0)}}
    out = maybe_jit(lowtrain.rewrite(_scoped_program, rules, scopes=both))(x, w)
    np.testing.assert_array_equal(out, 2.0 * 5.0 * ref)


@pytest.mark.parametrize(
    "scopes, message",
    [
        ([("head", {})], "Expected `scopes` as a mapping"),
        ({"head": {"dot_general": 2.0}}, r"Expected `scopes\['head'\]` to map"),
    ],
)
def test_bad_scope_rules(scopes, message):
    with pytest.raises(TypeError, match=message):
        lowtrain.rewrite(jnp.sin, {}, scopes=scopes)
