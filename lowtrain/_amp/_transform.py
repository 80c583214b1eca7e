"""`amp`: mixed precision as a function transform, and `amp_stop`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat, fp8
from .._attention import attention_config, dot_product_attention
from .._compat import COMBINER_PRIMITIVES, current_vmap, custom_vmap_p
from .._context import trace_key
from .._interpret import (
    SCATTERS,
    Eqn,
    FlatCall,
    Interpreter,
    call_transformed,
    variable_owners,
    write_back,
)
from ..fp8.internal import delayed_dot_config, static_dot_config
from ._params import param_vars
from ._policy import AMP_STOP_SCOPE, Policy, get_policy
from ._rules import (
    BLOCK,
    BLOCK_NAMES,
    BLOCK_PRIMITIVES,
    COMPUTE,
    FLOAT32,
    FP8,
    KEEP,
    WIDEST,
)

# The actions that run a matmul block-scaled, and those whose matmuls return the
# compute dtype.
_BLOCKS = (BLOCK, *BLOCK_NAMES)
_NARROW = (COMPUTE, FP8, *_BLOCKS)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype | None:
    best = None
    for d in dtypes:
        if best is None or jnp.finfo(d).bits > jnp.finfo(best).bits:
            best = d
        elif jnp.finfo(d).bits == jnp.finfo(best).bits and d != best:
            # float16 and bfloat16 have the same width: neither holds the other.
            best = jnp.dtype(jnp.float32)
    return best


def _cast(x, dtype):
    if x.dtype == dtype:
        return x
    return jnp.asarray(x).astype(dtype)


class _AmpInterpreter(Interpreter):
    def __init__(self, policy: Policy, n_params: int = 0):
        self.policy = policy
        self.n_params = n_params
        # The program's parameter variables (`_params.py`), found on the first
        # (outermost) evaluation when the policy has a block recipe: which operand
        # of a block-scaled matmul is the weight.
        self.weights: frozenset | None = None

    def eval_jaxpr(self, closed, args, *rest, **kwargs) -> list:
        if self.weights is None:
            block = self.policy.blocks and self.n_params
            self.weights = param_vars(closed, self.n_params) if block else frozenset()
        return super().eval_jaxpr(closed, args, *rest, **kwargs)

    @staticmethod
    def _cast(eqn: Eqn, x, dtype):
        # One cast per (value, dtype) per trace: ops sharing an input share its cast,
        # so the backward pass sums their cotangents once, in the wider dtype, and
        # casts back once (per-use casts would round each to half and sum in half).
        if x.dtype == dtype:
            return x
        key = (id(x), jnp.dtype(dtype))
        if key not in eqn.memo:
            eqn.memo[key] = (x, _cast(x, dtype))  # keeps `x` alive: ids stay unique
        return eqn.memo[key][1]

    def rule(self, eqn: Eqn, *invals) -> list:
        name = eqn.primitive.name
        if name == "convert_element_type":
            # An explicit cast in the program is honoured as written.
            return eqn.bind(*invals)
        action = self.policy.action(name, eqn.scopes)
        invals = [jnp.asarray(v) if not hasattr(v, "dtype") else v for v in invals]
        if action in (FP8, *_BLOCKS) and self._too_small(eqn):
            action = COMPUTE
        if action in _BLOCKS and not self._blockable(eqn):
            action = COMPUTE
        if action == FP8:
            return [self._fp8(eqn, *invals)]
        if action in _BLOCKS:
            return [self._block(eqn, self.policy.recipe(action), *invals)]
        if name in SCATTERS:
            return [self._scatter(eqn, action, *invals)]
        if name in COMBINER_PRIMITIVES:
            # Their combiner jaxpr is typed for the traced dtypes: keep those.
            action = KEEP
        if action == KEEP:
            args = [
                self._cast(eqn, v, a.dtype) if _is_float(v.dtype) else v
                for v, a in zip(invals, eqn.in_avals)
            ]
        else:
            target = self._target(action, invals, eqn.weak)
            if target is None:  # no float inputs: nothing to decide
                return eqn.bind(*invals)
            args = [
                self._cast(eqn, v, target) if _is_float(v.dtype) else v for v in invals
            ]
        params = {}
        if "preferred_element_type" in eqn.params:
            # dot_general/conv: return the operands' dtype (accumulation is float32 in
            # XLA either way, see `_rules.py`), so the backward matmuls run in it too.
            float_args = [a.dtype for a in args if _is_float(a.dtype)]
            pref = eqn.params["preferred_element_type"]
            if float_args and pref is not None and _is_float(pref):
                params["preferred_element_type"] = float_args[0]
        return eqn.bind(*args, **params)

    def higher_order(self, eqn: Eqn, *invals) -> list:
        if eqn.primitive is custom_vmap_p and self._keeps(eqn):
            # Inside `amp_stop` (as the FP8 ops' amax records are): bound as written,
            # so its batching rule still applies under a `jax.vmap` around `amp`.
            return self._as_written(eqn, invals)
        delayed = delayed_dot_config(eqn)
        if delayed is not None:
            return [self._fp8_delayed(eqn, delayed, *invals)]
        static = static_dot_config(eqn)
        if static is not None:
            return [self._fp8_static(eqn, static, *invals)]
        found = attention_config(eqn)
        if found is None:
            return super().higher_order(eqn, *invals)
        # `lowtrain.dot_product_attention`: called again on operands cast as the
        # policy says, so it runs whole in that dtype (cuDNN's kernel on a GPU)
        # instead of its traced body being placed op by op. Its backward pass, which
        # JAX derived from that call, runs as JAX wrote it.
        config, written = found
        action = (
            self.policy.action("dot_product_attention", eqn.scopes) if written else KEEP
        )
        if action == KEEP:
            args = [self._cast(eqn, v, a.dtype) for v, a in zip(invals, eqn.in_avals)]
        else:
            target = self._target(action, invals, eqn.weak)
            args = [self._cast(eqn, v, target) for v in invals]
        if not written:
            return eqn.bind(*args)
        return [dot_product_attention(*args, **config._asdict())]

    def unsupported(self, eqn: Eqn, *invals) -> list:
        # Inside `amp_stop` (or any "keep" scope) a higher-order op we cannot look into
        # runs as written.
        if not self._keeps(eqn):
            return super().unsupported(eqn, *invals)
        return self._as_written(eqn, invals)

    def _keeps(self, eqn: Eqn) -> bool:
        return self.policy.action(eqn.primitive.name, eqn.scopes) == KEEP

    def _as_written(self, eqn: Eqn, invals) -> list:
        # Inputs cast back to their traced dtypes, the equation bound unchanged.
        args = [_cast(jnp.asarray(v), a.dtype) for v, a in zip(invals, eqn.in_avals)]
        return eqn.bind(*args)

    def _scatter(self, eqn: Eqn, action, operand, indices, updates):
        # Rebuilt with `lax.scatter_*`, which traces a combiner for the new dtype.
        if action == KEEP:
            target = eqn.in_avals[0].dtype
        else:
            target = self._target(action, [operand, updates], (False, False))
        if target is None or not _is_float(operand.dtype):
            # An integer scatter (diffrax's step counters): nothing to decide.
            return eqn.bind(operand, indices, updates)[0]
        p = eqn.params
        return SCATTERS[eqn.primitive.name](
            self._cast(eqn, operand, target),
            indices,
            self._cast(eqn, updates, target),
            p["dimension_numbers"],
            indices_are_sorted=p["indices_are_sorted"],
            unique_indices=p["unique_indices"],
            mode=p["mode"],
        )

    def _too_small(self, eqn: Eqn) -> bool:
        # The policy's shape filter: an FP8 GEMM too small to pay for its casts.
        if eqn.primitive.name != "dot_general" or not self.policy.fp8_min_dim:
            return False
        lhs, rhs = (a.shape for a in eqn.in_avals)
        dims = fp8.gemm_dims(lhs, rhs, eqn.params["dimension_numbers"])
        return min(dims) < self.policy.fp8_min_dim

    def _blockable(self, eqn: Eqn) -> bool:
        # A block-scaled GEMM: a matmul with one contracting dimension per operand
        # (the blocks run along it) and a free one in each (the backward GEMMs
        # contract those); any other (a matrix-vector product, a contraction over
        # two dimensions, a convolution) runs in the compute dtype.
        if eqn.primitive.name not in BLOCK_PRIMITIVES:
            return False
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = (len(a.shape) for a in eqn.in_avals)
        free = lhs - len(lc) - len(lb) > 0 and rhs - len(rc) - len(rb) > 0
        return len(lc) == 1 and len(rc) == 1 and free

    def _block(self, eqn: Eqn, recipe, lhs, rhs):
        # The weight: the operand computed from a parameter (the right one if both
        # are; none for a product of activations), in `recipe`'s weight format.
        weights = self.weights or frozenset()
        lhs_w, rhs_w = (
            not isinstance(v, _compat.Literal) and v in weights for v in eqn.invars
        )
        weight = "rhs" if rhs_w else "lhs" if lhs_w else None
        dn = eqn.params["dimension_numbers"]
        return fp8.block_recipe_dot(
            lhs,
            rhs,
            dn,
            recipe,
            weight=weight,
            out_dtype=self.policy.compute_dtype,
        )

    def _fp8(self, eqn: Eqn, lhs, rhs):
        out = self.policy.compute_dtype
        if eqn.primitive.name == "dot_general":
            dn = eqn.params["dimension_numbers"]
            return fp8.fp8_dot_general(lhs, rhs, dn, out_dtype=out)
        params = dict(eqn.params)
        params.pop("preferred_element_type")
        return fp8.fp8_conv_general_dilated(lhs, rhs, out_dtype=out, **params)

    def _fp8_delayed(self, eqn: Eqn, config, lhs, rhs, *state):
        # `lowtrain.fp8.fp8_dot_general_delayed`: called again on the operands as
        # they come (as `_fp8` calls `fp8_dot_general`), its scales' state as traced
        # (float32), returning the dtype the policy gives a matmul; inside
        # `amp_stop` (a "keep" scope) as written.
        action = self.policy.action("dot_general", eqn.scopes)
        if action == KEEP:
            return self._as_written(eqn, (lhs, rhs, *state))[0]
        dn, treedef = config
        state = [_cast(v, a.dtype) for v, a in zip(state, eqn.in_avals[2:])]
        if action in _NARROW:
            out = self.policy.compute_dtype
        else:
            out = self._target(action, [lhs, rhs], eqn.weak[:2])
        scales = jax.tree.unflatten(treedef, state)
        return fp8.fp8_dot_general_delayed(lhs, rhs, dn, *scales, out_dtype=out)

    def _fp8_static(self, eqn: Eqn, config, lhs, rhs):
        # A static-scale `lowtrain.fp8.fp8_dot_general` (unit scaling's FP8 cast):
        # called again on the operands as they come, returning the dtype the policy
        # gives a matmul, so its FP8 product is written in the compute dtype; inside
        # a "keep" scope as written.
        action = self.policy.action("dot_general", eqn.scopes)
        if action == KEEP:
            return self._as_written(eqn, (lhs, rhs))[0]
        dn, scales, rounding = config
        if action in _NARROW:
            out = self.policy.compute_dtype
        else:
            out = self._target(action, [lhs, rhs], eqn.weak)
        return fp8.fp8_dot_general(
            lhs, rhs, dn, scale=scales, out_dtype=out, rounding=rounding
        )

    def _target(self, action, invals, weak):
        floats = [v.dtype for v in invals if _is_float(v.dtype)]
        if not floats:
            return None
        if action == COMPUTE:
            return self.policy.compute_dtype
        if action == FLOAT32:
            return _widest([jnp.dtype(jnp.float32), *floats])
        if action == WIDEST:
            # Scalar constants (the 2.0 in `x * 2.0`) follow the other inputs, as in
            # JAX's own promotion of weakly typed Python scalars.
            strong = [
                v.dtype for v, w in zip(invals, weak) if _is_float(v.dtype) and not w
            ]
            return _widest(strong or floats)
        return jnp.dtype(action)

    def join(self, types):
        def leaf(*ts):
            if _is_float(ts[0].dtype):
                return jax.ShapeDtypeStruct(ts[0].shape, _widest([t.dtype for t in ts]))
            return ts[0]

        return jax.tree.map(leaf, *types)

    def coerce(self, value, type_):
        if _is_float(value.dtype) and _is_float(type_.dtype):
            return _cast(value, type_.dtype)
        return value


def _save_half(half):
    """A `jax.checkpoint` policy: save an op's output only if it is not wider than
    `half` (so float32 values are recomputed in the backward pass)."""
    width = jnp.finfo(half).bits

    def saveable(prim, *avals, **params):
        out = params.get("new_dtype") or params.get("preferred_element_type")
        if out is None:
            floats = [a.dtype for a in avals if _is_float(getattr(a, "dtype", "i4"))]
            out = floats[0] if floats else None
        return out is None or not _is_float(out) or jnp.finfo(out).bits <= width

    return saveable


def _cast_floats(leaves, dtype):
    """`leaves` with the floats cast to `dtype`."""
    return [_cast(x, dtype) if _is_float(x.dtype) else x for x in leaves]


@eqx.filter_jit
def _amp_call(fn, policy: Policy, args, kwargs, settings=(), n_params=0):
    # Traced once per input structure (filter_jit's cache): the program is traced at the
    # dtypes it was written for, then re-interpreted under the policy.
    # Inputs enter as they are: each op casts what it uses (`_AmpInterpreter.rule`),
    # so an input used by float32 ops keeps its precision there.
    call = FlatCall(fn, args, kwargs)
    remat = _save_half(policy.compute_dtype) if policy.residuals == "half" else None
    # The first `n_params` inputs are the parameters (the wrapped module's leaves).
    outs = call_transformed(
        _AmpInterpreter(policy, n_params),
        call,
        call.inputs,
        leave=lambda outs: _cast_floats(outs, policy.output_dtype),
        remat_policy=remat,
    )
    out = call.rebuild(outs)
    # Inputs changed in place (Flax NNX state) come back in their own dtypes, to be
    # set on the caller's objects outside this jit (`_call`).
    updates = [(i, _cast(v, call.inputs[i].dtype)) for i, v in call.updates]
    return out, updates


def _batched_call(frame, fn, policy: Policy, args, kwargs, n_params: int):
    """`fn(*args, **kwargs)` called under the `jax.vmap` of `frame`, run as
    `amp(jax.vmap(fn), policy)` on the whole batch: the program `amp` places is the
    batched one (a weight gradient is one matmul over the batch, not one per example
    summed afterwards; a collective over the vmap's axis is an op on the batch).
    None if nothing in the call is batched by that vmap."""
    leaves, treedef = jax.tree.flatten((fn, args, kwargs))
    arrays = [eqx.is_array(x) for x in leaves]
    split = [frame.split(x) for x, a in zip(leaves, arrays) if a]
    if all(dim is None for _, dim in split):
        return None
    out_structure, out_dims = [], []

    def per_example(*xs):
        it = iter(xs)
        full = [next(it) if a else x for x, a in zip(leaves, arrays)]
        f, a, k = jax.tree.unflatten(treedef, full)
        variables = [v for v in variable_owners((f, a, k)) if v is not None]
        before = [v.get_value() for v in variables]
        dynamic, static = eqx.partition(f(*a, **k), eqx.is_array)
        if any(v.get_value() is not b for v, b in zip(variables, before)):
            raise TypeError(
                "Expected the function under `jax.vmap(amp(...))` not to change its "
                "inputs in place, got a change (a Flax NNX module's BatchNorm "
                "statistics or RNG stream, say), which a per-example call cannot "
                "keep. Call the module on the whole batch (`amp(model)(batch)`), or "
                "batch it with `nnx.vmap`, which says what each state is mapped over."
            )
        flat, out_tree = jax.tree.flatten(dynamic)
        out_structure[:] = [(out_tree, static)]
        return flat

    def batched(*xs):
        outs, dims = frame.batch_flat(per_example, xs, [d for _, d in split])
        out_dims[:] = dims
        return outs

    with frame.outside():
        # `fn`'s own array leaves come first among `split`: still the parameters.
        vals = tuple(val for val, _ in split)
        outs = _call(batched, policy, vals, {}, n_params=n_params)
    out_tree, static = out_structure[0]
    wrapped = [frame.wrap(x, d) for x, d in zip(outs, out_dims)]
    return eqx.combine(jax.tree.unflatten(out_tree, wrapped), static)


def _call(fn, policy: Policy, args, kwargs, n_params: int | None = None):
    # Under `jax.vmap`, the batched program (`_batched_call`; a vmap around that one
    # is peeled the same way); else `fn` itself. `n_params`: how many of the array
    # leaves of `(fn, args, kwargs)`, first, are parameters (None: `fn`'s own).
    if n_params is None:
        n_params = sum(1 for x in jax.tree.leaves(fn) if eqx.is_array(x))
    frame = current_vmap()
    if frame is not None:
        out = _batched_call(frame, fn, policy, args, kwargs, n_params)
        if out is not None:
            return out
    out, updates = _amp_call(fn, policy, args, kwargs, trace_key(), n_params)
    # What the call changed in place (an NNX BatchNorm's statistics, a dropout RNG
    # stream) is set on the caller's objects, as the call without `amp` sets it.
    write_back((fn, args, kwargs), updates)
    return out


class _Amp(eqx.Module):
    fn: Callable
    policy: Policy = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fn

    def __call__(self, *args, **kwargs):
        return _call(self.fn, self.policy, args, kwargs)


def amp(fn: Callable, policy: Policy | str) -> Callable:
    """Run `fn` in mixed precision under `policy`.

    `fn` is a function or any callable `eqx.Module`. The result is an `eqx.Module` that
    calls `fn` as follows: the program is traced at the dtypes it was written for, and
    every primitive, including those inside `jit`, `scan`, `while`, `cond`, `remat` and
    the rules of `custom_jvp`/`custom_vjp` functions, is re-run in the precision the
    policy gives it, its float inputs cast there, where it uses them (as
    `torch.autocast` casts): matmuls and convolutions in the compute dtype; exp, log,
    tanh, div, reductions and friends in float32; everything else in the widest float
    dtype of its inputs (a float32 bias added to a compute-dtype product gives
    float32). So an input (the module's parameters too) is rounded to the compute
    dtype only where a matmul uses it; float outputs are cast to
    `policy.output_dtype`.

    Parameters stay stored in their own dtype, so gradients with respect to them come
    back in it. The wrapped module's parameters are its leaves (`__wrapped__` is `fn`),
    so `eqx.filter_grad` of a loss that calls `amp(model, policy)` differentiates them.
    Each input structure is traced once and compiled (`eqx.filter_jit`), so eager calls
    do not re-trace; `amp` composes with `jax.jit`, `jax.grad`, `jax.vmap`,
    `jax.checkpoint` and their Equinox filtered versions, in either order. Under
    `jax.vmap` (the per-example way Equinox models are written) it runs
    `amp(jax.vmap(fn))`: the batched program, whose weight gradients are one matmul
    over the batch and whose collectives over the vmap's axis are ops on the batch.
    Outputs it does not cast (bools, ints, keys, constants) pass through.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain

    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    half = lowtrain.amp(mlp, "bf16")
    y = half(jnp.ones(4))
    assert y.dtype == jnp.float32  # output_dtype of the "bf16" preset
    grads = eqx.filter_grad(lambda m, x: m(x).sum())(half, jnp.ones(4))
    assert grads.fn.layers[0].weight.dtype == jnp.float32
    ```
    """
    if isinstance(policy, str):
        policy = get_policy(policy)
    if not isinstance(policy, Policy):
        raise TypeError(
            "Expected a `lowtrain.Policy` or a policy name such as 'bf16', got "
            f"{type(policy).__name__} instead."
        )
    if not callable(fn):
        raise TypeError(f"Expected a function or callable module, got {fn!r} instead.")
    return _Amp(fn, policy)


def amp_stop(fn: Callable | None = None) -> Any:
    """Keep a region in the precision it was written in, inside `amp`.

    Use as a decorator (`@amp_stop`: `fn` is the function it wraps) or a context
    manager (`with amp_stop():`, `fn` left `None`). Every primitive inside runs on
    inputs cast back to the dtypes the program was traced with, so a float32 region
    stays float32 even under a float16 policy. Outside `amp` it does nothing but open
    a `jax.named_scope`.

    ```python
    import jax.numpy as jnp
    import lowtrain

    def f(x):
        with lowtrain.amp_stop():
            y = x @ x  # stays float32
        return y @ x  # runs in the compute dtype

    out = lowtrain.amp(f, "fp16")(jnp.ones((2, 2)))
    ```
    """
    if fn is None:
        return jax.named_scope(AMP_STOP_SCOPE)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with jax.named_scope(AMP_STOP_SCOPE):
            return fn(*args, **kwargs)

    return wrapper
