"""The benchmark models, their losses, and the same losses in hand-placed precision.

The models are the recipes' own: `lowtrain.recipes.mnist.MLP` (784-512-512-10, batch
128) and `lowtrain.recipes.gpt.GPT` (4 layers, 4 heads, width 128, context 64, batch
16, vocabulary 64, the blocks under `lax.scan`). `loss` is the float32 loss both are
trained with; `hand_mlp_loss` and `hand_gpt_loss` are that loss with mixed precision
written by hand as `torch.autocast` places it and `lowtrain.amp`'s default policy
does: parameters kept in float32, each matmul on operands cast to the compute dtype
(returning it), and everything else in the widest dtype of its inputs (float32 once
a float32 bias, parameter or layer-norm output is among them), with layer norm, the
attention's query scaling and softmax, GELU and the cross-entropy in float32. Both
compute the same loss (the step-time table checks it). With `fp8=True`
(`hand_gpt_loss`) every matmul runs through `lowtrain.fp8.fp8_dot_general` instead,
called by hand at each einsum: the placement of `amp`'s "fp8" preset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

import lowtrain
import lowtrain.unit_scaling.functional as U
from lowtrain.fp8 import fp8_dot_general
from lowtrain.recipes.gpt import GPT, Block
from lowtrain.recipes.gpt import cross_entropy as lean_cross_entropy
from lowtrain.recipes.internal import GPTConfig, Linear
from lowtrain.recipes.mnist import MLP

F32 = jnp.float32
HALF = {"fp16": jnp.dtype(jnp.float16), "bf16": jnp.dtype(jnp.bfloat16)}
GPT_CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
GPT_VOCAB = 64
GPT_BATCH = 16
MLP_BATCH = 128


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy in float32 of `logits` (..., classes) against
    integer labels (...), as the recipes' trainers compute it."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def loss(model: Callable, x: jax.Array, y: jax.Array) -> jax.Array:
    """The float32 loss of both models: cross-entropy of `model(x)` against `y`."""
    return cross_entropy(model(x), y)


def unit_loss(model: Callable, x: jax.Array, y: jax.Array) -> jax.Array:
    """The unit-scaled GPT's (`model=gpt_unit`) float32 loss, as
    `recipes.gpt.UnitGptTrainer` computes it: `U.cross_entropy`."""
    return U.cross_entropy(model(x), y)


def cast_floats(tree: Any, dtype) -> Any:
    """Cast every floating-point array of `tree` to `dtype`."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree
    )


# --------------------------------------------------------------------------------------
# Hand-placed mixed precision: casts written at the matmuls
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matmuls:
    """How the hand-placed models run their matmuls, as `lowtrain.amp` places them
    (and `torch.autocast` does): the parameters stay float32; each matmul casts its
    operands to `half` and returns `half`; every other op runs in the widest dtype of
    its inputs (JAX's standard promotion: a float32 bias added to a `half` product
    gives float32). `fp8`: each matmul a `lowtrain.fp8.fp8_dot_general` (E4M3
    operands as they come, E5M2 cotangent, current scaling) returning `half`, as a
    user injects FP8 into einsums by hand (Flax's `fp8_ops` style)."""

    half: Any
    fp8: bool = False

    def einsum(self, spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        """`jnp.einsum(spec, a, b)` as a matmul of `half` operands returning `half`,
        or in FP8 when `fp8`."""
        if not self.fp8:
            return jnp.einsum(spec, a.astype(self.half), b.astype(self.half))
        dot = self._fp8_dot_general
        return jnp.einsum(
            spec, a, b, preferred_element_type=self.half, _dot_general=dot
        )

    def _fp8_dot_general(self, lhs, rhs, dimension_numbers, precision=None, **_):
        # `jnp.einsum`'s `_dot_general` hook; the FP8 op returns `half`.
        return fp8_dot_general(lhs, rhs, dimension_numbers, out_dtype=self.half)

    def linear(self, layer: Linear, x: jax.Array) -> jax.Array:
        """The recipe's `Linear` on `x` (the `Linear.__call__` einsum, then its
        float32 bias)."""
        y = self.einsum("...i,io->...o", x, layer.kernel)
        return y if layer.bias is None else y + jnp.broadcast_to(layer.bias, y.shape)


def hand_mlp_loss(half, fp8: bool = False) -> Callable:
    """The MLP loss in mixed precision: `MLP.__call__` with its matmuls in `half`
    (`Matmuls`), the cross-entropy in float32."""
    mm = Matmuls(jnp.dtype(half), fp8=fp8)

    def hand_loss(model: MLP, images: jax.Array, labels: jax.Array) -> jax.Array:
        x = images.reshape(images.shape[0], 784)
        for layer in model.layers[:-1]:
            x = jax.nn.relu(mm.linear(layer, x))
        logits = mm.linear(model.layers[-1], x)
        return cross_entropy(logits, labels)  # upcasts the logits

    return hand_loss


def _attention(block: Block, x: jax.Array, mm: Matmuls) -> jax.Array:
    """`Block.attention` with its matmuls in half (or FP8), the query scaling and
    softmax in float32 (`model.attention=fused`: the whole attention one op in half
    precision, which computes its softmax in float32)."""
    b, t, c = x.shape
    hs = c // block.n_head
    q, k, v = (
        a.reshape(b, t, block.n_head, hs)
        for a in jnp.split(mm.linear(block.qkv, x), 3, axis=-1)
    )
    if block.fused:  # one op in half precision: cuDNN's kernel on a GPU, as in `amp`
        q, k, v = (a.astype(mm.half) for a in (q, k, v))
        y = lowtrain.dot_product_attention(q, k, v, is_causal=True)
        return mm.linear(block.proj, y.reshape(b, t, c))
    # `/ sqrt(hs)` is a division, which the AMP policy runs in float32.
    att = mm.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / math.sqrt(hs)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), att.shape)
    att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
    y = mm.einsum("bhqk,bkhd->bqhd", att, v)
    return mm.linear(block.proj, y.reshape(b, t, c))


