"""The interpreter core shared by `lowtrain.amp` and `lowtrain.scalify`.

An `Interpreter` evaluates a closed jaxpr equation by equation. First-order primitives
go to the subclass's `rule` method; higher-order primitives (jit, scan, while, cond,
remat, custom_jvp, custom_vjp) go to the rules registered here, which transform their
sub-jaxprs with the same interpreter and rebuild the higher-order op through JAX's
public API (`lax.scan`, `jax.checkpoint`, `jax.custom_vjp`, ...; inner jits are
inlined). A custom derivative
therefore stays custom: its rule is itself interpreted.

A subclass supplies three things:
- `rule(eqn, *invals)`: evaluate one first-order equation on interpreter values;
- `join(types)`: the common type of several values that must agree (the outputs of the
  branches of a `cond`, or a loop carry before and after one iteration);
- `coerce(value, type)`: turn a value into that type.
Values may be arrays or pytrees of arrays (a `ScaledArray`); a "type" is whatever
`jax.eval_shape` returns for a value (a pytree of `jax.ShapeDtypeStruct`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat

# The scatter primitives by name, and the public functions that rebuild them: their
# combiner jaxpr is typed for the traced dtype, so a rule that changes dtypes calls
# these (which trace a combiner for the new one) instead of binding.
SCATTERS = {
    "scatter": lax.scatter,
    "scatter-add": lax.scatter_add,
    "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min,
    "scatter-max": lax.scatter_max,
}

# Maps a higher-order primitive to `rule(interpreter, eqn, *invals) -> list of outvals`.
# Filled with `register_higher_order`; registering a primitive twice is an error.
HIGHER_ORDER_RULES: dict[_compat.Primitive, Callable[..., list]] = {}


@dataclasses.dataclass(frozen=True)
class Eqn:
    """What a rule sees of one equation.

    `in_avals`/`out_avals` are the types the equation was traced with (the original
    program); `weak[i]` says input `i` is a scalar constant or weakly typed (a Python
    scalar such as the `2.0` in `x * 2.0`; jaxpr literals lose their weak type, so
    every literal counts); `scopes` is the full `jax.named_scope` path, outermost first,
    including the
    scopes of the higher-order ops that contain it.
    """

    primitive: _compat.Primitive
    params: dict[str, Any]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    weak: tuple[bool, ...]
    scopes: tuple[str, ...]
    # Shared by the equations of one jaxpr evaluation (one trace): rules may cache
    # derived values here, such as the one float32 copy of a float16 input that three
    # ops use (so its cotangents are summed once, in float32).
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def bind(self, *args, **params):
        """Bind this equation's primitive on `args`, its params updated by `params`."""
        out = self.primitive.bind(*args, **{**self.params, **params})
        return list(out) if self.primitive.multiple_results else [out]


def register_higher_order(primitive: _compat.Primitive):
    """Decorator registering the interpreter rule of a higher-order primitive."""

    def register(rule):
        if primitive in HIGHER_ORDER_RULES:
            raise ValueError(
                f"A higher-order rule for `{primitive}` is already registered; "
                "registering a second one would silently replace it."
            )
        HIGHER_ORDER_RULES[primitive] = rule
        return rule

    return register


