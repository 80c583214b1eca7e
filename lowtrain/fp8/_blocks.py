"""Block-scaled (microscaling) formats: a scale per small block of elements.

A block-scaled tensor is narrow `elements` (FP8 or FP4) and one `scale` per block of
consecutive elements along the contraction axis (a 1-D block of 16, 32 or 128), or per
2-D tile (128x128): the value of each element is `element * scale` (times a float32
per-tensor scale, for NVFP4). A block follows its own amax, so an outlier costs
precision in its block only.

Which rule each format follows, and where it comes from:

- MX (`MXFP8_E4M3`, `MXFP8_E5M2`, `MXFP4`), the OCP Microscaling Formats (MX)
  Specification v1.0. Blocks of 32; the scale is E8M0 (a biased power of two, bias
  127, exponents -127 to 127, the byte `0xFF` NaN, no zero and no infinity; section
  5.4.1). The shared scale of a block is `X = 2**(floor(log2(amax)) - emax_elem)`,
  `emax_elem` the exponent of the element format's largest normal (8 for E4M3, 15 for
  E5M2, 2 for E2M1), clamped to E8M0's range (so a block of zeros, or one whose amax
  is below `2**(emax_elem - 127)`, gets `2**-127`, the byte 0); the elements are
  `V / X` rounded to the element format, finite values beyond its largest one clamped
  to it with their sign (section 6.3, Algorithm 1, as Rouhani et al., "Microscaling
  Data Formats for Deep Learning", state it). A NaN scale makes every element of its
  block NaN; a block holding an infinity or a NaN gets the NaN scale, as the spec
  authors' reference code (Microsoft's `microxcaling`, `mx/mx_ops.py`) and torchao's
  `to_mx` (`torchao/prototype/mx_formats/mx_tensor.py`, the default `FLOOR` mode)
  do. Implemented bit for bit as torchao's `FLOOR` mode: the exponent is read off
  float32 amax's exponent field (-127 for zero and float32 subnormals).
- `scale_rule="pow2_ceil"` (`MXFP8_E4M3_CEIL`, `MXFP8_E5M2_CEIL`): the scale is
  `amax / max_elem` (float32 division) rounded *up* to a power of two, so the block's
  amax never clips (the OCP rule clips a block's largest values by up to an eighth:
  2-12% of the values of the char-GPT's MXFP8 casts, which cost it 0.08 nats/char
  over 2000 steps). This is what JAX's own
  quantizer for `jax.nn.scaled_dot_general` does (`cast_to_e8m0_with_rounding_up` in
  `jax/_src/cudnn/scaled_matmul_stablehlo.py`), as do cuBLAS's MXFP8 recipe,
  Transformer Engine's MXFP8 and torchao's `RCEIL` mode (the last two multiply amax
  by a rounded `1 / max_elem` instead of dividing, which can differ by one scale step
  when the quotient lands within a rounding of a power of two).
- `NVFP4`, NVIDIA's FP4: E2M1 elements, blocks of 16, an E4M3 scale per block and a
  float32 scale per tensor. The per-tensor (decode) scale is `s_t = amax(x) / (448 *
  6)` (torchao's `per_tensor_amax_to_scale`; the inverse of Transformer Engine's
  global encode scale `448 * 6 / amax`), from the largest *finite* `|x|`, 1 for a
  tensor of zeros, or given. A block's scale is `e4m3(min(amax_b / s_t / 6, 448))`,
  rounded to nearest even, and its elements `x / s_t / s_b` rounded to E2M1. The
  operations are
  in JAX's order (`jax/_src/cudnn/scaled_matmul_stablehlo.py`, `quantize`, mode
  "nvfp4"), with which this agrees bit for bit; Transformer Engine and torchao fold
  the two divisions into one multiplication by a rounded reciprocal, which can move an
  element by one E2M1 step at a rounding tie.
- DeepSeek-V3's FP8 tiles (`FP8_1X128` for activations, `FP8_128X128` for weights):
  E4M3 elements, a float32 scale per 1x128 block or 128x128 tile, `s = amax / 448`
  and elements `x / s` (DeepSeek-V3's `act_quant` kernel, `inference/kernel.py`).

For every format with amax-derived (not power-of-two) scales: a block of zeros has
scale 0 and elements 0 (where a bare `x / s` gives NaN), and so has a block whose scale
underflows the scale format. A block holding an infinity or a NaN has a NaN scale
(E4M3 NaN, float32 NaN), so it dequantizes to NaN as an MX block does: an overflow
stays one (where Transformer Engine's NVFP4 saturates an infinity), and the Trainer's
finiteness check skips the step. The elements of a NaN-scaled block are NaN where the
element format has a NaN (E4M3, E5M2), 0 in E2M1 (which has none).

A length along the contraction axis (or the tile axis) that the block does not divide
leaves a partial last block, as if the tensor were padded with zeros (which change no
amax), as `microxcaling` and Transformer Engine's reference quantizers pad: the scales
then have `ceil(n / block)` entries along it. (`jax.nn.scaled_matmul` and the
Blackwell GEMMs need whole blocks.)

Arithmetic is float32. A power-of-two scale is applied as two multiplications by
normal powers of two, so it is exact even for the E8M0 scale `2**-127`, which is a
float32 subnormal that XLA's CPU backend flushes to zero; values whose product is below
float32's normal range do flush there.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from ._formats import E4M3, E5M2
from ._quantize import _nearest, _pow2, _stochastic, _uniform_bits
from ._sites import Site, probed

F32 = jnp.dtype(jnp.float32)
E2M1 = jnp.dtype(jnp.float4_e2m1fn)
"""FP4 E2M1 (`float4_e2m1fn`: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; no
infinity, no NaN): the elements of MXFP4 and NVFP4."""
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
"""E8M0 (`float8_e8m0fnu`: the powers of two 2**-127 to 2**127, bias 127, and NaN
0xFF; no sign, no zero): the scales of the MX formats."""

_ELEMENTS = (E4M3, E5M2, E2M1)
_SCALES = (E8M0, E4M3, F32)
SCALE_RULES = ("pow2_floor", "pow2_ceil", "amax")


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: what the elements, the blocks and the scales are.

    Each element's value is `element * scale` (times the per-tensor scale where
    `tensor_scale`), one scale per `block` of elements. The rules are those of the
    specification or library each named format follows (the module's docstring in
    `lowtrain/fp8/_blocks.py` lists them with their sources): `MXFP8_E4M3`,
    `MXFP8_E5M2`, `MXFP4`, `NVFP4`, `FP8_1X128`, `FP8_128X128`; `block_format(name)`
    looks them up. A variant is `dataclasses.replace` of one, such as NVFP4 with
    16x16 tiles, or MXFP8 with scales rounded up as JAX's quantizer does.

    **Arguments:**

    - `name`: what it is called (its key in `BLOCK_FORMATS` for a named one).
    - `elements`: the element dtype: `lowtrain.fp8.E4M3`, `E5M2` or `E2M1`.
    - `block`: `(tile, length)`: the elements that share a scale, `length` along the
      contraction axis and `tile` along a second axis (1 for 1-D blocks): `(1, 32)`
      for MX, `(128, 128)` for a 128x128 tile.
    - `scales`: the scale dtype: `lowtrain.fp8.E8M0`, `E4M3` or float32.
    - `scale_rule`: how a block's scale comes from its amax: "pow2_floor" (the OCP MX
      rule, `2**(floor(log2(amax)) - emax_elem)`), "pow2_ceil" (`amax / max_elem`
      rounded up to a power of two) — both with E8M0 scales — or "amax" (`amax /
      max_elem`, divided by the per-tensor scale if any, rounded to `scales`).
    - `tensor_scale`: whether there is also a float32 scale per tensor (NVFP4); only
      with the "amax" rule. Default False.

    ```python
    import dataclasses
    import lowtrain.fp8 as fp8

    assert fp8.MXFP8_E4M3.block == (1, 32) and fp8.MXFP8_E4M3.scales == fp8.E8M0
    assert fp8.block_format("nvfp4") is fp8.NVFP4 and fp8.NVFP4.tensor_scale
    nvfp4_16x16 = dataclasses.replace(fp8.NVFP4, name="nvfp4_16x16", block=(16, 16))
    ```
    """

    name: str
    elements: np.dtype
    block: tuple[int, int]
    scales: np.dtype
    scale_rule: str
    tensor_scale: bool = False

    def __post_init__(self):
        elements, scales = jnp.dtype(self.elements), jnp.dtype(self.scales)
        block = tuple(self.block)
        if elements not in _ELEMENTS:
            raise ValueError(
                f"Expected `elements` among E4M3, E5M2, E2M1 (lowtrain.fp8), got "
                f"{elements} instead."
            )
        if scales not in _SCALES:
            raise ValueError(
                f"Expected `scales` among E8M0, E4M3 (lowtrain.fp8) and float32, got "
                f"{scales} instead."
            )
        if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
            raise ValueError(
                "Expected `block` as `(tile, length)`, two positive ints such as "
                f"(1, 32) or (128, 128), got {self.block!r} instead."
            )
        pow2 = self.scale_rule in ("pow2_floor", "pow2_ceil")
        if self.scale_rule not in SCALE_RULES or pow2 != (scales == E8M0):
            raise ValueError(
                f"Expected `scale_rule` 'pow2_floor' or 'pow2_ceil' with E8M0 scales, "
                f"or 'amax' with E4M3 or float32 ones, got {self.scale_rule!r} with "
                f"{scales} instead."
            )
        if self.tensor_scale and pow2:
            raise ValueError(
                "Expected `tensor_scale=False` with power-of-two scales (a "
                f"per-tensor scale is NVFP4's, with the 'amax' rule), got it with "
                f"{self.scale_rule!r} instead."
            )
        object.__setattr__(self, "elements", elements)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "block", block)


