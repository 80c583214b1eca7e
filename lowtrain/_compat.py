"""Every use of JAX internals (`jax._src`, `jax.extend`) in lowtrain lives here.

The rest of the package imports these names from this module only. Each block states the
JAX versions it was checked against; `tests/test_compat.py` fails loudly when a
primitive's parameters change under us, so a JAX upgrade cannot silently
mis-transform a program.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

# JAX 0.10 to 0.12: inside `jax.vmap` the current trace (`core.trace_ctx.trace`) is a
# `BatchTrace`: `to_batch_info(x)` gives a value's batched array and batch dimension
# (None where this vmap does not batch it), `parent_trace` is the trace around the
# vmap, `axis_data` holds its axis name (`core.no_axis_name` when unnamed), size and
# spmd axis name, and `BatchTracer(trace, val, dim)` puts a batched array back in.
# `jax.custom_batching.custom_vmap`'s batching rule uses the same (`VmapFrame`).
# `custom_batching.vmap_unrestricted(wrapped_fun, *args, in_axes, axis_name,
# axis_size)` batches a function and returns its outputs with their batch dimensions
# (None: not batched), which `jax.vmap` does not report (`batch_flat`).
from jax._src import api_util as _api_util
from jax._src import core as _core
from jax._src import linear_util as _lu

# JAX 0.10 to 0.12: a custom_vjp backward rule may return `ad_util.Zero` placeholders
# for inputs that get no cotangent.
from jax._src.ad_util import Zero as _Zero

# JAX 0.10 to 0.12: `jax.custom_batching.custom_vmap` binds `custom_vmap_call`, whose
# primitive `jax.extend` does not expose; its body `call` is a `ClosedJaxpr` in 0.10
# and an open `Jaxpr` in 0.11, constants passed as arguments in both
# (`custom_vmap_body`).
from jax._src.custom_batching import custom_vmap_p as custom_vmap_p
from jax._src.custom_batching import vmap_unrestricted as _vmap_unrestricted
from jax._src.interpreters import batching as _batching

# JAX 0.10 to 0.12: a name stack is a tuple of `Scope` (from `jax.named_scope`) and
# `Transform` (jvp, transpose, ...) entries; the name stack of an equation inside a
# sub-jaxpr is relative to the equation that holds it.
from jax._src.source_info_util import Scope as _Scope
from jax._src.source_info_util import Transform as _Transform

# JAX 0.10.2, 0.11.2 and 0.12.0: `summarize(source_info)`
# formats the innermost frame outside JAX as "file:line:column (function)".
from jax._src.source_info_util import summarize as _summarize_source
from jax._src.source_info_util import (
    transform_name_stack as _transform_name_stack,
)

# JAX 0.10 to 0.12: `jax.extend.core` exposes the primitives of every higher-order op.
# The jit primitive was called `pjit` before JAX 0.7 and `jit` since; the remat
# primitive is `remat2` (its Python name `remat_p`). We support JAX >= 0.10 only
# (see pyproject).
from jax.extend.core import ClosedJaxpr as ClosedJaxpr
from jax.extend.core import Jaxpr as Jaxpr
from jax.extend.core import JaxprEqn as JaxprEqn
from jax.extend.core import Literal as Literal
from jax.extend.core import Primitive as Primitive
from jax.extend.core import Var as Var
from jax.extend.core import jaxpr_as_fun as jaxpr_as_fun
from jax.extend.core import jaxprs_in_params as jaxprs_in_params
from jax.extend.core.primitives import cond_p as cond_p
from jax.extend.core.primitives import custom_jvp_call_p as custom_jvp_call_p
from jax.extend.core.primitives import custom_vjp_call_p as custom_vjp_call_p
from jax.extend.core.primitives import jit_p as jit_p
from jax.extend.core.primitives import remat_p as remat_p
from jax.extend.core.primitives import scan_p as scan_p
from jax.extend.core.primitives import while_p as while_p


def _jax_version() -> tuple[int, int]:
    """`(major, minor)` of the installed JAX."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