class Interpreter:
    """Evaluates closed jaxprs under a table of rules. Subclass it (see module doc)."""

    def rule(self, eqn: Eqn, *invals) -> list:
        raise NotImplementedError

    def join(self, types: Sequence[Any]) -> Any:
        raise NotImplementedError

    def coerce(self, value: Any, type_: Any) -> Any:
        raise NotImplementedError

    # -- hooks for values that are pytrees (a `ScaledArray`); the defaults suit arrays.

    def scan_split(self, value: Any) -> tuple[Any, Any]:
        """Split a value scanned over (or stacked by) `lax.scan` into (the part that has
        the scanned axis, the part that does not)."""
        return value, None

    def scan_merge(self, sliced: Any, rest: Any) -> Any:
        """Inverse of `scan_split` for one step's slice."""
        return sliced

    def scan_output(self, value: Any) -> Any:
        """A value as one step's output of a `lax.scan`, before `scan_split`."""
        return value

    def scan_stacked(self, stacked: Any, rests: Any) -> Any:
        """A value from the outputs stacked by `lax.scan`: `stacked` has the scanned
        axis, `rests` are the per-step rests of `scan_split`, stacked too."""
        return stacked

    def tangent_in(self, primal: Any, tangent: Any) -> Any:
        """JAX's tangent (a pytree like `primal`) as an interpreter value."""
        return tangent

    def tangent_out(self, primal: Any, tangent: Any) -> Any:
        """An interpreter value as JAX's tangent of `primal` (a pytree like it)."""
        return self.coerce(tangent, _type_of(primal))

    def vjp_saved(self, primals: Sequence[Any], outs: Sequence[Any]) -> Any:
        """What `cotangents_in`/`cotangents_out` need, saved by a custom_vjp forward."""
        return None

    def cotangents_in(self, saved: Any, cts: Sequence[Any]) -> list:
        """JAX's cotangents of the outputs as interpreter values."""
        return list(cts)

    def cotangents_out(self, saved: Any, cts: Sequence[Any], types: Sequence[Any]):
        """Interpreter values as JAX's cotangents of the inputs (of types `types`)."""
        return [self.coerce(c, t) for c, t in zip(cts, types)]

    def unsupported(self, eqn: Eqn, *invals) -> list:
        """Called for a higher-order primitive with no registered rule."""
        raise NotImplementedError(
            f"lowtrain cannot transform the higher-order primitive `{eqn.primitive}`: "
            "it holds sub-jaxprs and no rule is registered for it. Wrap the call in "
            "`lowtrain.amp_stop` to run it unchanged in the precision it was written "
            "in, or register a rule with `lowtrain._interpret.register_higher_order`."
        )

    def eval_jaxpr(
        self,
        closed: _compat.ClosedJaxpr,
        args: Sequence[Any],
        scopes: tuple[str, ...] = (),
        consts: Sequence[Any] | None = None,
        memo: dict | None = None,
    ) -> list:
        """Evaluate `closed` on `args` (one value per invar) and return its outputs.

        `consts` replaces the jaxpr's own constants when given; `memo` is shared with
        the caller's equations when given (an inlined sub-jaxpr, same trace).
        """
        jaxpr = closed.jaxpr
        if len(args) != len(jaxpr.invars):
            raise ValueError(
                f"Expected {len(jaxpr.invars)} arguments for this jaxpr, "
                f"got {len(args)} instead."
            )
        env: dict[_compat.Var, Any] = {}
        memo = {} if memo is None else memo
        # Weakly typed variables: literals, and first-order results computed from weak
        # float inputs only (`broadcast_in_dim 0.0` is as weak as the `0.0`).
        weak_vars: set[_compat.Var] = set()

        def read(atom):
            return atom.val if isinstance(atom, _compat.Literal) else env[atom]

        def is_weak(atom):
            return (
                isinstance(atom, _compat.Literal)
                or atom in weak_vars
                or getattr(atom.aval, "weak_type", False)
            )

        env.update(zip(jaxpr.constvars, closed.consts if consts is None else consts))
        env.update(zip(jaxpr.invars, args))
        for jeqn in jaxpr.eqns:
            inner = scopes + _compat.eqn_scopes(jeqn)
            eqn = Eqn(
                jeqn.primitive,
                dict(jeqn.params),
                tuple(v.aval for v in jeqn.invars),
                tuple(v.aval for v in jeqn.outvars),
                tuple(is_weak(v) for v in jeqn.invars),
                inner,
                memo,
            )
            float_weak = [w for w, a in zip(eqn.weak, eqn.in_avals) if _is_float(a)]
            if (
                float_weak
                and all(float_weak)
                and jeqn.primitive not in HIGHER_ORDER_RULES
            ):
                weak_vars.update(jeqn.outvars)
            invals = [read(v) for v in jeqn.invars]
            with _named_scopes(_compat.eqn_scopes(jeqn)):
                if jeqn.primitive in HIGHER_ORDER_RULES:
                    outvals = HIGHER_ORDER_RULES[jeqn.primitive](self, eqn, *invals)
                elif jeqn.primitive.name not in _compat.COMBINER_PRIMITIVES and any(
                    True for _ in _compat.jaxprs_in_params(jeqn.params)
                ):
                    outvals = self.unsupported(eqn, *invals)
                else:
                    outvals = self.rule(eqn, *invals)
            if len(outvals) != len(jeqn.outvars):
                raise RuntimeError(
                    f"The rule for `{jeqn.primitive}` returned {len(outvals)} outputs, "
                    f"expected {len(jeqn.outvars)}."
                )
            env.update(zip(jeqn.outvars, outvals))
        return [read(v) for v in jaxpr.outvars]

    def fix_types(self, step: Callable, init: Sequence[Any], *extra: Any) -> list:
        """Types of a loop carry that one more iteration of `step` leaves unchanged.

        Starts from the types of `init`, joins them with what `step` returns, and
        repeats until they stop changing: a carry entered in float16 whose body
        produces float32 is carried in float32.
        """
        types = [_type_of(v) for v in init]
        for _ in range(4):
            outs = jax.eval_shape(step, types, *extra)
            new = [self.join([t, o]) for t, o in zip(types, outs)]
            if _same_types(new, types):
                return types
            types = new
        raise RuntimeError(
            f"The loop carry types did not settle: {types}. Please report this."
        )


