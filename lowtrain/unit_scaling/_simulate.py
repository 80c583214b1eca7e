"""`simulate_fp8`: every matmul through FP8 by a plain cast (scale 1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jaxtyping import Array

from .._rewrite import rewrite
from ..fp8 import E4M3, E5M2, dequantize, quantize
from ..fp8._quantize import from_bits, to_bits

MATMULS = ("dot_general", "conv_general_dilated")


def _fp8_round(x: Array, dtype) -> Array:
    # Scale 1: `x` itself is cast, saturating at the format's max (448 for E4M3,
    # 57344 for E5M2); magnitudes below half the smallest subnormal (2**-10 for E4M3,
    # 2**-17 for E5M2) become 0. The result is in `x.dtype` again.
    return dequantize(quantize(x, dtype, 1.0), 1.0, x.dtype)


def fp8_cast_op(op: Callable, lhs: Array, rhs: Array) -> Array:
    """`op(lhs, rhs)` with both operands cast to E4M3 and the cotangent to E5M2,
    all with scale 1: FP8 without per-tensor scales (a `lowtrain.rewrite` rule).

    `op` is bilinear (a matmul, an einsum, a convolution). Forward: `op` of the
    E4M3-rounded operands. Backward: the output cotangent is rounded to E5M2 and both
    gradients come from it and the E4M3 operands, as in `lowtrain.fp8`'s scaled path.
    The rounding is `lowtrain.fp8.quantize` (saturating, round to nearest even).
    The backward pass keeps the rounded operands as their FP8 bytes (`uint8`).
    Around it, `op` runs in whatever precision the caller's policy gives it: under
    the "bf16" policy that is a bfloat16 matmul of FP8 values (exact: bfloat16 holds
    every E4M3 and E5M2 value), accumulated in float32. A model whose tensors are
    near unit scale (unit scaling) loses little; one whose are not (a standard GPT's
    small activations and gradients) underflows: the recipes' `fp8_naive` baseline.

    ```python
    import jax.numpy as jnp
    from lowtrain.unit_scaling import fp8_cast_op

    y = fp8_cast_op(jnp.matmul, jnp.array([[1000.0, 0.3, 1e-4]]), jnp.ones((3, 1)))
    assert float(y[0, 0]) == 448.0 + 0.3125  # saturated, rounded, flushed to zero
    ```
    """

    @jax.custom_vjp
    def run(lhs, rhs):
        return op(_fp8_round(lhs, E4M3), _fp8_round(rhs, E4M3))

    def fwd(a, b):
        ql, qr = quantize(a, E4M3, 1.0), quantize(b, E4M3, 1.0)
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
        return vjp(_fp8_round(g, E5M2))

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def fp8_weight_cast_op(op: Callable, lhs: Array, rhs: Array) -> Array:
    """For a `dot_general`: `fp8_cast_op(op, lhs, rhs)` where an operand is a weight
    (rank 2 or less: a layer's matrix), else `op(lhs, rhs)` as it is: the products of
    two activations, attention's `q @ k.T` and `p @ v` (both of rank 3 or more), stay
    in the caller's precision, as FP8 training practice keeps them (their
    probabilities and scores are not unit-scaled: most of a softmax's outputs are far
    below 1). Not for convolutions, whose kernels have rank 3 or more: see
    `fp8_cast_rules`.

    ```python
    import jax.numpy as jnp
    from lowtrain.unit_scaling import fp8_weight_cast_op

    x, w = jnp.full((2, 3, 4), 1e-4), jnp.ones((4, 2))  # 1e-4: 0 in E4M3
    assert float(fp8_weight_cast_op(jnp.matmul, x, w).max()) == 0.0  # cast
    scores = fp8_weight_cast_op(jnp.matmul, x, x.transpose(0, 2, 1))  # kept
    assert abs(float(scores[0, 0, 0]) - 4e-8) < 1e-13  # not flushed
    ```
    """
    if min(jax.numpy.ndim(lhs), jax.numpy.ndim(rhs)) <= 2:
        return fp8_cast_op(op, lhs, rhs)
    return op(lhs, rhs)


def fp8_cast_rules(weights_only: bool = False) -> dict[str, Callable]:
    """The `lowtrain.rewrite` rules of `simulate_fp8`: `fp8_cast_op` for every
    `dot_general` and `conv_general_dilated`; with `weights_only`, the
    `dot_general`s through `fp8_weight_cast_op` (convolutions are always cast: their
    kernel is a weight).

    ```python
    import lowtrain.unit_scaling as uu

    rules = uu.fp8_cast_rules(weights_only=True)
    assert rules["dot_general"] is uu.fp8_weight_cast_op
    assert rules["conv_general_dilated"] is uu.fp8_cast_op
    ```
    """
    rules = dict.fromkeys(MATMULS, fp8_cast_op)
    if weights_only:
        rules["dot_general"] = fp8_weight_cast_op
    return rules


def simulate_fp8(
    fn: Callable, *, weights_only: bool = False, keep: Sequence[str] = ()
) -> Callable:
    """`fn` with every matmul and convolution through FP8 by a plain cast: operands
    to E4M3 forward, the cotangent to E5M2 backward, scale 1, saturating
    (`fp8_cast_op` on each `dot_general` and `conv_general_dilated`, by
    `lowtrain.rewrite`). What unit scaling makes safe: compose as
    `simulate_fp8(unit_scale(model))`, then `lowtrain.amp` around it for the rest.
    With `weights_only`, only the matmuls with a weight operand (`fp8_weight_cast_op`:
    attention's two products of activations stay as they are; `fp8_cast_rules`).
    Matmuls inside a `jax.named_scope` named in `keep` (names or globs) stay as they
    are: the "critical" matmuls whose inputs u-μP finds growing during training, such
    as `uu.TransformerDecoder`'s readout (`"projection"`) and the MLPs'
    down-projections (`"linear_2"`).

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
    return rewrite(fn, fp8_cast_rules(weights_only), scopes=keep_scopes(keep))


def keep_scopes(keep: Sequence[str]) -> dict[str, dict]:
    """`lowtrain.rewrite`'s `scopes=` that leaves each `jax.named_scope` in `keep`
    (names or globs) as written: `simulate_fp8`'s `keep`. Checked: a list of names,
    not one string (whose letters would each become a scope).

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.keep_scopes(["projection"]) == {"projection": {}}
    ```
    """
    if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
        raise TypeError(
            "Expected `keep` as a list of `jax.named_scope` names, e.g. "
            f"['linear_2', 'projection'], got {keep!r} instead."
        )
    return {name: {} for name in keep}