def _block(block: Block, x: jax.Array, mm: Matmuls) -> jax.Array:
    """`Block.__call__`: its matmuls as `mm` places them; the layer norms and GELU
    on float32 values (the biases are float32), in float32."""
    x = x + _attention(block, block.ln1(x), mm)
    h = mm.linear(block.fc, block.ln2(x))
    return x + mm.linear(block.out, jax.nn.gelu(h, approximate=False))


def _hand_gpt_logits(model: GPT, tokens: jax.Array, mm: Matmuls):
    """`GPT.__call__` in mixed precision; `model` holds float32 parameters."""
    b, t = tokens.shape
    x = model.wte[tokens] + jnp.broadcast_to(model.wpe[:t], (b, t, model.wpe.shape[1]))
    params, static = eqx.partition(model.blocks, eqx.is_array)
    if model.scan_layers:
        step = lambda x, p: (_block(eqx.combine(p, static), x, mm), None)
        x, _ = lax.scan(step, x, params)
    else:
        for i in range(jax.tree.leaves(params)[0].shape[0]):
            layer = jax.tree.map(lambda a, i=i: a[i], params)
            x = _block(eqx.combine(layer, static), x, mm)
    return mm.einsum("btc,vc->btv", model.ln_f(x), model.wte)


def hand_gpt_loss(half, fp8: bool = False, lean: bool = False) -> Callable:
    """The GPT loss with mixed precision placed by hand: matmuls in `half`, the rest
    in float32 (`Matmuls`); `fp8`: every matmul through `lowtrain.fp8` (the "fp8"
    policy's placement, `half` bfloat16). `lean`: the loss of
    `model.cross_entropy=lean` (`recipes.gpt.cross_entropy` on the `half` logits)
    instead of float32 logits. `twin` picks these arguments for an `amp` preset."""
    mm = Matmuls(jnp.dtype(half), fp8=fp8)
    ce = lean_cross_entropy if lean else cross_entropy

    def hand_loss(model: GPT, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return ce(_hand_gpt_logits(model, tokens, mm), targets)

    return hand_loss


# --------------------------------------------------------------------------------------
# Benchmark cases
# --------------------------------------------------------------------------------------


@dataclass
class Case:
    """A model, its loss in hand-placed mixed precision, and a batch (the float32
    loss is `loss` for every case). `hand_loss(half, fp8=False)` returns the
    hand-placed loss (`twin` calls it for a preset)."""

    name: str
    model: eqx.Module
    hand_loss: Callable[..., Callable]
    batch: tuple[jax.Array, jax.Array]
    step_factor: int = 1  # times `--steps` timed steps (for cheap, noisy steps)


def mlp_case(key: jax.Array) -> Case:
    """The recipe's MLP 784-512-512-10 on a random batch of 128 images."""
    k_model, k_x, k_y = jax.random.split(key, 3)
    images = jax.random.normal(k_x, (MLP_BATCH, 28, 28))
    labels = jax.random.randint(k_y, (MLP_BATCH,), 0, 10)
    return Case(
        "MLP 784-512-512-10, batch 128",
        MLP(hidden=(512, 512), key=k_model),
        hand_mlp_loss,
        (images, labels),
        step_factor=5,
    )


def gpt_case(key: jax.Array) -> Case:
    """The recipe's GPT (4 layers, width 128, 4 heads) on random token crops."""
    k_model, k_tokens = jax.random.split(key)
    c = GPT_CONFIG
    stream = jax.random.randint(k_tokens, (GPT_BATCH, c.block_size + 1), 0, GPT_VOCAB)
    return Case(
        f"GPT {c.n_layer}L d{c.n_embd} h{c.n_head}, seq {c.block_size}, "
        f"batch {GPT_BATCH}",
        GPT(c, GPT_VOCAB, key=k_model),
        hand_gpt_loss,
        (stream[:, :-1], stream[:, 1:]),
    )


def make_cases() -> list[Case]:
    """The MLP and GPT benchmark cases, with their inputs on the device."""
    key_mlp, key_gpt = jax.random.split(jax.random.key(0))
    return [mlp_case(key_mlp), gpt_case(key_gpt)]


def twin(hand_loss: Callable[..., Callable], policy: str, **kw) -> Callable:
    """The loss `hand_loss` (`hand_mlp_loss`, `hand_gpt_loss`) places by hand as
    `amp`'s preset `policy` places it: "fp16", "bf16" (everything but the float32 ops
    in that dtype) or "fp8" (FP8 matmuls, the rest in the preset's bfloat16)."""
    if policy == "fp8":
        return hand_loss(lowtrain.get_policy(policy).compute_dtype, fp8=True, **kw)
    return hand_loss(HALF[policy], **kw)


def half_residuals(policy: str) -> lowtrain.Policy:
    """`policy` with `residuals="half"`: only compute-dtype values are saved."""
    return lowtrain.get_policy(policy).with_residuals("half")


def variant_losses(case: Case, policy: str) -> dict[str, Callable]:
    """The losses compared for `case` under `policy`: amp (saving all residuals, and
    saving only half-precision ones) and by hand."""
    return {
        "amp": lowtrain.amp(loss, policy),
        "amp_half": lowtrain.amp(loss, half_residuals(policy)),
        "hand": twin(case.hand_loss, policy),
    }


def residual_variants(case: Case) -> dict[str, Callable]:
    """The losses whose saved residuals are compared, by row name."""
    return {
        "float32 loss": loss,
        "amp fp16": lowtrain.amp(loss, "fp16"),
        "amp bf16": lowtrain.amp(loss, "bf16"),
        "amp fp16, residuals=half": lowtrain.amp(loss, half_residuals("fp16")),
        "amp bf16, residuals=half": lowtrain.amp(loss, half_residuals("bf16")),
        "hand fp16": case.hand_loss(HALF["fp16"]),
        "hand bf16": case.hand_loss(HALF["bf16"]),
    }


def loss_gap(case: Case, policy: str) -> float:
    """The largest |loss(amp) - loss(v)| over the variants `v` of `variant_losses`
    under `policy`, at the initial parameters: 0.0 when they all place every op of
    the forward pass in the same precision.

    All are compiled with XLA's excess precision off (`xla_allow_excess_precision`):
    with it on (the default), XLA may keep a chain of half-precision elementwise ops
    in float32 where its fusion allows, so two programs with the same ops can round
    differently (by about 1e-5 here).
    """
    values = {}
    for name, fn in variant_losses(case, policy).items():
        compiled = jax.jit(fn).lower(case.model, *case.batch)
        compiled = compiled.compile({"xla_allow_excess_precision": False})
        values[name] = float(compiled(case.model, *case.batch))
    return max(abs(values["amp"] - v) for v in values.values())
