"""Unit-scaled transformer blocks: `MLP`, `MHSA`, `TransformerLayer`,
`DepthSequential` and the decoder-only `TransformerDecoder` (u-μP's reference
model).

All of them take whole batches (`(..., seq, hidden)`, or integer tokens
`(..., seq)` for the decoder), never one example under `jax.vmap`: their weight
gradients are scaled by `batch ** -0.5`, with the batch counted from the call.

Each sublayer runs inside a `jax.named_scope` named after its attribute
(`embedding`, `mhsa`, `linear_qkv`, `attention`, `linear_o`, `mlp`, `linear_1`,
`linear_gate`, `linear_2`, `projection`), so precisions and reports can pick one
out: `uu.simulate_fp8(model, keep=("linear_2", "projection"))` leaves the MLPs'
down-projections and the readout out of FP8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._activations import dropout, gelu, silu_glu
from ._attention import scaled_dot_product_attention
from ._losses import cross_entropy
from ._modules import Embedding, Linear, LinearReadout, RMSNorm
from ._residual import (
    check_stream_scale,
    next_stream_scale,
    residual_apply,
    transformer_residual_scaling_rule,
)
from ._swiglu import folds, swiglu_mlp
from .constraints import to_output_scale


def _scoped(name: str, layer: Callable, x: Array) -> Array:
    # Each sublayer runs in a `jax.named_scope` of its attribute's name, so that
    # precisions and reports can pick it out (`rewrite(..., scopes={"linear_2": {}})`).
    with jax.named_scope(name):
        return layer(x)


class MLP(eqx.Module):
    """A unit-scaled transformer MLP: `linear_2(silu_glu(linear_1(x),
    linear_gate(x)))` (SwiGLU, as in u-μP), or `linear_2(gelu(linear_1(x)))` with
    `activation="gelu"`; no biases; inner width `expansion * hidden_size`.

    Its linears use `constraint=None`: each keeps unit output and unit gradient
    scales apart, and the mismatch of `linear_1` (`sqrt(hidden / inner)`) cancels
    the one of `linear_2` (`sqrt(inner / hidden)`), so the input gradient is the
    true one. With `fold_scales=True` the SwiGLU form runs as `swiglu_mlp`: the same
    values and gradients, the up-projections' backward constant on the weight and
    input gradients instead of their `(..., inner)` cotangents (5% of a GPT step on
    XLA:CPU), which makes those `sqrt(hidden) / 2**0.75` times larger: float16
    gradients overflow, so use `fold_scales=False` (op by op) there. Linears given a
    bias or a constraint (by `eqx.tree_at`) always run op by op. Call it on a whole
    batch `(..., hidden_size)`, not under `jax.vmap` (the weight gradients are
    scaled by `batch ** -0.5`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    mlp = uu.MLP(64, key=jax.random.key(0))
    y = mlp(jax.random.normal(jax.random.key(1), (8, 16, 64)))
    assert y.shape == (8, 16, 64) and mlp.linear_1.weight.shape == (256, 64)
    assert 0.75 < jnp.sqrt(jnp.mean(y**2)) < 1.33
    ```
    """

    linear_1: Linear
    linear_gate: Linear | None
    linear_2: Linear
    activation: Literal["silu_glu", "gelu"] = eqx.field(static=True)
    fold_scales: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        expansion: int = 4,
        *,
        activation: Literal["silu_glu", "gelu"] = "silu_glu",
        fold_scales: bool = True,
        key: PRNGKeyArray,
    ):
        if not isinstance(fold_scales, bool):
            raise TypeError(
                f"Expected `fold_scales` True or False, got {fold_scales!r} instead "
                "(False: op by op, for float16)."
            )
        if activation not in ("silu_glu", "gelu"):
            raise ValueError(
                f"Expected `activation` 'silu_glu' or 'gelu', got {activation!r}."
            )
        k1, kg, k2 = jax.random.split(key, 3)
        inner = expansion * hidden_size
        kw = dict(use_bias=False, constraint=None)
        self.linear_1 = Linear(hidden_size, inner, **kw, key=k1)
        gated = activation == "silu_glu"
        self.linear_gate = Linear(hidden_size, inner, **kw, key=kg) if gated else None
        self.linear_2 = Linear(inner, hidden_size, **kw, key=k2)
        self.activation, self.fold_scales = activation, fold_scales

    def __call__(
        self, x: Float[Array, "... hidden"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... hidden"]:
        linears = (self.linear_1, self.linear_gate, self.linear_2)
        if self.fold_scales and folds(*linears):
            return swiglu_mlp(x, *(lin.weight for lin in linears))
        h = _scoped("linear_1", self.linear_1, x)  # (..., inner)
        if self.linear_gate is not None:
            h = silu_glu(h, _scoped("linear_gate", self.linear_gate, x))
        else:
            h = gelu(h)
        return _scoped("linear_2", self.linear_2, h)


class MHSA(eqx.Module):
    """Unit-scaled multi-head self-attention on `(..., seq, hidden_size)`: one
    `linear_qkv` to `3 * hidden_size`, `heads` heads of
    `U.scaled_dot_product_attention` (u-μP's `mult / head_dim` temperature), and
    `linear_o`; no biases.

    The linears use `constraint=to_output_scale` (as u-μP): unit outputs, and for
    `linear_qkv` a unit input gradient too, since at initialization almost all of
    it comes through the values. Call it on a whole batch, not under `jax.vmap`
    (the weight gradients are scaled by `batch ** -0.5`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    attn = uu.MHSA(64, 4, is_causal=True, key=jax.random.key(0))
    y = attn(jax.random.normal(jax.random.key(1), (8, 32, 64)))
    assert y.shape == (8, 32, 64)
    ```
    """

    linear_qkv: Linear
    linear_o: Linear
    heads: int = eqx.field(static=True)
    is_causal: bool = eqx.field(static=True)
    mult: float = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        *,
        is_causal: bool = False,
        mult: float = 1.0,
        key: PRNGKeyArray,
    ):
        if heads < 1 or hidden_size % heads:
            raise ValueError(
                f"Expected `heads` dividing `hidden_size` {hidden_size}, got {heads}."
            )
        kqkv, ko = jax.random.split(key)
        kw = dict(use_bias=False, constraint=to_output_scale)
        self.linear_qkv = Linear(hidden_size, 3 * hidden_size, **kw, key=kqkv)
        self.linear_o = Linear(hidden_size, hidden_size, **kw, key=ko)
        self.heads, self.is_causal, self.mult = heads, is_causal, mult

    def __call__(
        self, x: Float[Array, "... seq hidden"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... seq hidden"]:
        *lead, seq, hidden = x.shape
        qkv = _scoped("linear_qkv", self.linear_qkv, x)
        qkv = qkv.reshape(*lead, seq, 3, self.heads, -1)
        q, k, v = jnp.swapaxes(jnp.moveaxis(qkv, -3, 0), -3, -2)  # (..., heads, seq, d)
        with jax.named_scope("attention"):
            out = scaled_dot_product_attention(
                q, k, v, is_causal=self.is_causal, mult=self.mult
            )
        out = jnp.swapaxes(out, -3, -2).reshape(*lead, seq, hidden)
        return _scoped("linear_o", self.linear_o, out)


class TransformerLayer(eqx.Module):
    """A unit-scaled pre-norm transformer layer: two residual branches,
    `residual_apply(lambda h: mhsa(rms_norm(h)), x, mhsa_tau)` then the same with
    the MLP and `mlp_tau`, each branch followed by unit-scaled dropout when
    `dropout_p > 0` (then pass a `key`, or set `inference=True`, as
    `eqx.nn.inference_mode` does).

    `tau` weighs a branch against the skip: the output is `(tau * branch + skip) /
    sqrt(1 + tau**2)`. `TransformerDecoder` sets it by depth
    (`transformer_residual_scaling_rule`). Call it on a whole batch
    `(..., seq, hidden_size)`, not under `jax.vmap`.

    `stream_scale=c` (`TransformerDecoder` sets it) runs both branches with
    `U.residual_apply(..., stream_scale=...)`: the input is the unit-scaled stream
    times `c` and the output the unit-scaled one times
    `c * sqrt((1 + mhsa_tau**2) * (1 + mlp_tau**2))`, with no factor on the stream
    itself (the pre-norms make the branches blind to it). Same model, same branch
    gradients; the residual gradient of a deep stack stays a plain sum, which
    XLA fuses better. `None` (the default): unit-scaled in and out.

    **Arguments:**

    - `hidden_size`: the width, the last axis of `x`.
    - `heads`: the number of attention heads; it must divide `hidden_size`.
    - `mhsa_tau`: keyword-only; the attention branch's `tau` (default 1.0).
    - `mlp_tau`: keyword-only; the MLP branch's `tau` (default 1.0).
    - `is_causal`: keyword-only; whether the attention is causal (default False).
    - `dropout_p`: keyword-only; the dropout probability after each branch, in
      [0, 1); 0.0 (default): no dropout.
    - `stream_scale`: keyword-only; the input stream's factor `c > 0` (above), or
      None (default).
    - `inference`: keyword-only; True makes dropout its inference form (a
      `sqrt(1 - dropout_p)` scale, no `key`); default False.
    - `fold_mlp_scales`: keyword-only; the MLP's `fold_scales` (default True;
      False for float16).
    - `key`: keyword-only; the PRNG key of the initialization.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    layer = uu.TransformerLayer(64, 4, mhsa_tau=0.5, mlp_tau=0.5, key=jax.random.key(0))
    y = layer(jax.random.normal(jax.random.key(1), (8, 32, 64)))
    assert y.shape == (8, 32, 64)
    ```
    """

    mhsa_norm: RMSNorm
    mhsa: MHSA
    mlp_norm: RMSNorm
    mlp: MLP
    mhsa_tau: float = eqx.field(static=True)
    mlp_tau: float = eqx.field(static=True)
    dropout_p: float = eqx.field(static=True)
    stream_scale: float | None = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        *,
        mhsa_tau: float = 1.0,
        mlp_tau: float = 1.0,
        is_causal: bool = False,
        dropout_p: float = 0.0,
        stream_scale: float | None = None,
        inference: bool = False,
        fold_mlp_scales: bool = True,
        key: PRNGKeyArray,
    ):
        check_stream_scale(stream_scale)
        kattn, kmlp = jax.random.split(key)
        self.mhsa_norm = RMSNorm(hidden_size)
        self.mhsa = MHSA(hidden_size, heads, is_causal=is_causal, key=kattn)
        self.mlp_norm = RMSNorm(hidden_size)
        self.mlp = MLP(hidden_size, fold_scales=fold_mlp_scales, key=kmlp)
        self.mhsa_tau, self.mlp_tau = mhsa_tau, mlp_tau
        self.dropout_p, self.inference = dropout_p, inference
        self.stream_scale = stream_scale

    def _drop(self, h: Array, key: PRNGKeyArray | None) -> Array:
        if self.dropout_p == 0:
            return h
        return dropout(h, self.dropout_p, key=key, inference=self.inference)

    def __call__(
        self, x: Float[Array, "... seq hidden"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... seq hidden"]:
        kattn, kmlp = (None, None) if key is None else jax.random.split(key)
        c = self.stream_scale
        x = residual_apply(
            lambda h: self._drop(_scoped("mhsa", self.mhsa, self.mhsa_norm(h)), kattn),
            x,
            self.mhsa_tau,
            stream_scale=c,
        )
        if c is not None:
            c = next_stream_scale(c, self.mhsa_tau)
        return residual_apply(
            lambda h: self._drop(_scoped("mlp", self.mlp, self.mlp_norm(h)), kmlp),
            x,
            self.mlp_tau,
            stream_scale=c,
        )


class DepthSequential(eqx.Module):
    """`layers` (a sequence of callables, kept as a tuple) applied in order,
    `x = layer(x, key=...)`, which the u-μP optimizers count as depth: every
    parameter inside gets its learning rate multiplied by `len(layers) ** -0.5`
    (depth-μP). Each layer takes `(x, *, key)`; `key`, if given, is split between
    them.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    keys = jax.random.split(jax.random.key(0), 3)
    stack = uu.DepthSequential([uu.Linear(8, 8, key=k) for k in keys])
    assert stack(jnp.ones((4, 8))).shape == (4, 8) and len(stack) == 3
    ```
    """

    layers: tuple[Callable, ...]

    def __init__(self, layers: Sequence[Callable]):
        self.layers = tuple(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        n = len(self.layers)
        keys = [None] * n if key is None else list(jax.random.split(key, n))
        for layer, k in zip(self.layers, keys):
            x = layer(x, key=k)
        return x


class TransformerDecoder(eqx.Module):
    """A unit-scaled decoder-only transformer (a GPT, u-μP's reference model):
    `Embedding`, `layers` causal pre-norm `TransformerLayer`s in a
    `DepthSequential`, a final `RMSNorm` and a `LinearReadout` to the vocabulary.

    Branch `i` of the `2 * layers` residual branches (attention, MLP, attention,
    ...) gets `tau = residual_scaling(i, 2 * layers)` (default
    `transformer_residual_scaling_rule()`: embedding, attention and MLP each make up
    a third of the output's variance, at any depth). Like u-μP's reference it has
    no positional embedding (causal attention still tells positions apart). The
    layers pass the residual stream on without normalising it at each add
    (`TransformerLayer(stream_scale=...)`; the final norm does it once): the same
    model and gradients, and a faster step. `fold_mlp_scales=False` runs the MLPs
    op by op (`MLP(fold_scales=False)`: for float16).

    Call it on a whole batch of integer tokens `(..., seq)`, not under `jax.vmap`;
    it returns logits `(..., seq, vocab_size)`. `loss(tokens)` is the mean
    next-token `U.cross_entropy`.

    **Arguments:**

    - `hidden_size`: the width of the residual stream.
    - `vocab_size`: the number of token ids, the logits' last axis.
    - `layers`: the number of `TransformerLayer`s.
    - `heads`: the attention heads of each layer; it must divide `hidden_size`.
    - `dropout_p`: keyword-only; each layer's dropout probability (default 0.0:
      none).
    - `residual_scaling`: keyword-only; `tau(index, branches) -> float`, the weight
      of each residual branch; None (default):
      `transformer_residual_scaling_rule()`.
    - `fold_mlp_scales`: keyword-only; the MLPs' `fold_scales` (default True;
      False for float16).
    - `key`: keyword-only; the PRNG key of the initialization.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling as uu

    gpt = uu.TransformerDecoder(32, 16, layers=2, heads=2, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, 16)
    assert gpt(tokens).shape == (4, 12, 16)
    assert abs(float(gpt.loss(tokens)) - float(jnp.log(16))) < 0.5
    ```
    """

    embedding: Embedding
    layers: DepthSequential
    final_norm: RMSNorm
    projection: LinearReadout

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        layers: int,
        heads: int,
        *,
        dropout_p: float = 0.0,
        residual_scaling: Callable[[int, int], float] | None = None,
        fold_mlp_scales: bool = True,
        key: PRNGKeyArray,
    ):
        tau = residual_scaling or transformer_residual_scaling_rule()
        kemb, kproj, *klayers = jax.random.split(key, layers + 2)
        self.embedding = Embedding(vocab_size, hidden_size, key=kemb)
        taus = [tau(i, 2 * layers) for i in range(2 * layers)]
        # The stream's factor over the unit-scaled one before each branch.
        scales = [1.0]
        for t in taus:
            scales.append(next_stream_scale(scales[-1], t))
        self.layers = DepthSequential(
            [
                TransformerLayer(
                    hidden_size,
                    heads,
                    mhsa_tau=taus[2 * i],
                    mlp_tau=taus[2 * i + 1],
                    is_causal=True,
                    dropout_p=dropout_p,
                    stream_scale=scales[2 * i],
                    fold_mlp_scales=fold_mlp_scales,
                    key=k,
                )
                for i, k in enumerate(klayers)
            ]
        )
        self.final_norm = RMSNorm(hidden_size)
        self.projection = LinearReadout(hidden_size, vocab_size, key=kproj)

    def __call__(
        self, tokens: Int[Array, "... seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... seq vocab"]:
        x = _scoped("embedding", self.embedding, tokens)
        x = self.layers(x, key=key)  # (..., seq, hidden)
        return _scoped("projection", self.projection, self.final_norm(x))

    def loss(
        self, tokens: Int[Array, "... seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, ""]:
        """The mean cross-entropy of predicting `tokens[..., 1:]` from the logits at
        the positions before them (`U.cross_entropy`: unit-scaled gradient).

        **Arguments:**

        - `tokens`: the integer token ids, shape `(..., seq)`.
        - `key`: keyword-only; the PRNG key of dropout, split between the layers;
          needed only with `dropout_p > 0` outside inference mode.
        """
        logits = self(tokens, key=key)
        return cross_entropy(logits[..., :-1, :], tokens[..., 1:])
