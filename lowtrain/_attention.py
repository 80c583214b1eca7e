"""`dot_product_attention`: attention as one op, which `amp` runs whole in the compute
dtype (cuDNN's fused kernel on an NVIDIA GPU) instead of op by op."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

IMPLEMENTATIONS = (None, "xla", "cudnn")
# cuDNN's fused (flash) attention takes float16 and bfloat16 operands, and head sizes
# that are multiples of 8 up to 128 on every architecture it supports (256 on Hopper).
_CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_CUDNN_MAX_HEAD = 128
_NAME = "lowtrain_dot_product_attention_"
F32 = jnp.float32


class AttentionConfig(NamedTuple):
    """The static arguments of one `dot_product_attention` call."""

    is_causal: bool
    scale: float | None
    implementation: str | None


# Set while a transform that interprets a traced program op by op (`scalify`) traces
# it: `dot_product_attention` calls that leave `implementation` to lowtrain trace XLA's
# ops then, which the transform has rules for, instead of cuDNN's kernel, which it
# does not (and whose backward pass JAX writes before the transform sees it).
_XLA_ONLY = contextvars.ContextVar("lowtrain_attention_xla_only", default=False)


@contextlib.contextmanager
def xla_only():
    """Within: `dot_product_attention` with no `implementation` traces "xla"."""
    token = _XLA_ONLY.set(True)
    try:
        yield
    finally:
        _XLA_ONLY.reset(token)


# The jitted op of each configuration, by the name its `jit` equation carries (which
# is how an interpreter recognises the op in a jaxpr: the configuration is static, so
# it is not in the equation's parameters).
_CONFIGS: dict[str, AttentionConfig] = {}


def attention_config(eqn) -> tuple[AttentionConfig, bool] | None:
    """For an equation (a `lowtrain._eqn.Eqn`) of `dot_product_attention`, its
    configuration and whether it is the call as written; None for any other.

    JAX's autodiff splits the op's jit into jits of the same name (the residuals'
    computation, the transposed pass); only the call as written has the op's
    signature, `(query, key, value) -> output` of the query's shape."""
    if eqn.primitive.name != "jit":
        return None
    config = _CONFIGS.get(eqn.params.get("name", ""))
    if config is None:
        return None
    avals_in, avals_out = eqn.in_avals, eqn.out_avals
    written = (
        len(avals_in) == 3
        and len(avals_out) == 1
        and avals_out[0].shape == avals_in[0].shape
    )
    return config, written


def _on_cuda() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return "cuda" in jax.devices()[0].client.platform_version.lower()


def choose_implementation(
    dtype, head_size: int, implementation: str | None, cuda: bool | None = None
) -> str:
    """The implementation `dot_product_attention` runs: `implementation` if given,
    else "cudnn" on an NVIDIA GPU (`cuda`, default: JAX's default backend) for float16
    and bfloat16 operands with a head size cuDNN takes, and "xla" otherwise."""
    if implementation is not None:
        return implementation
    cuda = _on_cuda() if cuda is None else cuda
    fits = head_size % 8 == 0 and head_size <= _CUDNN_MAX_HEAD
    return "cudnn" if cuda and jnp.dtype(dtype) in _CUDNN_DTYPES and fits else "xla"


