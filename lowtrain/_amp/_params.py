"""Which values of a program are parameters: for the "block" action, which operand of
a matmul is the weight (its own block format: 128x128 tiles, NVFP4's 16x16 ones) and
which gradient GEMM is the weight gradient (NVFP4's Hadamard transform).

A dataflow pass over the traced program, before it is evaluated: the parameters are
the jaxpr's first `n` inputs (the array leaves of the module `amp` wraps, which
`FlatCall` puts first), and a value computed from a parameter by a layout change
only is one too. A sub-jaxpr's inputs follow the operands they are bound to (a
scan's slices of stacked layers, a jit's, a remat's, a cond's or a while body's
arguments), and a jit's outputs follow its sub-jaxpr's.
"""

from __future__ import annotations

from collections.abc import Iterable

from .. import _compat

# Ops that move or cast a value but do not mix it with anything: a weight stays one.
_LAYOUT = frozenset(
    {
        "convert_element_type",
        "transpose",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "slice",
        "dynamic_slice",
        "sharding_constraint",
        "reduce_precision",
    }
)


def param_vars(closed: _compat.ClosedJaxpr, n_params: int) -> frozenset:
    """The variables of `closed` (its sub-jaxprs' too) that hold a parameter or a
    layout change of one, its first `n_params` inputs being the parameters."""
    found: set = set(closed.jaxpr.invars[:n_params])
    _walk(closed.jaxpr, found)
    return frozenset(found)


def _sub_jaxprs(params: dict) -> Iterable[tuple[str, object]]:
    for name, value in params.items():
        values = value if isinstance(value, tuple | list) else (value,)
        for v in values:
            jaxpr = getattr(v, "jaxpr", v)  # a ClosedJaxpr's, or an open Jaxpr
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
                yield name, jaxpr


def _walk(jaxpr, found: set) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
        if name in _LAYOUT:
            if ins and ins[0] in found:
                found.update(eqn.outvars)
            continue
        for param, sub in _sub_jaxprs(eqn.params):
            if param == "cond_jaxpr":  # a while's predicate: no matmuls to place
                continue
            # The sub-jaxpr's inputs are the last of the equation's operands (all of
            # them for jit, remat, scan and the custom rules; a cond's branches drop
            # the index, a while's body the predicate's constants).
            n = len(sub.invars)
            operands = list(eqn.invars)[len(eqn.invars) - n :] if n else []
            for outer, inner in zip(operands, sub.invars):
                if not isinstance(outer, _compat.Literal) and outer in found:
                    found.add(inner)
            _walk(sub, found)
            if name in ("jit", "pjit", "closed_call") and len(sub.outvars) == len(
                eqn.outvars
            ):
                for inner, outer in zip(sub.outvars, eqn.outvars):
                    if not isinstance(inner, _compat.Literal) and inner in found:
                        found.add(outer)