# Every parameter each higher-order primitive carries, as emitted by JAX 0.10.2. The
# interpreter rebuilds these ops with public APIs (`jax.jit`, `lax.scan`, ...) from the
# parameters in USED_PARAMS; the rest are dropped on purpose: an inner jit's layouts,
# donations and compiler options (the outer jit governs them; its `NamedSharding`
# in/out shardings are kept as `with_sharding_constraint`s), `differentiated` of
# remat (set by AD itself), `symbolic_zeros` (the rebuilt custom rules take
# instantiated zeros). `tests/test_compat.py` fails when the installed JAX emits a
# parameter not listed here, so a new one is looked at before it is silently dropped.
KNOWN_PARAMS: dict[str, frozenset[str]] = {
    "jit": frozenset(
        {
            "jaxpr",
            "name",
            "inline",
            "keep_unused",
            "in_shardings",
            "out_shardings",
            "in_layouts",
            "out_layouts",
            "donated_invars",
            "ctx_mesh",
            "compiler_options_kvs",
        }
    ),
    # JAX 0.10: the constants and carry are counted by `num_consts`/`num_carry`;
    # JAX 0.11 and 0.12: the input and output groups are `FlatTree`s `ft_in` and
    # `ft_out` (read by `scan_inputs`).
    "scan": frozenset({"jaxpr", "length", "reverse", "unroll"})
    | (
        {"num_consts", "num_carry"} if _jax_version() < (0, 11) else {"ft_in", "ft_out"}
    ),
    "while": frozenset({"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"}),
    "cond": frozenset({"branches"}),
    "remat2": frozenset({"jaxpr", "prevent_cse", "policy", "differentiated"}),
    "custom_jvp_call": frozenset(
        {"call_jaxpr", "jvp_jaxpr_fun", "num_consts", "symbolic_zeros"}
    ),
    "custom_vjp_call": frozenset(
        {
            "call_jaxpr",
            "fwd_jaxpr_thunk",
            "bwd",
            "out_trees",
            "num_consts",
            "symbolic_zeros",
        }
    ),
    "custom_vmap_call": frozenset({"call", "rule", "in_tree", "out_tree"}),
}
USED_PARAMS: dict[str, frozenset[str]] = {
    "jit": frozenset(
        {"jaxpr", "name", "inline", "keep_unused", "in_shardings", "out_shardings"}
    ),
    "scan": KNOWN_PARAMS["scan"],
    "while": KNOWN_PARAMS["while"],
    "cond": KNOWN_PARAMS["cond"],
    "remat2": frozenset({"jaxpr", "prevent_cse", "policy"}),
    "custom_jvp_call": frozenset({"call_jaxpr", "jvp_jaxpr_fun", "num_consts"}),
    "custom_vjp_call": frozenset(
        {"call_jaxpr", "fwd_jaxpr_thunk", "bwd", "out_trees", "num_consts"}
    ),
    "custom_vmap_call": frozenset({"call"}),
}


# First-order primitives whose params hold a small jaxpr describing their combiner
# (the `add` of scatter-add, the body of a generic reduce). They are not control flow:
# they go to the interpreter's first-order `rule`, which must rebuild them (the
# combiner is typed for the traced dtype) or keep their traced dtypes.
COMBINER_PRIMITIVES = frozenset(
    {
        "scatter",
        "scatter-add",
        "scatter-mul",
        "scatter-min",
        "scatter-max",
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "select_and_scatter_add",
    }
)


def eqn_scopes(eqn: JaxprEqn) -> tuple[str, ...]:
    """The `jax.named_scope` names around `eqn`, outermost first (no transforms)."""
    return tuple(
        s.name for s in eqn.source_info.name_stack.stack if isinstance(s, _Scope)
    )


