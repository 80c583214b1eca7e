"""Fails loudly when the JAX internals lowtrain relies on change (see _compat.py)."""

import re

import jax
import jax.numpy as jnp
import pytest

from lowtrain import _compat

from .helpers import higher_order_program, iter_eqns


def _higher_order_eqns():
    jaxpr = jax.make_jaxpr(higher_order_program)(jnp.ones(3))
    return [e for e in iter_eqns(jaxpr) if e.primitive.name in _compat.KNOWN_PARAMS]


def test_every_higher_order_primitive_is_seen():
    seen = {e.primitive.name for e in _higher_order_eqns()}
    assert seen == set(_compat.KNOWN_PARAMS), (
        f"JAX renamed a higher-order primitive: expected "
        f"{sorted(_compat.KNOWN_PARAMS)}, "
        f"got {sorted(seen)}. Update lowtrain/_compat.py."
    )


@pytest.mark.parametrize("name", sorted(_compat.KNOWN_PARAMS))
def test_primitive_params_unchanged(name):
    eqns = [e for e in _higher_order_eqns() if e.primitive.name == name]
    assert eqns, f"The test program no longer produces `{name}`: JAX renamed it."
    for eqn in eqns:
        params = set(eqn.params)
        missing = _compat.USED_PARAMS[name] - params
        new = params - _compat.KNOWN_PARAMS[name]
        assert not missing, f"JAX {jax.__version__} removed `{name}` params {missing}."
        assert not new, (
            f"JAX {jax.__version__} added `{name}` params {new}: check that the rule "
            "in lowtrain/_higher_order.py may drop them, then list them in "
            "_compat.KNOWN_PARAMS."
        )


def test_internal_hooks_still_work():
    # The custom rule extractors return jaxprs of the documented shapes.
    eqns = {e.primitive.name: e for e in _higher_order_eqns()}
    jvp, out_zeros = _compat.custom_jvp_rule_jaxpr(eqns["custom_jvp_call"].params, 1)
    assert len(jvp.in_avals) == 2 and out_zeros == (False,)
    fwd, forwards, bwd = _compat.custom_vjp_rule_parts(
        eqns["custom_vjp_call"].params, 1
    )
    assert len(fwd.out_avals) + sum(f is not None for f in forwards) == 2
    scopes = jax.make_jaxpr(lambda x: jax.named_scope("a")(jnp.sin)(x))(jnp.ones(2))
    assert _compat.eqn_scopes(scopes.jaxpr.eqns[0]) == ("a",)


def test_supported_version(monkeypatch):
    _compat.check_version()  # the installed JAX is supported
    for version in ("0.9.2", "0.12.0", "1.0.0"):
        monkeypatch.setattr(jax, "__version__", version)
        with pytest.raises(ImportError, match=f"got jax {version}"):
            _compat.check_version()


def _sin_under_jvp_in_scopes():
    """The `sin` equation of `f` under `jax.jvp`, and `f`."""

    def f(x):
        return jax.named_scope("outer")(jax.named_scope("inner")(jnp.sin))(x)

    jaxpr = jax.make_jaxpr(lambda x: jax.jvp(f, (x,), (x,)))(jnp.ones(2, jnp.bfloat16))
    return next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "sin"), f


def test_eqn_name_stack():
    eqn, _ = _sin_under_jvp_in_scopes()
    stack = _compat.eqn_name_stack(eqn)
    assert stack == "jvp(outer)/inner", (
        f"JAX {jax.__version__} prints name stacks differently: got {stack!r}. "
        "Update lowtrain/_compat.py and the residual tables of scripts/bench_amp.py."
    )


def test_enter_name_stack():
    # An equation re-emitted inside `enter_name_stack` gets the same name stack,
    # transforms included (what `lowtrain.numerics` reads the backward pass from).
    eqn, _ = _sin_under_jvp_in_scopes()

    def again(x):
        with _compat.enter_name_stack(eqn):
            return jnp.sin(x)

    (new,) = jax.make_jaxpr(again)(jnp.ones(2)).jaxpr.eqns
    assert _compat.eqn_name_stack(new) == "jvp(outer)/inner"


def test_eqn_source_line():
    eqn, f = _sin_under_jvp_in_scopes()
    line = _compat.eqn_source_line(eqn)
    # "<path>/tests/test_compat.py:<line>:<column> (<qualified name of f>)"
    want = rf".*/test_compat\.py:{f.__code__.co_firstlineno + 1}:\d+ \(.*\bf\)"
    assert re.fullmatch(want, line), (
        f"JAX {jax.__version__} summarizes source lines differently: got {line!r}. "
        "Update lowtrain/_compat.py."
    )


def test_short_type():
    jaxpr = jax.make_jaxpr(lambda x: (x, x.astype(jnp.float32)[0]))(
        jnp.ones((16, 64), jnp.bfloat16)
    )
    types = [_compat.short_type(v.aval) for v in jaxpr.jaxpr.outvars]
    assert types == ["bf16[16,64]", "f32[64]"], (
        f"JAX {jax.__version__} writes short types differently: got {types}. "
        "Update lowtrain/_compat.py."
    )