def _is_float(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _same_types(a, b) -> bool:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(leaves_a, leaves_b)
    )


@contextlib.contextmanager
def _named_scopes(names: tuple[str, ...]):
    # Re-enter the equation's scopes so the transformed program keeps its name stack
    # (and a second transform, or a profiler, still sees "eqx.nn.Linear" and friends).
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(jax.named_scope(name))
        yield


def _sub(interp: Interpreter, closed, scopes):
    return functools.partial(interp.eval_jaxpr, closed, scopes=scopes)


@register_higher_order(_compat.jit_p)
def _jit_rule(interp: Interpreter, eqn: Eqn, *args):
    # Inlined, in the same trace and sharing its memo: a value used inside and outside
    # an inner jit (jnp.var is one) is cast once. The outer program is jitted anyway,
    # and XLA inlines nested jits, so nothing is lost.
    return interp.eval_jaxpr(eqn.params["jaxpr"], args, eqn.scopes, memo=eqn.memo)


@register_higher_order(_compat.remat_p)
def _remat_rule(interp: Interpreter, eqn: Eqn, *args):
    run = _sub(interp, _compat.ClosedJaxpr(eqn.params["jaxpr"], ()), eqn.scopes)
    fn = jax.checkpoint(
        lambda *xs: run(xs),
        prevent_cse=eqn.params["prevent_cse"],
        policy=eqn.params["policy"],
    )
    return list(fn(*args))


