"""`unit_scale`: unit scaling as a jaxpr transform on the interpreter core.

The program is traced as written (N(0, 1) weights, `jax.nn` nonlinearities, a mean
loss) and each equation is re-run with unit-scaling's forward and backward scales:

- `dot_general`: output times `K**-0.5` (K the contracted size), an operand's
  gradient times `N**-0.5` (N the other operand's free size: fan-out for an
  activation, the batch for a weight); inside the residual part of the network the
  output scale and the activation gradients' scales are tied by `constraint`
  (gmean by default), a weight's is free (it leaves the graph).
- residual adds (an `add` one of whose operands depends on the other: found by
  dependency analysis of the jaxpr, as the paper does on its graph) become
  `U.residual_split` / `U.residual_add`.
- `jax.nn.relu`, `silu`, `gelu` (the jitted ones, found by name) get the scales that
  keep unit-normal inputs unit (`U.relu_scales`-style constants computed once).
- after the last residual add (everything, in a network without one) no constraint
  applies; in the loss head (what follows the last matmul) a multiplication or
  division by a constant (the `1/N` of a mean loss), the `n` of `x**n`, and the
  gather that picks the label's log-probability scale only the forward value, so
  the gradient flowing back from the loss is unit.
- inlined nonlinearities of the form `p(v) * q(v)` (GELU, in either of `jax.nn.gelu`'s
  forms) are found in the jaxpr and get the same unit gains, computed by quadrature
  of the function the equations compute.

Gradients in the unconstrained part differ from the true ones by a constant factor
per parameter, which Adam-style optimizers do not see (they are scale invariant);
SGD sees it as a per-parameter learning-rate change.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .._context import trace_key
from .._eqn import Eqn, is_float
from .._interpret import FlatCall, Interpreter, write_back
from . import constraints as _constraints
from ._scale import scale_bwd, scale_fwd

# Forward and backward scales that keep a unit-normal input unit for the jitted
# `jax.nn` nonlinearities: 1 / RMS(f(x)) and 1 / RMS(f'(x)), x ~ N(0, 1), by
# numerical integration once (`_unit_gain`).
_NONLINEARITIES = {"relu": jax.nn.relu, "silu": jax.nn.silu, "gelu": jax.nn.gelu}


@functools.cache
def _unit_gain(name: str) -> tuple[float, float]:
    return _gains(_NONLINEARITIES[name])


_LAYER_OPS = ("dot_general", "conv_general_dilated")
# Ops a nonlinearity such as GELU is made of, in the jaxpr (jax.nn.gelu is inlined).
_ELEMENTWISE = {
    "mul", "add", "sub", "div", "neg", "tanh", "erf", "erfc", "logistic", "exp",
    "integer_pow", "sqrt", "rsqrt", "max", "min", "abs", "copy", "log1p", "expm1",
}  # fmt: skip
_NONLINEAR = {"tanh", "erf", "erfc", "logistic", "exp", "integer_pow", "max", "min"}


def _gains(fn: Callable) -> tuple[float, float]:
    """`(1 / RMS(f(x)), 1 / RMS(f'(x)))` for x ~ N(0, 1), by quadrature."""
    with jax.ensure_compile_time_eval():  # constants, even when called in a trace
        x = jnp.linspace(-8.0, 8.0, 16001)
        density = jnp.exp(-0.5 * x**2) / math.sqrt(2 * math.pi)
        dx = float(x[1] - x[0])
        y, dy = jax.jvp(fn, (x,), (jnp.ones_like(x),))
        fwd = float(jnp.sum(y**2 * density) * dx) ** -0.5
        bwd = float(jnp.sum(dy**2 * density) * dx) ** -0.5
    return fwd, bwd


def _island_fn(v, eqns, out) -> Callable:
    """The elementwise function `out(v)` that `eqns` compute."""

    def fn(x):
        env = {v: x}
        for e in eqns:
            args = [a.val if _is_literal(a) else env[a] for a in e.invars]
            res = e.primitive.bind(*args, **e.params)
            env[e.outvars[0]] = res
        return env[out]

    return fn


class _Plan:
    """The dataflow facts of one jaxpr that the rules need."""

    def __init__(self, jaxpr):
        deps: dict = {}
        for e in jaxpr.eqns:
            inputs = {v for v in e.invars if not _is_literal(v)}
            below = set(inputs)
            for v in inputs:
                below |= deps.get(v, set())
            for v in e.outvars:
                deps[v] = below
        self.leaves = set(jaxpr.invars) | set(jaxpr.constvars)
        layers = {  # outputs of the ops that make a residual branch a layer
            e.outvars[0] for e in jaxpr.eqns if e.primitive.name in _LAYER_OPS
        }
        self.residual_adds: dict = {}  # add's outvar -> (residual var, skip var)
        for e in jaxpr.eqns:
            if e.primitive.name != "add" or any(_is_literal(v) for v in e.invars):
                continue
            a, b = e.invars
            for residual, skip in ((b, a), (a, b)):
                # `skip + f(skip)` where f holds a matmul: a residual add (an add
                # inside GELU's formula, `x + c * x**3`, is not one).
                branch = deps.get(residual, set()) | {residual}
                if any(skip in deps.get(v, ()) for v in branch & layers):
                    self.residual_adds[e.outvars[0]] = (residual, skip)
                    break
        self.gates = self._find_gates(jaxpr, deps)
        # The loss head: what no layer depends on (after the last matmul).
        feeds_layers = set().union(*(deps.get(v, set()) for v in layers))
        self.head = {
            e.outvars[0]
            for e in jaxpr.eqns
            if e.outvars and e.outvars[0] not in feeds_layers | layers
        }
        # Vars the residual adds depend on: the constrained part of the network.
        self.constrained = set()
        self.branch_of = {}  # skip var -> the vars of its residual branch
        for out, (residual, skip) in self.residual_adds.items():
            self.constrained |= deps.get(out, set()) | {out}
            self.branch_of[skip] = deps.get(residual, set()) | {residual}
        self.deps = deps

    @staticmethod
    def _find_gates(jaxpr, deps) -> dict:
        """Inlined nonlinearities of the form `p(v) * q(v)` (GELU: `0.5 v *
        erfc(-v / sqrt(2))`, or `v * 0.5 (1 + tanh(...))`): the `mul`'s outvar ->
        the gains of the elementwise function of `v` that it computes."""
        producer = {e.outvars[0]: (i, e) for i, e in enumerate(jaxpr.eqns)}

        def island(w, found):  # the elementwise eqns from the root up to `w`
            if _is_literal(w):
                return set()
            entry = producer.get(w)
            if entry is None or entry[1].primitive.name not in _ELEMENTWISE:
                found.add(w)
                return set()
            eqns = {entry[0]}
            for a in entry[1].invars:
                eqns |= island(a, found)
            return eqns

        gates = {}
        for e in jaxpr.eqns:
            if e.primitive.name != "mul" or any(_is_literal(a) for a in e.invars):
                continue
            roots: set = set()
            eqns = island(e.outvars[0], roots)
            if len(roots) != 1 or len(eqns) > 16:
                continue
            chain = [jaxpr.eqns[i] for i in sorted(eqns)]
            if not any(c.primitive.name in _NONLINEAR for c in chain):
                continue
            (root,) = roots
            if root.aval.shape != e.outvars[0].aval.shape:
                continue
            gates[e.outvars[0]] = _gains(_island_fn(root, chain, e.outvars[0]))
        return gates

    def activation(self, var) -> bool:
        """`var` is computed from something other than leaves (params, inputs)."""
        return not _is_literal(var) and not (self.deps.get(var, {var}) <= self.leaves)


def _is_literal(v) -> bool:
    return not hasattr(v, "count") and hasattr(v, "val")


class _UnitScaleInterpreter(Interpreter):
    def __init__(self, constraint):
        self.constraint = constraint
        self.plans: dict = {}  # var -> its jaxpr's _Plan

    def eval_jaxpr(self, closed, args, scopes=(), consts=None, memo=None):
        plan = _Plan(closed.jaxpr)
        for e in closed.jaxpr.eqns:
            for v in (*e.invars, *e.outvars):
                if not _is_literal(v):
                    self.plans[v] = plan
        return super().eval_jaxpr(closed, args, scopes, consts, memo)

    def _plan(self, eqn: Eqn) -> _Plan | None:
        for v in (*eqn.outvars, *eqn.invars):
            if v in self.plans:
                return self.plans[v]
        return None

    def _split_inputs(self, eqn: Eqn, invals: list) -> list:
        # A skip var read on a residual branch reads the branch half of its split.
        plan = self._plan(eqn)
        if plan is None or not plan.branch_of:
            return invals
        from . import functional as U

        out = list(invals)
        for i, v in enumerate(eqn.invars):
            branch = None if _is_literal(v) else plan.branch_of.get(v)
            if branch is not None and any(o in branch for o in eqn.outvars):
                key = ("split", v)
                if key not in eqn.memo:
                    eqn.memo[key] = U.residual_split(invals[i])
                out[i] = eqn.memo[key][0]
        return out

    def rule(self, eqn: Eqn, *invals) -> list:
        invals = self._split_inputs(eqn, list(invals))
        plan = self._plan(eqn)
        name = eqn.primitive.name
        constrained = plan is not None and eqn.outvars[0] in plan.constrained
        if plan is not None and eqn.outvars[0] in plan.residual_adds:
            residual_var, skip_var = plan.residual_adds[eqn.outvars[0]]
            vals = dict(zip(eqn.invars, invals))
            split = eqn.memo.get(("split", skip_var))
            skip = vals[skip_var] if split is None else split[1]
            from . import functional as U

            return [U.residual_add(vals[residual_var], skip)]
        if name == "dot_general":
            return [self._dot(eqn, plan, constrained, *invals)]
        if plan is not None and eqn.outvars[0] in plan.gates:
            return [
                self._nonlinear(plan.gates[eqn.outvars[0]], constrained, eqn, invals)
            ]
        if not constrained and plan is not None and eqn.outvars[0] in plan.head:
            return self._head(eqn, plan, *invals)
        return eqn.bind(*invals)

    def _head(self, eqn: Eqn, plan, *invals) -> list:
        # After the last matmul (the loss): scales need not be tied, so the backward
        # pass is made unit where the forward's constants shrink it.
        name, const = eqn.primitive.name, _constant_operand(eqn)
        if name in ("mul", "div") and const is not None:
            return [self._forward_only(eqn, const, *invals)]
        if name == "integer_pow" and eqn.params["y"] > 1:
            # d(x**n) = n x**(n-1) dx: the `n` is a constant, not a scale to keep.
            x = scale_bwd(invals[0], 1 / eqn.params["y"])
            return eqn.bind(x, *invals[1:])
        if name == "gather" and plan is not None and plan.activation(eqn.invars[0]):
            # Picking `m` of `n` entries (the label's log-probability) scatters the
            # gradient into `n`: its RMS falls by sqrt(n / m); put that back.
            n, m = eqn.in_avals[0].size, eqn.out_avals[0].size
            x = scale_bwd(invals[0], (n / m) ** 0.5) if n > m else invals[0]
            return eqn.bind(x, *invals[1:])
        return eqn.bind(*invals)

    def _dot(self, eqn: Eqn, plan, constrained, lhs, rhs):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        la, ra = eqn.in_avals
        k = math.prod(la.shape[d] for d in lc)
        lhs_free = la.size // (k * math.prod(la.shape[d] for d in lb))
        rhs_free = ra.size // (k * math.prod(ra.shape[d] for d in rb))
        out_scale = k**-0.5
        # An operand's gradient sums the cotangent over the other's free size: the
        # fan-out for an activation, the batch (all leading axes) for a weight.
        grad = [rhs_free**-0.5, lhs_free**-0.5]
        tied = [
            constrained and plan is not None and plan.activation(v) for v in eqn.invars
        ]
        if any(tied) and self.constraint is not None:
            picked = [out_scale, *(g for g, t in zip(grad, tied) if t)]
            out_scale = _constraints.apply(self.constraint, *picked)[0]
            grad = [out_scale if t else g for g, t in zip(grad, tied)]
        lhs, rhs = scale_bwd(lhs, grad[0]), scale_bwd(rhs, grad[1])
        return scale_fwd(eqn.bind(lhs, rhs)[0], out_scale)

    def _forward_only(self, eqn: Eqn, const: int, *invals):
        # `x * c`, `c * x` or `x / c` by a constant `c`: the value as written, the
        # gradient of `x` unscaled (so a mean loss passes a unit cotangent back).
        x, c = invals[1 - const], invals[const]
        factor = c if eqn.primitive.name == "mul" else 1 / c
        x = scale_bwd(x, 1 / jnp.asarray(factor, x.dtype))
        args = [x, c] if const == 1 else [c, x]
        return eqn.bind(*args)[0]

    def _nonlinear(self, gains, constrained, eqn, invals):
        # Forward: `fwd * f(x)`; backward: the cotangent times `bwd` before f', so
        # a unit-normal `x` and a unit cotangent stay unit (tied if constrained).
        fwd, bwd = gains
        if constrained and self.constraint is not None:
            fwd = bwd = _constraints.apply(self.constraint, fwd, bwd)[0]
        (out,) = (
            eqn.bind(*invals)
            if eqn.primitive.name != "jit"
            else (super().higher_order(eqn, *invals))
        )
        return scale_fwd(scale_bwd(out, bwd), fwd)

    def higher_order(self, eqn: Eqn, *invals) -> list:
        name = eqn.params.get("name")
        if eqn.primitive.name == "jit" and name in _NONLINEARITIES and len(invals) == 1:
            plan = self._plan(eqn)
            constrained = plan is not None and eqn.outvars[0] in plan.constrained
            return [self._nonlinear(_unit_gain(name), constrained, eqn, invals)]
        return super().higher_order(eqn, *invals)

    def join(self, types):
        return types[0]

    def coerce(self, value, type_):
        if is_float(value) and is_float(type_) and value.dtype != type_.dtype:
            return value.astype(type_.dtype)
        return value


def _constant_operand(eqn: Eqn) -> int | None:
    """The position of a float scalar constant operand (`c` in `x * c`, `c * x`,
    `x / c`) of a binary op on a float array, or None."""
    if len(eqn.in_avals) != 2 or not all(is_float(a) for a in eqn.in_avals):
        return None
    scalar = [a.shape == () and w for a, w in zip(eqn.in_avals, eqn.weak)]
    if scalar == [False, True]:
        return 1
    if scalar == [True, False] and eqn.primitive.name == "mul":
        return 0
    return None


class _Inline(Interpreter):
    """The program as written, with inner jits inlined (but the nonlinearities,
    which `_UnitScaleInterpreter` finds by name): one jaxpr to analyse."""

    def rule(self, eqn: Eqn, *invals) -> list:
        return eqn.bind(*invals)

    def higher_order(self, eqn: Eqn, *invals) -> list:
        if eqn.primitive.name == "jit" and eqn.params.get("name") in _NONLINEARITIES:
            return eqn.bind(*invals)
        return super().higher_order(eqn, *invals)

    def join(self, types):
        return types[0]

    def coerce(self, value, type_):
        return value


@eqx.filter_jit
def _unit_scale_call(fn, constraint, args, kwargs, settings=()):
    call = FlatCall(fn, args, kwargs)
    closed = jax.make_jaxpr(call)(*call.inputs)
    flat = jax.make_jaxpr(lambda *xs: _Inline().eval_jaxpr(closed, list(xs)))(
        *call.inputs
    )
    outs = _UnitScaleInterpreter(constraint).eval_jaxpr(flat, call.inputs)
    return call.rebuild(outs), call.updates


class _UnitScale(eqx.Module):
    fn: Callable
    constraint: Callable | None = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fn

    def __call__(self, *args, **kwargs):
        out, updates = _unit_scale_call(
            self.fn, self.constraint, args, kwargs, trace_key()
        )
        # Flax NNX state the call changed in place, set on the caller's objects.
        write_back((self.fn, args, kwargs), updates)
        return out


def unit_scale(fn: Callable, *, constraint=_constraints.gmean) -> Callable:
    """`fn` unit-scaled: the one-line transform (see the module docstring).

    Returns an `eqx.Module` wrapping `fn` (its `__wrapped__`), called as `fn` is.

    **Arguments:**

    - `fn`: the function or callable module to transform, traced with the
      arguments of each call (a non-callable raises `TypeError`).
    - `constraint`: keyword-only; in the residual part of the network, ties each
      matmul's output scale to its activation operands' gradient scales, and each
      nonlinearity's forward scale to its backward one (default `gmean`; a
      function of `lowtrain.unit_scaling.constraints`); None leaves them apart.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    def loss(ws, x, y):  # a plain MLP with N(0, 1) weights: badly scaled
        for w in ws[:-1]:
            x = jax.nn.relu(x @ w)
        return jnp.mean((x @ ws[-1] - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 3)
    ws = [jax.random.normal(k, (256, 256)) for k in keys]
    x, y = jax.random.normal(keys[0], (64, 256)), jnp.zeros((64, 256))
    grads = jax.grad(uu.unit_scale(loss))(ws, x, y)
    rms = [float(jnp.sqrt(jnp.mean(g**2))) for g in grads]
    assert all(0.25 <= r <= 4 for r in rms)
    ```
    """
    if not callable(fn):
        raise TypeError(f"Expected a function or callable module, got {fn!r} instead.")
    return _UnitScale(fn, constraint)
