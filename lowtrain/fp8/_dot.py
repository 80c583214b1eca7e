"""FP8 matmul and convolution: E4M3 operands forward, E5M2 cotangent backward."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .._compat import current_vmap
from .._scopes import AMP_STOP_SCOPE
from ._formats import E4M3, E5M2
from ._quantize import (
    ROUNDINGS,
    DelayedScale,
    amax,
    current_scale,
    dequantize,
    from_bits,
    quantize_at,
    record,
    to_bits,
)
from ._sites import KEEP_SCOPE, Site, conv_gemm, matmul_sites, probed

F32 = jnp.float32


def _exact(fn):
    # The FP8 ops choose every dtype themselves: inside `amp` (which re-interprets
    # their jaxprs, forward and backward) they run exactly as written.
    @functools.wraps(fn)
    def wrapper(*args):
        with jax.named_scope(AMP_STOP_SCOPE):
            return fn(*args)

    return wrapper


def _qdq(x, dtype, scale, out_dtype, site: Site | None = None, rounding="nearest"):
    # Quantize then dequantize: the operand's values after the round trip through FP8.
    q = quantize_at(x, dtype, scale, site=site, rounding=rounding)
    return dequantize(q, scale, out_dtype)


def gemm_of(lhs_shape, rhs_shape, dimension_numbers) -> tuple[int, int, int, int]:
    """`(batch, M, N, K)` of a `dot_general` of these shapes (`gemm_dims` and the
    product of the batch dimensions): its FLOPs are `2 * batch * M * N * K`."""
    (_, _), (lb, _) = dimension_numbers
    batch = math.prod(int(lhs_shape[d]) for d in lb)
    return (batch, *gemm_dims(lhs_shape, rhs_shape, dimension_numbers))


def _sites_of(op, lhs, rhs, dn, applied: bool = True) -> dict[str, Site]:
    # The cast sites of `op(lhs, rhs)`: a `dot_general` with dimension numbers `dn`,
    # or (dn None) a convolution `op`, whose output shape JAX infers.
    lhs_shape, rhs_shape = jnp.shape(lhs), jnp.shape(rhs)
    if dn is not None:
        gemm = gemm_of(lhs_shape, rhs_shape, dn)
    else:  # `op` is a `functools.partial` of `lax.conv_general_dilated`
        params = {**op.keywords, "preferred_element_type": None}
        # Shapes only: the operands may come in different float dtypes (an input
        # already in the compute dtype, a float32 kernel), which the op would refuse.
        lhs_, rhs_ = (jax.ShapeDtypeStruct(jnp.shape(x), F32) for x in (lhs, rhs))
        out = jax.eval_shape(functools.partial(op.func, **params), lhs_, rhs_).shape
        spec = op.keywords.get("dimension_numbers")
        gemm = conv_gemm(rhs_shape, out, _conv_features(lhs_shape, rhs_shape, spec))
    return matmul_sites(lhs_shape, rhs_shape, gemm, applied)


def _conv_features(lhs_shape, rhs_shape, dimension_numbers) -> int:
    # A convolution's output features: the size of the kernel's "O" dimension.
    spec = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    return int(rhs_shape[spec.rhs_spec[0]])


def f8_dot_lowering() -> bool:
    """Whether FP8 matmuls are written as a dot of the FP8 arrays themselves (on a GPU)
    rather than of their dequantized values (elsewhere). Decided when the op is traced,
    by JAX's default backend.

    Both compute `sum(a8 * b8) * sa * sb` from the same FP8 operands. The XLA of JAX
    0.11.2 (measured on an H100) compiles only the first to an FP8 GEMM on Hopper: it
    does not rewrite the dequantize pattern `dot(convert(a8) * sa, convert(b8) * sb)`,
    which then runs as a 16-bit GEMM on dequantized copies. The CPU keeps the
    dequantized form, whose results the recipes' tables record.
    """
    return jax.default_backend() == "gpu"


def _f8_dot(a: Array, b: Array, dn) -> Array:
    """`dot_general` of two FP8 arrays with float32 accumulation, batch dimensions
    moved to the front first (the batched layout cuBLASLt takes; the output, batch then
    `a`'s then `b`'s free dimensions, is the same)."""
    (ac, bc), (ab, bb) = dn
    a_free = [d for d in range(a.ndim) if d not in (*ac, *ab)]
    b_free = [d for d in range(b.ndim) if d not in (*bc, *bb)]
    nb = len(ab)
    a = a.transpose((*ab, *a_free, *ac))
    b = b.transpose((*bb, *bc, *b_free))
    batch = tuple(range(nb))
    contract = (tuple(range(nb + len(a_free), a.ndim)), tuple(range(nb, nb + len(bc))))
    return lax.dot_general(a, b, (contract, (batch, batch)), preferred_element_type=F32)


def _dot_grad(g: Array, x: Array, y: Array, dn, swap: bool) -> Array:
    """The gradient with respect to `x` of `dot_general(x, y, dn)` (`swap`: of
    `dot_general(y, x, dn')`, `x` the right operand) for the output cotangent `g`,
    with `_f8_dot`: JAX's transpose rule of `dot_general`, on FP8 arrays."""
    (xc, yc), (xb, yb) = dn
    x_kept = [d for d in range(x.ndim) if d not in (*xc, *xb)]
    y_kept = [d for d in range(y.ndim) if d not in (*yc, *yb)]
    nb = len(xb)
    free = (len(y_kept), len(x_kept)) if swap else (len(x_kept), len(y_kept))
    ans_y = range(nb + free[0], nb + sum(free)) if not swap else range(nb, nb + free[0])
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(range(nb)), tuple(yb)))
    x_contract_by_y = [xc[i] for i in sorted(range(len(yc)), key=lambda i: yc[i])]
    out_axes = np.argsort([*xb, *x_kept, *x_contract_by_y])
    return _f8_dot(g, y, dims).transpose(tuple(int(a) for a in out_axes))