@register_higher_order(_compat.scan_p)
def _scan_rule(interp: Interpreter, eqn: Eqn, *args):
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, init, xs = (
        args[:n_consts],
        args[n_consts : n_consts + n_carry],
        args[n_consts + n_carry :],
    )
    run = _sub(interp, p["jaxpr"], eqn.scopes)

    # Scanned inputs are split into the part with the scanned axis and the rest (the
    # scale of a `ScaledArray`), which is closed over.
    split = [interp.scan_split(x) for x in xs]
    sliced, rests = [s for s, _ in split], [r for _, r in split]

    def body(carry, x_slices):
        x = [interp.scan_merge(s, r) for s, r in zip(x_slices, rests)]
        outs = run([*consts, *carry, *x])
        return outs[:n_carry], outs[n_carry:]

    # One slice of each scanned input, to find the carry types abstractly.
    slice_types = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _type_of(s))
        for s in sliced
    ]
    types = interp.fix_types(lambda c, x: body(c, x)[0], init, slice_types)

    def typed_body(carry, x_slices):
        new, ys = body(carry, x_slices)
        return [interp.coerce(v, t) for v, t in zip(new, types)], [
            interp.scan_split(interp.scan_output(y)) for y in ys
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
    return [*carry, *(interp.scan_stacked(s, r) for s, r in ys)]


@register_higher_order(_compat.while_p)
def _while_rule(interp: Interpreter, eqn: Eqn, *args):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = args[:nc], args[nc : nc + nb], args[nc + nb :]
    run_cond = _sub(interp, p["cond_jaxpr"], eqn.scopes)
    run_body = _sub(interp, p["body_jaxpr"], eqn.scopes)

    def body(carry):
        return run_body([*body_consts, *carry])

    types = interp.fix_types(body, init)

    def typed_body(carry):
        return [interp.coerce(v, t) for v, t in zip(body(carry), types)]

    def cond(carry):
        (pred,) = run_cond([*cond_consts, *carry])
        return pred

    init = [interp.coerce(v, t) for v, t in zip(init, types)]
    return list(lax.while_loop(cond, typed_body, init))


@register_higher_order(_compat.cond_p)
def _cond_rule(interp: Interpreter, eqn: Eqn, index, *ops):
    runs = [_sub(interp, br, eqn.scopes) for br in eqn.params["branches"]]
    branch_types = [jax.eval_shape(lambda o, r=r: r(o), list(ops)) for r in runs]
    types = [interp.join(ts) for ts in zip(*branch_types)]

    def typed(run):
        return lambda *o: [interp.coerce(v, t) for v, t in zip(run(o), types)]

    return list(lax.switch(index, [typed(r) for r in runs], *ops))


@register_higher_order(_compat.custom_jvp_call_p)
def _custom_jvp_rule(interp: Interpreter, eqn: Eqn, *args):
    p = eqn.params
    n = p["num_consts"]
    consts, primals = args[:n], args[n:]
    run = _sub(interp, p["call_jaxpr"], eqn.scopes)
    jvp_jaxpr, out_zeros = _compat.custom_jvp_rule_jaxpr(p, len(primals))
    run_jvp = _sub(interp, jvp_jaxpr, eqn.scopes)

    @jax.custom_jvp
    def fn(*xs):
        return run([*consts, *xs])

    @fn.defjvp
    def fn_jvp(xs, ts):
        out_types = jax.eval_shape(lambda *a: run([*consts, *a]), *xs)
        ts = [interp.tangent_in(x, t) for x, t in zip(xs, ts)]
        outs = run_jvp([*xs, *ts])
        primal_outs, nz_tangents = outs[: len(out_zeros)], iter(outs[len(out_zeros) :])
        primal_outs = [interp.coerce(v, t) for v, t in zip(primal_outs, out_types)]
        tangent_outs = [
            _zeros_like(t) if z else interp.tangent_out(y, next(nz_tangents))
            for z, t, y in zip(out_zeros, out_types, primal_outs)
        ]
        return primal_outs, tangent_outs

    return list(fn(*primals))


@register_higher_order(_compat.custom_vjp_call_p)
def _custom_vjp_rule(interp: Interpreter, eqn: Eqn, *args):
    p = eqn.params
    n = p["num_consts"]
    consts, primals = args[:n], args[n:]
    call_jaxpr = p["call_jaxpr"]
    run = _sub(interp, call_jaxpr, eqn.scopes)
    fwd_jaxpr, res_forwards, bwd = _compat.custom_vjp_rule_parts(p, len(primals))
    run_fwd = _sub(interp, fwd_jaxpr, eqn.scopes)
    n_res_out = len(fwd_jaxpr.out_avals) - len(call_jaxpr.out_avals)
    # Trace the user's backward rule at the original types (as the forward was), then
    # interpret that jaxpr on whatever types the transformed forward produced.
    orig_primals = call_jaxpr.in_avals[n:]
    res_avals, fwd_res = [], iter(fwd_jaxpr.out_avals[:n_res_out])
    for i in res_forwards:
        res_avals.append(orig_primals[i] if i is not None else next(fwd_res))
    bwd_closed = jax.make_jaxpr(lambda *a: _instantiate(bwd(*a), orig_primals))(
        *map(_struct, [*res_avals, *call_jaxpr.out_avals])
    )
    run_bwd = _sub(interp, bwd_closed, eqn.scopes)

    in_types = [_type_of(x) for x in primals]
    out_types = jax.eval_shape(lambda *xs: run([*consts, *xs]), *primals)

    @jax.custom_vjp
    def fn(*xs):
        return run([*consts, *xs])

    def fn_fwd(*xs):
        outs = run_fwd(list(xs))
        res_out, primal_outs = iter(outs[:n_res_out]), outs[n_res_out:]
        res = [xs[i] if i is not None else next(res_out) for i in res_forwards]
        primal_outs = [interp.coerce(v, t) for v, t in zip(primal_outs, out_types)]
        return primal_outs, (res, interp.vjp_saved(xs, primal_outs))

    def fn_bwd(saved, cts):
        res, extra = saved
        cts_in = run_bwd([*res, *interp.cotangents_in(extra, cts)])
        return tuple(interp.cotangents_out(extra, cts_in, in_types))

    fn.defvjp(fn_fwd, fn_bwd)
    return list(fn(*primals))


def _type_of(value):
    return jax.eval_shape(lambda v: v, value)


def _struct(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _zeros_like(type_):
    return jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), type_)


