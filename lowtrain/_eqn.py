"""What an interpreter rule sees of one equation (`Eqn`), and the contract between an
interpreter's values and the higher-order ops that carry them (`Values`).

Part of the interpreter core (`_interpret.py` evaluates, `_higher_order.py` rebuilds
jit/scan/while/cond/remat/custom_jvp/custom_vjp); imports nothing of lowtrain but
`_compat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat


@dataclasses.dataclass(frozen=True)
class Eqn:
    """What a rule sees of one equation.

    `in_avals`/`out_avals` are the types the equation was traced with (the original
    program); `weak[i]` says input `i` is a scalar constant or weakly typed (a Python
    scalar such as the `2.0` in `x * 2.0`; jaxpr literals lose their weak type, so
    every literal counts); `scopes` is the full `jax.named_scope` path, outermost
    first, including the scopes of the higher-order ops that contain it; `invars` and
    `outvars` are the equation's atoms in its jaxpr (for a transform that analyses
    the program's dataflow, such as `unit_scale`'s search for residual adds).
    """

    primitive: _compat.Primitive
    params: dict[str, Any]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    weak: tuple[bool, ...]
    scopes: tuple[str, ...]
    invars: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    outvars: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    # Shared by the equations of one jaxpr evaluation (one trace): rules may cache
    # derived values here, such as the one float32 copy of a float16 input that three
    # ops use (so its cotangents are summed once, in float32).
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def bind(self, *args, **params) -> list:
        """Bind this equation's primitive on `args`, its params updated by `params`."""
        out = self.primitive.bind(*args, **{**self.params, **params})
        return list(out) if self.primitive.multiple_results else [out]


class Values:
    """How an interpreter's values travel through JAX's higher-order ops.

    The interpreter core evaluates a program on *values*: plain arrays for `amp`,
    `ScaledArray`s (a pytree `(data, scale)`) for `scalify`. A value is an array or
    a pytree of arrays; its *type* is what `jax.eval_shape` returns for it. JAX's
    `lax.scan`, `jax.custom_jvp` and `jax.custom_vjp` only see pytrees of arrays, so
    the rules that rebuild them (`lowtrain/_higher_order.py`) ask these hooks how a
    value splits, stacks and differentiates. Every hook has the default for values
    that are plain arrays (this class); a transform whose values are pytrees
    subclasses it (`lowtrain/scalify/_transform.py`) and sets its interpreter's
    `values` attribute. After `tangent_out` and `cotangents_out` the core coerces the
    results to the primal types with the interpreter's `coerce`.
    """

    # -- lax.scan -----------------------------------------------------------------

    def scan_split(self, value: Any) -> tuple[Any, Any]:
        """Split a value scanned over (an `xs` input, or a stacked output) into
        (the part that has the scanned axis, the rest), the rest closed over by
        every step. Default: `(value, None)`."""
        return value, None

    def scan_merge(self, sliced: Any, rest: Any) -> Any:
        """One step's value from its slice of `scan_split`'s first part and the
        rest. Default: the slice."""
        return sliced

    def scan_output(self, value: Any) -> Any:
        """A value as one step's output `y` of a `lax.scan`, before it goes through
        `scan_split` (to give every step the same structure). Default: as is."""
        return value

    def scan_stacked(self, stacked: Any, rests: Any) -> Any:
        """The value of outputs stacked by `lax.scan`: `stacked` has the scanned
        axis and `rests` are the per-step rests of `scan_split`, stacked too.
        Default: `stacked`."""
        return stacked

    # -- custom_jvp ---------------------------------------------------------------

    def tangent_in(self, primal: Any, tangent: Any) -> Any:
        """JAX's tangent of `primal` (a pytree like it) as a value. Default: as is."""
        return tangent

    def tangent_out(self, primal: Any, tangent: Any) -> Any:
        """A value as JAX's tangent of `primal` (a pytree like it; the core then
        coerces it to `primal`'s type). Default: as is."""
        return tangent

    # -- custom_vjp ---------------------------------------------------------------

    def vjp_saved(self, primals: Sequence[Any], outs: Sequence[Any]) -> Any:
        """What `cotangents_in`/`cotangents_out` need from the forward pass, saved
        with the residuals. Default: None."""
        return None

    def cotangents_in(self, saved: Any, cts: Sequence[Any]) -> list:
        """JAX's cotangents of the outputs as values. Default: as they are."""
        return list(cts)

    def cotangents_out(self, saved: Any, cts: Sequence[Any]) -> list:
        """Values as JAX's cotangents of the inputs (the core then coerces each to
        its input's type). Default: as they are."""
        return list(cts)


def type_of(value: Any) -> Any:
    """The type of a value: a pytree of `jax.ShapeDtypeStruct`."""
    return jax.eval_shape(lambda v: v, value)


def is_float(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def same_types(a, b) -> bool:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(leaves_a, leaves_b)
    )