def _scaled_out(ql, sl, qr, sr, op, dn, out_dtype):
    """`op(ql * sl, qr * sr)` in `out_dtype`, float32 accumulation."""
    if dn is not None and f8_dot_lowering():
        return (_f8_dot(ql, qr, dn) * (sl * sr)).astype(out_dtype)
    return op(dequantize(ql, sl, out_dtype), dequantize(qr, sr, out_dtype))


def _scaled_grads(
    g, sg, ql, sl, qr, sr, op, dn, out_dtype, site: Site, rounding="nearest"
):
    """The gradients of `_scaled_out` for the output cotangent `g`, which is quantized
    to E5M2 with scale `sg` (to be cast to each operand's dtype) as cast `site`."""
    if dn is not None and f8_dot_lowering():
        g8 = quantize_at(g, E5M2, sg, site=site, rounding=rounding)
        (lc, rc), (lb, rb) = dn
        dl = _dot_grad(g8, ql, qr, dn, swap=False) * (sg * sr)
        dr = _dot_grad(g8, qr, ql, ((rc, lc), (rb, lb)), swap=True) * (sg * sl)
        return dl, dr
    _, vjp = jax.vjp(op, dequantize(ql, sl, out_dtype), dequantize(qr, sr, out_dtype))
    return vjp(_qdq(g, E5M2, sg, out_dtype, site, rounding))


