"""The unit-scaled GPT with its mixed precision placed by hand: the hand-cast twin of
the bench's unit_bf16, unit_fp16 and unit_fp8 rows.

`recipe=gpt_unit_bf16|fp16` run `model=gpt_unit` (`lowtrain.unit_scaling.
TransformerDecoder`) under `lowtrain.amp`'s "bf16" / "fp16" policy; `gpt_unit_fp8`
first rewrites every matmul but the readout's into `uu.fp8_cast_op` (E4M3 operands,
E5M2 cotangent, scale 1: `precision=fp8_naive`, `keep: [projection]`), then runs the
"bf16" policy. `hand_unit_loss` writes the same model with the casts in the code, as
one writes a unit-scaled model in mixed precision without lowtrain's transforms:
parameters kept in float32; every matmul on operands cast to half, returning half
(for unit_fp8 a `lowtrain.fp8.fp8_dot_general` with scale 1 called by hand, on the
operands as they come); every other op in the widest dtype of its inputs, and the
ops `amp`'s policy runs in float32 upcast by hand (the RMS norms' mean and rsqrt,
the attention softmax, SiLU's sigmoid and the products after it). The
unit-scaling ops that decide no precision (`U.scale_fwd`, `U.scale_bwd`,
`U.residual_apply`, `U.embedding`, `U.cross_entropy`) are the library's own.

The result is the Trainer's loss to the last bit (`tests/test_bench.py`), so the
bench's lowtrain / hand ratio measures what the transforms cost, not a different
placement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import lowtrain
import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U
from lowtrain.fp8 import fp8_dot_general
from lowtrain.recipes.internal import NaiveFp8PrecisionConfig
from lowtrain.unit_scaling.internal import (
    attention_scale,
    folds,
    glu_scale,
    leading_size,
    next_stream_scale,
)

F32 = jnp.float32


@dataclass(frozen=True)
class UnitMatmuls:
    """How the hand-placed unit GPT runs its matmuls: on `half` operands, returning
    `half`; with `fp8`, each a `lowtrain.fp8.fp8_dot_general` with static scale 1
    (the operands cast to E4M3, the cotangent to E5M2, no amax) unless its
    sublayer's name is in `keep`, as `precision=fp8_naive` with `precision.keep`
    places them."""

    half: Any
    fp8: bool = False
    keep: tuple[str, ...] = ()

    def __call__(self, a, b, scope: str, spec: str | None = None):
        """`a @ b` (or `jnp.einsum(spec, a, b)`) of the sublayer `scope`."""
        half = self.half
        spec = spec or "...k,kn->...n"
        if self.fp8 and scope not in self.keep:
            # The einsum's dot_general as an FP8 matmul with static scale 1, called
            # by hand on the operands as they come (on a GPU an FP8 GEMM).
            def fp8_dot(lhs, rhs, dimension_numbers, precision=None, **_):
                return fp8_dot_general(
                    lhs, rhs, dimension_numbers, scale=1.0, out_dtype=half
                )

            return jnp.einsum(
                spec, a, b, preferred_element_type=half, _dot_general=fp8_dot
            )
        return jnp.einsum(spec, a.astype(half), b.astype(half))


def _not_the_unit_gpt(expected: str, got: str) -> ValueError:
    return ValueError(
        f"Expected the unit GPT's {expected}, got {got} instead. This twin writes "
        "`model=gpt_unit` as `recipes.gpt.build_model` builds it "
        "(`uu.TransformerDecoder`); another model needs a twin of its own."
    )


def _linear(mm: UnitMatmuls, layer, x, scope: str, output_power: float = 0.5):
    """`U.linear` (`output_power` 1: `U.linear_readout`) of a bias-free `uu.Linear`
    with its matmul placed by `mm`: the same scales, forward and backward."""
    if layer.bias is not None:
        raise _not_the_unit_gpt("bias-free linears", f"a bias in {layer}")
    fan_out, fan_in = layer.weight.shape
    output_scale, grad_input_scale = uu.constraints.apply(
        layer.constraint, fan_in**-output_power, fan_out**-0.5
    )
    x = U.scale_bwd(x, grad_input_scale)
    weight = U.scale_bwd(layer.weight, leading_size(x, 1) ** -0.5)
    return U.scale_fwd(mm(x, weight.T, scope), output_scale)


def _rms_norm(norm: uu.RMSNorm, x):
    """`uu.RMSNorm` (no weight) of the stream `x`, as `amp` places it: the mean and
    the rsqrt in float32, the square and the product in the widest dtype."""
    if norm.weight is not None:
        raise _not_the_unit_gpt("weightless RMS norms", "an RMS norm with a weight")
    axes = tuple(range(x.ndim - len(norm.shape), x.ndim))
    ms = jnp.mean((x * x).astype(F32), axis=axes, keepdims=True)
    return x.astype(F32) * lax.rsqrt(ms + norm.eps)


def _attention(mm: UnitMatmuls, q, k, v, mult: float):
    """`U.scaled_dot_product_attention(q, k, v, is_causal=True, mult=mult)`: the
    products by `mm`, the softmax in float32 on the masked half scores."""
    seq, head_dim = q.shape[-2:]
    scale = attention_scale(seq, head_dim, True, mult)
    q, k, v = (U.scale_bwd(t, scale) for t in (q, k, v))
    logits = mm(q, k, "attention", "...qd,...kd->...qk") * (mult / head_dim)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), logits.shape)
    # The library masks with float32's lowest, which is -inf in 16 bits.
    logits = jnp.where(mask, logits, float(jnp.finfo(F32).min))
    weights = jax.nn.softmax(logits.astype(F32), axis=-1)
    return U.scale_fwd(mm(weights, v, "attention", "...qk,...kd->...qd"), scale)


def _mhsa(mm: UnitMatmuls, attn: uu.MHSA, x):
    """`uu.MHSA.__call__` (causal)."""
    *lead, seq, hidden = x.shape
    qkv = _linear(mm, attn.linear_qkv, x, "linear_qkv")
    qkv = qkv.reshape(*lead, seq, 3, attn.heads, -1)
    q, k, v = jnp.swapaxes(jnp.moveaxis(qkv, -3, 0), -3, -2)
    out = _attention(mm, q, k, v, attn.mult)
    out = jnp.swapaxes(out, -3, -2).reshape(*lead, seq, hidden)
    return _linear(mm, attn.linear_o, out, "linear_o")


def _silu_f32(g):
    """SiLU of a half `g` in float32 (`logistic` is a float32 op of the policy)."""
    g = g.astype(F32)
    return g * jax.nn.sigmoid(g)


def _mlp(mm: UnitMatmuls, mlp: uu.MLP, x):
    """`uu.MLP.__call__` (SwiGLU): `U.swiglu_mlp`'s folded scales when `mlp`
    folds them, else op by op (`U.linear`, `U.silu_glu`, `U.linear`)."""
    if mlp.linear_gate is None:
        raise _not_the_unit_gpt("SwiGLU MLPs", f"activation={mlp.activation!r}")
    s = glu_scale()
    if mlp.fold_scales and folds(mlp.linear_1, mlp.linear_gate, mlp.linear_2):
        inner, hidden = mlp.linear_1.weight.shape
        in_scale, ct_scale = hidden**-0.5, hidden**-0.5 * s
        w_scale = leading_size(x, 1) ** -0.5
        x = U.scale_bwd(x, inner**-0.5 * ct_scale)
        w1 = U.scale_bwd(mlp.linear_1.weight, w_scale * ct_scale)
        wg = U.scale_bwd(mlp.linear_gate.weight, w_scale * ct_scale)
        a = mm(x, w1.T, "linear_1")
        g = mm(x, wg.T, "linear_gate")
        h = U.scale_fwd(a.astype(F32) * _silu_f32(g * in_scale), in_scale * s)
        w2 = U.scale_bwd(mlp.linear_2.weight, w_scale)
        return U.scale_fwd(mm(h, w2.T, "linear_2"), inner**-0.5)
    a = _linear(mm, mlp.linear_1, x, "linear_1")
    g = _linear(mm, mlp.linear_gate, x, "linear_gate")
    a, g = U.scale_bwd(a, s), U.scale_bwd(g, s)
    h = U.scale_fwd(a * _silu_f32(g * 1.0), s)  # `U.silu_glu(a, g)`, mult 1
    return _linear(mm, mlp.linear_2, h, "linear_2")


def _layer(mm: UnitMatmuls, layer: uu.TransformerLayer, x):
    """`uu.TransformerLayer.__call__` (no dropout) on the stream `x`."""
    if layer.dropout_p != 0 or layer.stream_scale is None:
        raise _not_the_unit_gpt(
            "layers without dropout and with a stream scale",
            f"dropout {layer.dropout_p}, stream scale {layer.stream_scale}",
        )
    c = layer.stream_scale
    x = U.residual_apply(
        lambda h: _mhsa(mm, layer.mhsa, _rms_norm(layer.mhsa_norm, h)),
        x,
        layer.mhsa_tau,
        stream_scale=c,
    )
    return U.residual_apply(
        lambda h: _mlp(mm, layer.mlp, _rms_norm(layer.mlp_norm, h)),
        x,
        layer.mlp_tau,
        stream_scale=next_stream_scale(c, layer.mhsa_tau),
    )


def hand_unit_loss(
    half, fp8: bool = False, keep: Sequence[str] = ("projection",)
) -> Callable:
    """The unit-scaled GPT's loss (`U.cross_entropy`, as `UnitGptTrainer` has it)
    with mixed precision placed by hand: parameters in float32, each matmul on
    operands cast to `half`; with `fp8`, every matmul but those of the sublayers in
    `keep` an FP8 matmul with static scale 1 (unit_fp8's placement)."""
    mm = UnitMatmuls(jnp.dtype(half), fp8=fp8, keep=tuple(keep))

    def hand_loss(model: uu.TransformerDecoder, tokens, targets):
        # The parameters stay float32: the stream starts as float32 rows.
        x = U.embedding(tokens, model.embedding.weight)
        for layer in model.layers.layers:
            x = _layer(mm, layer, x)
        h = _rms_norm(model.final_norm, x)
        logits = _linear(mm, model.projection, h, "projection", output_power=1.0)
        return U.cross_entropy(logits.astype(F32), targets)

    return hand_loss


def twin(config) -> Callable | None:
    """The hand-cast twin of a unit-scaled recipe (`config`: its checked
    `recipes._config.Config`): `hand_unit_loss` in its policy's compute dtype, with
    the FP8 casts and `keep` of `precision=fp8_naive`; None for
    `precision.weights_only=true`, a placement it does not write. Like the GPT's
    twins it saves what autodiff saves, whatever `precision.residuals` says."""
    p = config.precision
    fp8 = isinstance(p, NaiveFp8PrecisionConfig)
    if fp8 and p.weights_only:
        return None
    half = lowtrain.get_policy(p.policy).compute_dtype
    return hand_unit_loss(half, fp8=fp8, keep=tuple(p.keep) if fp8 else ())