@contextlib.contextmanager
def enter_name_stack(eqn: JaxprEqn):
    """Re-enter `eqn`'s name stack on top of the current one: its `jax.named_scope`s
    and JAX's transform names (`transpose(...)` marks a backward pass), so a program
    an interpreter re-emits keeps both (`lowtrain.numerics` reads the pass from it)."""
    # JAX 0.10.2, 0.11.2 and 0.12.0: `name_stack.stack` holds `Scope`s and
    # `Transform`s in order; `transform_name_stack` pushes a `Transform` as JAX's
    # `jvp`/`transpose` do.
    with contextlib.ExitStack() as stack:
        for item in eqn.source_info.name_stack.stack:
            if isinstance(item, _Scope):
                stack.enter_context(jax.named_scope(item.name))
            elif isinstance(item, _Transform):
                stack.enter_context(_transform_name_stack(item.name))
        yield


def eqn_name_stack(eqn: JaxprEqn) -> str:
    """The name stack of `eqn` as JAX prints it, `jax.named_scope` names and
    transforms: `"jvp(outer)/inner"` for an op in `named_scope("inner")` inside
    `named_scope("outer")`, under `jax.jvp`; `""` for none."""
    # JAX 0.10.2, 0.11.2 and 0.12.0 (`tests/test_compat.py` says if it differs):
    # `source_info.name_stack` is a `NameStack` whose `str` joins the scopes with "/"
    # and wraps them in each transform's name.
    return str(eqn.source_info.name_stack)


def eqn_source_line(eqn: JaxprEqn) -> str:
    """Where `eqn` was traced, as `"path/file.py:line:column (function)"` (the form
    `jax.ad_checkpoint.print_saved_residuals` prints), user frames only."""
    # JAX 0.10.2, 0.11.2 and 0.12.0: `source_info_util.summarize` picks the innermost
    # frame outside JAX itself from the traceback JAX records on each equation.
    return _summarize_source(eqn.source_info)


def short_type(aval) -> str:
    """An abstract value's type in JAX's short notation, such as `"f32[16,64]"` or
    `"bf16[]"` (as `print_saved_residuals` and jaxprs print them)."""
    # JAX 0.10.2, 0.11.2 and 0.12.0: `ShapedArray.str_short(short_dtypes=True)`, a
    # method of JAX's internal `core.ShapedArray`.
    return aval.str_short(short_dtypes=True)


def custom_vmap_body(params: dict[str, Any]) -> ClosedJaxpr:
    """The body of a `custom_vmap_call`, closed (see the import above)."""
    call = params["call"]
    # JAX 0.10: a `ClosedJaxpr`; JAX 0.11 and 0.12: a `Jaxpr` with no constants.
    return call if isinstance(call, ClosedJaxpr) else ClosedJaxpr(call, ())


def custom_jvp_rule_jaxpr(
    params: dict[str, Any], num_args: int, zeros: Sequence[bool] | None = None
) -> tuple:
    """The JVP rule of a `custom_jvp_call` as `(closed_jaxpr, out_zeros)`, traced for
    tangents of which `zeros` say which are symbolic zeros (default: none).

    The jaxpr takes `(*primals, *nonzero_tangents)` (constants excluded) and returns
    `(*primal_outs, *nonzero_tangent_outs)`.
    """
    # JAX 0.10 to 0.12: `jvp_jaxpr_fun` is a `lu.WrappedFun` taking one "is symbolic
    # zero" flag per primal and returning (jaxpr, consts, out_zeros); the jaxpr takes
    # the primals and the tangents that are not symbolic zeros (`lift_jvp`).
    zeros = [False] * num_args if zeros is None else [bool(z) for z in zeros]
    jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    return ClosedJaxpr(jaxpr, consts), tuple(out_zeros)


