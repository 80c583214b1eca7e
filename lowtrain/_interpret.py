"""The interpreter core shared by `lowtrain.amp` and `lowtrain.scalify`.

An `Interpreter` evaluates a closed jaxpr equation by equation. First-order primitives
go to the subclass's `rule` method; higher-order primitives (jit, scan, while, cond,
remat, custom_jvp, custom_vjp) go to the rules of `lowtrain/_higher_order.py`, which
transform their sub-jaxprs with the same interpreter and rebuild the op through JAX's
public API (inner jits are inlined). A custom derivative therefore stays custom: its
rule is itself interpreted.

A subclass supplies:
- `rule(eqn, *invals)`: evaluate one first-order equation (`lowtrain._eqn.Eqn`) on
  interpreter values;
- `join(types)`: the common type of several values that must agree (the outputs of the
  branches of a `cond`, or a loop carry before and after one iteration);
- `coerce(value, type)`: turn a value into that type;
- `values`: a `lowtrain._eqn.Values` (the default suits values that are arrays; a
  transform whose values are pytrees, such as scalify's `ScaledArray`, gives its own);
- optionally `unsupported(eqn, *invals)`, for a higher-order primitive with no rule.
A "type" is whatever `jax.eval_shape` returns for a value (a pytree of
`jax.ShapeDtypeStruct`).

`call_transformed` runs a function under an interpreter forward *and* backward (the
backward pass is interpreted too); `amp` uses it. docs/architecture.md shows where
this sits among lowtrain's layers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from . import _compat
from ._eqn import Eqn, Values, is_float, same_types, type_of
from ._higher_order import RULES as HIGHER_ORDER_RULES
from ._higher_order import instantiate_zero, is_perturbed, primal_value, trace_once

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


class Interpreter:
    """Evaluates closed jaxprs under a table of rules. Subclass it (see module doc)."""

    values: Values = Values()

    def rule(self, eqn: Eqn, *invals) -> list:
        raise NotImplementedError

    def join(self, types: Sequence[Any]) -> Any:
        raise NotImplementedError

    def coerce(self, value: Any, type_: Any) -> Any:
        raise NotImplementedError

    def higher_order(self, eqn: Eqn, *invals) -> list:
        """Evaluate a higher-order equation: its rule in `_higher_order.py`. A
        subclass may handle some first (e.g. an inner jit by its `name`)."""
        return HIGHER_ORDER_RULES[eqn.primitive](self, eqn, *invals)

    def unsupported(self, eqn: Eqn, *invals) -> list:
        """Called for a higher-order primitive with no rule in `_higher_order.py`."""
        raise NotImplementedError(
            f"lowtrain cannot transform the higher-order primitive `{eqn.primitive}`: "
            "it holds sub-jaxprs that lowtrain has no rule to rebuild. Wrap the call "
            "in `lowtrain.amp_stop` to run it unchanged in the precision it was "
            "written in, and report the primitive to lowtrain's issue tracker."
        )

    def eval_jaxpr(
        self,
        closed: _compat.ClosedJaxpr,
        args: Sequence[Any],
        scopes: tuple[str, ...] = (),
        consts: Sequence[Any] | None = None,
        memo: dict | None = None,
        strong_inputs: bool = False,
    ) -> list:
        """Evaluate `closed` on `args` (one value per invar) and return its outputs.

        `consts` replaces the jaxpr's own constants when given; `memo` is shared with
        the caller's equations when given (an inlined sub-jaxpr, same trace).
        `strong_inputs`: the jaxpr's inputs and constants are never taken for scalar
        constants, whatever their weak type (a learnable `jnp.array(0.25)`).
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

        strong = set(jaxpr.invars) | set(jaxpr.constvars) if strong_inputs else set()

        def is_weak(atom):
            if isinstance(atom, _compat.Literal):
                return True
            return atom not in strong and (
                atom in weak_vars or getattr(atom.aval, "weak_type", False)
            )

        env.update(zip(jaxpr.constvars, closed.consts if consts is None else consts))
        env.update(zip(jaxpr.invars, args))
        for jeqn in jaxpr.eqns:
            eqn = Eqn(
                jeqn.primitive,
                dict(jeqn.params),
                tuple(v.aval for v in jeqn.invars),
                tuple(v.aval for v in jeqn.outvars),
                tuple(is_weak(v) for v in jeqn.invars),
                scopes + _compat.eqn_scopes(jeqn),
                tuple(jeqn.invars),
                tuple(jeqn.outvars),
                memo,
            )
            higher = HIGHER_ORDER_RULES.get(jeqn.primitive)
            float_weak = [w for w, a in zip(eqn.weak, eqn.in_avals) if is_float(a)]
            if float_weak and all(float_weak) and higher is None:
                weak_vars.update(jeqn.outvars)
            invals = [read(v) for v in jeqn.invars]
            # Re-enter the equation's name stack (scopes and transforms), so the
            # transformed program keeps it: a second transform, a profiler, or
            # `lowtrain.numerics` still sees "eqx.nn.Linear" and `transpose(...)`.
            with _compat.enter_name_stack(jeqn):
                if higher is not None:
                    # A literal carried by a loop or passed to a branch, or a bool
                    # or int one passed to a custom rule (a `True` in a while loop's
                    # carry), enters as an array of its type, as in JAX's own. A
                    # float literal elsewhere stays a Python value: a weak scalar
                    # (an FP8 op's static scale of 1.0 is one).
                    invals = [
                        jnp.asarray(x, v.aval.dtype)
                        if isinstance(v, _compat.Literal)
                        and (jeqn.primitive in _LOOPS or not is_float(v.aval))
                        else x
                        for v, x in zip(jeqn.invars, invals)
                    ]
                    outvals = self.higher_order(eqn, *invals)
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
        # An output may be a literal (a constant the program returns, such as a
        # `jnp.array(False)`): returned as an array of its type.
        return [
            jnp.asarray(v.val, v.aval.dtype)
            if isinstance(v, _compat.Literal)
            else env[v]
            for v in jaxpr.outvars
        ]

    def fix_types(
        self, step: Callable, init: Sequence[Any], *extra: Any
    ) -> tuple[list, Callable]:
        """Types of a loop carry that one more iteration of `step` leaves unchanged,
        and `step` traced at them.

        `step(carry, *extra) -> (new_carry, other_outputs)`. Starts from the types of
        `init`, joins them with the new carry's, and repeats until they stop
        changing: a carry entered in float16 whose body produces float32 is carried
        in float32. The last trace is kept (`trace_once`): the loop's body replays
        it, so a loop nested in loops is transformed once, not once per enclosing
        trace.
        """
        types = [type_of(v) for v in init]
        for _ in range(4):
            replay, (outs, _) = trace_once(step, types, *extra)
            new = [self.join([t, o]) for t, o in zip(types, outs)]
            if same_types(new, types):
                return types, replay
            types = new
        raise RuntimeError(
            f"The loop carry types did not settle: {types}. Please report this."
        )


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
    # Traced with strong types: an input is a value of the program (a parameter, a
    # batch), never a scalar constant, even where made from a Python float
    # (`eqx.nn.PReLU`'s slope is weakly typed): it is not rounded to the compute
    # dtype, and a float32 one keeps its op in float32 as any float32 input does.
    in_types = [_strong(type_of(x)) for x in args]
    closed = jax.make_jaxpr(fn)(*in_types)
    n_consts = len(closed.consts)
    all_types = [*map(type_of, closed.consts), *in_types]

    def forward(*xs):
        xs = enter(list(xs))
        return leave(
            interp.eval_jaxpr(
                closed, xs[n_consts:], consts=xs[:n_consts], strong_inputs=True
            )
        )

    @jax.custom_vjp
    def run(*xs):
        return forward(*xs)

    def run_fwd(*primals):
        # `CustomVJPPrimal`s (symbolic zeros): only the inputs JAX perturbs are
        # differentiated, so a custom rule inside sees the others unperturbed, as
        # without the transform (Equinox's `filter_custom_vjp` refuses a tangent on
        # its non-differentiable arguments).
        xs = [primal_value(x) for x in primals]
        wanted = tuple(i for i, x in enumerate(primals) if is_perturbed(x))

        def forward_of(*ws):
            full = list(xs)
            for i, w in zip(wanted, ws):
                full[i] = w
            return forward(*full)

        # A `jax.checkpoint` policy, if given, chooses the residuals: what it does not
        # save is recomputed by the backward pass.
        fwd = (
            forward_of
            if remat_policy is None
            else jax.checkpoint(forward_of, policy=remat_policy)
        )
        # The pullback is a pytree (a `jax.tree_util.Partial` of the residuals):
        # it is the residual itself.
        out, pullback = jax.vjp(fwd, *(xs[i] for i in wanted))
        return out, (pullback, wanted)

    def run_bwd(saved, cts):
        pullback, wanted = saved
        cts = [instantiate_zero(c) for c in cts]
        backward = jax.make_jaxpr(lambda p, c: p(c))(pullback, list(cts))
        cts_in = interp.eval_jaxpr(backward, [*jax.tree.leaves(pullback), *cts])
        by_input = dict(zip(wanted, cts_in, strict=True))
        return tuple(
            interp.coerce(by_input[i], t) if i in by_input and is_float(t) else None
            for i, t in enumerate(all_types)
        )

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return run(*closed.consts, *args)