def _instantiate(cts, avals):
    return [jnp.zeros(a.shape, a.dtype) if c is None else c for c, a in zip(cts, avals)]


def call_transformed(
    interp: Interpreter,
    fn: Callable[..., list],
    args: Sequence[Any],
    *,
    enter: Callable[[list], list] = lambda xs: xs,
    leave: Callable[[list], list] = lambda outs: outs,
    remat_policy: Callable | None = None,
) -> list:
    """Call the flat function `fn(*args) -> list of arrays` under `interp`, forward and
    backward.

    `fn` is traced at the types of `args` (the program as written); its jaxpr is
    evaluated by `interp` on `enter(args)` and the outputs go through `leave`.

    The backward pass is a program too, and `interp` transforms it like the forward
    one: under reverse-mode differentiation, JAX linearizes the transformed forward
    (so cotangents take the dtypes of their primals, and the residuals are those of
    the transformed ops), and the transposed program is traced into a jaxpr and
    evaluated by `interp`. So the rules place every backward op (the batch sum that
    makes a bias gradient is a `reduce_sum` like any other), and cotangents of `args`
    come back in the types of `args`. Supports `jax.grad`/`jax.vjp` (any order),
    `jax.vmap` and `jax.checkpoint`, but not forward-mode `jax.jvp`.

    `remat_policy` (a `jax.checkpoint` policy) chooses which forward values are saved
    for the backward pass; the others are recomputed there.

    The arrays `fn` closes over (its jaxpr's constants) are treated as inputs: passed
    through `enter` and differentiated, so `amp(lambda x: model(x))` differentiates the
    closed-over `model` too. Non-float inputs get no cotangent.
    """
    in_types = [_type_of(x) for x in args]
    closed = jax.make_jaxpr(fn)(*in_types)
    n_consts = len(closed.consts)
    all_types = [*map(_type_of, closed.consts), *in_types]
    vjp_tree: dict[str, Any] = {}

    def forward(*xs):
        xs = enter(list(xs))
        return leave(interp.eval_jaxpr(closed, xs[n_consts:], consts=xs[:n_consts]))

    @jax.custom_vjp
    def run(*xs):
        return forward(*xs)

    def run_fwd(*xs):
        # A `jax.checkpoint` policy, if given, chooses the residuals: what it does not
        # save is recomputed by the backward pass.
        fwd = (
            forward
            if remat_policy is None
            else jax.checkpoint(forward, policy=remat_policy)
        )
        outs, vjp = jax.vjp(fwd, *xs)
        res, vjp_tree["tree"] = jax.tree.flatten(vjp)
        return outs, res

    def run_bwd(res, cts):
        pullback = lambda r, c: jax.tree.unflatten(vjp_tree["tree"], r)(c)
        backward = jax.make_jaxpr(pullback)(res, list(cts))
        cts_in = interp.eval_jaxpr(backward, [*res, *cts])
        return tuple(
            interp.coerce(c, t) if _is_float(t) else None
            for c, t in zip(cts_in, all_types)
        )

    run.defvjp(run_fwd, run_bwd)
    return run(*closed.consts, *args)