def custom_vjp_rule_parts(
    params: dict[str, Any], num_args: int, nonzeros: Sequence[bool] | None = None
) -> tuple:
    """The forward and backward rules of a `custom_vjp_call`, the forward traced for
    primals of which `nonzeros` say which are perturbed (default: all).

    Returns `(fwd_jaxpr, res_forwards, bwd)`: `fwd_jaxpr` maps the primals (constants
    excluded) to `(*residuals, *primal_outs)`, where the residuals that are just
    forwarded inputs are left out; `res_forwards[i]` is the input index of residual `i`
    or None; `bwd(*residuals, *cotangents)` returns one cotangent per primal, with None
    where the rule returned a symbolic zero.
    """
    # JAX 0.10 to 0.12: `fwd_jaxpr_thunk` is a `lu.WrappedFun` taking one "is nonzero"
    # flag per primal; `out_trees()` returns (out_tree, res_tree, input_forwards) once
    # the forward has been traced; `bwd` is a `lu.WrappedFun` over flat arguments.
    nonzeros = [True] * num_args if nonzeros is None else [bool(z) for z in nonzeros]
    jaxpr, consts = params["fwd_jaxpr_thunk"].call_wrapped(*nonzeros)
    _, _, res_forwards = params["out_trees"]()
    bwd_fun = params["bwd"]
    # JAX 0.10: `bwd` returns the flat cotangents. JAX 0.11, 0.12: it returns the pair
    # `(cotangents, logs)` (`custom_vjp.defvjp_with_logs`); the logs are dropped, as
    # a plain `jax.vjp` drops them.
    returns_logs = _jax_version() >= (0, 11)

    def bwd(*args):
        outs = bwd_fun.call_wrapped(*args)
        if returns_logs:
            outs, _ = outs
        if len(outs) != num_args:
            raise AssertionError(
                f"JAX {jax.__version__}'s custom_vjp backward rule returned "
                f"{len(outs)} cotangents for {num_args} primals: update "
                "lowtrain/_compat.custom_vjp_rule_parts."
            )
        return [None if isinstance(o, _Zero) else o for o in outs]

    return ClosedJaxpr(jaxpr, consts), tuple(res_forwards), bwd


def scan_inputs(params: dict[str, Any], args: Sequence) -> tuple:
    """`(consts, init, xs)`: a `scan` equation's inputs (`args`: its values or its
    `invars`) split into its constants, initial carry and scanned inputs. Its outputs
    are the final carry (`len(init)` of them), then the stacked `ys`."""
    if "num_consts" in params:  # JAX 0.10: the two counts are parameters
        n_consts, n_carry = params["num_consts"], params["num_carry"]
    else:  # JAX 0.11, 0.12: `ft_in`, a `FlatTree`, packs the groups (consts,
        # carry, xs); iterating one group yields its leaves, one per input.
        consts, carry, _ = params["ft_in"].unpack()
        n_consts, n_carry = len(list(consts)), len(list(carry))
    args, end = tuple(args), n_consts + n_carry
    return args[:n_consts], args[n_consts:end], args[end:]


def check_version() -> None:
    """Raise if the installed JAX is outside the range this module was written for."""
    if not (0, 10) <= _jax_version() < (0, 13):
        raise ImportError(
            f"lowtrain supports JAX 0.10.x to 0.12.x, got jax {jax.__version__} "
            "instead. Install a supported version: `pip install 'jax>=0.10,<0.13'`."
        )


def make_value_identity_primitive(name: str, impl, transpose):
    """A new primitive `p` whose output has its input's shape and dtype.

    `impl(x, **params)` computes it (and lowers it, via `mlir.lower_fun`); it is linear
    for autodiff: its JVP applies `p` to the tangent, and `transpose(ct, **params)`
    gives the cotangent's transpose. Batching applies it elementwise to the batch.
    lowtrain's scalify ops (dynamic rescaling, scaled FP8 casts) are such primitives:
    the identity (or a rounding) on values, which the scalify interpreter recognises.
    """
    # JAX 0.10 to 0.12: `jax.interpreters.{ad,batching,mlir}` keep these helpers.
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x, **params: x)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    ad.deflinear2(prim, lambda ct, x, **params: [transpose(ct, **params)])
    batching.defvectorized(prim)
    return prim


