"""The residuals reverse-mode AD saves for the backward pass, and what produces them.

The residual set and order are those of `jax.ad_checkpoint.print_saved_residuals`
(`measure` checks the totals against its printed output), but a residual computed
inside a jitted function (as all of `lowtrain.amp`'s are) is followed to the equation
that computes it, with its primitive, `jax.named_scope` path and source line, rather
than reported as an "output of jitted function". Counted in the jaxpr, before XLA
fuses or rematerialises anything.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax import ad_checkpoint

from lowtrain import _compat


@dataclass
class Residual:
    """One residual: its type, what kind of value it is, and what produced it."""

    aval: Any
    kind: str  # "argument", "param cast", "activation", "literal" or "constant"
    producer: str  # primitive and `jax.named_scope` path, or the argument's name
    source: str  # source line of the producing equation

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.aval.shape) * np.dtype(self.aval.dtype).itemsize


def _source(eqn) -> str:
    """`file:line (function)` of an equation, from the package or scripts folder."""
    text = _compat.eqn_source_line(eqn)
    return re.sub(r"^.*/(site-packages|lowtrain|scripts)/", r"\1/", text)


def _origin(atom, path: list) -> tuple:
    """Follow `atom` through `jit` boundaries to what defines it.

    `path` is a list of `(jaxpr, calling equation)` from the outermost jaxpr in; the
    calling equations are `jit`s and `scan`s (whose stacked outputs are followed into
    the body).
    Returns `("eqn", eqn, path)`, `("argument", index, path)`, `("literal", ...)` or
    `("constant", ...)`.
    """
    jaxpr, call = path[-1]
    if isinstance(atom, _compat.Literal):
        return ("literal", None, path)
    producers = {v: (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
    found = producers.get(atom)
    if found is not None:
        eqn, i = found
        name = eqn.primitive.name
        if name == "jit" or (name == "scan" and i >= eqn.params["num_carry"]):
            # Into the function, or the scan body whose outputs the scan stacks.
            inner = eqn.params["jaxpr"].jaxpr
            return _origin(inner.outvars[i], [*path, (inner, eqn)])
        if name == "reduce_precision":  # as print_saved_residuals does
            return _origin(eqn.invars[0], path)
        return ("eqn", eqn, path)
    if atom in jaxpr.invars:
        index = jaxpr.invars.index(atom)
        if call is None:
            return ("argument", index, path)
        p = call.params
        if call.primitive.name == "scan" and index < p["num_consts"] + p["num_carry"]:
            return ("eqn", call, path[:-1])  # a constant or carry, stacked by the scan
        return _origin(call.invars[index], path[:-1])  # (a slice of) the input
    return ("constant", None, path)


def saved_residuals(f: Callable, *args) -> list[Residual]:
    """The residuals `jax.vjp(f, *args)` saves, attributed through jit boundaries."""
    leaves, in_tree = jax.tree_util.tree_flatten_with_path(args)
    names = [jax.tree_util.keystr(p) for p, _ in leaves]

    def flat(*xs):
        return f(*jax.tree.unflatten(in_tree, xs))

    vjp = jax.make_jaxpr(lambda *xs: jax.vjp(flat, *xs), return_shape=True)
    closed, shapes = vjp(*[x for _, x in leaves])
    num_res = len(jax.tree.leaves(shapes[1]))
    top = closed.jaxpr
    residuals = []
    for var in top.outvars[len(top.outvars) - num_res :]:
        kind, eqn, path = _origin(var, [(top, None)])
        if kind == "argument":
            residuals.append(Residual(var.aval, kind, names[eqn], ""))
            continue
        if kind != "eqn":
            residuals.append(Residual(var.aval, kind, kind, ""))
            continue
        is_cast = eqn.primitive.name == "convert_element_type"
        if is_cast and _origin(eqn.invars[0], path)[0] == "argument":
            kind = "param cast"
        else:
            kind = "activation"
        producer = eqn.primitive.name
        calls = [call.params.get("name", "scan") for _, call in path[1:]]
        if calls:
            producer += f" in {'/'.join(calls)}"
        scope = _compat.eqn_name_stack(eqn)
        if scope:
            producer += f" @ {scope}"
        residuals.append(Residual(var.aval, kind, producer, _source(eqn)))
    return residuals


def printed_residual_bytes(f: Callable, *args) -> int:
    """Total bytes of the residuals `jax.ad_checkpoint.print_saved_residuals` prints."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        ad_checkpoint.print_saved_residuals(f, *args)
    sizes = {"f64": 8, "f32": 4, "i32": 4, "u32": 4, "f16": 2, "bf16": 2, "bool": 1}
    total = 0
    for line in buffer.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\]", line)
        if m:
            shape = [int(d) for d in m.group(2).split(",") if d]
            total += math.prod(shape) * sizes.get(m.group(1), 4)
    return total


def xla_temp_bytes(f: Callable, params: Any) -> int | None:
    """Bytes of temporary buffers XLA allocates for `jax.value_and_grad(f)(params)`."""
    compiled = jax.jit(jax.value_and_grad(f)).lower(params).compile()
    analysis = compiled.memory_analysis()
    return None if analysis is None else analysis.temp_size_in_bytes


def measure(
    variants: dict[str, Callable], model: eqx.Module, batch: tuple, xla_memory: bool
) -> tuple[dict[str, list[Residual]], dict[str, int | None]]:
    """The residuals of each loss in `variants` with respect to `model`'s float arrays
    on `batch`, checked against `print_saved_residuals`; with `xla_memory`, also the
    temporary bytes XLA allocates for its value and gradient (else None)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    results, temps = {}, {}
    for name, loss_fn in variants.items():

        def f(p, loss_fn=loss_fn):
            return loss_fn(eqx.combine(p, static), *batch)

        res = saved_residuals(f, params)
        total = sum(r.nbytes for r in res)
        printed = printed_residual_bytes(f, params)
        if printed != total:
            raise RuntimeError(
                f"{name}: {total} residual bytes, but print_saved_residuals lists "
                f"{printed}."
            )
        results[name] = res
        temps[name] = xla_temp_bytes(f, params) if xla_memory else None
    return results, temps