_LOOPS = (_compat.while_p, _compat.scan_p, _compat.cond_p)


def _strong(type_):
    return jax.ShapeDtypeStruct(
        type_.shape, type_.dtype, sharding=getattr(type_, "sharding", None)
    )


class FlatCall:
    """`fn(*args, **kwargs)` as a function of its array leaves, for tracing to a jaxpr.

    `inputs` are the array leaves of `(fn, args, kwargs)` (with `is_leaf`, whole
    pytrees such as a `ScaledArray` count as one input); calling the object on
    replacements for them runs `fn` and returns its output's array leaves, as a list;
    `rebuild(leaves)` puts leaves back into the output's structure, its non-array
    parts included. Call it (trace it) before `rebuild`.

    An input `fn` changes in place (a Flax NNX `Variable`: BatchNorm's running
    statistics, an RNG stream's count) is returned too, after the output's leaves:
    `rebuild` leaves them in `updates`, as `(index in inputs, new value)` pairs, for
    `write_back` to set on the caller's own objects, as `nnx.jit` does.
    """

    def __init__(self, fn, args, kwargs, *, is_leaf=None):
        self._is_input = lambda x: eqx.is_array(x) or bool(is_leaf and is_leaf(x))
        leaves, self._treedef = jax.tree.flatten((fn, args, kwargs), is_leaf=is_leaf)
        self._leaves = leaves
        self._is_leaf = is_leaf
        self.inputs = [x for x in leaves if self._is_input(x)]
        self._out = None  # (the output's treedef, its non-array part)
        self._updated: list[int] = []  # inputs `fn` changed in place
        self.updates: list[tuple[int, Any]] = []

    def __call__(self, *xs) -> list:
        it = iter(xs)
        full = [next(it) if self._is_input(x) else x for x in self._leaves]
        fn, args, kwargs = jax.tree.unflatten(self._treedef, full)
        dynamic, static = eqx.partition(fn(*args, **kwargs), eqx.is_array)
        leaves, treedef = jax.tree.flatten(dynamic)
        self._out = (treedef, static)
        # What the call changed in place: the inputs' leaves, read again.
        after, after_def = jax.tree.flatten((fn, args, kwargs), is_leaf=self._is_leaf)
        if after_def != self._treedef:
            raise TypeError(
                "Expected the function under the transform to keep the structure of "
                "its inputs, got a change in place that adds or removes leaves "
                f"(before: {self._treedef}, after: {after_def}). Return new values "
                "instead of setting new attributes on an input."
            )
        after = [a for a, x in zip(after, self._leaves) if self._is_input(x)]
        self._updated = [i for i, (a, x) in enumerate(zip(after, xs)) if a is not x]
        return [*leaves, *(after[i] for i in self._updated)]

    def rebuild(self, leaves) -> Any:
        treedef, static = self._out
        leaves = list(leaves)
        n = len(leaves) - len(self._updated)
        self.updates = list(zip(self._updated, leaves[n:]))
        return eqx.combine(
            jax.tree.unflatten(treedef, leaves[:n]), static, is_leaf=self._is_leaf
        )