def _xla_attention(query, key, value, is_causal: bool, scale: float | None):
    """What `jax.nn.dot_product_attention(implementation="xla")` computes: float32
    logits and softmax, probabilities cast to the operands' dtype for the product with
    `value`. (JAX's own asks `dot_general` for the `F16_F16_F32` algorithm on float16
    operands, which XLA's CPU backend rejects: JAX 0.10, 0.11.)"""
    _, t, n, h = query.shape
    s, kv_heads = key.shape[1], key.shape[2]
    if kv_heads != n:  # grouped-query attention: each key/value head serves n / kv
        key, value = (jnp.repeat(a, n // kv_heads, axis=2) for a in (key, value))
    scale = 1 / math.sqrt(h) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", query, key, preferred_element_type=F32)
    logits = logits * jnp.float32(scale)  # (B, N, T, S)
    if is_causal:
        causal = jnp.tril(jnp.ones((t, s), bool))
        # A large finite negative, as JAX's: a fully masked row gives 0s, not NaN.
        logits = jnp.where(causal, logits, -0.7 * jnp.finfo(F32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, value)


@functools.cache
def _op(config: AttentionConfig):
    def run(query, key, value):
        impl = choose_implementation(
            query.dtype, query.shape[-1], config.implementation
        )
        if impl == "xla":
            return _xla_attention(query, key, value, config.is_causal, config.scale)
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            scale=config.scale,
            is_causal=config.is_causal,
            implementation=impl,
        )

    run.__name__ = run.__qualname__ = f"{_NAME}{len(_CONFIGS)}"
    _CONFIGS[run.__name__] = config
    return jax.jit(run)


def dot_product_attention(
    query: Float[Array, "batch q_seq heads head_size"],
    key: Float[Array, "batch kv_seq kv_heads head_size"],
    value: Float[Array, "batch kv_seq kv_heads head_size"],
    *,
    is_causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "batch q_seq heads head_size"]:
    """`jax.nn.dot_product_attention` (`softmax(scale * q @ k.T) @ v`, per head; layout
    `(batch, seq, heads, head_size)`, `scale` default `1 / sqrt(head_size)`), as one op
    that `amp` runs whole. The batch axis may be absent (one sequence, as in a
    per-example Equinox model under `jax.vmap`) or several axes.

    Outside `amp` it is `jax.nn.dot_product_attention` with `implementation` chosen
    as follows when not given: cuDNN's fused kernel ("cudnn") on an NVIDIA GPU for
    float16 and bfloat16 operands with a head size that is a multiple of 8 up to 128,
    and otherwise "xla", what JAX's XLA implementation computes (float32 logits and
    softmax, probabilities in the operands' dtype), written with `jnp.einsum` (JAX's
    own fails on float16 on the CPU). cuDNN's kernel never writes the `(q_seq, kv_seq)`
    scores to memory, which in a GPT's step is most of its memory traffic and of the
    memory saved for the backward pass.

    Under `amp`, the policy's action for `"dot_product_attention"` (default:
    "compute") casts the three operands once, and the op runs in that dtype as above:
    so under the "bf16" or "fp8" presets a GPU runs cuDNN's kernel in bfloat16 (the
    "fp8" preset keeps attention in bfloat16, as Transformer Engine does; its matmuls
    elsewhere are FP8), while attention written with `jnp.einsum` and
    `jax.nn.softmax` is placed op by op and writes its scores. Under `scalify`, which
    propagates scales op by op, a call with no `implementation` runs the XLA
    implementation's ops on any device; other transforms (`numerics`, `unit_scale`)
    see the op that runs.

    **Arguments:**

    - `query`: float array of shape `(batch, q_seq, heads, head_size)`.
    - `key`: float array of shape `(batch, kv_seq, kv_heads, head_size)`, where
      `kv_heads` divides `heads` (grouped-query attention when fewer).
    - `value`: float array of the shape of `key`.
    - `is_causal`: whether query position `t` attends only to key positions `<= t`
      (a lower-triangular mask); default False.
    - `scale`: the factor the logits are multiplied by; default (None)
      `1 / sqrt(head_size)`.
    - `implementation`: "xla", "cudnn" or None (the default: chosen as above).

    All three share their leading (batch) axes, as said above. Returns an array of
    the shape of `query`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain

    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 4, 8))
    y = lowtrain.dot_product_attention(q, k, v, is_causal=True)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert jnp.allclose(y, ref, atol=1e-6)
    half = lowtrain.amp(
        lambda q, k, v: lowtrain.dot_product_attention(q, k, v, is_causal=True), "bf16"
    )
    assert jnp.allclose(half(q, k, v), ref, atol=0.05)
    ```
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"Expected `implementation` None, 'xla' or 'cudnn', got {implementation!r} "
            "instead. None picks cuDNN where it runs and XLA elsewhere."
        )
    lead = jnp.shape(query)[:-3]
    for name, x in (("query", query), ("key", key), ("value", value)):
        if jnp.ndim(x) < 3 or jnp.shape(x)[:-3] != lead:
            raise ValueError(
                f"Expected `{name}` of shape (..., seq, heads, head_size) with the "
                f"query's leading axes {lead}, got shape {jnp.shape(x)} instead. "
                "Lay out query, key and value as (batch, seq, heads, head_size), or "
                "(seq, heads, head_size) for one sequence."
            )
    scale = None if scale is None else float(scale)
    if implementation is None and _XLA_ONLY.get():
        implementation = "xla"
    config = AttentionConfig(bool(is_causal), scale, implementation)
    # Leading axes (none, or several: a `vmap` over a batched call) become one batch
    # axis: the op's jit always sees (batch, seq, heads, head_size).
    flat = [jnp.reshape(x, (-1, *jnp.shape(x)[-3:])) for x in (query, key, value)]
    out = _op(config)(*flat)
    return out.reshape(*lead, *out.shape[1:])
