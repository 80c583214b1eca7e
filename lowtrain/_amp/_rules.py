"""The default AMP rule table: which precision each primitive runs in, and why.

A rule is an *action* (a string, so policies stay plain data that Hydra can write):
- "compute": cast float inputs to the policy's compute dtype;
- "float32": cast float inputs to at least float32;
- "widest": cast float inputs to the widest float dtype among them, ignoring weakly
  typed scalars such as the `2.0` in `x * 2.0` (the default for every primitive not
  listed);
- "keep": cast float inputs back to the dtype the program was traced with (what
  `amp_stop` does to a whole region);
- "fp8" (matmuls and convolutions only): run through `lowtrain.fp8`'s FP8 path (E4M3
  operands forward, E5M2 cotangent backward, per-tensor current scaling), returning
  the compute dtype;
- "block" (`dot_general` only): run through `lowtrain.fp8.block_recipe_dot` with
  the policy's `block` recipe (block-scaled MXFP8, DeepSeek-V3's FP8 tiles, NVFP4;
  simulated: quantize, dequantize, multiply), returning the compute dtype;
- a block recipe's name, "mxfp8", "fp8_block" or "nvfp4" (`dot_general` only): as
  "block", with that recipe (the policy's own `block` where it has that name, so
  its switched parts hold), so that one policy can run each matmul in its own
  format (`lowtrain.numerics.plan(formats=...)`'s choices, by scope);
- a float dtype name ("float32", "bfloat16", ...): cast float inputs to that dtype.
"""

from __future__ import annotations

from .. import _scopes

COMPUTE = "compute"
FLOAT32 = "float32"
WIDEST = "widest"
KEEP = "keep"
FP8 = "fp8"
BLOCK = "block"
# Actions that run a named block recipe (`lowtrain.fp8.BLOCK_RECIPES`' keys).
BLOCK_NAMES = ("mxfp8", "fp8_block", "nvfp4")
ACTIONS = (COMPUTE, FLOAT32, WIDEST, KEEP, FP8, BLOCK, *BLOCK_NAMES)
FP8_PRIMITIVES = ("dot_general", "conv_general_dilated")
# Block scaling runs along one contracting dimension: matmuls only (a convolution
# under a block policy runs in the compute dtype).
BLOCK_PRIMITIVES = ("dot_general",)

# `amp_stop` opens a `jax.named_scope` with this name (defined in the core, since
# `lowtrain.fp8` opens it too); every policy maps it to "keep".
AMP_STOP_SCOPE = _scopes.AMP_STOP_SCOPE

# Matmuls and convolutions carry almost all the FLOPs and are what tensor cores speed
# up. They run in the compute dtype and also return it, so the activations they
# produce (and the residuals saved for the backward pass) are half-size. Products are
# accumulated in float32: XLA's GPU backend asks cuBLAS/cuDNN for a float32 compute
# type on half inputs, and its CPU backend upcasts half-precision dots to float32
# (`test_accumulation_is_float32` checks this with a sum that float16 would get wrong).
_MATMUL = {
    "dot_general": COMPUTE,
    "conv_general_dilated": COMPUTE,
}

_FLOAT32_REASONS = {
    # exp overflows float16 above 11.09; expm1 and exp2 likewise.
    "exp": "overflows float16 above x = 11.09",
    "exp2": "overflows float16 above x = 16",
    "expm1": "overflows float16 above x = 11.09; loses its small-x accuracy in half",
    # log/log1p: results near 0 need more than 10 mantissa bits (log-probabilities).
    "log": "log-probabilities need more than float16's 3 significant digits",
    "log1p": "exists for small-x accuracy, which half precision discards",
    "pow": "x**y over- and underflows float16 for moderate exponents",
    "integer_pow": "x**3 in GELU, x**2 in variances overflow float16 above 256",
    "square": "variances: x**2 overflows float16 for |x| > 256",
    "sqrt": "norms: feeds divisions whose error compounds",
    "rsqrt": "layer/RMS norm: 1/sqrt(var + eps) with eps below float16's resolution",
    "cbrt": "root functions amplify relative error near 0",
    "logistic": "sigmoid saturates to exactly 0/1 in half, killing gradients",
    "tanh": "saturates to exactly +-1 in half precision, killing gradients",
    "erf": "GELU's erf saturates early in half precision",
    "erfc": "tail probabilities underflow float16",
    "erf_inv": "diverges at +-1, where half precision has few values",
    "lgamma": "grows fast, overflows float16",
    "digamma": "loss of accuracy near its poles",
    "div": "softmax normalisation and means: small denominators overflow half",
    # Reductions accumulate many terms: float16 sums stop growing at 2048 + 1.
    "reduce_sum": "accumulating many terms: a float16 sum stalls (2048 + 1 == 2048)",
    "reduce_prod": "products of many terms over- and underflow half",
    "reduce_max": "softmax/logsumexp stabiliser: kept in float32 with its consumers",
    "reduce_min": "kept in float32 like reduce_max",
    "argmax": "ties and near-ties resolve as in the float32 program",
    "argmin": "ties and near-ties resolve as in the float32 program",
    "cumsum": "running sums stall like reduce_sum",
    "cumprod": "running products over- and underflow",
    "cumlogsumexp": "log-space accumulation, as logsumexp",
    "cummax": "kept in float32 like reduce_max",
    "cummin": "kept in float32 like reduce_min",
    # The backward of a gather (embedding lookup) sums the rows' cotangents.
    "scatter-add": "embedding gradients sum many rows: float16 sums stall",
}

# `lowtrain.dot_product_attention` is one op to `amp` (not a primitive: its jit, see
# `lowtrain/_attention.py`): its operands are cast once and it runs whole, on a GPU as
# cuDNN's fused kernel, which keeps its own softmax in float32 and never writes the
# scores; so the compute dtype, as for a matmul.
_ATTENTION = {"dot_product_attention": COMPUTE}

# The bits of a bitcast depend on the dtype: never change it. cuDNN's attention
# kernels (JAX binds them in the backward pass of the op above) take exactly the
# dtypes their forward ran in.
_KEEP = {
    "bitcast_convert_type": KEEP,
    **{
        f"dot_product_attention_{part}": KEEP
        for part in ("fwd", "bwd", "fwd_wrapper", "bwd_wrapper")
    },
}

DEFAULT_RULES: dict[str, str] = {
    **_MATMUL,
    **_ATTENTION,
    **{name: FLOAT32 for name in _FLOAT32_REASONS},
    **_KEEP,
}
