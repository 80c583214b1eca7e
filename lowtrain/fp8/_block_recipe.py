"""Block-scaled training recipes: which block format each operand of a matmul and its
gradient take, and the NVFP4 recipe's extra parts (Hadamard transform, stochastic
rounding). What the "block" action of `lowtrain.amp` runs each matmul through."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
from jaxtyping import Array

from ._block_dot import block_dot_general
from ._blocks import (
    FP8_1X128,
    FP8_128X128,
    MXFP8_E4M3_CEIL,
    NVFP4,
    BlockFormat,
    block_format,
)

WEIGHTS = (None, "lhs", "rhs")


@dataclasses.dataclass(frozen=True)
class BlockRecipe:
    """How a block-scaled matmul quantizes its operands and gradients: the recipe of
    the `mxfp8`, `fp8_block` and `nvfp4` precisions (`BLOCK_RECIPES`), run by
    `block_recipe_dot` (and, for every matmul of a model, by the "block" action of a
    `lowtrain.Policy`).

    A matmul's operand is either a weight (a parameter of the model) or an
    activation; the output cotangent is the gradient. The forward GEMM quantizes each
    operand in its format along the contracting dimension; the two backward GEMMs
    requantize them along the dimension each contracts, and the cotangent in
    `grads` (`lowtrain.fp8.block_dot_general`).

    **Arguments:**

    - `name`: what it is called (its key in `BLOCK_RECIPES` for a named one).
    - `activations`: the `BlockFormat` (or its name) of an operand that is not a
      weight.
    - `weights`: the format of a weight operand (2-D tiles such as 128x128 quantize
      a weight alike in the forward and the backward GEMMs).
    - `grads`: the format of the output cotangent, in both backward GEMMs.
    - `hadamard`: whether the weight-gradient GEMM's two inputs (the activation and
      the cotangent) get the 16x16 random Hadamard transform along the dimension
      it contracts (NVIDIA's NVFP4 recipe). Default False.
    - `stochastic`: whether the cotangent rounds stochastically (unbiased), in both
      backward GEMMs; the forward operands always round to nearest even. Default
      False.

    ```python
    import dataclasses
    import lowtrain.fp8 as fp8

    nvfp4 = fp8.block_recipe("nvfp4")
    assert nvfp4.weights.block == (16, 16) and nvfp4.hadamard and nvfp4.stochastic
    assert fp8.block_recipe("fp8_block").weights is fp8.FP8_128X128
    no_rht = dataclasses.replace(nvfp4, hadamard=False)
    assert no_rht != nvfp4 and hash(no_rht)  # static data, as a Policy holds it
    ```
    """

    name: str
    activations: BlockFormat
    weights: BlockFormat
    grads: BlockFormat
    hadamard: bool = False
    stochastic: bool = False

    def __post_init__(self):
        for field in ("activations", "weights", "grads"):
            object.__setattr__(self, field, block_format(getattr(self, field)))
        for field in ("hadamard", "stochastic"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(
                    f"Expected `{field}` as a bool, got {getattr(self, field)!r} "
                    "instead."
                )


# NVFP4 in 16x16 tiles: NVIDIA's weights (the same tiles in the forward GEMM and
# the transposed backward one).
NVFP4_16X16 = dataclasses.replace(NVFP4, name="nvfp4_16x16", block=(16, 16))

BLOCK_RECIPES = types.MappingProxyType(
    {
        # Transformer Engine's `MXFP8BlockScaling`: E4M3 for every tensor, gradients
        # too (the per-32 scales give the range E5M2 was for), each block's scale
        # rounded up (TE's `float_to_e8m0(amax / 448)`, cuBLAS's; the OCP rule's
        # clipping costs the char-GPT 0.08 nats/char). E5M2 gradients are
        # `dataclasses.replace(..., grads=MXFP8_E5M2_CEIL)`.
        "mxfp8": BlockRecipe(
            "mxfp8", MXFP8_E4M3_CEIL, MXFP8_E4M3_CEIL, MXFP8_E4M3_CEIL
        ),
        # DeepSeek-V3: 1x128 blocks for activations and gradients, 128x128 tiles
        # for weights, E4M3 throughout.
        "fp8_block": BlockRecipe("fp8_block", FP8_1X128, FP8_128X128, FP8_1X128),
        # NVIDIA's NVFP4 pretraining recipe: 16x16 weight tiles, the random
        # Hadamard transform on the weight-gradient GEMM's inputs, stochastic
        # rounding of the gradients.
        "nvfp4": BlockRecipe(
            "nvfp4", NVFP4, NVFP4_16X16, NVFP4, hadamard=True, stochastic=True
        ),
    }
)
"""The named block-scaled recipes by name: "mxfp8", "fp8_block", "nvfp4"
(read-only)."""


def block_recipe(recipe: BlockRecipe | str) -> BlockRecipe:
    """The named `BlockRecipe` (a key of `BLOCK_RECIPES`: "mxfp8", "fp8_block",
    "nvfp4"), or `recipe` itself if it is one.

    **Arguments:**

    - `recipe`: a name or a `BlockRecipe`.

    ```python
    import lowtrain.fp8 as fp8

    assert fp8.block_recipe("mxfp8").grads is fp8.MXFP8_E4M3_CEIL
    ```
    """
    if isinstance(recipe, BlockRecipe):
        return recipe
    if recipe not in BLOCK_RECIPES:
        raise ValueError(
            f"Expected a block recipe among {', '.join(BLOCK_RECIPES)} or a "
            f"`lowtrain.fp8.BlockRecipe`, got {recipe!r} instead."
        )
    return BLOCK_RECIPES[recipe]


def block_recipe_dot(
    lhs: Array,
    rhs: Array,
    dimension_numbers,
    recipe: BlockRecipe | str,
    *,
    weight: str | None = "rhs",
    out_dtype=None,
) -> Array:
    """`lowtrain.fp8.block_dot_general` with the formats and options of `recipe`:
    the weight operand (`weight`) in `recipe.weights`, the other in
    `recipe.activations`, the cotangent in `recipe.grads` (stochastically rounded
    if `recipe.stochastic`, from a hash of each value and its position), and with
    `recipe.hadamard` the random Hadamard transform on the inputs of the weight's
    gradient GEMM. Without a weight (`weight=None`: a product of two activations,
    such as attention's), both operands in `recipe.activations` and no Hadamard
    transform.

    **Arguments:**

    - `lhs`, `rhs`: the operands, float arrays.
    - `dimension_numbers`: as for `lax.dot_general` (one contracting dimension per
      operand).
    - `recipe`: a `BlockRecipe` or its name.
    - `weight`: which operand is the weight: "rhs" (the default), "lhs" or None.
    - `out_dtype`: the result's dtype; default None: `lhs.dtype`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (8, 256))
    w = jax.random.normal(jax.random.key(1), (256, 128))
    dn = (((1,), (0,)), ((), ()))
    y = fp8.block_recipe_dot(x, w, dn, "fp8_block")
    same = fp8.block_dot_general(
        x, w, dn, fp8.FP8_1X128, rhs_format=fp8.FP8_128X128, grad_format=fp8.FP8_1X128
    )
    assert jnp.array_equal(y, same)
    ```
    """
    r = block_recipe(recipe)
    if weight not in WEIGHTS:
        raise ValueError(
            f"Expected `weight` among {WEIGHTS} (which operand is the weight), got "
            f"{weight!r} instead."
        )
    lhs_fmt = r.weights if weight == "lhs" else r.activations
    rhs_fmt = r.weights if weight == "rhs" else r.activations
    return block_dot_general(
        lhs,
        rhs,
        dimension_numbers,
        lhs_fmt,
        rhs_format=rhs_fmt,
        grad_format=r.grads,
        out_dtype=None if out_dtype is None else jnp.dtype(out_dtype),
        rounding="stochastic" if r.stochastic else "nearest",
        hadamard=weight if r.hadamard else None,
    )