def _fp8_op(op, lhs, rhs, out_dtype, margin, dn=None, rounding="nearest"):
    """`op(lhs, rhs)` with both operands through E4M3, its cotangent through E5M2;
    `dn`: `op` is `dot_general` with these dimension numbers (GPU: `_f8_dot`).

    The residuals saved for the backward pass are the FP8 operands (as their bits)
    and their scales.
    """
    sites = _sites_of(op, lhs, rhs, dn)

    @jax.custom_vjp
    @_exact
    def run(lhs, rhs):
        return fwd(lhs, rhs)[0]

    @_exact
    def fwd(lhs, rhs):
        sl = current_scale(lhs, E4M3, margin=margin)
        sr = current_scale(rhs, E4M3, margin=margin)
        ql = quantize_at(lhs, E4M3, sl, site=sites["lhs"], rounding=rounding)
        qr = quantize_at(rhs, E4M3, sr, site=sites["rhs"], rounding=rounding)
        out = _scaled_out(ql, sl, qr, sr, op, dn, out_dtype)
        return out, (to_bits(ql), sl, to_bits(qr), sr)

    @_exact
    def bwd(res, g):
        bl, sl, br, sr = res
        ql, qr = from_bits(bl, E4M3), from_bits(br, E4M3)
        sg = current_scale(g, E5M2, margin=margin)
        site = sites["grad"]
        dl, dr = _scaled_grads(g, sg, ql, sl, qr, sr, op, dn, out_dtype, site, rounding)
        return dl.astype(lhs.dtype), dr.astype(rhs.dtype)

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def fp8_dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers,
    *,
    out_dtype=None,
    margin: int = 0,
    scale: float | tuple[float, float, float] | None = None,
    rounding: str = "nearest",
) -> Array:
    """`lax.dot_general` in FP8, with per-tensor current scaling or a static scale.

    Forward: each operand is scaled, cast to E4M3 with saturation, and multiplied with
    float32 accumulation; the result is returned in `out_dtype` (default:
    `lhs.dtype`). Backward: the output cotangent is scaled and cast to E5M2, and both
    input gradients are computed from FP8 operands (the E4M3 forward operands, saved
    as the residuals, and the E5M2 cotangent). Any batch and contracting dimensions
    work (attention einsums too). On a GPU the three products are dots of the FP8
    arrays themselves, which XLA compiles to FP8 GEMMs on Hopper (`f8_dot_lowering`).

    The scales: with `scale=None` (the default) each tensor's own, from its amax
    (`current_scale`, `margin` powers of two of headroom). With `scale` a number, or
    `(lhs, rhs, cotangent)` numbers, those static scales (1, or a power of two, so
    scaling is exact): no pass reads a tensor for its amax. This is the FP8 of unit
    scaling, whose tensors are near unit scale by construction
    (`lowtrain.unit_scaling.simulate_fp8`, the `unit_fp8` recipes). Under
    `lowtrain.amp` a static-scale product comes back in the policy's compute dtype.

    `rounding` is the three casts' (`quantize`): "nearest", or "stochastic"
    (unbiased, its draws a hash of each value and its index; on a GPU the products
    are FP8 GEMMs of the stochastically rounded operands all the same).

    **Arguments:**

    - `lhs`, `rhs`: the operands, float arrays.
    - `dimension_numbers`: `((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))`, as for `lax.dot_general`.
    - `out_dtype`: the result's dtype; default (None) `lhs.dtype`.
    - `margin`: with current scaling, the headroom exponent of every scale
      (`2**margin`); default 0.
    - `scale`: None (the default: current scaling), or a positive finite number, or
      three of them `(lhs, rhs, cotangent)`: static scales.
    - `rounding`: "nearest" (the default) or "stochastic".

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (8, 16)) * 1e4
    w = jax.random.normal(jax.random.key(1), (16, 4)) * 1e-4
    dn = (((1,), (0,)), ((), ()))
    y = fp8.fp8_dot_general(x, w, dn)
    assert jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.05
    # Static scale 1: values beyond 448 saturate, as a plain cast does.
    y1 = fp8.fp8_dot_general(jnp.array([[1000.0, 0.3]]), jnp.ones((2, 1)), dn, scale=1)
    assert float(y1[0, 0]) == 448.0 + 0.3125
    ```
    """
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"Expected `rounding` among {', '.join(ROUNDINGS)}, got {rounding!r} "
            "instead."
        )
    if scale is not None:
        return _static(lhs, rhs, dimension_numbers, scale, out_dtype, rounding)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    op = functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        preferred_element_type=out_dtype,
    )
    return _fp8_op(op, lhs, rhs, out_dtype, margin, dimension_numbers, rounding)