MXFP8_E4M3 = BlockFormat("mxfp8_e4m3", E4M3, (1, 32), E8M0, "pow2_floor")
"""OCP MXFP8 with E4M3 elements (OCP Microscaling Formats Specification v1.0): blocks
of 32, an E8M0 scale `2**(floor(log2(amax)) - 8)` each (section 6.3), elements
saturating at 448."""
MXFP8_E5M2 = BlockFormat("mxfp8_e5m2", E5M2, (1, 32), E8M0, "pow2_floor")
"""OCP MXFP8 with E5M2 elements: blocks of 32, an E8M0 scale
`2**(floor(log2(amax)) - 15)` each, elements saturating at 57344."""
MXFP4 = BlockFormat("mxfp4", E2M1, (1, 32), E8M0, "pow2_floor")
"""OCP MXFP4: E2M1 elements in blocks of 32, an E8M0 scale `2**(floor(log2(amax)) -
2)` each, elements saturating at 6."""
NVFP4 = BlockFormat("nvfp4", E2M1, (1, 16), E4M3, "amax", tensor_scale=True)
"""NVIDIA's NVFP4: E2M1 elements in blocks of 16; a float32 scale per tensor, `s_t =
amax(x) / (448 * 6)` (Transformer Engine, torchao); an E4M3 scale per block, `amax_b
/ s_t / 6` rounded to nearest even (at most 448); elements `x / s_t / s_b`, in the
order of JAX's quantizer for `jax.nn.scaled_dot_general`."""
FP8_1X128 = BlockFormat("fp8_1x128", E4M3, (1, 128), F32, "amax")
"""DeepSeek-V3's FP8 for activations: E4M3 elements in blocks of 128 along the
contraction axis, a float32 scale `amax / 448` each (its `act_quant` kernel)."""
FP8_128X128 = BlockFormat("fp8_128x128", E4M3, (128, 128), F32, "amax")
"""DeepSeek-V3's FP8 for weights: E4M3 elements in 128x128 tiles, a float32 scale
`amax / 448` each."""
MXFP8_E4M3_CEIL = BlockFormat("mxfp8_e4m3_ceil", E4M3, (1, 32), E8M0, "pow2_ceil")
"""MXFP8 E4M3 with each block's scale `amax / 448` rounded up to a power of two (no
element clips): the rule of Transformer Engine's and cuBLAS's MXFP8 and of JAX's
quantizer for `jax.nn.scaled_dot_general`; the `mxfp8` recipe's format."""
MXFP8_E5M2_CEIL = BlockFormat("mxfp8_e5m2_ceil", E5M2, (1, 32), E8M0, "pow2_ceil")
"""MXFP8 E5M2 with scales rounded up (`amax / 57344`), as `MXFP8_E4M3_CEIL`."""
BLOCK_FORMATS = types.MappingProxyType(
    {
        f.name: f
        for f in (
            MXFP8_E4M3,
            MXFP8_E5M2,
            MXFP4,
            NVFP4,
            FP8_1X128,
            FP8_128X128,
            MXFP8_E4M3_CEIL,
            MXFP8_E5M2_CEIL,
        )
    }
)
"""The named block formats by name: "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4",
"fp8_1x128", "fp8_128x128", "mxfp8_e4m3_ceil", "mxfp8_e5m2_ceil" (read-only)."""


