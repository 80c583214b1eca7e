"""Unit-scaled dot-product attention, with u-μP's `1 / d` logit temperature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._core import at_least_float32, logarithmic_interpolation
from ._scale import scale_bwd, scale_fwd


def attention_scale(seq: int, head_dim: int, is_causal: bool, mult: float) -> float:
    # With the 1/d temperature and unit-normal q, k the logits have RMS
    # mult / sqrt(d): attention is nearly flat, so each output row averages the
    # values it sees. Non-causal: `seq` values, variance 1 / seq. Causal: row i sees
    # i + 1 of them, variance 1 / (i + 1), so H_seq / seq on average (H the harmonic
    # number). Sharp attention (large mult) copies one value: variance 1. u-μP's
    # model interpolates the RMS between the two with weight
    # sigmoid(log(mult^2 / (4 d))).
    spread = sum(1 / i for i in range(1, seq + 1)) if is_causal else 1.0
    flat_rms = (spread / seq) ** 0.5
    alpha = 1 / (1 + 4 * head_dim / mult**2)
    return 1 / logarithmic_interpolation(alpha, flat_rms, 1.0)


def scaled_dot_product_attention(
    q: Float[Array, "*batch q_seq head_dim"],
    k: Float[Array, "*batch kv_seq head_dim"],
    v: Float[Array, "*batch kv_seq v_dim"],
    is_causal: bool = False,
    mult: float = 1.0,
) -> Float[Array, "*batch q_seq v_dim"]:
    """Unit-scaled attention `softmax(mult * q @ k.T / head_dim) @ v`, with u-μP's
    logit temperature `mult / head_dim` (not `1 / sqrt(head_dim)`: with it, the
    logits' scale is independent of the width once q and k align, as in μP).

    `is_causal=True` masks key `j > i` for query `i` (same lengths, no padding). The
    softmax runs in at least float32.

    Scales: one scale `s` multiplies the output and the gradients of `q`, `k` and
    `v` (forward and backward agree, so there is no constraint). For unit-normal
    inputs attention is nearly flat and each output averages the values it sees:
    `s = sqrt(kv_seq)` (non-causal) or `sqrt(kv_seq / H)` with `H = 1 + 1/2 + ... +
    1/kv_seq` (causal: query `i` averages `i + 1` values), moving towards 1 (a copied
    value) as `mult**2 / head_dim` grows. The output and the gradient of `v` are then
    unit; the gradients of `q` and `k`, small at initialization as with any flat
    attention, grow as attention sharpens. The unit-scaling library uses
    `log(kv_seq)` where this uses `H` (the exact mean; also defined for one token).
    The model assumes values independent across positions: a component shared by
    all positions passes flat attention unreduced and comes out up to `s` times
    larger (non-causal stacks of layers at initialization grow this way).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    q, k, v = jax.random.normal(jax.random.key(0), (3, 4, 128, 64))  # (..., seq, d)
    y = U.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert y.shape == (4, 128, 64)
    assert 0.8 < jnp.sqrt(jnp.mean(y**2)) < 1.25
    ```
    """
    if q.ndim < 2 or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "`scaled_dot_product_attention` expected q (..., q_seq, d), k "
            f"(..., kv_seq, d) and v (..., kv_seq, dv), got {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)} instead."
        )
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            "`scaled_dot_product_attention` expected q, k and v with the same "
            f"leading axes, got {tuple(q.shape)} and {tuple(k.shape)}. Broadcast them "
            "explicitly (e.g. `jnp.broadcast_to`) first."
        )
    q_seq, head_dim = q.shape[-2:]
    kv_seq = k.shape[-2]
    if is_causal and q_seq != kv_seq:
        raise ValueError(
            f"`is_causal=True` expected q_seq == kv_seq, got {q_seq} and {kv_seq}."
        )
    scale = attention_scale(kv_seq, head_dim, is_causal, mult)
    q, k, v = (scale_bwd(t, scale) for t in (q, k, v))
    logits = jnp.einsum("...qd,...kd->...qk", q, k) * (mult / head_dim)
    logits = at_least_float32(logits)
    if is_causal:
        mask = jnp.tril(jnp.ones((q_seq, kv_seq), dtype=bool))
        lowest = jnp.finfo(logits.dtype).min
        logits = jnp.where(jnp.broadcast_to(mask, logits.shape), logits, lowest)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return scale_fwd(jnp.einsum("...qk,...kd->...qd", weights, v), scale)