def gemm_dims(lhs_shape, rhs_shape, dimension_numbers) -> tuple[int, int, int]:
    """The GEMM a `dot_general` of operands of shapes `lhs_shape` and `rhs_shape`
    with `dimension_numbers` (as for `lax.dot_general`) is, batch dimensions aside:
    `(M, N, K)`, the sizes of `lhs`'s free dimensions, `rhs`'s free dimensions and
    the contracting ones (each the product over its dimensions). A shape filter such as
    `lowtrain.Policy(fp8_min_dim=...)` compares the smallest with its threshold: an
    FP8 GEMM pays for its casts only when all three are large.

    ```python
    import lowtrain.fp8 as fp8

    dn = (((2,), (0,)), ((), ()))  # (B, T, C) @ (C, D)
    assert fp8.gemm_dims((8, 1024, 768), (768, 3072), dn) == (8192, 3072, 768)
    heads = (((3,), (3,)), ((0, 2), (0, 2)))  # q @ k.T per batch and head
    assert fp8.gemm_dims((8, 1024, 12, 64), (8, 1024, 12, 64), heads)[2] == 64
    ```
    """
    (lc, rc), (lb, rb) = dimension_numbers
    size = lambda shape, dims: math.prod(int(shape[d]) for d in dims)
    lf = [d for d in range(len(lhs_shape)) if d not in (*lc, *lb)]
    rf = [d for d in range(len(rhs_shape)) if d not in (*rc, *rb)]
    return size(lhs_shape, lf), size(rhs_shape, rf), size(lhs_shape, lc)


def _static_scales(scale) -> tuple[float, float, float]:
    scales = (scale,) * 3 if isinstance(scale, int | float) else tuple(scale)
    if len(scales) != 3 or not all(
        isinstance(s, int | float) and math.isfinite(s) and s > 0 for s in scales
    ):
        raise ValueError(
            "Expected `scale` as a positive number or three of them (lhs, rhs, "
            f"cotangent), e.g. 1.0 or (1.0, 1.0, 2.0**-4), got {scale!r} instead. "
            "Use `scale=None` for current scaling (each tensor's own amax)."
        )
    return tuple(float(s) for s in scales)


def _normal_dn(dimension_numbers) -> tuple:
    # Hashable, whatever sequences they came as: ((lc, rc), (lb, rb)) of int tuples.
    return tuple(tuple(tuple(map(int, d)) for d in pair) for pair in dimension_numbers)


def _static(lhs, rhs, dimension_numbers, scale, out_dtype, rounding) -> Array:
    scales = _static_scales(scale)
    dn = _normal_dn(dimension_numbers)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    on_batch = _on_whole_batch(
        lambda lhs, rhs, dn: _static(lhs, rhs, dn, scales, out_dtype, rounding),
        lhs,
        rhs,
        dn,
    )
    if on_batch is not None:
        return on_batch
    dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype), out_dtype)
    ranks = (jnp.ndim(lhs), jnp.ndim(rhs))
    # The lowering is part of the key: a jit traces once, and the backend decides it.
    static = _static_op(dn, dtypes, scales, ranks, f8_dot_lowering(), rounding)
    return static(lhs, rhs)


def fp8_conv_general_dilated(
    lhs: Array, rhs: Array, *, out_dtype=None, margin=0, **params
):
    """`lax.conv_general_dilated` in FP8 (same scheme as `fp8_dot_general`, with
    current scaling).

    **Arguments:**

    - `lhs`: the input, a float array.
    - `rhs`: the kernel, a float array.
    - `out_dtype`: the result's dtype; default (None) `lhs.dtype`.
    - `margin`: the headroom exponent of every scale (`2**margin`); default 0.
    - `**params`: `conv_general_dilated`'s other keyword arguments
      (`window_strides`, `padding`, ...), passed on.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (1, 2, 8, 8))
    k = jax.random.normal(jax.random.key(1), (3, 2, 3, 3))
    y = fp8.fp8_conv_general_dilated(x, k, window_strides=(1, 1), padding="SAME")
    ref = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")
    assert jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref) < 0.05
    ```
    """
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    params = {**params, "preferred_element_type": out_dtype}
    op = functools.partial(lax.conv_general_dilated, **params)
    return _fp8_op(op, lhs, rhs, out_dtype, margin)


