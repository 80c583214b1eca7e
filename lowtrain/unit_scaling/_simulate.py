"""`simulate_fp8`: every matmul through FP8 by a plain cast (scale 1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._rewrite import rewrite
from ..fp8 import E4M3, E5M2, dequantize, fp8_dot_general, gemm_dims
from ..fp8.internal import (
    FORMAT_SCOPE,
    ROUNDINGS,
    from_bits,
    keep_op,
    matmul_sites,
    quantize_at,
    to_bits,
)

MATMULS = ("dot_general", "conv_general_dilated")


def _check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"Expected `rounding` among {', '.join(ROUNDINGS)}, got {rounding!r} "
            "instead."
        )
    return rounding


def fp8_cast_op(
    op: Callable, lhs: Array, rhs: Array, *, rounding: str = "nearest"
) -> Array:
    """`op(lhs, rhs)` with both operands cast to E4M3 and the cotangent to E5M2,
    all with scale 1: FP8 without per-tensor scales (a `lowtrain.rewrite` rule).

    `op` is bilinear (a matmul, an einsum, a convolution). Forward: `op` of the
    E4M3-rounded operands. Backward: the output cotangent is rounded to E5M2 and both
    gradients come from it and the E4M3 operands, as in `lowtrain.fp8`'s scaled path.
    The rounding is `lowtrain.fp8.quantize` (saturating, round to nearest even).
    The backward pass keeps the rounded operands as their FP8 bytes (`uint8`).
    A `dot_general` of a program that `lowtrain.rewrite` hands the rule (its `op`
    names its dimension numbers) becomes `lowtrain.fp8.fp8_dot_general` with static
    scale 1: on a GPU the forward and both backward products are FP8 GEMMs of the
    cast operands, with no amax pass; elsewhere, and for a convolution or a plain
    function `op`, `op` runs on the cast values in whatever precision the caller's
    policy gives it. Either way the product of the same FP8 values is accumulated in
    float32 and returned, under `lowtrain.amp`, in the compute dtype (under the
    "bf16" policy a bfloat16 matmul of FP8 values is exact: bfloat16 holds every
    E4M3 and E5M2 value). A model whose tensors are
    near unit scale (unit scaling) loses little; one whose are not (a standard GPT's
    small activations and gradients) underflows: the recipes' `fp8_naive` baseline.

    `rounding="stochastic"` rounds each of the three casts stochastically
    (`lowtrain.fp8.quantize`, its draws a hash of each value and its index, so the
    step is deterministic), as unit-scaling's FP8 simulation does by default.

    **Arguments:**

    - `op`: the bilinear function, `op(lhs, rhs)`: a `lowtrain.rewrite` rule's `op`
      (a `dot_general` or `conv_general_dilated` of the program, with its params)
      or any function such as `jnp.matmul`.
    - `lhs`: the left operand, a float array, cast to E4M3.
    - `rhs`: the right operand, a float array, cast to E4M3.
    - `rounding`: keyword-only; "nearest" (default) or "stochastic"; another
      raises `ValueError`.

    ```python
    import jax.numpy as jnp
    from lowtrain.unit_scaling import fp8_cast_op

    y = fp8_cast_op(jnp.matmul, jnp.array([[1000.0, 0.3, 1e-4]]), jnp.ones((3, 1)))
    assert float(y[0, 0]) == 448.0 + 0.3125  # saturated, rounded, flushed to zero
    ```
    """
    rounding = _check_rounding(rounding)
    params = getattr(op, "params", None)
    is_dot = getattr(getattr(op, "primitive", None), "name", "") == "dot_general"
    if is_dot and params:
        # A `dot_general` of a program (a `lowtrain.rewrite` rule's `op`): the same
        # casts written as an FP8 matmul with static scale 1, on a GPU an FP8 GEMM
        # of the cast operands; the product, accumulated in float32, is the same.
        out = params.get("preferred_element_type") or lhs.dtype
        dn = params["dimension_numbers"]
        return fp8_dot_general(
            lhs, rhs, dn, scale=1.0, out_dtype=out, rounding=rounding
        )
    sites = matmul_sites(jnp.shape(lhs), jnp.shape(rhs))

    def cast(x, role):
        dtype = E5M2 if role == "grad" else E4M3
        return quantize_at(x, dtype, 1.0, site=sites[role], rounding=rounding)

    @jax.custom_vjp
    def run(lhs, rhs):
        return op(
            dequantize(cast(lhs, "lhs"), 1.0, lhs.dtype),
            dequantize(cast(rhs, "rhs"), 1.0, rhs.dtype),
        )

    def fwd(a, b):
        ql, qr = cast(a, "lhs"), cast(b, "rhs")
        out = op(dequantize(ql, 1.0, a.dtype), dequantize(qr, 1.0, b.dtype))
        # The rounded operands are saved as their FP8 bits: one byte a value, not a
        # copy in the operands' dtype (float32 in a program `amp` runs in bf16).
        return out, (to_bits(ql), to_bits(qr))

    def bwd(res, g):
        ql, qr = (
            dequantize(from_bits(b, E4M3), 1.0, x.dtype)
            for b, x in zip(res, (lhs, rhs))
        )
        _, vjp = jax.vjp(op, ql, qr)
        return vjp(dequantize(cast(g, "grad"), 1.0, g.dtype))

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def fp8_weight_cast_op(
    op: Callable, lhs: Array, rhs: Array, *, rounding: str = "nearest"
) -> Array:
    """For a `dot_general`: `fp8_cast_op(op, lhs, rhs)` where an operand is a weight
    (rank 2 or less: a layer's matrix), else `op(lhs, rhs)` as it is: the products of
    two activations, attention's `q @ k.T` and `p @ v` (both of rank 3 or more), stay
    in the caller's precision, as FP8 training practice keeps them (their
    probabilities and scores are not unit-scaled: most of a softmax's outputs are far
    below 1). Not for convolutions, whose kernels have rank 3 or more: see
    `fp8_cast_rules`. (A product kept runs as `lowtrain.fp8`'s `keep_op`: as
    written, with the casts it would get named for a numerics report.)

    **Arguments:**

    - `op`: the `dot_general` (or any bilinear function such as `jnp.matmul`),
      `op(lhs, rhs)`.
    - `lhs`: the left operand, a float array.
    - `rhs`: the right operand, a float array.
    - `rounding`: keyword-only; the casts' rounding, "nearest" (default) or
      "stochastic", as `fp8_cast_op`'s (unused for a product kept).

    ```python
    import jax.numpy as jnp
    from lowtrain.unit_scaling import fp8_weight_cast_op

    x, w = jnp.full((2, 3, 4), 1e-4), jnp.ones((4, 2))  # 1e-4: 0 in E4M3
    assert float(fp8_weight_cast_op(jnp.matmul, x, w).max()) == 0.0  # cast
    scores = fp8_weight_cast_op(jnp.matmul, x, x.transpose(0, 2, 1))  # kept
    assert abs(float(scores[0, 0, 0]) - 4e-8) < 1e-13  # not flushed
    ```
    """
    if min(jnp.ndim(lhs), jnp.ndim(rhs)) <= 2:
        return fp8_cast_op(op, lhs, rhs, rounding=rounding)
    return keep_op(op, lhs, rhs)


@dataclasses.dataclass(frozen=True)
class _Rounded:
    # `rule(op, lhs, rhs, rounding=rounding)`: a rule of `fp8_cast_rules` with a
    # rounding other than the default, hashable by value (`lowtrain.rewrite` keys its
    # compiled programs on the rules).
    rule: Callable
    rounding: str

    def __call__(self, op, lhs: Array, rhs: Array) -> Array:
        return self.rule(op, lhs, rhs, rounding=self.rounding)


@dataclasses.dataclass(frozen=True)
class _AtLeast:
    # A `dot_general` rule applied only where the GEMM's M, N and K are all at least
    # `min_dim` (`lowtrain.fp8.gemm_dims`); a smaller one runs as written (`keep_op`).
    # Hashable by value.
    rule: Callable
    min_dim: int

    def __call__(self, op, lhs: Array, rhs: Array) -> Array:
        dn = op.params["dimension_numbers"]
        if min(gemm_dims(jnp.shape(lhs), jnp.shape(rhs), dn)) < self.min_dim:
            return keep_op(op, lhs, rhs)
        return self.rule(op, lhs, rhs)


def fp8_cast_rules(
    weights_only: bool = False, min_dim: int = 0, rounding: str = "nearest"
) -> dict[str, Callable]:
    """The `lowtrain.rewrite` rules of `simulate_fp8`: `fp8_cast_op` for every
    `dot_general` and `conv_general_dilated`; with `weights_only`, the
    `dot_general`s through `fp8_weight_cast_op` (convolutions are always cast: their
    kernel is a weight). With `min_dim`, a `dot_general` whose GEMM has an M, N or K
    below it (`lowtrain.fp8.gemm_dims`: too small for an FP8 GEMM to pay) is left as
    written. `rounding` ("nearest" or "stochastic") is each cast's (`fp8_cast_op`).

    ```python
    import lowtrain.unit_scaling as uu

    rules = uu.fp8_cast_rules(weights_only=True)
    assert rules["dot_general"] is uu.fp8_weight_cast_op
    assert rules["conv_general_dilated"] is uu.fp8_cast_op
    assert uu.fp8_cast_rules(min_dim=256) == uu.fp8_cast_rules(min_dim=256)
    sr = uu.fp8_cast_rules(rounding="stochastic")
    assert sr == uu.fp8_cast_rules(rounding="stochastic") != rules
    ```
    """
    if isinstance(min_dim, bool) or not isinstance(min_dim, int) or min_dim < 0:
        raise ValueError(
            f"Expected `min_dim` as an int >= 0 (0: every matmul in FP8), got "
            f"{min_dim!r} instead."
        )
    _check_rounding(rounding)
    rules = dict.fromkeys(MATMULS, fp8_cast_op)
    if weights_only:
        rules["dot_general"] = fp8_weight_cast_op
    if rounding != "nearest":
        rules = {k: _Rounded(rule, rounding) for k, rule in rules.items()}
    if min_dim:
        rules["dot_general"] = _AtLeast(rules["dot_general"], min_dim)
    return rules


def simulate_fp8(
    fn: Callable,
    *,
    weights_only: bool = False,
    keep: Sequence[str] = (),
    min_dim: int = 0,
    rounding: str = "nearest",
) -> Callable:
    """`fn` with every matmul and convolution through FP8 by a plain cast: operands
    to E4M3 forward, the cotangent to E5M2 backward, scale 1, saturating
    (`fp8_cast_op` on each `dot_general` and `conv_general_dilated`, by
    `lowtrain.rewrite`). What unit scaling makes safe: compose as
    `simulate_fp8(unit_scale(model))`, then `lowtrain.amp` around it for the rest.
    With `weights_only`, only the matmuls with a weight operand (`fp8_weight_cast_op`:
    attention's two products of activations stay as they are; `fp8_cast_rules`).
    Matmuls selected by `keep` (see `keep_scopes`: `jax.named_scope` names or globs,
    each optionally with `@` and the right operand's shape) stay as they are: the
    "critical" matmuls whose inputs u-μP finds growing during training, such
    as `uu.TransformerDecoder`'s readout (`"projection"`) and the MLPs'
    down-projections (`"linear_2"`), or what a `lowtrain.numerics.Plan` keeps
    (`plan.keep`). With `min_dim`, the matmuls whose GEMM has an M,
    N or K below it stay as they are too (see `fp8_cast_rules`). `rounding`:
    "nearest" (the default) or "stochastic" (see `fp8_cast_op`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    f = uu.simulate_fp8(lambda x, w: x @ w)
    x = jnp.array([[1.0 + 2**-5, 1e-4]])
    assert float(f(x, jnp.ones((2, 1)))[0, 0]) == 1.0  # 1 + 2**-5 rounds to 1 in E4M3
    g = jax.grad(lambda x: f(x, jnp.ones((2, 1))).sum() * 1e-6)(x)
    assert float(jnp.abs(g).max()) == 0.0  # 1e-6 is below E5M2's smallest subnormal

    def head(x, w):
        with jax.named_scope("projection"):
            return x @ w

    kept = uu.simulate_fp8(head, keep=["projection"])
    y = kept(x, jnp.ones((2, 1)))  # as written: not rounded, 1e-4 not flushed
    assert abs(float(y[0, 0]) - (1.0 + 2**-5 + 1e-4)) < 1e-6
    ```
    """
    rules = fp8_cast_rules(weights_only, min_dim, rounding)
    return rewrite(fn, rules, scopes=keep_scopes(keep, rules))


@dataclasses.dataclass(frozen=True)
class _Kept:
    # `keep_op` with the shadows' scaling (`amax`: current scaling's), hashable.
    amax: bool

    def __call__(self, op, lhs: Array, rhs: Array) -> Array:
        return keep_op(op, lhs, rhs, amax=self.amax)


@dataclasses.dataclass(frozen=True)
class _InFormat:
    # `op` inside the scope that names `fmt` (`format_scope`), hashable.
    fmt: str

    def __call__(self, op, lhs: Array, rhs: Array) -> Array:
        with jax.named_scope(format_scope(self.fmt)):
            return op(lhs, rhs)


@dataclasses.dataclass(frozen=True)
class _ByShape:
    # Inside a routed scope, the matmuls whose right operand has a shape of `routes`
    # run its rule; the others run `rule` (None: as written). Hashable by value.
    routes: tuple[tuple[tuple[int, ...], Callable], ...]
    rule: Callable | None

    @property
    def shapes(self) -> set[tuple[int, ...]]:
        return {shape for shape, _ in self.routes}

    def __call__(self, op, lhs: Array, rhs: Array) -> Array:
        shape = tuple(jnp.shape(rhs))
        for routed, rule in self.routes:
            if routed == shape:
                return rule(op, lhs, rhs)
        return op(lhs, rhs) if self.rule is None else self.rule(op, lhs, rhs)


WIDE = "wide"


def format_scope(fmt: str) -> str:
    """The `jax.named_scope` a matmul that `route_scopes` sends to format `fmt`
    runs in: `"lowtrain.format|<fmt>"`.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.format_scope("nvfp4") == "lowtrain.format|nvfp4"
    ```
    """
    return f"{FORMAT_SCOPE}|{fmt}"


def parse_keep(entry: str) -> tuple[str, tuple[int, ...] | None]:
    """`entry`, a `keep` entry (a string), as `(scope, rhs shape or None)`:
    `"projection"` -> `("projection", None)`, `"...i,io->...o@128x384"` ->
    `("...i,io->...o", (128, 384))`. A non-string raises `TypeError`, a malformed
    shape after `@` `ValueError`.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.parse_keep("linear_2") == ("linear_2", None)
    assert uu.parse_keep("...i,io->...o@128x384") == ("...i,io->...o", (128, 384))
    ```
    """
    if not isinstance(entry, str):
        raise TypeError(
            f"Expected a `keep` entry as a string such as 'projection' or "
            f"'...i,io->...o@128x384', got {entry!r} instead."
        )
    scope, at, shape = entry.rpartition("@")
    if not at:
        return entry, None
    try:
        dims = tuple(int(d) for d in shape.split("x"))
    except ValueError:
        dims = ()
    if not scope or not dims or min(dims) < 0:
        raise ValueError(
            f"Expected a `keep` entry as a scope name, or a scope name, '@' and the "
            f"right operand's shape such as '...i,io->...o@128x384', got {entry!r} "
            "instead."
        )
    return scope, dims


def keep_scopes(
    keep: Sequence[str], rules: dict | None = None, *, amax: bool = False
) -> dict[str, dict]:
    """`lowtrain.rewrite`'s `scopes=` that keeps the matmuls `keep` selects out of
    FP8: `simulate_fp8`'s `keep`. An entry is a `jax.named_scope` name or glob (every
    matmul and convolution inside it), or such a name, `@` and a shape (only the
    `dot_general`s inside it whose right operand, a layer's weight, has that shape:
    `"...i,io->...o@128x384"`, how a `lowtrain.numerics.Plan` names one of several
    layers sharing a scope; the other matmuls there run `rules`, or as written
    without `rules`). Kept matmuls run as written through `lowtrain.fp8`'s
    `keep_op`, which names the casts FP8 would perform (scale 1, or with `amax` the
    tensors' own amax) so a numerics report still judges them. Checked: a list of
    entries, not one string (whose letters would each become a scope).

    ```python
    import lowtrain.unit_scaling as uu

    assert set(uu.keep_scopes(["projection"])) == {"projection"}
    table = uu.keep_scopes(["mlp@128x512", "mlp@512x128"])
    assert table["mlp"]["dot_general"].shapes == {(128, 512), (512, 128)}
    ```
    """
    if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
        raise TypeError(
            "Expected `keep` as a list of `jax.named_scope` names, e.g. "
            f"['linear_2', 'projection'], got {keep!r} instead."
        )
    return route_scopes(dict.fromkeys(keep, WIDE), rules, amax=amax)


def route_scopes(
    routes: dict[str, str], rules: dict | None = None, *, amax: bool = False
) -> dict[str, dict]:
    """`lowtrain.rewrite`'s `scopes=` that runs each matmul `routes` selects in its
    own format: `routes` maps a `keep` entry (a scope name or glob, or such a name,
    `@` and the right operand's shape: `parse_keep`) to `"wide"` (kept out of FP8,
    as `keep_scopes` keeps it) or a format's name, which runs the matmul inside the
    scope `format_scope(name)` (`"lowtrain.format|nvfp4"`): a `lowtrain.Policy`
    that maps that scope to the action of the same name runs it so. How a
    `lowtrain.numerics.Plan` with several formats applies (`Plan.routes`).

    - `routes`: entry -> `"wide"` or a format's name.
    - `rules`: what the other matmuls of a scope named with a shape run (None: as
      written), as `keep_scopes`'.
    - `amax`: whether a wide matmul's shadow casts use each tensor's own amax
      (current scaling's) rather than scale 1 (`lowtrain.fp8.keep_op`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain
    import lowtrain.unit_scaling as uu

    def f(x, w):
        with jax.named_scope("attn"):
            return x @ w

    table = uu.route_scopes({"attn": "mxfp8", "mlp@128x512": "wide"})
    assert table["mlp"]["dot_general"].shapes == {(128, 512)}
    policy = lowtrain.get_policy("nvfp4").with_scopes(
        {uu.format_scope("mxfp8"): "mxfp8"}
    )
    routed = lowtrain.amp(lowtrain.rewrite(f, {}, scopes=table), policy)
    x, w = jnp.full((1, 32), 0.2).at[0, 0].set(6.0), jnp.ones((32, 1))
    assert abs(routed(x, w)[0, 0] - 12.2) < 0.2  # MXFP8: E4M3 keeps 0.2 next to 6
    assert lowtrain.amp(f, policy)(x, w)[0, 0] == 9.1875  # NVFP4: 15 of them flush
    ```
    """
    if not isinstance(routes, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in routes.items()
    ):
        raise TypeError(
            "Expected `routes` as a dict from `keep` entries to format names, e.g. "
            f"{{'attn': 'mxfp8', 'projection': 'wide'}}, got {routes!r} instead."
        )
    rule_of = lambda fmt: _Kept(amax) if fmt == WIDE else _InFormat(fmt)  # noqa: E731
    whole: dict[str, str] = {}
    shapes: dict[str, dict] = {}
    for entry, fmt in routes.items():
        scope, shape = parse_keep(entry)
        if shape is None:
            whole[scope] = fmt
        else:
            shapes.setdefault(scope, {})[shape] = fmt
    table = {
        name: dict.fromkeys(MATMULS, rule_of(fmt))
        for name, fmt in sorted(whole.items())
    }
    for name, found in sorted(shapes.items()):
        if name in whole:
            continue
        other = dict(rules or {})
        by_shape = tuple(sorted((s, rule_of(f)) for s, f in found.items()))
        table[name] = {
            **other,
            "dot_general": _ByShape(by_shape, other.get("dot_general")),
        }
    return table
