"""The interpreter core: rules applied inside every higher-order primitive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from lowtrain import _compat
from lowtrain._higher_order import RULES
from lowtrain._interpret import Interpreter, call_transformed

from .helpers import higher_order_program as _program


class SinToCos(Interpreter):
    """Replaces every `sin` by `cos`, and records the primitives it saw."""

    def __init__(self):
        self.seen = []

    def rule(self, eqn, *invals):
        self.seen.append(eqn.primitive.name)
        if eqn.primitive.name == "sin":
            return [jnp.cos(*invals)]
        return eqn.bind(*invals)

    def join(self, types):
        return types[0]

    def coerce(self, value, type_):
        return value


def _with_cos(x):
    # `_program` with every sin written as cos, the expected result of SinToCos.
    y = jnp.cos(jax.jit(jnp.cos)(x))
    y = jnp.cos(jax.nn.relu(y))
    y, _ = lax.scan(lambda c, _: (c * 2.0, None), y, None, length=2)
    y = lax.cond(jnp.sum(y) > 0, lambda a: a, lambda a: -a, y)
    y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.5), (0, y))[1]
    return jax.checkpoint(jnp.exp)(y)


@pytest.mark.parametrize("jit", [False, True])
def test_rules_reach_every_sub_jaxpr(jit):
    x = jnp.linspace(-1.0, 1.0, 5)
    closed = jax.make_jaxpr(_program)(x)
    interp = SinToCos()
    run = lambda x: interp.eval_jaxpr(closed, [x])[0]
    out = (jax.jit(run) if jit else run)(x)
    np.testing.assert_allclose(out, _with_cos(x), rtol=1e-6)
    # sin inside the jit and inside the custom_vjp; mul inside scan and while; neg in
    # the cond branch; exp inside remat; max inside relu's custom_jvp.
    assert "sin" in interp.seen
    assert {"mul", "neg", "exp", "max", "lt"} <= set(interp.seen)


def test_custom_rules_are_transformed_not_dropped():
    # The forward's sin becomes cos, but the gradient is still the user's rule (3),
    # not the derivative of either sin or cos.
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda r, c: (c * 3.0,))
    x = jnp.linspace(-1.0, 1.0, 5)
    closed = jax.make_jaxpr(f)(x)
    interp = SinToCos()
    g = jax.grad(lambda x: jnp.sum(interp.eval_jaxpr(closed, [x])[0]))(x)
    np.testing.assert_allclose(g, 3.0)  # the user's rule, not d/dx cos
    np.testing.assert_allclose(interp.eval_jaxpr(closed, [x])[0], jnp.cos(x))


def test_call_transformed_interprets_the_backward_pass():
    interp = SinToCos()
    x = jnp.linspace(-1.0, 1.0, 5)
    fn = lambda x: [jnp.sum(jnp.sin(jnp.broadcast_to(x, (3, 5))), axis=1)]
    (out,) = call_transformed(interp, fn, [x])
    np.testing.assert_allclose(out, jnp.sum(jnp.cos(x)) * jnp.ones(3), rtol=1e-6)
    assert "reduce_sum" in interp.seen and interp.seen.count("sin") == 1
    interp.seen.clear()
    # The backward program (the transpose of the broadcast is a reduce_sum) goes
    # through the interpreter too; the gradient is that of the transformed forward.
    g = jax.grad(lambda x: jnp.sum(call_transformed(interp, fn, [x])[0]))(x)
    np.testing.assert_allclose(g, -3 * jnp.sin(x), rtol=1e-6)
    assert interp.seen.count("reduce_sum") >= 2  # forward's, and the transposed one


def test_every_known_higher_order_primitive_has_a_rule():
    # `_compat.KNOWN_PARAMS` lists the higher-order primitives lowtrain handles; each
    # needs a rule, and no rule is left for a primitive that is gone.
    assert {p.name for p in RULES} == set(_compat.KNOWN_PARAMS)


def test_unsupported_higher_order_primitive():
    def solve(x):
        return lax.custom_linear_solve(lambda v: 2.0 * v, x, lambda mv, b: b / 2.0)

    closed = jax.make_jaxpr(solve)(jnp.ones(3))
    with pytest.raises(NotImplementedError, match="`custom_linear_solve`"):
        SinToCos().eval_jaxpr(closed, [jnp.ones(3)])


def test_wrong_argument_count():
    closed = jax.make_jaxpr(jnp.sin)(jnp.ones(3))
    with pytest.raises(ValueError, match="Expected 1 arguments"):
        SinToCos().eval_jaxpr(closed, [])
