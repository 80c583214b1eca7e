"""`scalify`: run a program on `ScaledArray`s, propagating scales through every op."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .._attention import xla_only
from .._context import trace_key
from .._eqn import Eqn, Values
from .._interpret import FlatCall, Interpreter
from . import _ops  # noqa: F401  (registers the rule of the scalify_op primitive)
from ._rules import RULES, Ctx, scaled, value
from ._scaled_array import POW2_MODES, ScaledArray, is_scaled

F32 = jnp.float32


def _is_sa_type(t) -> bool:
    return isinstance(t, ScaledArray)


class _Stacked(eqx.Module):
    """Outputs stacked by `lax.scan` (the forward's residuals, per-layer activations):
    step `i` is `data[i] * scales[i]`. Each step keeps its own scale, so a scan that
    slices it again (the backward pass's) gets every step back exactly; any other op
    sees it `merged` to one scale."""

    data: jax.Array
    scales: jax.Array

    def merged(self) -> ScaledArray:
        scale = jnp.max(self.scales)
        shape = self.scales.shape + (1,) * (self.data.ndim - 1)
        ratio = jnp.where(
            scale > 0, self.scales / jnp.where(scale > 0, scale, 1.0), 0.0
        )
        data = (self.data.astype(F32) * ratio.reshape(shape)).astype(self.data.dtype)
        return ScaledArray(data, scale)


def _merged(v):
    return v.merged() if isinstance(v, _Stacked) else v


_STACKED = "stacked"


class _ScaledValues(Values):
    """`lowtrain._eqn.Values` for `ScaledArray`s (see each hook there)."""

    # A scanned ScaledArray slices its data; its scale is shared by every step. A
    # stacked output slices both its data and its per-step scales.
    def scan_split(self, v):
        if isinstance(v, _Stacked):
            return (v.data, v.scales), _STACKED
        return (v.data, v.scale) if is_scaled(v) else (v, None)

    def scan_merge(self, sliced, rest):
        if rest is None:
            return sliced
        return ScaledArray(*sliced) if rest is _STACKED else ScaledArray(sliced, rest)

    def scan_output(self, v):
        return _merged(v)

    def scan_stacked(self, stacked, scales):
        return stacked if scales is None else _Stacked(stacked, scales)

    # JAX differentiates a ScaledArray by its leaves (data, scale); the rules compute
    # with values. value = data * scale, so a tangent (td, ts) has the value
    # td * scale + data * ts, and a cotangent (cd, cs) of the value c has
    # cd = c * scale and cs = sum(c * data).
    def tangent_in(self, primal, tangent):
        if not is_scaled(primal):
            return tangent
        extra = primal.data.astype(F32) * (tangent.scale / primal.scale)
        data = (tangent.data.astype(F32) + extra).astype(primal.dtype)
        return ScaledArray(data, primal.scale)

    def tangent_out(self, primal, tangent):
        if not is_scaled(primal):
            return tangent
        data = (value(tangent) / primal.scale).astype(primal.dtype)
        return ScaledArray(data, jnp.zeros((), F32))

    def vjp_saved(self, primals, outs):
        return list(primals), [o.scale if is_scaled(o) else None for o in outs]

    def cotangents_in(self, saved, cts):
        _, out_scales = saved
        # The cotangent of the value is cd / scale: the ScaledArray (cd, 1 / scale).
        return [
            c if s is None else ScaledArray(c.data, 1.0 / s)
            for c, s in zip(cts, out_scales)
        ]

    def cotangents_out(self, saved, cts):
        primals, _ = saved
        out = []
        for x, c in zip(primals, cts):
            if is_scaled(x):
                c = value(c)
                data = (c * x.scale).astype(x.dtype)
                c = ScaledArray(data, jnp.sum(c * x.data.astype(F32)))
            out.append(c)
        return out


class _ScalifyInterpreter(Interpreter):
    values = _ScaledValues()

    def __init__(self, pow2: str, auto_rescale: bool):
        self.ctx = Ctx(pow2, auto_rescale)

    def rule(self, eqn: Eqn, *invals) -> list:
        invals = [_merged(v) for v in invals]
        name = eqn.primitive.name
        if name != "scalify_op" and not any(is_scaled(v) for v in invals):
            return eqn.bind(*invals)  # integers, booleans, unscaled floats: as is
        rule = RULES.get(name)
        if rule is None:
            raise NotImplementedError(
                f"scalify has no rule for the primitive `{eqn.primitive}`, which got a "
                "ScaledArray input. Convert it first with `lowtrain.scalify."
                "stop_scaling(x)`, or register a rule with `lowtrain.scalify."
                "register_rule(name)`."
            )
        return rule(self.ctx, eqn, *invals)

    def join(self, types):
        scaled_types = [t for t in types if _is_sa_type(t)]
        return scaled_types[0] if scaled_types else types[0]

    def coerce(self, value_, type_):
        value_ = _merged(value_)
        if _is_sa_type(type_):
            v = scaled(value_)
            return ScaledArray(v.data.astype(type_.data.dtype), v.scale)
        if is_scaled(value_):
            return value_.to_array(type_.dtype)
        return value_.astype(type_.dtype) if value_.dtype != type_.dtype else value_


def _abstract(x):
    # A ScaledArray is traced as a plain array of its data's shape and dtype.
    if is_scaled(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


@eqx.filter_jit
def _scalify_call(fn, pow2, auto_rescale, args, kwargs, settings=()):
    call = FlatCall(fn, args, kwargs, is_leaf=is_scaled)
    with xla_only():  # attention as XLA's ops, which have scale rules, on any device
        closed = jax.make_jaxpr(call)(*map(_abstract, call.inputs))
    outs = _ScalifyInterpreter(pow2, auto_rescale).eval_jaxpr(closed, call.inputs)
    return call.rebuild([_merged(v) for v in outs])


class _Scalify(eqx.Module):
    fn: Callable
    pow2: str = eqx.field(static=True)
    auto_rescale: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fn

    def __call__(self, *args, **kwargs):
        return _scalify_call(
            self.fn, self.pow2, self.auto_rescale, args, kwargs, trace_key()
        )


def scalify(fn: Callable, *, pow2: str = "down", auto_rescale: bool = True) -> Callable:
    """Run `fn` with scale propagation: `ScaledArray` inputs stay scaled end to end.

    `fn` is traced with each `ScaledArray` input standing for a plain array of its
    data's shape and dtype; then every primitive is re-run by its scale rule
    (`lowtrain.scalify` rules: each chooses an output scale, such as
    `sqrt(sa**2 + sb**2)` for a sum or `sa * sb * sqrt(K)` for a matmul), including
    inside `jit`, `scan`, `while`, `cond`, `remat` and the rules of
    `custom_jvp`/`custom_vjp` functions. With `auto_rescale` (default), each
    arithmetic result (sums, products, quotients, matmuls, reductions, powers,
    roots) whose float32 data has an RMS outside `[2**-4, 2**4]` at that scale gets
    its scale multiplied by that RMS rounded by `pow2`, so its data's RMS is ~1:
    data stays near unit RMS, forward and backward, without `dynamic_rescale_*`
    calls. `auto_rescale=False` keeps the static scales only. Inputs may mix
    `ScaledArray`s and plain arrays; ops on plain arrays only run as written.
    Outputs are `ScaledArray`s where scales reached them. `pow2` rounds new scales
    to powers of two ("down", "up" or "none").

    Put the whole training step inside (`scalify(train_step)`, with `jax.grad` and the
    optimizer): the backward pass and the update are then scaled as well. `jax.grad`
    of a scalified function works too. The result is an `eqx.Module`, compiled once
    per input structure.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    x = scalify.as_scaled_array(jnp.array([1e6, 2e6, -3e6]), dtype=jnp.float16)
    f = scalify.scalify(lambda x: jnp.sum(jax.nn.relu(x) * 3.0))
    out = f(x)  # 9e6: far beyond float16's 65504, yet the data is float16
    assert out.data.dtype == jnp.float16
    assert jnp.allclose(scalify.asarray(out, jnp.float32), 9e6, rtol=1e-3)
    ```
    """
    if pow2 not in POW2_MODES:
        raise ValueError(f"Expected `pow2` in {POW2_MODES}, got {pow2!r} instead.")
    if not callable(fn):
        raise TypeError(f"Expected a function or callable module, got {fn!r} instead.")
    return _Scalify(fn, pow2, bool(auto_rescale))


def register_rule(*names: str):
    """Decorator registering a scale rule `rule(ctx, eqn, *invals) -> list` for the
    primitives `names` (an error if one has a rule already). See the rules in
    `lowtrain/scalify/_rules.py` for examples.

    ```python
    import jax.numpy as jnp
    import lowtrain.scalify as scalify

    assert "my_prim" not in scalify.registered_rules()

    @scalify.register_rule("my_prim")
    def _my_rule(ctx, eqn, x):
        return [x]  # identity: scale unchanged

    assert "my_prim" in scalify.registered_rules()
    scalify.unregister_rule("my_prim")
    ```
    """
    from ._rules import register

    return register(*names)


def registered_rules() -> tuple[str, ...]:
    """The primitive names scalify has rules for.

    ```python
    import lowtrain.scalify as scalify

    assert "dot_general" in scalify.registered_rules()
    ```
    """
    return tuple(sorted(RULES))


def unregister_rule(name: str) -> None:
    """Remove the rule for `name` (for tests and experiments).

    ```python
    import lowtrain.scalify as scalify

    scalify.register_rule("tmp_prim")(lambda ctx, eqn, x: [x])
    scalify.unregister_rule("tmp_prim")
    ```
    """
    RULES.pop(name)