def block_format(format: BlockFormat | str) -> BlockFormat:
    """The named `BlockFormat` (a key of `BLOCK_FORMATS`: "mxfp8_e4m3",
    "mxfp8_e5m2", "mxfp4", "nvfp4", "fp8_1x128", "fp8_128x128",
    "mxfp8_e4m3_ceil", "mxfp8_e5m2_ceil"), or `format` itself if it is one.

    **Arguments:**

    - `format`: a name or a `BlockFormat`.

    ```python
    import lowtrain.fp8 as fp8

    assert fp8.block_format("mxfp4") is fp8.MXFP4
    assert fp8.block_format(fp8.NVFP4) is fp8.NVFP4
    ```
    """
    if isinstance(format, BlockFormat):
        return format
    if format not in BLOCK_FORMATS:
        raise ValueError(
            f"Expected a block format among {', '.join(BLOCK_FORMATS)} or a "
            f"`lowtrain.fp8.BlockFormat`, got {format!r} instead."
        )
    return BLOCK_FORMATS[format]


class BlockScaled(eqx.Module):
    """A block-scaled tensor, as `block_quantize` returns it: the value of each
    element is `elements * scales` (each scale repeated over its block) `*
    tensor_scale` (where the format has one).

    - `elements`: the elements in the format's element dtype, the shape of the
      tensor.
    - `scales`: the block scales in the format's scale dtype (E8M0 as
      `float8_e8m0fnu`); the tensor's shape with `ceil(n / block)` entries along
      `axis` (and along `tile_axis` for 2-D tiles), the layout
      `jax.nn.scaled_matmul` takes.
    - `tensor_scale`: the float32 per-tensor scale (a scalar), or None.
    - `format`, `axis`, `tile_axis` (static): the `BlockFormat`, the contraction axis
      the blocks run along, the axis a 2-D tile spans as well (None for 1-D blocks).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    x = jax.random.normal(jax.random.key(0), (2, 64))
    q = fp8.block_quantize(x, fp8.MXFP8_E4M3)  # blocks of 32 along the last axis
    assert q.elements.dtype == fp8.E4M3 and q.scales.shape == (2, 2)
    # Each block's values to within 1/8 of its amax (which may clip to 448 / 512).
    assert float(jnp.max(jnp.abs(q.dequantize() - x))) < 0.25
    ```
    """

    elements: Array
    scales: Array
    tensor_scale: Array | None
    format: BlockFormat = eqx.field(static=True)
    axis: int = eqx.field(static=True)
    tile_axis: int | None = eqx.field(static=True)

    def dequantize(self, dtype=F32) -> Array:
        """The values, `elements * scales * tensor_scale`, computed in float32 and
        returned in `dtype`; every element of a NaN-scaled block is NaN.

        **Arguments:**

        - `dtype`: the result's dtype; default float32.
        """
        return _dequantize(self, jnp.dtype(dtype))

    def _values(self, dtype) -> Array:
        layout = _Layout(self.elements.shape, self.format, self.axis, self.tile_axis)
        q = layout.blocks(self.elements.astype(F32))
        scales = _raw(self.scales, self.format)
        values = _scaled(q, scales, self.tensor_scale, layout)
        return layout.unblock(values).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q: BlockScaled, dtype) -> Array:
    return q._values(dtype)


