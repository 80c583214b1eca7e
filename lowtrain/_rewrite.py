"""`rewrite`: replace chosen primitives of a program by functions of your own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax

from ._context import trace_key
from ._eqn import Eqn, is_float
from ._interpret import FlatCall, Interpreter, write_back
from ._scopes import match_scope

# A rewrite rule: `rule(op, *operands) -> output`, where `op(*operands)` runs the
# original primitive with its original parameters (an `Op`: `op.params` are those).
Rule = Callable[..., Any]


class Op:
    """The operation a rule replaces: `op(*operands)` runs the original primitive
    with its original parameters; `op.primitive` and `op.params` are those (a rule
    that writes the operation another way reads them: `dimension_numbers` of a
    `dot_general`)."""

    def __init__(self, eqn: Eqn):
        self._eqn = eqn
        self.primitive = eqn.primitive
        self.params = eqn.params

    def __call__(self, *args):
        out = self._eqn.bind(*args)
        return out if self.primitive.multiple_results else out[0]


class _RewriteInterpreter(Interpreter):
    def __init__(self, rules, scopes):
        self.rules = dict(rules)
        self.scopes = tuple((name, dict(table)) for name, table in scopes)

    def rule(self, eqn: Eqn, *invals) -> list:
        rules = match_scope(self.scopes, eqn.scopes, self.rules)
        fn = rules.get(eqn.primitive.name)
        if fn is None:
            return eqn.bind(*invals)

        out = fn(Op(eqn), *invals)
        return list(out) if eqn.primitive.multiple_results else [out]

    def join(self, types):
        return types[0]  # a rewritten program keeps its types

    def coerce(self, value, type_):
        if is_float(value) and is_float(type_) and value.dtype != type_.dtype:
            return value.astype(type_.dtype)
        return value


@eqx.filter_jit
def _rewrite_call(fn, rules, scopes, args, kwargs, settings=()):
    call = FlatCall(fn, args, kwargs)
    closed = jax.make_jaxpr(call)(*call.inputs)
    out = call.rebuild(
        _RewriteInterpreter(rules, scopes).eval_jaxpr(closed, call.inputs)
    )
    return out, call.updates


class _Rewrite(eqx.Module):
    fn: Callable
    rules: tuple[tuple[str, Rule], ...] = eqx.field(static=True)
    scopes: tuple[tuple[str, tuple[tuple[str, Rule], ...]], ...] = eqx.field(
        static=True, default=()
    )

    @property
    def __wrapped__(self):
        return self.fn

    def __call__(self, *args, **kwargs):
        out, updates = _rewrite_call(
            self.fn, self.rules, self.scopes, args, kwargs, trace_key()
        )
        # Flax NNX state the call changed in place, set on the caller's objects.
        write_back((self.fn, args, kwargs), updates)
        return out


def _check_rules(rules, what: str) -> tuple[tuple[str, Rule], ...]:
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"Expected {what} as a mapping from primitive names to functions, e.g. "
            f"{{'dot_general': my_dot}}, got {type(rules).__name__} instead."
        )
    for name, rule in rules.items():
        if not isinstance(name, str) or not callable(rule):
            raise TypeError(
                f"Expected {what} to map primitive names (str) to functions "
                f"`rule(op, *operands)`, got {name!r}: {rule!r} instead."
            )
    return tuple(sorted(rules.items()))


def rewrite(
    fn: Callable,
    rules: Mapping[str, Rule],
    *,
    scopes: Mapping[str, Mapping[str, Rule]] | None = None,
) -> Callable:
    """`fn` with every equation of the primitives named in `rules` replaced.

    `fn` is traced at the types it is called with; each equation whose primitive is
    named in `rules` (`"dot_general"`, `"conv_general_dilated"`, ...) runs as
    `rules[name](op, *operands)` instead, where `op(*operands)` is the original
    operation with its original parameters (`op.primitive` and `op.params` name
    them); every other equation runs as written,
    inside `jit`, `scan`, `while`, `cond`, `remat` and `custom_jvp`/`custom_vjp` too.
    A rule returns what `op` would (same shape and dtype). `scopes` maps a
    `jax.named_scope` name (or glob, matched as `lowtrain.amp`'s scope rules are:
    the outermost matching scope wins) to the rules used inside it instead of
    `rules`; `{}` leaves that scope as written. Nothing else changes:
    `jax.grad` differentiates the rewritten program, so a rule may carry its own
    `jax.custom_vjp`, and the result composes with `lowtrain.amp` (rewrite first:
    `amp(rewrite(model, rules), policy)` sees the rules' ops in the program it casts).

    Like `amp`, the result is an `eqx.Module` (its parameters are `fn`'s; see
    `__wrapped__`), compiled once per input structure. This is how a precision can
    change every matmul of a model that was written without precision arguments: the
    recipes' naive-FP8 baseline and scalify's FP8 matmuls are such rules.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain

    def round_operands(op, lhs, rhs):  # every matmul on bfloat16-rounded operands
        rnd = lambda x: x.astype(jnp.bfloat16).astype(x.dtype)
        return op(rnd(lhs), rnd(rhs))

    f = lambda x, w: jnp.tanh(x @ w)
    g = lowtrain.rewrite(f, {"dot_general": round_operands})
    x, w = jnp.full((2, 3), 1 + 2**-12), jnp.ones((3, 4))
    assert g(x, w).dtype == jnp.float32
    assert jnp.array_equal(g(x, w), jnp.tanh(jnp.full((2, 4), 3.0)))

    def head(x, w):
        with jax.named_scope("head"):  # left as written
            return x @ w

    h = lowtrain.rewrite(head, {"dot_general": round_operands}, scopes={"head": {}})
    assert float(h(x, w)[0, 0]) == 3 * (1 + 2**-12)
    ```
    """
    if not callable(fn):
        raise TypeError(f"Expected a function or callable module, got {fn!r} instead.")
    if scopes is not None and not isinstance(scopes, Mapping):
        raise TypeError(
            "Expected `scopes` as a mapping from `jax.named_scope` names (or globs) "
            f"to rule mappings, e.g. {{'head': {{}}}}, got {type(scopes).__name__} "
            "instead."
        )
    scoped = tuple(
        (name, _check_rules(table, f"`scopes[{name!r}]`"))
        for name, table in (scopes or {}).items()
    )
    return _Rewrite(fn, _check_rules(rules, "`rules`"), scoped)