def fp8_dot_general_delayed(
    lhs: Array,
    rhs: Array,
    dimension_numbers,
    lhs_scale: DelayedScale,
    rhs_scale: DelayedScale,
    g_scale: DelayedScale,
    *,
    out_dtype=None,
) -> Array:
    """`fp8_dot_general` with delayed scaling.

    Each tensor is quantized with the scale of its `DelayedScale` (`lhs_scale`,
    `rhs_scale`: E4M3; `g_scale`, the output cotangent's: E5M2), so no cast waits for
    its own tensor's amax. The "gradient" returned for each `DelayedScale` is the
    call's record: the tensor's amax in `amax_history[0]` (zeros after it) and 1 in
    `scale`, the number of calls. The records of several calls add up, as a shared
    weight's gradients do; `pop_scales(grads, model)` turns their sum into the new
    states (see `Fp8Linear`). The result is in `out_dtype` (default: `lhs.dtype`);
    under `lowtrain.amp` in the policy's compute dtype, as the "fp8" policy returns
    its FP8 matmuls' (the op is a jit `amp` recognises by its name; under a
    `jax.vmap` inside `amp`, JAX has batched that jit before `amp` sees it, and it
    runs as written). Under `jax.vmap`, a state shared by the batch records the amax
    of the whole batch, as a call on the batch does; a batched state, one per member.

    **Arguments:**

    - `lhs`, `rhs`: the operands, float arrays.
    - `dimension_numbers`: as for `lax.dot_general`.
    - `lhs_scale`, `rhs_scale`: the operands' `DelayedScale`s (E4M3).
    - `g_scale`: the output cotangent's `DelayedScale` (E5M2).
    - `out_dtype`: the result's dtype; default (None) `lhs.dtype`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x, w = jnp.full((2, 4), 3.0), jnp.full((4, 3), 0.5)
    s = [fp8.DelayedScale(fp8.E4M3), fp8.DelayedScale(fp8.E4M3)]
    s.append(fp8.DelayedScale(fp8.E5M2))
    dn = (((1,), (0,)), ((), ()))
    loss = lambda x, w, *s: jnp.sum(fp8.fp8_dot_general_delayed(x, w, dn, *s))
    _, _, xs, ws, gs = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w, *s)
    assert xs.amax_history[0] == 3.0 and ws.amax_history[0] == 0.5  # the amaxes
    assert gs.amax_history[0] == 1.0 and gs.scale == 1.0  # a sum's cotangent; 1 call
    ```
    """
    scales = (lhs_scale, rhs_scale, g_scale)
    dn = _normal_dn(dimension_numbers)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    on_batch = _on_whole_batch(
        lambda lhs, rhs, dn, *scales: fp8_dot_general_delayed(
            lhs, rhs, dn, *scales, out_dtype=out_dtype
        ),
        lhs,
        rhs,
        dn,
        scales,
    )
    if on_batch is not None:
        return on_batch
    dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype), out_dtype)
    # The rank of every input: under `jax.vmap` JAX batches the jit into one of the
    # same name whose inputs have more axes (`delayed_dot_config` tells them apart).
    ranks = tuple(jnp.ndim(a) for a in jax.tree.leaves((lhs, rhs, scales)))
    treedef = jax.tree.structure(scales)
    return _delayed_op(dn, dtypes, treedef, ranks)(lhs, rhs, scales)