def block_quantize(
    x: ArrayLike,
    format: BlockFormat | str,
    *,
    axis: int = -1,
    tile_axis: int | None = None,
    tensor_scale: ArrayLike | None = None,
    key: PRNGKeyArray | None = None,
    rounding: str = "nearest",
) -> BlockScaled:
    """`x` in the block-scaled `format`, blocks along `axis`: a `BlockScaled`.

    Each block's scale follows the format's rule (each named format's docstring,
    and in more detail the module `lowtrain/fp8/_blocks.py`, give it with its
    source): MX's shared power of two
    `2**(floor(log2(amax)) - emax_elem)` in E8M0; NVFP4's `amax / 6` relative to the
    float32 per-tensor scale `amax(x) / (448 * 6)`, rounded to E4M3; DeepSeek-V3's
    `amax / 448` in float32. The elements are `x` divided by their scales, finite
    values beyond the element format's largest one saturated to it (with their
    sign), rounded to nearest, ties to even, or (given `key`, or with
    `rounding="stochastic"`) stochastically. A block
    holding an infinity or a NaN has a NaN scale: it dequantizes to NaN. A length
    the block does not divide leaves a partial last block.

    Stochastic rounding rounds each element to one of its two neighbours in the
    element format, up with probability equal to its distance from the lower one
    over their gap, so the elements are unbiased: `E[element] = x / scale`, up to
    saturation. The scales are not random.

    **Arguments:**

    - `x`: the array, of a float dtype (computed in float32).
    - `format`: a `BlockFormat` or its name ("mxfp8_e4m3", "nvfp4", ...).
    - `axis`: the axis the blocks run along (the contraction axis of the matmul
      the tensor is for); default the last.
    - `tile_axis`: for 2-D tiles, the second axis a tile spans; default the last
      axis other than `axis`. Ignored for 1-D blocks.
    - `tensor_scale`: for a format with a per-tensor scale (NVFP4), that scale (a
      positive float32 scalar; a calibrated or delayed one); default None: from
      `x`'s own amax.
    - `key`: a PRNG key for stochastic rounding; None (the default): to nearest even
      unless `rounding="stochastic"`.
    - `rounding`: "nearest" (the default) or "stochastic"; stochastic without `key`
      draws from a hash of each value and its position, as `lowtrain.fp8.quantize`
      does (no key to thread through a model; a new tensor, new draws).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    # One MXFP8 block of 32: amax 1000 has exponent 9, so the scale is 2**(9 - 8) = 2
    # (E8M0 byte 127 + 1); 1000 / 2 = 500 saturates to 448, 3 / 2 = 1.5 is exact.
    x = jnp.zeros(32).at[0].set(1000.0).at[1].set(3.0)
    q = fp8.block_quantize(x, fp8.MXFP8_E4M3)
    assert q.scales.dtype == fp8.E8M0 and q.scales.astype(jnp.float32).tolist() == [2.0]
    assert q.dequantize()[:3].tolist() == [896.0, 3.0, 0.0]
    # NVFP4 on a (4, 64) tensor: E2M1 elements, an E4M3 scale per 16, a float32 one.
    w = jax.random.normal(jax.random.key(0), (4, 64))
    q4 = fp8.block_quantize(w, "nvfp4")
    assert q4.elements.dtype == fp8.E2M1 and q4.scales.shape == (4, 4)
    assert q4.tensor_scale.dtype == jnp.float32
    ```
    """
    fmt, x, axis, tile_axis, tensor_scale, stochastic = _checked(
        x, format, axis, tile_axis, tensor_scale, key, rounding
    )
    return _block_quantize(x, tensor_scale, key, fmt, axis, tile_axis, stochastic)


