"""Batched layers for the recipes, and the naive FP8 matmul baseline.

The layers take whole batches (`(..., in)`), not single examples under `vmap`: the FP8
policy scales each matmul *per tensor*, and a `vmap` outside `lowtrain.amp` would
turn that into one scale per example, which is not what FP8 hardware does.

Parameter names matter to the optimizer: weight decay applies to the fields named in
`DECAYED` (matrices and embeddings), not to biases and norms (`decay_mask`).
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from lowtrain import fp8, scalify

DECAYED = ("kernel", "wte", "wpe")


def decay_mask(params: PyTree) -> PyTree:
    """True for the arrays weight decay applies to: fields named in `DECAYED`."""

    def decayed(path, _):
        last = path[-1] if path else None
        return getattr(last, "name", None) in DECAYED

    return jax.tree_util.tree_map_with_path(decayed, params)


def _fp8_round(x: Array, dtype) -> Array:
    # Scale 1: `x` itself is cast, saturating at the format's max (448 for E4M3,
    # 57344 for E5M2); magnitudes below half the smallest subnormal (2**-10 for E4M3,
    # 2**-17 for E5M2) become 0. The result is in `x.dtype` again.
    return fp8.dequantize(fp8.quantize(x, dtype, 1.0), 1.0, x.dtype)


def naive_fp8(op, lhs: Array, rhs: Array) -> Array:
    """`op(lhs, rhs)` with both operands cast to E4M3 and the cotangent to E5M2,
    all with scale 1: FP8 without scaling, the baseline the `fp8` policy improves on.

    `op` is bilinear (a matmul, an einsum, a convolution). Forward: `op` of the
    E4M3-rounded operands. Backward: the output cotangent is rounded to E5M2 and both
    gradients come from it and the E4M3 operands, as in `lowtrain.fp8`'s scaled path.
    The rounding is `lowtrain.fp8.quantize` (saturating, round to nearest even).
    Around it, `op` runs in whatever precision the caller's policy gives it: under
    the "bf16" policy that is a bfloat16 matmul of FP8 values (exact: bfloat16 holds
    every E4M3 and E5M2 value), accumulated in float32.
    """

    @jax.custom_vjp
    def run(lhs, rhs):
        return op(_fp8_round(lhs, fp8.E4M3), _fp8_round(rhs, fp8.E4M3))

    def fwd(lhs, rhs):
        ql, qr = _fp8_round(lhs, fp8.E4M3), _fp8_round(rhs, fp8.E4M3)
        return op(ql, qr), (ql, qr)

    def bwd(res, g):
        _, vjp = jax.vjp(op, *res)
        return vjp(_fp8_round(g, fp8.E5M2))

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def scalify_fp8(op, lhs: Array, rhs: Array) -> Array:
    """`op(lhs, rhs)` for `transform=scalify`: both operands rescaled to unit RMS and
    their data cast to E4M3; in the backward pass the output cotangent is rescaled to
    unit RMS and its data cast to E5M2 (`lowtrain.scalify.dynamic_rescale_l2[_grad]`,
    `cast_fp8`: the scales are kept, so values do not change beyond FP8 rounding).
    Unit RMS puts the data where the FP8 formats have their precision and range.
    Outside `scalify` the rescales are the identity and the casts have scale 1."""
    lhs = scalify.cast_fp8(scalify.dynamic_rescale_l2(lhs), fp8.E4M3, None)
    rhs = scalify.cast_fp8(scalify.dynamic_rescale_l2(rhs), fp8.E4M3, None)
    # Backward, the cotangent meets the rescale first, then the E5M2 cast.
    out = scalify.cast_fp8(op(lhs, rhs), None, fp8.E5M2)
    return scalify.dynamic_rescale_l2_grad(out)


FP8_PATHS = {
    None: lambda op, a, b: op(a, b),
    "naive": naive_fp8,
    "scalify": scalify_fp8,
}


def fp8_op(path: str | None, op, a: Array, b: Array) -> Array:
    """`op(a, b)` through the FP8 path `path`: None (as is), "naive" or "scalify"."""
    return FP8_PATHS[path](op, a, b)


def einsum(spec: str, a: Array, b: Array, *, fp8_path: str | None = None) -> Array:
    """`jnp.einsum(spec, a, b)` through `fp8_op`."""
    return fp8_op(fp8_path, functools.partial(jnp.einsum, spec), a, b)


def _add_bias(y: Array, bias: Array | None) -> Array:
    return y if bias is None else y + jnp.broadcast_to(bias, y.shape)


class Linear(eqx.Module):
    """`x @ kernel + bias` on a batch: `(..., in) -> (..., out)`."""

    kernel: Float[Array, "in out"]
    bias: Float[Array, " out"] | None
    fp8_path: str | None = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        std: float | None = None,
        bias: bool = True,
        fp8_path: str | None = None,
        key: PRNGKeyArray,
    ):
        std = 1 / math.sqrt(in_features) if std is None else std
        self.kernel = std * jax.random.normal(key, (in_features, out_features))
        self.bias = jnp.zeros(out_features) if bias else None
        self.fp8_path = fp8_path

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        y = einsum("...i,io->...o", x, self.kernel, fp8_path=self.fp8_path)
        return _add_bias(y, self.bias)


class Conv2d(eqx.Module):
    """A 3x3 "SAME" convolution on NHWC batches: `(B, H, W, in) -> (B, H, W, out)`."""

    kernel: Float[Array, "3 3 in out"]
    bias: Float[Array, " out"]
    fp8_path: str | None = eqx.field(static=True)

    def __init__(self, in_ch: int, out_ch: int, *, fp8_path=None, key: PRNGKeyArray):
        std = math.sqrt(2 / (9 * in_ch))  # He: the convolutions feed ReLUs
        self.kernel = std * jax.random.normal(key, (3, 3, in_ch, out_ch))
        self.bias = jnp.zeros(out_ch)
        self.fp8_path = fp8_path

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W O"]:
        op = functools.partial(
            lax.conv_general_dilated,
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        y = fp8_op(self.fp8_path, op, x, self.kernel)
        return _add_bias(y, self.bias)


class LayerNorm(eqx.Module):
    """Layer norm over the last axis of a batch (float32 inside `lowtrain.amp`)."""

    scale: Float[Array, " C"]
    offset: Float[Array, " C"]
    eps: float = eqx.field(static=True)

    def __init__(self, size: int, eps: float = 1e-5):
        self.scale = jnp.ones(size)
        self.offset = jnp.zeros(size)
        self.eps = eps

    def __call__(self, x: Float[Array, "... C"]) -> Float[Array, "... C"]:
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        y = (x - mean) * lax.rsqrt(var + self.eps)
        scale, offset = (
            jnp.broadcast_to(v, y.shape) for v in (self.scale, self.offset)
        )
        return y * scale + offset