def _on_whole_batch(op, lhs, rhs, dn, rest=()) -> Array | None:
    """Under a `jax.vmap` that batches `lhs` only (not `rhs`, the weight, nor the
    leaves of `rest`): `op(lhs, rhs, dn, *rest)` called once on the whole batch, the
    batch one more free dimension of `lhs`, as a layer applied to a batch does, so
    a tensor's scale and amax are the batch's and `amp` finds the op it knows (JAX
    would batch the op's jit into one of more axes). None otherwise."""
    frame = current_vmap()
    if frame is None:
        return None
    lhs_b, lhs_dim = frame.split(lhs)
    others = [frame.split(x) for x in jax.tree.leaves((rhs, rest))]
    if lhs_dim is None or any(dim is not None for _, dim in others):
        return None
    rhs_v, *rest_v = [v for v, _ in others]
    rhs_v = jax.tree.unflatten(jax.tree.structure(rhs), [rhs_v])
    rest_v = jax.tree.unflatten(jax.tree.structure(tuple(rest)), rest_v)
    (lc, rc), (lb, rb) = dn
    shift = lambda dims: tuple(d + 1 for d in dims)
    batched_dn = ((shift(lc), rc), (shift(lb), rb))
    with frame.outside():
        out = op(jnp.moveaxis(lhs_b, lhs_dim, 0), rhs_v, batched_dn, *rest_v)
    # `dot_general`'s output: batch dimensions, then `lhs`'s free ones (the vmap's
    # first among them), then `rhs`'s.
    return frame.wrap(out, len(lb))


# `fp8_dot_general_delayed` runs as a jit with a name of its own per configuration
# (dimension numbers, dtypes, the scales' structure and static fields, none of which
# is in the equation's parameters, and the inputs' ranks): `amp` finds it in a jaxpr
# by that name, as it finds `lowtrain.dot_product_attention`.
_DELAYED_NAME = "lowtrain_fp8_dot_general_delayed_"
_DELAYED: dict[str, tuple] = {}


def delayed_dot_config(eqn) -> tuple | None:
    """For an equation (a `lowtrain._eqn.Eqn`) of `fp8_dot_general_delayed` as called:
    `(dimension_numbers, the scales' treedef)`; None for any other. (JAX's autodiff
    splits a jit into jits of the same name, with other signatures, and `jax.vmap`
    batches it into one with more axes: the call takes `lhs`, `rhs` and the scales'
    leaves, with the ranks it was made for, and returns the product.)"""
    return _registered(eqn, _DELAYED)


def _registered(eqn, table: dict[str, tuple]) -> tuple | None:
    # The configuration `table` holds for the jit `eqn` calls (its last entry the
    # inputs' ranks, which must match), or None.
    if eqn.primitive.name != "jit":
        return None
    config = table.get(eqn.params.get("name", ""))
    if config is None:
        return None
    *config, ranks = config
    if len(eqn.out_avals) != 1 or tuple(a.ndim for a in eqn.in_avals) != ranks:
        return None
    return tuple(config)


def _register(call, prefix: str, table: dict[str, tuple], config: tuple):
    # `call` as a jit named `prefix` + a number, its configuration in `table`.
    call.__name__ = call.__qualname__ = f"{prefix}{len(table)}"
    table[call.__name__] = config
    return jax.jit(call)


def _recorded(state: DelayedScale, x: Array) -> DelayedScale:
    return record(state, amax(x))


# The call's record of `x`'s amax for `state` (`lowtrain.fp8._quantize.record`).
# Under `jax.vmap` with one state for the whole batch, the amax is over the whole
# batch, as when the op is called on it (JAX's default would record each example's
# and sum them: the record comes back as a cotangent, and the cotangent of an
# unbatched input is summed over the batch).
_record = jax.custom_batching.custom_vmap(_recorded)