def _checked(x, format, axis, tile_axis, tensor_scale, key, rounding):
    # `block_quantize`'s arguments checked: (format, x, axis, tile_axis, tensor
    # scale, stochastic).
    fmt = block_format(format)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"Expected `x` of a float dtype, got {x.dtype} instead: cast it first "
            "(`x.astype(jnp.float32)`)."
        )
    axis, tile_axis = _axes(x.ndim, fmt, axis, tile_axis)
    if tensor_scale is not None:
        if not fmt.tensor_scale:
            raise ValueError(
                f"Expected `tensor_scale=None` for {fmt.name!r}, which has no "
                f"per-tensor scale, got {tensor_scale!r} instead."
            )
        tensor_scale = jnp.asarray(tensor_scale, F32).reshape(())
    if rounding not in _ROUNDINGS:
        raise ValueError(
            f"Expected `rounding` among {', '.join(_ROUNDINGS)}, got {rounding!r} "
            "instead."
        )
    stochastic = key is not None or rounding == "stochastic"
    return fmt, x, axis, tile_axis, tensor_scale, stochastic


_ROUNDINGS = ("nearest", "stochastic")


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _block_quantize(
    x, tensor_scale, key, fmt, axis, tile_axis, stochastic=False, site=None
) -> BlockScaled:
    # One compiled program per shape and format, also when called eagerly. `site`:
    # the `Site` the cast is named as (`block_site`), for a numerics report.
    layout = _Layout(x.shape, fmt, axis, tile_axis)
    r, s, s_t = _quantize_blocks(
        layout.blocks(x.astype(F32)), layout, tensor_scale, key, stochastic, site
    )
    # A NaN-scaled block: NaN elements where the format has a NaN, 0 in E2M1.
    nan = s == 255 if fmt.scales == E8M0 else jnp.isnan(s)
    r = jnp.where(layout.spread(nan), 0.0 if fmt.elements == E2M1 else jnp.nan, r)
    elements = layout.unblock(r).astype(fmt.elements)  # exact: `r` is on its grid
    return BlockScaled(elements, _stored(s, fmt), s_t, fmt, axis, tile_axis)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7, 8))
def _fake_quantize(
    x, tensor_scale, key, fmt, axis, tile_axis, stochastic=False, site=None, dtype=F32
) -> Array:
    # `_block_quantize(...).dequantize(dtype)` bit for bit, without the round trip
    # through the element dtype: the rounded values times their scales.
    layout = _Layout(x.shape, fmt, axis, tile_axis)
    r, s, s_t = _quantize_blocks(
        layout.blocks(x.astype(F32)), layout, tensor_scale, key, stochastic, site
    )
    return layout.unblock(_scaled(r, s, s_t, layout)).astype(dtype)


def block_fake_quantize(
    x: ArrayLike,
    format: BlockFormat | str,
    *,
    axis: int = -1,
    tile_axis: int | None = None,
    tensor_scale: ArrayLike | None = None,
    key: PRNGKeyArray | None = None,
    rounding: str = "nearest",
) -> Array:
    """`x` after a round trip through the block-scaled `format`, in `x`'s dtype:
    `block_quantize(x, format, ...).dequantize(x.dtype)` bit for bit, what a
    simulated block-scaled GEMM multiplies (`block_dot_general`). Computed without
    the narrow dtypes: the elements rounded in float32 arithmetic, times their
    scales.

    **Arguments:**

    - `x`: the array, of a float dtype.
    - `format`: a `BlockFormat` or its name.
    - `axis`: the axis the blocks run along; default the last.
    - `tile_axis`: for 2-D tiles, the second axis a tile spans; default the last
      axis other than `axis`.
    - `tensor_scale`: NVFP4's per-tensor scale; default None: from `x`'s amax.
    - `key`: a PRNG key for stochastic rounding; None (the default): to nearest even
      unless `rounding="stochastic"`.
    - `rounding`: "nearest" (the default) or "stochastic" (without `key`, from a
      hash of each value and its position), as `block_quantize`.

    ```python
    import jax.numpy as jnp
    import lowtrain.fp8 as fp8

    # One MXFP4 block: amax 6 has exponent 2 = emax of E2M1, so the scale is 1, and
    # 2.5 (a tie between 2 and 3) rounds to the even 2.
    x = jnp.zeros((1, 32), jnp.bfloat16).at[0, :3].set(
        jnp.array([6.0, 2.5, 0.3], jnp.bfloat16)
    )
    y = fp8.block_fake_quantize(x, fp8.MXFP4)
    assert y.dtype == jnp.bfloat16 and y[0, :3].tolist() == [6.0, 2.0, 0.5]
    ```
    """
    fmt, x, axis, tile_axis, tensor_scale, stochastic = _checked(
        x, format, axis, tile_axis, tensor_scale, key, rounding
    )
    return _fake_quantize(
        x, tensor_scale, key, fmt, axis, tile_axis, stochastic, None, x.dtype
    )


