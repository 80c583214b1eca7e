"""Fails loudly when the JAX internals lowtrain relies on change (see _compat.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain
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
    for version in ("0.9.2", "0.13.0", "1.0.0"):
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
        "Update lowtrain/_compat.py and the residual tables of `scripts/bench.py amp`."
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


@jax.custom_vjp
def _three(x, y, z):
    return x * y + z


_three.defvjp(
    lambda x, y, z: (x * y + z, (x, y)),
    lambda res, g: (g * res[1], g * res[0], None),  # no cotangent for z: a zero
)


def test_custom_vjp_backward_gives_one_cotangent_per_primal():
    # JAX 0.11's backward rule returns (cotangents, logs), 0.10's the cotangents.
    x = jnp.arange(3.0)
    jaxpr = jax.make_jaxpr(_three)(x, x, x)
    eqn = next(e for e in iter_eqns(jaxpr) if e.primitive.name == "custom_vjp_call")
    _, forwards, bwd = _compat.custom_vjp_rule_parts(eqn.params, 3)
    assert forwards == (0, 1)  # both residuals are inputs, forwarded
    args = (x, x + 1, x)
    cts = bwd(*[args[i] for i in forwards], jnp.ones(3))
    assert len(cts) == 3 and cts[2] is None
    np.testing.assert_array_equal(cts[0], x + 1)
    np.testing.assert_array_equal(cts[1], x)
    # Through a transform that rebuilds the custom_vjp: the same gradients as JAX's.
    loss = lambda *a: jnp.sum(jnp.sin(_three(*a)))
    grad = jax.grad(lowtrain.amp(loss, "bf16"), (0, 1, 2))
    expected = jax.grad(loss, (0, 1, 2))
    for a, b in zip(grad(x, x + 1, x), expected(x, x + 1, x)):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-2)


def test_backends_initialized_turns_true_at_the_first_device_use():
    # XLA reads XLA_FLAGS when the first backend is made: `use_triton_gemm` relies on
    # knowing whether that has happened (a fresh process: before, then after).
    import subprocess
    import sys

    code = (
        "from lowtrain import _compat; import jax.numpy as jnp; "
        "before = _compat.backends_initialized(); jnp.ones(2).block_until_ready(); "
        "print(before, _compat.backends_initialized())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


def test_scaled_dot_quantize():
    # JAX's own block quantizer, which tests/test_blocks.py checks
    # `lowtrain.fp8.block_quantize` against.
    x = jnp.arange(128.0).reshape(2, 64)
    try:
        mx = _compat.scaled_dot_quantize(x, "mxfp8")
        nv = _compat.scaled_dot_quantize(x, "nvfp4", jnp.ones(1))
    except (ImportError, AttributeError, TypeError) as e:
        pytest.fail(
            f"JAX {jax.__version__} moved or changed its block quantizer ({e!r}): "
            "update lowtrain/_compat.scaled_dot_quantize."
        )
    got = [(a.dtype, a.shape) for pair in (mx, nv) for a in pair]
    want = [
        (jnp.float8_e4m3fn, (2, 64)),
        (jnp.float8_e8m0fnu, (2, 2)),
        (jnp.float4_e2m1fn, (2, 64)),
        (jnp.float8_e4m3fn, (2, 4)),
    ]
    assert got == want, (
        f"JAX {jax.__version__}'s block quantizer returns {got}, expected {want}: "
        "update lowtrain/_compat.scaled_dot_quantize."
    )