def variable_owners(tree, *, is_leaf=None) -> list:
    """Per leaf of `jax.tree.leaves(tree, is_leaf=is_leaf)`: the Flax NNX `Variable`
    that holds it, or None (all None where `flax.nnx` is not imported)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return [None] * len(jax.tree.leaves(tree, is_leaf=is_leaf))
    variable = lambda x: isinstance(x, nnx.Variable)
    owners = []
    for node in jax.tree.leaves(
        tree, is_leaf=lambda x: variable(x) or bool(is_leaf and is_leaf(x))
    ):
        if variable(node):
            owners.extend([node] * len(jax.tree.leaves(node, is_leaf=is_leaf)))
        else:
            owners.append(None)
    return owners


def write_back(tree, updates, *, is_leaf=None) -> None:
    """Set `updates` (`(index, value)` pairs, indices into the array leaves of `tree`
    as `FlatCall.inputs` counts them) on the mutable objects of `tree` that hold
    those leaves: Flax NNX `Variable`s."""
    if not updates:
        return
    leaves = jax.tree.leaves(tree, is_leaf=is_leaf)
    owners = [  # per input (array) leaf, as FlatCall counts them
        owner
        for owner, x in zip(variable_owners(tree, is_leaf=is_leaf), leaves, strict=True)
        if eqx.is_array(x) or bool(is_leaf and is_leaf(x))
    ]
    for index, value in updates:
        owner = owners[index] if index < len(owners) else None
        if owner is None:
            raise TypeError(
                "Expected only Flax NNX `Variable`s to be changed in place by the "
                f"function under the transform, got a change of input leaf {index} "
                "(not held by a Variable). Return the new value instead."
            )
        owner.set_value(value)