# -- internals -----------------------------------------------------------------------


def _axes(ndim: int, fmt: BlockFormat, axis: int, tile_axis: int | None):
    # The block axis and the tile axis (None for 1-D blocks), non-negative.
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"Expected `axis` within the {ndim} dimensions of `x`, got {axis} instead."
        )
    axis %= ndim
    if fmt.block[0] == 1:
        return axis, None
    if tile_axis is None:
        others = [d for d in range(ndim) if d != axis]
        if not others:
            raise ValueError(
                f"Expected an array of at least 2 dimensions for the "
                f"{fmt.block[0]}x{fmt.block[1]} tiles of {fmt.name!r}, got one of "
                f"{ndim} instead: add an axis (`x[None]`)."
            )
        return axis, others[-1]
    if not -ndim <= tile_axis < ndim or tile_axis % ndim == axis:
        raise ValueError(
            f"Expected `tile_axis` within the {ndim} dimensions of `x` and other than "
            f"`axis` ({axis}), got {tile_axis} instead."
        )
    return axis, tile_axis % ndim


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The blocks of a tensor of `shape`, each blocked axis split in place: `blocks`
    reshapes the block axis (and the tile axis) into `(blocks, block)`, so a block's
    elements lie along the `reduced` axes (no transpose); its scales are the
    tensor's shape with each blocked axis shortened to its number of blocks, the
    layout of `BlockScaled.scales`. A length the block does not divide is padded
    with zeros to whole blocks, except a length shorter than one block, which is
    one partial block as it is (zeros change no amax)."""

    shape: tuple[int, ...]
    format: BlockFormat
    axis: int
    tile_axis: int | None

    @functools.cached_property
    def _dims(self) -> tuple[tuple[int, object, int], ...]:
        # The blocked layout's dimensions as (size, part, padded size): a tensor
        # axis `d` not blocked, or "kn", "kb" (blocks and their length along
        # `axis`), "tn", "tb" (along `tile_axis`); the padded size is a whole
        # block's, where a short axis is one partial block.
        (tb, kb), dims = self.format.block, []
        for d, n in enumerate(self.shape):
            if d in (self.axis, self.tile_axis):
                block, c = (kb, "k") if d == self.axis else (tb, "t")
                if n <= block:  # one partial block, unpadded
                    dims += [(1, c + "n", 1), (n, c + "b", block)]
                else:
                    dims += [(-(-n // block), c + "n", -(-n // block))]
                    dims += [(block, c + "b", block)]
            else:
                dims.append((n, d, n))
        return tuple(dims)

    @property
    def _shape(self) -> list[int]:
        return [size for size, _, _ in self._dims]

    @property
    def reduced(self) -> tuple[int, ...]:
        # The axes of `blocks` that run within a block.
        parts = [part for _, part, _ in self._dims]
        return tuple(i for i, part in enumerate(parts) if part in ("tb", "kb"))

    def _merged(self) -> list[int]:
        # The tensor's shape padded to whole blocks (a short axis unpadded).
        merged, sizes = [], iter(self._dims)
        for d in range(len(self.shape)):
            size = next(sizes)[0]
            if d in (self.axis, self.tile_axis):
                size *= next(sizes)[0]
            merged.append(size)
        return merged

    def blocks(self, x: Array) -> Array:
        merged = self._merged()
        if merged != list(self.shape):
            x = jnp.pad(
                x, [(0, m - n) for m, n in zip(merged, self.shape, strict=True)]
            )
        return x.reshape(self._shape)

    def unblock(self, xb: Array) -> Array:
        x = xb.reshape(self._merged())
        if list(x.shape) != list(self.shape):
            x = x[tuple(slice(0, n) for n in self.shape)]
        return x

    def spread(self, s: Array) -> Array:
        # The scales' layout -> broadcastable against `blocks`.
        return jnp.expand_dims(s, self.reduced)

    def _moved(self) -> tuple[list, dict]:
        # The parts in the order of the blocks laid out one after another, padded to
        # whole blocks: `(*other axes, T / tile, tile, K / length, length)` (1-D
        # blocks: tile 1), and the size of each.
        sizes = {"tn": 1, "tb": 1} | {part: pad for _, part, pad in self._dims}
        order = [part for _, part, _ in self._dims if isinstance(part, int)]
        return order + ["tn", "tb", "kn", "kb"], sizes

    def moved_shape(self) -> tuple[int, ...]:
        order, sizes = self._moved()
        return tuple(sizes[part] for part in order)

    def moved_index(self) -> Array:
        """Each element's position (uint32, `blocks`' shape) in the row-major order
        of `moved_shape`, where the stochastic rounding's draws are indexed."""
        order, sizes = self._moved()
        strides, stride = {}, 1
        for part in reversed(order):
            strides[part], stride = stride, stride * sizes[part]
        index = jnp.zeros(self._shape, jnp.uint32)
        for i, (_, part, _) in enumerate(self._dims):
            iota = lax.broadcasted_iota(jnp.uint32, self._shape, i)
            index = index + iota * jnp.uint32(strides[part])
        return index

    def from_moved(self, a: Array) -> Array:
        """`a`, of `moved_shape`, in `blocks`' layout (a short axis's padding cut)."""
        order, _ = self._moved()
        parts = [part for _, part, _ in self._dims]
        kept = [i for i, part in enumerate(order) if part in parts]
        a = a.reshape([a.shape[i] for i in kept])  # drops a 1-D block's tile axes
        order = [order[i] for i in kept]
        a = jnp.transpose(a, [order.index(part) for part in parts])
        return a[tuple(slice(0, size) for size in self._shape)]


