"""`track`: run a function and report the statistics of every float tensor it makes.

A transform on the interpreter core: `_TrackInterpreter.rule` binds each equation as
written and records its float outputs; their statistics (`_stats.batch_stats`, all
tensors of a program at once) are returned by the compiled program next to the
function's outputs. The
higher-order rules are this interpreter's own, because statistics computed inside a
loop body or a branch must leave it as outputs: `scan` and `while` carry them,
merged over the iterations (one row per equation of the body, aggregated exactly:
absmax is the max, RMS over all iterations' values, counts summed); `cond` returns
every branch's, those of the branches not taken empty (and dropped from the report).
`jit`, `remat`, `custom_jvp` and `custom_vjp` calls are inlined: the values are the
same, and the tracked function is for evaluation, not for differentiation (track
`jax.value_and_grad(loss)` to see the backward pass).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .._eqn import Eqn, is_float
from .._interpret import FlatCall, Interpreter
from .._scopes import AMP_STOP_SCOPE
from ..fp8.internal import FORMAT_SCOPE, KEEP_SCOPE, Site, current_scale
from ._report import CAST_ERROR, Meta, Report
from ._stats import (
    GROUP,
    batch_stats,
    empty_stats,
    merge,
    merge_stacked,
    rounding_error,
)

# Formats a plain cast narrows float32 to, judged in the casts report.
_HALF = ("float16", "bfloat16")
# Scopes lowtrain's transforms open, not the user's: left out of a cast's name.
_OURS = (AMP_STOP_SCOPE, KEEP_SCOPE)


def _name_stacks(closed, out: dict) -> dict:
    # Each equation's name stack, by its first output variable (the `Eqn` a rule sees
    # has the variables but not the name stack). JAX writes `transpose(...)` in the
    # name stack of the equations of a backward pass; sub-jaxprs' names are relative.
    for jeqn in closed.jaxpr.eqns if hasattr(closed, "jaxpr") else closed.eqns:
        if jeqn.outvars:
            out[jeqn.outvars[0]] = _compat.eqn_name_stack(jeqn)
        for sub in _compat.jaxprs_in_params(jeqn.params):
            _name_stacks(sub, out)
    return out


# Ops that only move values: their statistics are their input's, so no row.
_LAYOUT = frozenset(
    {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "copy"}
    | {"sharding_constraint", "reshard", "device_put"}
)


def _site_of(scopes) -> tuple[Site | None, tuple[str, ...]]:
    # The cast site among `scopes` (an FP8 cast's division, or a shadow's), and the
    # user's scopes around it (lowtrain's own left out).
    site, user = None, []
    for scope in scopes:
        found = Site.parse(scope)
        if found is not None:
            site = found
        elif scope not in _OURS and not scope.startswith(FORMAT_SCOPE + "|"):
            user.append(scope)
    return site, tuple(user)


class _TrackInterpreter(Interpreter):
    def __init__(self, stacks: dict, casts: bool = False):
        self.stacks = stacks
        self.casts = casts  # only the casts to a narrower format (see `track`)
        self.records: list = []  # (meta, (moments, counts)) in program order
        self.raw = 0  # values of the records whose statistics are still to compute
        self.bwd = False
        # Values computed from constants only (a mask, a broadcast constant), by id
        # (the values kept alive, so ids stay unique): their casts are not recorded,
        # as XLA would fold their statistics while compiling.
        self.constant: dict[int, Any] = {}

    def record(self, meta, value) -> None:
        # Statistics are taken as soon as GROUP values wait for them, so that a
        # tensor's buffer can be freed (and reused) soon after it is made.
        self.records.append((meta, value))
        if not isinstance(value, tuple):
            self.raw += value.size
            if self.raw >= GROUP:
                self.records, self.raw = _finish(self.records), 0

    def _is_constant(self, value) -> bool:
        return not isinstance(value, jax.core.Tracer) or id(value) in self.constant

    def _is_bwd(self, eqn: Eqn) -> bool:
        stack = self.stacks.get(eqn.outvars[0], "") if eqn.outvars else ""
        return self.bwd or "transpose(" in stack

    def rule(self, eqn: Eqn, *invals) -> list:
        outs = eqn.bind(*invals)
        prim = eqn.primitive.name
        if self.casts and all(self._is_constant(v) for v in invals):
            self.constant.update((id(v), v) for v in outs)
        if prim in _LAYOUT:
            return outs
        pass_ = "bwd" if self._is_bwd(eqn) else "fwd"
        if self.casts:
            self._record_cast(eqn, invals, outs, pass_)
            return outs
        name = "/".join((*eqn.scopes, prim))
        for out, aval in zip(outs, eqn.out_avals):
            if is_float(aval):
                meta = Meta(name, prim, pass_, str(aval.dtype), tuple(aval.shape))
                self.record(meta, out)
        return outs

    def _record_cast(self, eqn: Eqn, invals, outs, pass_: str) -> None:
        # An FP8 cast's division by its scale (the value it rounds), a shadow's
        # value (divided by its own scale for current scaling), or a plain cast of a
        # wider float to float16/bfloat16 (its input, judged in its output format).
        site, user = _site_of(eqn.scopes)
        if site is not None:
            if len(outs) != 1 or not is_float(eqn.out_avals[0]):
                return
            value = outs[0]
            if site.amax:
                value = value.astype(jnp.float32) / current_scale(value, site.fmt)
            name = "/".join(user) or "(top)"
            shape = tuple(eqn.out_avals[0].shape)
            self.record(Meta(name, "fp8_cast", pass_, site.fmt, shape, site), value)
            # What rounding it to nearest loses, folded into the cast's row as its
            # relative `error` (`Report.from_stats`).
            error = Meta(name, CAST_ERROR, pass_, site.fmt, shape, site)
            self.record(error, rounding_error(value, site.fmt))
        elif eqn.primitive.name == "convert_element_type":
            (x,), (to,) = invals, eqn.out_avals
            if not (is_float(eqn.in_avals[0]) and str(to.dtype) in _HALF):
                return
            if self._is_constant(x):  # a mask, say: nothing a precision decides
                return
            if jnp.finfo(eqn.in_avals[0].dtype).bits <= jnp.finfo(to.dtype).bits:
                return
            name = "/".join((*user, "convert_element_type"))
            meta = Meta(name, "convert_element_type", pass_, str(to.dtype), x.shape)
            self.record(meta, x)

    def join(self, types):
        return types[0]  # values keep the program's types

    def coerce(self, value, type_):
        return value

    @contextlib.contextmanager
    def _sub(self, eqn: Eqn):
        # Evaluate a sub-program with its own record list; restore ours after.
        saved = self.records, self.raw, self.bwd
        self.records, self.raw, self.bwd = [], 0, self._is_bwd(eqn)
        try:
            yield
        finally:
            self.records, self.raw, self.bwd = saved

    def _run(self, eqn: Eqn, closed, args) -> tuple[list, list]:
        with self._sub(eqn):
            return self.eval_jaxpr(closed, args, eqn.scopes), _finish(self.records)

    def higher_order(self, eqn: Eqn, *invals) -> list:
        prim, p = eqn.primitive, eqn.params
        if prim is _compat.scan_p:
            return self._scan(eqn, *invals)
        if prim is _compat.while_p:
            return self._while(eqn, *invals)
        if prim is _compat.cond_p:
            return self._cond(eqn, *invals)
        if prim is _compat.remat_p:
            sub = _compat.ClosedJaxpr(p["jaxpr"], ())
        elif prim is _compat.jit_p:
            sub = p["jaxpr"]
        elif prim is _compat.custom_vmap_p:  # its body (not under `jax.vmap` here)
            sub = _compat.custom_vmap_body(p)
        else:  # custom_jvp_call, custom_vjp_call: the primal function as written
            sub = p["call_jaxpr"]
        with self._sub(eqn):  # same trace: statistics at the end, with the rest
            outs = self.eval_jaxpr(sub, list(invals), eqn.scopes, memo=eqn.memo)
            records = self.records
        for meta, value in records:
            self.record(meta, value)
        return outs

    def _scan(self, eqn: Eqn, *args):
        p = eqn.params
        consts, init, xs = _compat.scan_inputs(p, args)
        n_carry = len(init)
        metas = []

        def body(carry, x):
            outs, records = self._run(eqn, p["jaxpr"], [*consts, *carry, *x])
            metas[:] = [m for m, _ in records]
            return outs[:n_carry], (outs[n_carry:], [s for _, s in records])

        carry, (ys, stats) = lax.scan(
            body,
            list(init),
            list(xs),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        for meta, (moments, counts) in zip(metas, stats):
            if not self.casts:  # one row over all iterations
                self.record(meta, merge_stacked(moments, counts))
            elif meta.layers:  # an inner scan's layers: merged over this one's
                self.record(meta, merge_stacked(moments, counts, apart=1))
            else:  # a row per iteration: the scan is over layers
                meta = meta._replace(layers=int(p["length"]))
                self.record(meta, (moments, counts))
        return [*carry, *ys]

    def _while(self, eqn: Eqn, *args):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = args[:nc], args[nc : nc + nb], args[nc + nb :]
        metas = []

        def body(carry):
            values, acc = carry
            outs, records = self._run(eqn, p["body_jaxpr"], [*body_consts, *values])
            metas[:] = [m for m, _ in records]
            new = [s for _, s in records]
            return outs, new if acc is None else [merge(a, b) for a, b in zip(acc, new)]

        jax.eval_shape(lambda c: body((c, None))[1], list(init))  # learn `metas`
        acc = [empty_stats(m.layers) for m in metas]

        def cond(carry):
            (pred,), _ = self._run(eqn, p["cond_jaxpr"], [*cond_consts, *carry[0]])
            return pred

        values, acc = lax.while_loop(cond, body, (list(init), acc))
        self.records.extend(zip(metas, acc))
        return list(values)

    def _cond(self, eqn: Eqn, index, *ops):
        branches = eqn.params["branches"]
        metas = [[] for _ in branches]

        def run(i):
            def branch(*o):
                outs, records = self._run(eqn, branches[i], list(o))
                metas[i][:] = [m for m, _ in records]
                mine = [s for _, s in records]
                stats = [
                    mine if j == i else [empty_stats(m.layers) for m in metas[j]]
                    for j in range(len(branches))
                ]
                return outs, stats

            return branch

        for i in range(len(branches)):  # learn each branch's records
            jax.eval_shape(run(i), *ops)
        outs, stats = lax.switch(index, [run(i) for i in range(len(branches))], *ops)
        for ms, ss in zip(metas, stats):
            self.records.extend(zip(ms, ss))
        return list(outs)


def _finish(records: list) -> list:
    # `(meta, array)` records get their statistics, all in one `batch_stats`;
    # `(meta, (moments, counts))` records (from loops and branches) are done.
    raw = [i for i, (_, v) in enumerate(records) if not isinstance(v, tuple)]
    if not raw:
        return list(records)
    moments, counts = batch_stats([records[i][1] for i in raw])
    out = list(records)
    for j, i in enumerate(raw):
        out[i] = (records[i][0], (moments[j], counts[j]))
    return out


@eqx.filter_jit
def tracked_call(fn, args, kwargs, casts: bool = False):
    call = FlatCall(fn, args, kwargs)
    closed = jax.make_jaxpr(call)(*call.inputs)
    interp = _TrackInterpreter(_name_stacks(closed, {}), casts)
    # The float inputs first (the weights, say): rows named by their path.
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path((fn, args, kwargs))[0]
        if eqx.is_array(leaf)
    ]
    for path, x in zip(paths, call.inputs):
        if is_float(x) and not casts:
            meta = Meta(f"input{path}", "input", "fwd", str(x.dtype), tuple(x.shape))
            interp.record(meta, x)
    outs = interp.eval_jaxpr(closed, call.inputs)
    records = _finish(interp.records)
    metas = tuple(m for m, _ in records)
    if not metas:
        moments, counts = empty_stats()
        return call.rebuild(outs), moments[:0], counts[:0], metas
    # (rows, 2) and (rows, N_COUNTS): a record with layers gives a row per layer.
    moments = jnp.concatenate([m.reshape(-1, 2) for _, (m, _) in records])
    counts = jnp.concatenate([c.reshape(-1, c.shape[-1]) for _, (_, c) in records])
    return call.rebuild(outs), moments, counts, metas


class _Tracked(eqx.Module):
    fn: Callable
    casts: bool = eqx.field(static=True, default=False)

    @property
    def __wrapped__(self):
        return self.fn

    def __call__(self, *args, **kwargs) -> tuple[Any, Report]:
        outs, moments, counts, metas = tracked_call(self.fn, args, kwargs, self.casts)
        if isinstance(moments, jax.core.Tracer):
            raise TypeError(
                "Expected a tracked function to be called outside `jax.jit` (its "
                "report is read on the host), got a call inside a traced function "
                "instead. Jit the function you track: `track(jax.jit(fn))`."
            )
        kind = "casts" if self.casts else "all"
        stats = np.asarray(moments), np.asarray(counts)
        return outs, Report.from_stats(metas, *stats, kind=kind)


def track(fn: Callable, *, casts: bool = False) -> Callable[..., tuple[Any, Report]]:
    """`fn` returning `(fn's outputs, report)`: the statistics of every float tensor
    its program makes, as a `lowtrain.numerics.Report`; with `casts=True`, of every
    tensor its program casts to a narrower format, as the cast sees it (below).

    `fn` is traced at the types it is called with and run, compiled, with every
    equation as written, so the outputs are `fn`'s values, to float rounding: the
    statistics read every intermediate tensor, which changes how XLA fuses the
    program, so a matmul or a reduction may add in another order and a fused
    function (tanh, exp) take another kernel, a few units in the last place (within
    2e-6 of the largest value in the float32 gradients of a GPT, measured). A
    program of elementwise float32 ops is bitwise as under `jax.jit`. Float16 and
    bfloat16 intermediates differ up to their rounding (XLA may keep those in
    float32 inside a fusion, `xla_allow_excess_precision`).
    Each float input (`primitive` "input", `name` "input" and its path in `(fn,
    args, kwargs)`, e.g. `"input[1][0].weight"`), and each float output of each
    equation (but those that only move values: reshape, transpose, broadcast, ...)
    gets a row of the report: its scope path,
    pass (`"bwd"` for the equations of a transposed program: track
    `jax.value_and_grad(loss)` to see the backward pass), dtype, shape, RMS, absmax,
    and which fraction of its nonzero values would underflow to zero / overflow if
    cast to float16, bfloat16, float8_e4m3fn and float8_e5m2. The statistics are
    computed inside the compiled program (a few reductions per tensor, returned next
    to the outputs: no host round trip per op). Inside `lax.scan` and `while` loops
    they are aggregated over the iterations (one row per equation of the body, over
    the values of all iterations: absmax the max, RMS over all of them, fractions of
    all of them); of a `cond`, only the branch taken has rows. An AMP or scalify
    transformed function is reported as it runs, in its own dtypes; a `ScaledArray`'s
    data and scale are separate arrays there, so its rows are its data as stored.

    With `casts=True` the report judges what a precision does (`kind` "casts"):
    only the tensors the program casts to a narrower format, each against the
    format it is cast to. An FP8 cast of `lowtrain.fp8` (the `fp8` policy, delayed
    scaling, the static-scale casts of unit scaling, scalify's casts) is read after
    its scale, as the value it rounds, its row named by the user's scopes around the
    matmul (`primitive` "fp8_cast"), its `site` saying the matmul's GEMM, the cast's
    role (`lhs`, `rhs`, `grad`) and whether it is applied or a shadow (a matmul kept
    wide by `lowtrain.fp8`'s `keep_op`: what its cast would see); a plain cast to
    float16 or bfloat16 (`convert_element_type` from a wider float) is its input,
    judged in its output format. Inside `lax.scan` each iteration has its own row
    (`layer`: the recipes' GPTs scan over their blocks); an outer scan around that
    is merged. Nothing else is read, so the tracked program costs little more than
    `fn` to run and to compile; a program that casts nothing has an empty report.

    Like `amp`, the result is an `eqx.Module` wrapping `fn`, compiled once per input
    structure.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.numerics

    def loss(w, x):
        with jax.named_scope("tiny"):
            y = x @ w
        return jnp.sum(y**2)

    w, x = jnp.full((8, 4), 1e-3), jnp.full((2, 8), 1e-3)
    (value, grad), report = lowtrain.numerics.track(jax.value_and_grad(loss))(w, x)
    assert value == jax.jit(loss)(w, x)
    row = next(r for r in report.rows if r["name"] == "tiny/dot_general")
    assert row["pass"] == "fwd" and row["underflow"]["float8_e4m3fn"] == 1.0
    assert {r["pass"] for r in report.rows} == {"fwd", "bwd"}
    ```
    """
    if not callable(fn):
        raise TypeError(f"Expected a function or callable module, got {fn!r} instead.")
    return _Tracked(fn, bool(casts))
