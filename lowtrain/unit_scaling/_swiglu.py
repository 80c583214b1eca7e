"""The unit-scaled SwiGLU MLP of `uu.MLP`, with its scales folded onto small tensors.

Written op by op (`linear`, `linear`, `silu_glu`, `linear`), the MLP multiplies its
`(..., inner)` activations and their gradients by constants at every op boundary.
On XLA:CPU the backward ones cost about 5% of a GPT step (`scripts/bench.py unit
--ablation`), although each is one multiply inside a fused loop. Here every
backward constant of the two up-projections is moved onto their weight gradients
and the input gradient (`(..., hidden)` and `(inner, hidden)`, a quarter of the size
or less), which gives the same values and gradients; the three matmuls stay plain
`dot_general`s in their `jax.named_scope`s, so `simulate_fp8`, `keep=` and AMP see
them as before.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float

from ._activations import glu_scale
from ._core import leading_size
from ._matmuls import _check_linear
from ._scale import scale_bwd, scale_fwd


def folds(linear_1, linear_gate, linear_2) -> bool:
    """Whether `swiglu_mlp` computes `uu.MLP`'s three linears: gated, and each
    without a bias and with `constraint=None`, as `uu.MLP` builds them."""
    linears = (linear_1, linear_gate, linear_2)
    return linear_gate is not None and all(
        lin.bias is None and lin.constraint is None for lin in linears
    )


def swiglu_mlp(
    x: Float[Array, "... hidden"],
    weight_1: Float[Array, "inner hidden"],
    weight_gate: Float[Array, "inner hidden"],
    weight_2: Float[Array, "hidden inner"],
) -> Float[Array, "... hidden"]:
    """`linear(silu_glu(linear(x, weight_1), linear(x, weight_gate)), weight_2)`
    with `U.linear(..., constraint=None)` and no biases, as `uu.MLP` builds it: the
    same values and gradients (to float32 rounding), from fewer multiplies.

    Op by op, the gated unit's output `s * a * silu(g)` (`s = U.silu_glu`'s scale)
    has the backward scale `hidden ** -0.5 * s` on the cotangents of `a` and `g`
    (the down-projection's input gradient scale times the unit's). Both branches
    share it, so here it multiplies what they feed instead: the weight gradients of
    `weight_1` and `weight_gate` (with their `batch ** -0.5`) and the input gradient
    (with `inner ** -0.5`). The forward is unchanged: `x`, the weights and the
    unit-scaled `h` enter the matmuls as op by op. The one difference: the
    cotangents at the outputs of the two up-projection matmuls (what
    `simulate_fp8` rounds to E5M2) are the op-by-op ones divided by
    `hidden ** -0.5 * s` (about 6.7 at width 128), still far inside E5M2's range,
    but enough for float16 gradients to overflow: `uu.MLP(fold_scales=False)` runs
    the MLP op by op instead.
    """
    for w in (weight_1, weight_gate):
        _check_linear(x, w, None, "linear")
    inner, hidden = weight_1.shape
    # `weight_2` takes the `(..., inner)` gated output.
    _check_linear(jax.ShapeDtypeStruct((inner,), x.dtype), weight_2, None, "linear")
    s = glu_scale()
    in_scale = hidden**-0.5  # the up-projections' output scale
    ct_scale = hidden**-0.5 * s  # the gated unit's backward scale
    w_scale = leading_size(x, 1) ** -0.5
    x = scale_bwd(x, inner**-0.5 * ct_scale)
    with jax.named_scope("linear_1"):
        a = x @ scale_bwd(weight_1, w_scale * ct_scale).T
    with jax.named_scope("linear_gate"):
        g = x @ scale_bwd(weight_gate, w_scale * ct_scale).T
    h = scale_fwd(a * jax.nn.silu(g * in_scale), in_scale * s)
    with jax.named_scope("linear_2"):
        return scale_fwd(h @ scale_bwd(weight_2, w_scale).T, inner**-0.5)