def _tensor_scale(amax: Array, fmt: BlockFormat) -> Array:
    # NVFP4's per-tensor decode scale from the tensor's largest finite |x| (an
    # overflowed block is NaN by itself and does not shrink the others): amax /
    # (scale max * element max), 1 for a tensor of zeros.
    denominator = _max(fmt.scales) * _max(fmt.elements)
    return jnp.where(amax > 0, _div(amax, denominator), 1.0).astype(F32)


def _max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _emax(dtype) -> int:
    # The exponent of the format's largest normal: 8 for E4M3 (448 = 1.75 * 2**8),
    # 15 for E5M2 (57344 = 1.75 * 2**15), 2 for E2M1 (6 = 1.5 * 2**2).
    return int(jnp.finfo(dtype).maxexp) - 1


def _div(a: Array, b) -> Array:
    # `a / b`, a true float32 division. XLA turns a division by a constant or by a
    # broadcast into a multiplication by the rounded reciprocal (`x / 448` into
    # `x * 0.00223214`, `x / broadcast(s)` into `x * broadcast(1 / s)`), which can
    # differ in the last bit, so the divisor is made to depend on `a`: where `a` is
    # NaN it is 1 (the quotient is NaN either way). That select fuses into the
    # division's loop, where a barrier would write the divisor out at full shape.
    # XLA also folds `(a / b) / c` into `a / (b * c)` (NVFP4's `x / s_t / s_b`),
    # which rounds differently, so the quotient leaves through a select too.
    b = jnp.broadcast_to(jnp.asarray(b, F32), jnp.shape(a))
    nan = jnp.isnan(a)
    return jnp.where(nan, a, a / jnp.where(nan, F32.type(1.0), b))


def _pow2_factors(e: Array, nan: Array | None = None) -> tuple[Array, Array]:
    # Two float32 factors whose product is 2**e, for int32 e in [-252, 252]: multiplying
    # by both is exact while the result is a normal float32 (two normal factors of the
    # same sign of exponent, so the intermediate lies between x and the result; 2**-127,
    # E8M0's byte 0, is a float32 subnormal, which XLA:CPU flushes to zero). Where
    # `nan`, the first is NaN.
    half = e >> 1  # floor(e / 2)
    first = _pow2(half)
    if nan is not None:
        first = jnp.where(nan, jnp.nan, first)
    return first, _pow2(e - half)


def _times_pow2(x: Array, e: Array) -> Array:
    # x * 2**e for int32 e in [-252, 252] (`_pow2_factors`).
    first, second = _pow2_factors(e)
    return x * first * second


