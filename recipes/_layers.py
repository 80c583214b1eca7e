"""Batched layers for the recipes' models, in plain JAX (no precision arguments: the
precision is the Trainer's business, see `recipes/precisions.py`).

The layers take whole batches (`(..., in)`), not single examples under `vmap`: the FP8
policy scales each matmul *per tensor*, and a `vmap` outside `lowtrain.amp` would
turn that into one scale per example, which is not what FP8 hardware does.

Parameter names matter to the optimizer: weight decay applies to the fields named in
`DECAYED` (matrices and embeddings), not to biases and norms (`decay_mask`).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

DECAYED = ("kernel", "wte", "wpe")


def decay_mask(params: PyTree) -> PyTree:
    """True for the arrays weight decay applies to: fields named in `DECAYED`."""

    def decayed(path, _):
        last = path[-1] if path else None
        return getattr(last, "name", None) in DECAYED

    return jax.tree_util.tree_map_with_path(decayed, params)


def _add_bias(y: Array, bias: Array | None) -> Array:
    return y if bias is None else y + jnp.broadcast_to(bias, y.shape)


class Linear(eqx.Module):
    """`x @ kernel + bias` on a batch: `(..., in) -> (..., out)`."""

    kernel: Float[Array, "in out"]
    bias: Float[Array, " out"] | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        std: float | None = None,
        bias: bool = True,
        key: PRNGKeyArray,
    ):
        std = 1 / math.sqrt(in_features) if std is None else std
        self.kernel = std * jax.random.normal(key, (in_features, out_features))
        self.bias = jnp.zeros(out_features) if bias else None

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        y = jnp.einsum("...i,io->...o", x, self.kernel)
        return _add_bias(y, self.bias)


class Conv2d(eqx.Module):
    """A 3x3 "SAME" convolution on NHWC batches: `(B, H, W, in) -> (B, H, W, out)`."""

    kernel: Float[Array, "3 3 in out"]
    bias: Float[Array, " out"]

    def __init__(self, in_ch: int, out_ch: int, *, key: PRNGKeyArray):
        std = math.sqrt(2 / (9 * in_ch))  # He: the convolutions feed ReLUs
        self.kernel = std * jax.random.normal(key, (3, 3, in_ch, out_ch))
        self.bias = jnp.zeros(out_ch)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W O"]:
        y = lax.conv_general_dilated(
            x,
            self.kernel,
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
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