def scaled_dot_quantize(x, mode: str, global_scale=None) -> tuple:
    """JAX's own block quantizer, the one `jax.nn.scaled_dot_general` applies to
    each operand: `(elements, scales)` of `x` in blocks along its last axis, which the
    block must divide. `mode` "mxfp8": E4M3 elements, E8M0 scales rounded up, blocks
    of 32; "nvfp4": E2M1 elements, E4M3 scales, blocks of 16, `x` first divided by
    `global_scale` (a float32 array of shape `(1,)`; default 1). What
    `lowtrain.fp8.block_quantize` is checked against."""
    # JAX 0.10.2 and the 0.11 line: `jax._src.cudnn.scaled_matmul_stablehlo.quantize
    # (x, config)`, its config a `BlockScaleConfig` from the public
    # `jax.nn.get_scaled_dot_general_config(mode, global_scale)`. Imported here, on
    # use, so that its moving breaks this function (and `tests/test_compat.py`), not
    # the import of lowtrain.
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize

    config = jax.nn.get_scaled_dot_general_config(mode, global_scale)
    with jax.numpy_rank_promotion("allow"):  # it divides by a (1,)-shaped scale
        return quantize(x, config)


def saved_residual_avals(fn, *args) -> list:
    """The types of the residuals `jax.vjp(fn, *args)` saves for the backward pass
    (what `jax.ad_checkpoint.print_saved_residuals` prints), for measuring memory."""
    # JAX 0.10 to 0.12: `print_saved_residuals` prints what this function returns,
    # a list of (aval, description) pairs.
    from jax._src.ad_checkpoint import saved_residuals

    return [aval for aval, _ in saved_residuals(fn, *args)]


@dataclasses.dataclass(frozen=True)
class VmapFrame:
    """The innermost `jax.vmap` being traced, seen from inside it: what lets a
    function called under `jax.vmap` run on the whole batch at once instead of being
    batched op by op (`lowtrain.amp` interprets `jax.vmap(f)` so)."""

    trace: Any

    @property
    def axis_name(self):
        name = self.trace.axis_data.name
        return None if name is _core.no_axis_name else name

    @property
    def axis_size(self) -> int:
        return self.trace.axis_data.size

    def split(self, x) -> tuple[Any, int | None]:
        """`(the batched array, its batch dimension)` of `x`; `(x, None)` where this
        vmap does not batch it."""
        val, dim = self.trace.to_batch_info(x)
        return val, (None if dim is None else int(dim))

    def outside(self):
        """A context in which arrays are the batched ones (the trace around the
        vmap)."""
        return _core.set_current_trace(self.trace.parent_trace)

    def wrap(self, batched, dim: int | None):
        """An array batched along `dim` (None: not batched), as a value of this
        vmap."""
        return _batching.BatchTracer(self.trace, batched, dim)

    def batch_flat(self, fn, args: Sequence, in_axes: Sequence) -> tuple[list, list]:
        """`fn(*args) -> list of arrays`, batched as `jax.vmap` with this vmap's
        axis name and size batches it (`in_axes` per argument): `(the outputs, their
        batch dimensions)`, None for an output that does not depend on the batch
        (as `jax.vmap(..., out_axes=None)` needs)."""
        name = self.trace.axis_data.name
        info = _api_util.debug_info("vmap", fn, tuple(args), {})
        wrapped = _lu.wrap_init(lambda *xs: list(fn(*xs)), debug_info=info)
        outs, out_axes = _vmap_unrestricted(
            wrapped,
            *args,
            in_axes=list(in_axes),
            axis_name=name,
            axis_size=self.axis_size,
        )
        return list(outs), [None if d is None else int(d) for d in out_axes]


def current_vmap() -> VmapFrame | None:
    """The innermost `jax.vmap` being traced, if that is the current trace (not,
    say, a `jax.grad` inside it); None otherwise. One that places its batch on mesh
    axes (`spmd_axis_name`, sharding-in-types) is not handled: None."""
    trace = _core.trace_ctx.trace
    if not isinstance(trace, _batching.BatchTrace):
        return None
    data = trace.axis_data
    if data.spmd_name is not None or getattr(data, "_ema", None) is not None:
        return None
    return VmapFrame(trace)


# JAX 0.10 to 0.12: `xla_bridge.backends_are_initialized()` says whether a backend
# (CPU, GPU) was made; XLA reads `XLA_FLAGS` once, when the first one is.
from jax._src.xla_bridge import backends_are_initialized as _backends_initialized  # noqa: E402


def backends_initialized() -> bool:
    """Whether JAX has made its backends (and so read `XLA_FLAGS`) in this process."""
    return _backends_initialized()