def _pow2_exponent(amax: Array, fmt: BlockFormat) -> Array:
    """The E8M0 exponent (int32, -127 to 127) of blocks of amax `amax` (finite)."""
    if fmt.scale_rule == "pow2_floor":
        # OCP MX: floor(log2(amax)) - emax_elem, floor(log2) read off the float32
        # exponent field (-127 for zero and subnormals, as torchao's FLOOR mode).
        bits = lax.bitcast_convert_type(amax, jnp.int32)
        exponent = ((bits >> 23) & 0xFF) - 127
        return jnp.clip(exponent - _emax(fmt.elements), -127, 127)
    # JAX's `cast_to_e8m0_with_rounding_up(amax / max)`: the float32 exponent field,
    # plus one if any mantissa bit is set (not past 2**127; a subnormal quotient goes
    # up to 2**-126 only above 2**-127).
    v = _div(amax, _max(fmt.elements))
    bits = lax.bitcast_convert_type(v, jnp.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    subnormal_down = (exponent == 0) & (mantissa <= 1 << 22)
    up = (mantissa > 0) & (exponent != 0xFE) & ~subnormal_down
    return exponent + up.astype(jnp.int32) - 127


def _quantize_blocks(
    xb: Array, layout: _Layout, s_t, key, stochastic=False, site: Site | None = None
):
    """`(rounded, scales, tensor scale)` of the float32 blocks `xb`
    (`layout.blocks`): the elements as float32 values on the element format's grid
    (any value in a NaN-scaled block, whose values are NaN), the scales as `_raw`
    holds them, and the per-tensor scale (`s_t` if given; None for a format without
    one); the values the elements round, after their scales, named as the cast
    `site`. (No cast to the narrow dtypes: XLA:CPU emulates those value by value,
    and fused into the loop over the elements it would cast each block's scale
    once per element.)"""
    fmt, red = layout.format, layout.reduced
    # Non-finite blocks found by `isfinite`, not by NaN propagating through `max`
    # (XLA:CPU's reductions over several axes can drop a NaN). NVFP4's tensor amax
    # is the largest of the blocks' finite ones.
    finite = jnp.all(jnp.isfinite(xb), axis=red)
    finite_amax = jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0.0), axis=red)
    amax = jnp.where(finite, finite_amax, jnp.inf)
    if fmt.tensor_scale and s_t is None:
        tensor_amax = jnp.max(finite_amax) if xb.size else F32.type(0.0)
        s_t = _tensor_scale(tensor_amax, fmt)
    if fmt.scales == E8M0:
        exponent = _pow2_exponent(jnp.where(finite, amax, 0.0), fmt)
        first, second = _pow2_factors(-exponent)
        v = xb * layout.spread(first) * layout.spread(second)
        scales = jnp.where(finite, exponent + 127, 255)  # the E8M0 byte
    else:
        if s_t is not None:  # NVFP4, in JAX's order: x / s_t first
            xb, amax = _div(xb, s_t), _div(amax, s_t)
        s = _div(amax, _max(fmt.elements))
        if fmt.scales != F32:  # saturated (a bare E4M3 cast makes >= 464 NaN),
            s = _nearest(jnp.minimum(s, _max(fmt.scales)), fmt.scales)  # rounded
        scales = jnp.where(finite, s, jnp.nan)
        zero, s32 = layout.spread(scales == 0), layout.spread(scales)
        # A zero scale (a block of zeros, or one below the scale format): zeros.
        v = _div(xb, jnp.where(zero, 1.0, s32))
        v = jnp.where(zero, _zeros(v), v)
    if site is not None:  # `v * 1`: metadata, the same compiled program
        v = probed(v, site)
    fmax = _max(fmt.elements)
    v = jnp.clip(v, -fmax, fmax)  # saturate finite values (NaN stays NaN)
    if stochastic:  # draws from `key`, or (None) a hash of each value and index
        # Drawn in the order of the blocks laid out one after another (the same
        # draws whichever axis the blocks run along in memory).
        if key is None:
            bits = _uniform_bits(v, None, 0, layout.moved_index())
        else:
            bits = jax.random.bits(key, layout.moved_shape(), jnp.uint32)
            bits = layout.from_moved(bits)
        v = _stochastic(v, fmt.elements, key, 0, bits)
    else:
        v = _nearest(v, fmt.elements)
    return v, scales, s_t


def _zeros(v: Array) -> Array:
    # +0 where `v` is finite (`v - v`), in `v`'s shape: a zero that is not a
    # constant, which XLA would broadcast to full shape and, inside a scanned loop,
    # hoist out of it and write out.
    return v - v


def _scaled(r: Array, scales: Array, s_t, layout: _Layout) -> Array:
    """The float32 values of the elements `r` (as float32, `layout.blocks`' layout)
    times their `scales` (as `_raw` holds them) and the per-tensor scale `s_t`;
    every element of a NaN-scaled block NaN."""
    if layout.format.scales == E8M0:
        first, second = _pow2_factors(scales - 127, nan=scales == 255)
        return r * layout.spread(first) * layout.spread(second)
    values = r * layout.spread(scales)  # exact for NVFP4: E2M1 times E4M3
    return values if s_t is None else values * s_t


def _raw(scales: Array, fmt: BlockFormat) -> Array:
    """A block's scales as `_quantize_blocks` computes them: the E8M0 byte (int32,
    255 NaN) for power-of-two scales, the float32 value otherwise."""
    if fmt.scales == E8M0:
        return lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    return scales.astype(F32)


def _stored(raw: Array, fmt: BlockFormat) -> Array:
    """`_raw`'s inverse: the scales in their dtype (exact: on its grid)."""
    if fmt.scales == E8M0:
        return lax.bitcast_convert_type(raw.astype(jnp.uint8), E8M0)
    return raw.astype(fmt.scales)


def block_site(fmt: BlockFormat, role: str, gemm, rhs_shape, stochastic: bool) -> Site:
    """The `Site` of a block-scaled cast in `fmt` (its element format, judged after
    the blocks' scales), for the matmul of GEMM `gemm` and right operand shape
    `rhs_shape`."""
    return Site(
        str(jnp.dtype(fmt.elements)),
        role,
        tuple(int(d) for d in gemm),
        tuple(int(d) for d in rhs_shape),
        scaling=fmt.name,
        stochastic=bool(stochastic),
    )