@_record.def_vmap
def _record_vmap(axis_size, in_batched, state, x):
    state_batched, _ = in_batched
    if not any(jax.tree.leaves(state_batched)):
        return _record(state, x), jax.tree.map(lambda _: False, state)
    # One state per member (a vmapped stack of layers): each records its own tensor.
    state = jax.tree.map(
        lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)),
        state,
        state_batched,
    )
    x_axis = 0 if in_batched[1] else None
    new = jax.vmap(_recorded, in_axes=(0, x_axis))(state, x)
    return new, jax.tree.map(lambda _: True, new)


@functools.cache
def _delayed_op(dimension_numbers, dtypes, treedef, ranks):
    lhs_dtype, rhs_dtype, out_dtype = dtypes
    op = functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        preferred_element_type=out_dtype,
    )

    def sites_for(lhs, rhs):
        return _sites_of(op, lhs, rhs, dimension_numbers)

    @_exact
    def product(lhs, rhs, scales):
        ls, rs, _ = scales
        sites = sites_for(lhs, rhs)
        ql = quantize_at(lhs, E4M3, ls.scale, site=sites["lhs"])
        qr = quantize_at(rhs, E4M3, rs.scale, site=sites["rhs"])
        out = _scaled_out(ql, ls.scale, qr, rs.scale, op, dimension_numbers, out_dtype)
        return out, ql, qr

    @jax.custom_vjp
    def run(lhs, rhs, scales):
        return product(lhs, rhs, scales)[0]

    @_exact
    def fwd(lhs, rhs, scales):
        ls, rs, gs = scales
        out, ql, qr = product(lhs, rhs, scales)
        records = (_record(ls, lhs), _record(rs, rhs))
        return out, (to_bits(ql), to_bits(qr), ls.scale, rs.scale, records, gs)

    @_exact
    def bwd(res, g):
        bl, br, sl, sr, (rec_l, rec_r), gs = res
        ql, qr = from_bits(bl, E4M3), from_bits(br, E4M3)
        site = sites_for(ql, qr)["grad"]
        dl, dr = _scaled_grads(
            g, gs.scale, ql, sl, qr, sr, op, dimension_numbers, out_dtype, site
        )
        # The "gradients" of the scales are this call's records (see `record`).
        records = (rec_l, rec_r, _record(gs, g))
        return dl.astype(lhs_dtype), dr.astype(rhs_dtype), records

    def call(lhs, rhs, scales):
        return run(lhs, rhs, scales)

    run.defvjp(fwd, bwd)
    return _register(call, _DELAYED_NAME, _DELAYED, (dimension_numbers, treedef, ranks))


# A static-scale `fp8_dot_general` runs as a jit with a name of its own per
# configuration (dimension numbers, dtypes, scales, the inputs' ranks), as the delayed
# one does: `amp` finds it by that name and calls it again for the compute dtype.
_STATIC_NAME = "lowtrain_fp8_dot_general_static_"
_STATIC: dict[str, tuple] = {}


def static_dot_config(eqn) -> tuple | None:
    """For an equation (a `lowtrain._eqn.Eqn`) of a static-scale `fp8_dot_general`
    as called: `(dimension_numbers, scales, rounding)`; None for any other (a jit of
    another name, or one `jax.vmap` batched into more axes)."""
    return _registered(eqn, _STATIC)


@functools.cache
def _static_op(dimension_numbers, dtypes, scales, ranks, f8_dots, rounding):
    lhs_dtype, rhs_dtype, out_dtype = dtypes
    sl, sr, sg = scales
    op = functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        preferred_element_type=out_dtype,
    )

    def sites_for(lhs, rhs):
        return _sites_of(op, lhs, rhs, dimension_numbers)

    @jax.custom_vjp
    def run(lhs, rhs):
        return fwd(lhs, rhs)[0]

    @_exact
    def fwd(lhs, rhs):
        # The scales are Python numbers: constants XLA folds (1: no multiply at all).
        sites = sites_for(lhs, rhs)
        ql = quantize_at(lhs, E4M3, sl, site=sites["lhs"], rounding=rounding)
        qr = quantize_at(rhs, E4M3, sr, site=sites["rhs"], rounding=rounding)
        dn = dimension_numbers if f8_dots else None  # None: the dequantized product
        out = _scaled_out(ql, sl, qr, sr, op, dn, out_dtype)
        return out, (to_bits(ql), to_bits(qr))

    @_exact
    def bwd(res, g):
        ql, qr = (from_bits(b, E4M3) for b in res)
        dn = dimension_numbers if f8_dots else None
        site = sites_for(ql, qr)["grad"]
        dl, dr = _scaled_grads(g, sg, ql, sl, qr, sr, op, dn, out_dtype, site, rounding)
        return dl.astype(lhs_dtype), dr.astype(rhs_dtype)

    run.defvjp(fwd, bwd)

    def call(lhs, rhs):
        return run(lhs, rhs)

    config = (dimension_numbers, scales, rounding, ranks)
    return _register(call, _STATIC_NAME, _STATIC, config)


