"""Unit-scaled residual connections: `residual_split`, `residual_add`,
`residual_apply`, and u-μP's rule for the weight `tau` of each branch in a
transformer (`transformer_residual_scaling_rule`).

A residual layer computes `(tau * f(x) + x) / sqrt(1 + tau**2)`: for a unit-RMS `x`
and a branch `f` whose output has unit RMS too, the sum keeps unit RMS, and `tau` is
the ratio of the branch's contribution to the skip's. The backward pass must keep the
branch's *own* gradients unit as well, so the branch weight is applied to the
gradient at the split (`residual_split`) and to the value at the add
(`residual_add`), rather than both at the add as a plain implementation would.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxtyping import Array, Float

from ._scale import scale_bwd, scale_fwd


def residual_split(
    x: Float[Array, "*shape"], tau: float = 1.0
) -> tuple[Float[Array, "*shape"], Float[Array, "*shape"]]:
    """`(residual, skip)`: two copies of `x` for a residual layer, to be joined by
    `residual_add` with the same `tau`.

    Values: both equal to `x`. Gradients: the one reaching `x` from `residual` is
    multiplied by `tau / sqrt(1 + tau**2)`, the one from `skip` by
    `1 / sqrt(1 + tau**2)`; for unit-RMS, independent branch and skip gradients
    their sum has unit RMS.

    ```python
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    residual, skip = U.residual_split(jnp.ones(3), tau=0.5)
    assert (residual == 1).all() and (skip == 1).all()
    ```
    """
    denom = (1 + tau**2) ** 0.5
    return scale_bwd(x, tau / denom), scale_bwd(x, 1 / denom)


def residual_add(
    residual: Float[Array, "*shape"], skip: Float[Array, "*shape"], tau: float = 1.0
) -> Float[Array, "*shape"]:
    """`(tau * residual + skip) / sqrt(1 + tau**2)`, with the gradient of each input
    equal to the output's (the branch weights were applied by `residual_split`).

    Scales: output `tau / sqrt(1 + tau**2)` on `residual` and `1 / sqrt(1 + tau**2)`
    on `skip` (unit RMS for unit-RMS, independent inputs); gradients 1.

    ```python
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    y = U.residual_add(jnp.ones(3), jnp.zeros(3), tau=1.0)
    assert jnp.allclose(y, 2**-0.5)
    ```
    """
    if residual.shape != skip.shape:
        raise ValueError(
            "`residual_add` expected `residual` and `skip` of one shape, got "
            f"{tuple(residual.shape)} and {tuple(skip.shape)} instead."
        )
    denom = (1 + tau**2) ** 0.5
    return scale_fwd(residual, tau / denom) + scale_fwd(skip, 1 / denom)


def residual_apply(
    fn: Callable[[Array], Array],
    x: Float[Array, "*shape"],
    tau: float = 1.0,
    *,
    stream_scale: float | None = None,
) -> Float[Array, "*shape"]:
    """The residual layer `(tau * fn(x) + x) / sqrt(1 + tau**2)` with unit-scaled
    gradients: `residual_split`, `fn` on the residual copy, `residual_add`.

    Scales: as `residual_split` and `residual_add`; for a unit-scaled `fn` (unit
    output and unit input gradient) the output and the gradient of `x` have unit RMS.

    `stream_scale=c` computes the same layer on a stream that carries no per-layer
    factor, for a `fn` that does not see its input's scale (a pre-norm branch:
    `fn(c * x) == fn(x)`, up to the norm's `eps`). Then `x` is the unit-scaled
    stream times `c`, and the result, `x + c * tau * fn(x)`, is the unit-scaled
    output times `c * sqrt(1 + tau**2)`: pass that as the next layer's `c` (the
    first layer's is 1). The branch's own gradients are the same as without
    `stream_scale`, and the gradient of `x` is the unit-scaled one divided by `c`.
    Nothing multiplies the stream, forward or backward, so a deep stack's
    residual gradient stays a plain sum (on XLA:CPU a factor per layer on the
    stream makes a transformer step 20% slower; `TransformerDecoder` uses this).

    **Arguments:**

    - `fn`: the residual branch, `fn(h)` of an array `h` of `x`'s shape, returning
      one of that shape.
    - `x`: the layer's input, the residual stream (times `stream_scale` if given).
    - `tau`: the branch's weight against the skip (default 1.0).
    - `stream_scale`: keyword-only; None (default) for a unit-scaled stream, else
      the stream's factor `c` over the unit-scaled one (above; `ValueError` unless
      `c > 0`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    w = jax.random.normal(jax.random.key(0), (64, 64))
    x = jax.random.normal(jax.random.key(1), (32, 64))
    y = U.residual_apply(lambda h: U.linear(h, w), x, tau=0.5)
    assert 0.8 < jnp.sqrt(jnp.mean(y**2)) < 1.2

    pre_norm = lambda h: U.linear(U.rms_norm(h), w)
    y = U.residual_apply(pre_norm, x, tau=0.5)
    z = U.residual_apply(pre_norm, 3 * x, tau=0.5, stream_scale=3.0)
    assert jnp.allclose(z, 3 * 1.25**0.5 * y, rtol=1e-4, atol=1e-4)
    ```
    """
    check_stream_scale(stream_scale)
    if stream_scale is None:
        residual, skip = residual_split(x, tau)
        return residual_add(fn(residual), skip, tau)
    denom = (1 + tau**2) ** 0.5
    # The branch sees the unit-scaled layer's gradient `g` (the stream's gradient is
    # `g / (c * denom)` after this layer), and gives `x` the unit-scaled branch
    # gradient times `1 / c`, as the skip does.
    out = scale_bwd(fn(scale_bwd(x, tau / denom)), stream_scale * denom)
    return x + scale_fwd(out, stream_scale * tau)


def check_stream_scale(stream_scale: float | None) -> None:
    # `residual_apply`'s and `TransformerLayer`'s check of `stream_scale`.
    if stream_scale is not None and not stream_scale > 0:
        raise ValueError(
            "Expected `stream_scale` None (a unit-scaled stream) or positive (the "
            "stream's factor over the unit-scaled one: 1 at the first layer, then "
            f"`next_stream_scale` of the one before), got {stream_scale!r}."
        )


def next_stream_scale(stream_scale: float, tau: float) -> float:
    # The stream's factor after a `residual_apply(..., tau, stream_scale=...)`.
    return stream_scale * (1 + tau**2) ** 0.5


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> Callable[[int, int], float]:
    """u-μP's depth rule for the branches of a transformer: a function
    `tau(index, branches)` for the `index`-th of `branches` residual branches, which
    alternate attention (even index) and MLP (odd index) after an embedding.

    With `alpha_mlp = residual_mult * sqrt(2 / (1 + residual_attn_ratio**2))` and
    `alpha_attn = residual_attn_ratio * alpha_mlp`, branch `index` gets
    `tau = alpha / sqrt(branches / 2 + n_attn * alpha_attn**2 + n_mlp * alpha_mlp**2)`,
    where `n_attn` and `n_mlp` count the attention and MLP branches before it. Then
    every attention branch contributes the same variance to the output, every MLP
    branch too; the attention branches together contribute `alpha_attn**2 / 2`
    times the embedding's variance and the MLP branches `alpha_mlp**2 / 2` (their
    ratio is `residual_attn_ratio**2`, their sum `2 * residual_mult**2` times the
    embedding's), whatever the depth. At the defaults each third of the output
    (embedding, attention, MLP) has the same variance, and
    `tau = 1 / sqrt(layers + index)` for `branches = 2 * layers`. (Appendix G of
    the u-μP paper.)

    **Arguments:**

    - `residual_mult`: the weight of all branches against the embedding (default
      1.0): together they contribute `2 * residual_mult**2` times the embedding's
      variance.
    - `residual_attn_ratio`: `alpha_attn / alpha_mlp`, the weight of each attention
      branch against each MLP branch (default 1.0).

    ```python
    import lowtrain.unit_scaling as uu

    tau = uu.transformer_residual_scaling_rule()
    assert abs(tau(0, 8) - 4**-0.5) < 1e-12 and abs(tau(5, 8) - 9**-0.5) < 1e-12
    ```
    """
    alpha_mlp = residual_mult * (2 / (1 + residual_attn_ratio**2)) ** 0.5
    alpha_attn = residual_attn_ratio * alpha_mlp

    def tau(index: int, branches: int) -> float:
        n_attn, n_mlp = (index + 1) // 2, index // 2
        alpha = alpha_attn if index % 2 == 0 else alpha_mlp
        seen = n_attn * alpha_attn**2 + n_mlp * alpha_mlp**2
        return alpha / (branches / 2 + seen) ** 0.5

    return tau
