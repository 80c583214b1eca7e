"""The interpreter core's rules for JAX's higher-order primitives.

`jit` (inlined), `scan`, `while`, `cond`, `remat`, `custom_jvp_call`,
`custom_vjp_call` and `custom_vmap_call` (inlined) hold sub-jaxprs. Each rule here
evaluates those with the same interpreter and rebuilds the op through JAX's public
API (`lax.scan`, `jax.checkpoint`, `jax.custom_vjp`, ...), so sub-programs are
transformed, not bound unchanged, and a custom derivative stays custom: its rule is
itself interpreted.

A rule is `rule(interp, eqn, *invals) -> list of outvals`, where `interp` is the
`lowtrain._interpret.Interpreter` evaluating the enclosing jaxpr. `RULES` is the
fixed table `Interpreter.eval_jaxpr` consults. It is not a user extension point: a
rule is tied to its primitive's parameters, which `tests/test_compat.py` checks
against each JAX release; a new higher-order primitive gets its rule here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import dtypes, lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from . import _compat
from ._eqn import Eqn, type_of


def _sub(interp, closed, scopes):
    return functools.partial(interp.eval_jaxpr, closed, scopes=scopes)


def _constrain(values, shardings) -> list:
    # A `NamedSharding` (given to the inner jit, or set by `jax.sharding.use_mesh`)
    # becomes a `with_sharding_constraint` on the value; an unspecified one, a
    # value that is not a plain array (a `ScaledArray`) or another sharding kind is
    # left to the outer jit.
    return [
        lax.with_sharding_constraint(v, s)
        if isinstance(s, jax.sharding.NamedSharding) and isinstance(v, jax.Array)
        else v
        for v, s in zip(values, shardings)
    ]


def trace_once(fn: Callable, *types: Any) -> tuple[Callable, Any]:
    """`fn` traced once at `types` (pytrees of `jax.ShapeDtypeStruct`): a function
    that replays the traced program on values of those types, and its output types.

    An interpreted sub-program needs its output types before it is rebuilt (a
    loop's carry, a branch's join, a custom rule's cotangents), and `jax.eval_shape`
    followed by the real call would transform it twice, and each loop or custom
    derivative nested in it twice again: a diffrax solve (a custom rule around loops
    of loops) would be transformed dozens of times. The replay binds the program's
    equations as traced, with the enclosing trace's values it closed over.
    """
    closed, out_types = jax.make_jaxpr(fn, return_shape=True)(*types)
    out_tree = jax.tree.structure(out_types)
    run = _compat.jaxpr_as_fun(closed)

    def replay(*args):
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(args)))

    return replay, out_types


def _jit_rule(interp, eqn: Eqn, *args):
    # Inlined, in the same trace and sharing its memo: a value used inside and outside
    # an inner jit (jnp.var is one) is cast once. The outer program is jitted anyway,
    # and XLA inlines nested jits; its in and out shardings are kept as constraints.
    p = eqn.params
    args = _constrain(args, p["in_shardings"])
    outs = interp.eval_jaxpr(p["jaxpr"], args, eqn.scopes, memo=eqn.memo)
    return _constrain(outs, p["out_shardings"])


def _remat_rule(interp, eqn: Eqn, *args):
    run = _sub(interp, _compat.ClosedJaxpr(eqn.params["jaxpr"], ()), eqn.scopes)
    fn = jax.checkpoint(
        lambda *xs: run(xs),
        prevent_cse=eqn.params["prevent_cse"],
        policy=eqn.params["policy"],
    )
    return list(fn(*args))


def _scan_rule(interp, eqn: Eqn, *args):
    p, values = eqn.params, interp.values
    consts, init, xs = _compat.scan_inputs(p, args)
    n_carry = len(init)
    run = _sub(interp, p["jaxpr"], eqn.scopes)

    # Scanned inputs are split into the part with the scanned axis and the rest (the
    # scale of a `ScaledArray`), which is closed over.
    split = [values.scan_split(x) for x in xs]
    sliced, rests = [s for s, _ in split], [r for _, r in split]

    def body(carry, x_slices):
        x = [values.scan_merge(s, r) for s, r in zip(x_slices, rests)]
        outs = run([*consts, *carry, *x])
        return outs[:n_carry], outs[n_carry:]

    # One slice of each scanned input, to find the carry types abstractly.
    slice_types = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), type_of(s))
        for s in sliced
    ]
    types, traced = interp.fix_types(body, init, slice_types)

    def typed_body(carry, x_slices):
        new, ys = traced(carry, x_slices)
        return [interp.coerce(v, t) for v, t in zip(new, types)], [
            values.scan_split(values.scan_output(y)) for y in ys
        ]

    init = [interp.coerce(v, t) for v, t in zip(init, types)]
    carry, ys = lax.scan(
        typed_body,
        init,
        sliced,
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [*carry, *(values.scan_stacked(s, r) for s, r in ys)]


def _while_rule(interp, eqn: Eqn, *args):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = args[:nc], args[nc : nc + nb], args[nc + nb :]
    run_cond = _sub(interp, p["cond_jaxpr"], eqn.scopes)
    run_body = _sub(interp, p["body_jaxpr"], eqn.scopes)

    def body(carry):
        return run_body([*body_consts, *carry]), ()

    types, traced = interp.fix_types(body, init)

    def typed_body(carry):
        return [interp.coerce(v, t) for v, t in zip(traced(carry)[0], types)]

    def cond(carry):
        (pred,) = run_cond([*cond_consts, *carry])
        return pred

    init = [interp.coerce(v, t) for v, t in zip(init, types)]
    return list(lax.while_loop(cond, typed_body, init))


def _cond_rule(interp, eqn: Eqn, index, *ops):
    op_types = [type_of(o) for o in ops]
    traced = [
        trace_once(_sub(interp, br, eqn.scopes), op_types)
        for br in eqn.params["branches"]
    ]
    types = [interp.join(ts) for ts in zip(*(t for _, t in traced))]

    def typed(replay):
        return lambda *o: [interp.coerce(v, t) for v, t in zip(replay(list(o)), types)]

    return list(lax.switch(index, [typed(r) for r, _ in traced], *ops))


def _lazy(make):
    # Values made on first use and kept, one per key: a custom rule is traced (and
    # transformed) only when JAX asks for it, as JAX itself calls a rule only where
    # a tangent reaches the function (`eqx.internal.nondifferentiable`'s rule raises
    # if called), and for the inputs JAX says are perturbed.
    made = {}

    def get(*key):
        if key not in made:
            made[key] = make(*key)
        return made[key]

    return get


def _custom_jvp_rule(interp, eqn: Eqn, *args):
    p, values = eqn.params, interp.values
    n = p["num_consts"]
    consts, primals = args[:n], args[n:]
    run = _sub(interp, p["call_jaxpr"], eqn.scopes)

    @_lazy
    def jvp_rule(zeros):  # traced when differentiated, for those tangents
        jvp_jaxpr, out_zeros = _compat.custom_jvp_rule_jaxpr(p, len(primals), zeros)
        return _sub(interp, jvp_jaxpr, eqn.scopes), out_zeros

    primal, out_types = trace_once(
        lambda *xs: run([*consts, *xs]), *[type_of(x) for x in primals]
    )

    @jax.custom_jvp
    def fn(*xs):
        return primal(*xs)

    def fn_jvp(xs, ts):
        # Symbolic zeros: the user's rule sees which inputs carry no tangent, as
        # when JAX calls it (Equinox's `nondifferentiable` raises on a tangent).
        # A rule written without symbolic zeros gets every tangent instantiated,
        # as JAX gives it (`jax.nn.softplus`'s rule multiplies them).
        if p.get("symbolic_zeros", False):
            zeros = tuple(is_zero_tangent(t) for t in ts)
        else:
            zeros = (False,) * len(ts)
        run_jvp, out_zeros = jvp_rule(zeros)
        ts = [
            values.tangent_in(x, instantiate_zero(t))
            for x, t, z in zip(xs, ts, zeros)
            if not z
        ]
        outs = run_jvp([*xs, *ts])
        primal_outs, nz_tangents = outs[: len(out_zeros)], iter(outs[len(out_zeros) :])
        primal_outs = [interp.coerce(v, t) for v, t in zip(primal_outs, out_types)]
        tangent_outs = []
        for z, t, y in zip(out_zeros, out_types, primal_outs):
            tangent = None if z else next(nz_tangents)
            if z or not jnp.issubdtype(t.dtype, jnp.inexact):
                # An integer or boolean output's tangent is float0, as JAX wants.
                tangent_outs.append(_zero_tangent(t))
            else:
                tangent = values.tangent_out(y, tangent)
                tangent_outs.append(interp.coerce(tangent, type_of(y)))
        return primal_outs, tangent_outs

    fn.defjvp(fn_jvp, symbolic_zeros=True)
    return list(fn(*primals))


def _custom_vjp_rule(interp, eqn: Eqn, *args):
    p, values = eqn.params, interp.values
    n = p["num_consts"]
    consts, primals = args[:n], args[n:]
    call_jaxpr = p["call_jaxpr"]
    run = _sub(interp, call_jaxpr, eqn.scopes)

    @_lazy
    def fwd_rule(perturbed):  # traced when differentiated, for those inputs
        fwd_jaxpr, res_forwards, bwd = _compat.custom_vjp_rule_parts(
            p, len(primals), perturbed
        )
        n_res_out = len(fwd_jaxpr.out_avals) - len(call_jaxpr.out_avals)
        run_fwd = _sub(interp, fwd_jaxpr, eqn.scopes)
        return run_fwd, fwd_jaxpr, n_res_out, res_forwards, bwd

    @_lazy
    def bwd_rule(perturbed):
        # Trace the user's backward rule at the original types (as the forward was),
        # then interpret that jaxpr on whatever types the transformed forward made.
        # A residual the forward computes as a constant (Equinox saves which inputs
        # were perturbed as Python bools, which its backward branches on) is given
        # to the rule as that value, as JAX gives it, not as an abstract array.
        _, fwd_jaxpr, n_res_out, res_forwards, bwd = fwd_rule(perturbed)
        orig_primals = call_jaxpr.in_avals[n:]
        known = dict(zip(fwd_jaxpr.jaxpr.constvars, fwd_jaxpr.consts))
        res_avals, constant = [], []
        fwd_res = iter(zip(fwd_jaxpr.out_avals, fwd_jaxpr.jaxpr.outvars))
        for i in res_forwards:
            if i is not None:
                res_avals.append(orig_primals[i])
                constant.append(None)
                continue
            aval, var = next(fwd_res)
            res_avals.append(aval)
            value = var.val if isinstance(var, _compat.Literal) else known.get(var)
            if value is None or np.ndim(value) != 0:
                constant.append(None)
            elif aval.dtype == bool:  # a Python bool, as a filter spec needs
                constant.append(bool(value))
            else:
                constant.append(np.asarray(value, aval.dtype))
        traced = [c is None for c in constant]

        def rule(*args):
            args, res = iter(args), []
            for c in constant:
                res.append(next(args) if c is None else c)
            return _instantiate(bwd(*res, *args), orig_primals)

        avals = [a for a, t in zip(res_avals, traced) if t] + call_jaxpr.out_avals
        bwd_closed = jax.make_jaxpr(rule)(*map(_struct, avals))
        return _sub(interp, bwd_closed, eqn.scopes), traced

    in_types = [type_of(x) for x in primals]
    primal, out_types = trace_once(lambda *xs: run([*consts, *xs]), *in_types)

    @jax.custom_vjp
    def fn(*xs):
        return primal(*xs)

    def fn_fwd(*primal_args):  # `CustomVJPPrimal`s: values and whether perturbed
        xs = [primal_value(x) for x in primal_args]
        perturbed = tuple(is_perturbed(x) for x in primal_args)
        run_fwd, _, n_res_out, res_forwards, _ = fwd_rule(perturbed)
        outs = run_fwd(xs)
        res_out, primal_outs = iter(outs[:n_res_out]), outs[n_res_out:]
        res = [xs[i] if i is not None else next(res_out) for i in res_forwards]
        primal_outs = [interp.coerce(v, t) for v, t in zip(primal_outs, out_types)]
        return primal_outs, (res, values.vjp_saved(xs, primal_outs), perturbed)

    def fn_bwd(saved, cts):
        res, extra, perturbed = saved
        cts = [instantiate_zero(c) for c in cts]
        run_bwd, traced = bwd_rule(perturbed)
        res = [r for r, t in zip(res, traced) if t]
        cts_in = run_bwd([*res, *values.cotangents_in(extra, cts)])
        cts_in = values.cotangents_out(extra, cts_in)
        return tuple(interp.coerce(c, t) for c, t in zip(cts_in, in_types, strict=True))

    # Symbolic zeros: the forward learns which inputs are perturbed, as the user's
    # rule does when JAX calls it (Equinox's `filter_custom_vjp` checks that its
    # non-differentiable inputs are not).
    fn.defvjp(fn_fwd, fn_bwd, symbolic_zeros=True)
    return list(fn(*primals))


def _struct(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _is_primal(leaf) -> bool:
    return isinstance(leaf, CustomVJPPrimal)


def primal_value(x):
    """The value of a `custom_vjp` forward rule's input under symbolic zeros: a
    `CustomVJPPrimal`, or a pytree of them (a `ScaledArray` under `scalify`)."""
    return jax.tree.map(lambda p: p.value, x, is_leaf=_is_primal)


def is_perturbed(x) -> bool:
    """Whether JAX differentiates that input (any of its leaves)."""
    return any(p.perturbed for p in jax.tree.leaves(x, is_leaf=_is_primal))


def is_zero_tangent(t) -> bool:
    """Whether a tangent (or each leaf of a pytree tangent) is a symbolic zero."""
    leaves = jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, SymbolicZero))
    return all(isinstance(x, SymbolicZero) for x in leaves)


def instantiate_zero(ct):
    """A cotangent or tangent with its symbolic zeros as arrays of their type
    (float0 for integers); a pytree's leaves each."""
    return jax.tree.map(_zero_array, ct, is_leaf=lambda x: isinstance(x, SymbolicZero))


def _zero_array(ct):
    if not isinstance(ct, SymbolicZero):
        return ct
    if ct.dtype == dtypes.float0:
        return np.zeros(ct.shape, dtypes.float0)
    return jnp.zeros(ct.shape, ct.dtype)


def _zero_tangent(type_):
    # A zero tangent for a value of `type_`: float0 for integers and booleans.
    if jnp.issubdtype(type_.dtype, jnp.inexact):
        return jnp.zeros(type_.shape, type_.dtype)
    return np.zeros(type_.shape, dtypes.float0)


def _instantiate(cts, avals):
    return [
        jnp.zeros(a.shape, a.dtype) if c is None else c
        for c, a in zip(cts, avals, strict=True)
    ]


def _custom_vmap_rule(interp, eqn: Eqn, *args):
    # `jax.custom_batching.custom_vmap`, not under `jax.vmap` (which applies the rule
    # as it traces): its body, inlined. The custom batching rule is not kept (it is
    # written for the body as traced, and a transform may change its dtypes), so
    # `jax.vmap` goes inside a transformed function, not around it.
    return interp.eval_jaxpr(
        _compat.custom_vmap_body(eqn.params), args, eqn.scopes, memo=eqn.memo
    )


# Maps each higher-order primitive to its rule (see the module docstring).
RULES = {
    _compat.jit_p: _jit_rule,
    _compat.remat_p: _remat_rule,
    _compat.scan_p: _scan_rule,
    _compat.while_p: _while_rule,
    _compat.cond_p: _cond_rule,
    _compat.custom_jvp_call_p: _custom_jvp_rule,
    _compat.custom_vjp_call_p: _custom_vjp_rule,
    _compat.custom_vmap_p: _custom_vmap_rule,
}