def keep_op(op, lhs: Array, rhs: Array, *, amax: bool = False) -> Array:
    """`op(lhs, rhs)` as written: a `lowtrain.rewrite` rule for a matmul (or
    convolution) kept out of FP8. It runs inside the `KEEP_SCOPE` named scope
    (`"lowtrain.fp8_keep"`), its
    backward pass too (a policy that would put it in FP8 maps the scope to its
    compute dtype), and forward and backward it names shadows of the three casts FP8
    would perform (`lowtrain.fp8._sites.probed`: scale 1 as unit scaling's casts,
    or with `amax` each tensor's own amax, as current scaling), so a numerics
    report still judges the matmul and a plan can move it back into FP8. Values and
    gradients are `op`'s: the shadows are multiplications by 1, which XLA removes.

    **Arguments:**

    - `op`: the operation as `lowtrain.rewrite` passes it (`op.primitive` and
      `op.params` name a `dot_general` or `conv_general_dilated`), or a plain
      function of `(lhs, rhs)`.
    - `lhs`, `rhs`: its operands.
    - `amax`: whether the shadow casts use each tensor's own amax (True) rather than
      scale 1 (False, the default).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain
    import lowtrain.fp8 as fp8

    f = lowtrain.rewrite(lambda x, w: x @ w, {"dot_general": fp8.keep_op})
    x, w = jnp.array([[1.0 + 2**-5, 1e-4]]), jnp.ones((2, 1))
    assert jnp.array_equal(f(x, w), x @ w)  # not rounded to FP8
    ```
    """
    params = getattr(op, "params", None) or {}
    prim = getattr(getattr(op, "primitive", None), "name", "")
    if prim == "dot_general":
        dn = params["dimension_numbers"]
        sites = matmul_sites(
            jnp.shape(lhs), jnp.shape(rhs), gemm_of(jnp.shape(lhs), jnp.shape(rhs), dn)
        )
    elif prim == "conv_general_dilated":
        out = jax.eval_shape(op, lhs, rhs).shape
        spec = params["dimension_numbers"]
        features = _conv_features(jnp.shape(lhs), jnp.shape(rhs), spec)
        sites = matmul_sites(
            jnp.shape(lhs), jnp.shape(rhs), conv_gemm(jnp.shape(rhs), out, features)
        )
    else:  # a plain function: no GEMM to name
        sites = matmul_sites(jnp.shape(lhs), jnp.shape(rhs))
    shadow = dict(applied=False, amax=amax)
    sites = {k: dataclasses.replace(v, **shadow) for k, v in sites.items()}

    def wide(lhs, rhs):
        with jax.named_scope(KEEP_SCOPE):
            return op(lhs, rhs)

    def forward(lhs, rhs):
        return wide(probed(lhs, sites["lhs"]), probed(rhs, sites["rhs"]))

    @jax.custom_vjp
    def run(lhs, rhs):
        return forward(lhs, rhs)

    def fwd(lhs, rhs):
        return forward(lhs, rhs), (lhs, rhs)

    def bwd(res, g):
        _, vjp = jax.vjp(wide, *res)
        return vjp(probed(g, sites["grad"]))

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)
