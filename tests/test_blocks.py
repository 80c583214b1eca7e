"""Block-scaled (microscaling) formats: the quantizers bit for bit against hand-computed
bits and JAX's own quantizer, and the simulated block-scaled matmul and its VJP.

Bits: E4M3 is s.eeee.mmm (bias 7), E5M2 s.eeeee.mm (bias 15), E2M1 s.ee.m (bias 1),
E8M0 the biased exponent (bias 127, 0xFF NaN)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowtrain.fp8 as fp8
from lowtrain import _compat
from lowtrain.fp8._quantize import _nearest

from .helpers import iter_eqns

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
NAMES = [
    *("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4", "fp8_1x128", "fp8_128x128"),
    *("mxfp8_e4m3_ceil", "mxfp8_e5m2_ceil"),
]


def _bits(a) -> list:
    """The bits of each element of `a` (a JAX or NumPy array) as ints, read on the
    host; float32 as values."""
    a = np.atleast_1d(np.asarray(a))
    return a.tolist() if a.dtype == np.float32 else a.view(np.uint8).tolist()


def _values(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def _block(values, n=64) -> np.ndarray:
    """`values` followed by zeros, `n` in all, float32. (Inputs are built and
    outputs read with NumPy, and each format keeps to one shape, two blocks, so that
    the tests compile little: its quantizer once.)"""
    x = np.zeros(n, np.float32)
    x[: len(values)] = values
    return x


def _shape(fmt) -> tuple:
    # Two blocks (two 128x128 tiles side by side).
    return (128, 256) if fmt.block[0] > 1 else (2 * fmt.block[1],)


def _key(seed: int):
    # XLA's RNG: the same statistics as the default threefry keys, a fraction of
    # the compile time on the CPU.
    return jax.random.key(seed, impl="rbg")


def test_named_formats():
    expected = {  # elements, block, scales, rule, per-tensor scale
        "mxfp8_e4m3": (fp8.E4M3, (1, 32), fp8.E8M0, "pow2_floor", False),
        "mxfp8_e5m2": (fp8.E5M2, (1, 32), fp8.E8M0, "pow2_floor", False),
        "mxfp4": (fp8.E2M1, (1, 32), fp8.E8M0, "pow2_floor", False),
        "nvfp4": (fp8.E2M1, (1, 16), fp8.E4M3, "amax", True),
        "fp8_1x128": (fp8.E4M3, (1, 128), F32, "amax", False),
        "fp8_128x128": (fp8.E4M3, (128, 128), F32, "amax", False),
        "mxfp8_e4m3_ceil": (fp8.E4M3, (1, 32), fp8.E8M0, "pow2_ceil", False),
        "mxfp8_e5m2_ceil": (fp8.E5M2, (1, 32), fp8.E8M0, "pow2_ceil", False),
    }
    assert list(fp8.BLOCK_FORMATS) == NAMES
    for name, fields in expected.items():
        f = fp8.block_format(name)
        assert (f.elements, f.block, f.scales, f.scale_rule, f.tensor_scale) == fields
    assert fp8.E2M1 == jnp.float4_e2m1fn and fp8.E8M0 == jnp.float8_e8m0fnu
    with pytest.raises(ValueError, match="Expected a block format among mxfp8_e4m3"):
        fp8.block_format("mxfp6")
    with pytest.raises(ValueError, match="Expected `scale_rule`"):
        fp8.BlockFormat("x", fp8.E4M3, (1, 32), F32, "pow2_floor")
    with pytest.raises(ValueError, match="Expected `block`"):
        fp8.BlockFormat("x", fp8.E4M3, (32,), F32, "amax")
    with pytest.raises(ValueError, match="Expected `tensor_scale=False`"):
        dataclasses.replace(fp8.MXFP4, tensor_scale=True)


# Per format: a block (a tile for 128x128) holding the element format's largest
# normal, smallest normal, smallest subnormal, largest subnormal and -largest, with a
# scale of exactly 1, so each value is its own element: the bits of those elements.
EXTREMES = {
    # E4M3: 448 = 1.75 * 2**8 (0.1111.110), 2**-6 (0.0001.000), 2**-9 (0.0000.001),
    # 7 * 2**-9 (0.0000.111). MX: floor(log2(448)) = 8 = emax, so X = 2**0 (E8M0 127).
    "mxfp8_e4m3": ([448.0, 2**-6, 2**-9, 7 * 2**-9, -448.0], [126, 8, 1, 7, 254]),
    # E5M2: 57344 = 1.75 * 2**15 (0.11110.11), 2**-14 (0.00001.00), 2**-16
    # (0.00000.01), 3 * 2**-16 (0.00000.11). X = 2**(15 - 15) = 1.
    "mxfp8_e5m2": (
        [57344.0, 2**-14, 2**-16, 3 * 2**-16, -57344.0],
        [123, 4, 1, 3, 251],
    ),
    # E2M1: 6 = 1.5 * 2**2 (0.11.1), 1 (0.01.0), 0.5 (0.00.1: the only subnormal).
    # X = 2**(2 - 2) = 1.
    "mxfp4": ([6.0, 1.0, 0.5, 0.5, -6.0], [7, 2, 1, 1, 15]),
    # NVFP4: a second block holds 2688 = 448 * 6, so the tensor scale is
    # 2688 / (448 * 6) = 1; this block's amax 6 gives 6 / 1 / 6 = 1 (E4M3 0x38).
    "nvfp4": ([6.0, 1.0, 0.5, 0.5, -6.0], [7, 2, 1, 1, 15]),
    # DeepSeek-V3: 448 / 448 = 1 in float32.
    "fp8_1x128": ([448.0, 2**-6, 2**-9, 7 * 2**-9, -448.0], [126, 8, 1, 7, 254]),
    "fp8_128x128": ([448.0, 2**-6, 2**-9, 7 * 2**-9, -448.0], [126, 8, 1, 7, 254]),
}
# Scales rounded up: 448 / 448 and 57344 / 57344 are 1, a power of two already.
EXTREMES["mxfp8_e4m3_ceil"] = EXTREMES["mxfp8_e4m3"]
EXTREMES["mxfp8_e5m2_ceil"] = EXTREMES["mxfp8_e5m2"]


@pytest.mark.parametrize("name", NAMES)
def test_extreme_elements_round_trip_exactly(name):
    values, element_bits = EXTREMES[name]
    fmt = fp8.block_format(name)
    n = len(values)
    if name == "nvfp4":
        x = np.concatenate([_block(values, 16), _block([2688.0], 16)])
    elif name == "fp8_128x128":
        x = np.zeros((128, 256), np.float32)
        x[7, :n] = values
    else:
        x = _block(values, 2 * fmt.block[1])
    q = fp8.block_quantize(x, fmt)
    assert q.elements.dtype == fmt.elements and q.scales.dtype == fmt.scales
    first = np.asarray(q.elements)[7 if name == "fp8_128x128" else slice(None)]
    assert _bits(first[:n]) == element_bits
    one = {fp8.E8M0: [127], fp8.E4M3: [0x38], jnp.dtype(F32): [1.0]}[fmt.scales]
    assert np.ravel(_bits(q.scales))[:1].tolist() == one
    if name == "nvfp4":
        assert q.tensor_scale.dtype == F32 and float(q.tensor_scale) == 1.0
        assert _bits(q.scales) == [0x38, 0x7E]  # 2688 / 1 / 6 = 448
    else:
        assert q.tensor_scale is None
    values = q.dequantize()
    assert values.dtype == F32
    np.testing.assert_array_equal(values, x)
    assert jax.eval_shape(lambda: q.dequantize(jnp.bfloat16)).dtype == jnp.bfloat16


def test_e8m0_scale_range():
    # The largest amax, 1.5 * 2**127: floor(log2) = 127, so X = 2**(127 - 8) in
    # MXFP8 E4M3 (E8M0 127 + 119 = 246) and 2**(127 - 2) in MXFP4 (252); the
    # element 1.5 * 2**8 = 384 is 0.1111.100. The smallest: a block of float32's
    # smallest subnormal clamps to 2**-127, E8M0 byte 0, its element flushing to 0.
    big = fp8.block_quantize(_block([1.5 * 2.0**127]), fp8.MXFP8_E4M3)
    assert _bits(big.scales)[:1] == [246] and _bits(big.elements)[:1] == [0x7C]
    assert float(_values(big.dequantize())[0]) == 1.5 * 2.0**127
    assert _bits(fp8.block_quantize(_block([1.5 * 2.0**127]), "mxfp4").scales[:1]) == [
        252
    ]
    tiny = fp8.block_quantize(_block([2.0**-149]), fp8.MXFP8_E4M3)
    assert _bits(tiny.scales) == [0, 0] and _bits(tiny.elements)[:1] == [0]
    # 2**-118 = 2**(8 - 127 + 1): floor(log2) - 8 = -126, E8M0 byte 1, element 256.
    low = fp8.block_quantize(_block([2.0**-118]), fp8.MXFP8_E4M3)
    assert _bits(low.scales)[:1] == [1]
    assert float(_values(low.dequantize())[0]) == 2.0**-118


@pytest.mark.parametrize("name", NAMES)
def test_block_of_zeros(name):
    # MX: amax 0 -> floor(log2) read off float32's exponent field as -127, clamped:
    # X = 2**-127 (E8M0 has no zero). NVFP4, DeepSeek: amax / max = 0. The elements
    # are zeros, never NaN (a bare 0 / 0 would be), and NVFP4's tensor scale is 1.
    fmt = fp8.block_format(name)
    shape = _shape(fmt)
    q = fp8.block_quantize(np.zeros(shape, np.float32), fmt)
    expected = 0 if fmt.scales == fp8.E8M0 else 0.0  # E8M0 byte 0; E4M3 0; 0.0
    assert set(np.ravel(_bits(q.scales)).tolist()) == {expected}
    assert set(np.ravel(_bits(q.elements)).tolist()) == {0}
    np.testing.assert_array_equal(q.dequantize(), np.zeros(shape))
    if fmt.tensor_scale:
        assert float(q.tensor_scale) == 1.0


def test_one_huge_element_saturates_and_the_rest_keep_or_flush():
    # MXFP8 E4M3 block: amax 1000, floor(log2(1000)) = 9, X = 2**(9 - 8) = 2 (E8M0
    # 128). 1000 / 2 = 500 > 448: clamped to 448 (0.1111.110), back 896. 1 / 2 = 0.5
    # (0.0110.000) exact. 0.01 / 2 = 0.005 = 2.56 * 2**-9: subnormal 3 * 2**-9
    # (0.0000.011), back 0.01171875. 1e-4 / 2 = 0.0256 * 2**-9 flushes to 0.
    # -0.75 / 2 = -1.5 * 2**-2 (1.0101.100).
    q = fp8.block_quantize(_block([1000.0, 1.0, 0.01, 1e-4, -0.75]), fp8.MXFP8_E4M3)
    assert _bits(q.scales) == [128, 0]
    assert _bits(q.elements)[:5] == [0x7E, 0x30, 0x03, 0x00, 0xAC]
    assert _values(q.dequantize())[:5].tolist() == [896.0, 1.0, 0.01171875, 0.0, -0.75]
    # The same block of 128 in DeepSeek's format: s = 1000 / 448, so 1000 is 448
    # exactly (saturated, if anything), and 1 / s = 0.448 = 1.792 * 2**-2 rounds to
    # 1.75 * 2**-2 (0.0101.110).
    d = fp8.block_quantize(_block([1000.0, 1.0], 256), fp8.FP8_1X128)
    assert _bits(d.scales) == [float(np.float32(1000) / np.float32(448)), 0.0]
    assert _bits(d.elements)[:2] == [0x7E, 0x2E]


@pytest.mark.parametrize("name", NAMES)
def test_nan_and_inf_make_their_block_nan(name):
    # A block holding a NaN or an infinity gets the NaN scale (E8M0 0xFF, E4M3 NaN,
    # float32 NaN): all its elements dequantize to NaN (an MX NaN scale makes its
    # block NaN); the elements are NaN where the format has one, 0 in E2M1. The next
    # block is untouched: 1.0 quantizes as it would alone.
    fmt = fp8.block_format(name)
    length = fmt.block[1]
    for special in (np.nan, np.inf, -np.inf):
        x = np.concatenate([_block([1.0, special], length), _block([1.0], length)])
        if name == "fp8_128x128":
            x = np.zeros((128, 256), np.float32)
            x[3, :2] = [1.0, special]
            x[3, 128] = 1.0
        q = fp8.block_quantize(x, fmt)
        values = _values(q.dequantize())
        row = values[3] if name == "fp8_128x128" else values
        if name == "fp8_128x128":
            assert np.isnan(values[:, :length]).all()
        assert np.isnan(row[:length]).all()
        assert row[length] == 1.0 and not np.isnan(row[length + 1 :]).any()
        scale = np.ravel(np.asarray(q.scales))[0]
        if fmt.scales == fp8.E8M0:
            assert _bits(scale) == [0xFF]
        assert np.isnan(scale.astype(np.float32))
        elements = np.asarray(q.elements)
        first = elements[3] if name == "fp8_128x128" else elements
        if fmt.elements == fp8.E2M1:
            assert set(_bits(first[:length])) == {0}
        else:
            assert np.isnan(first[:length].astype(np.float32)).all()
        if fmt.tensor_scale:  # from the largest finite |x|: 1 / (448 * 6)
            assert float(q.tensor_scale) == float(np.float32(1) / np.float32(2688))


def test_hand_computed_mxfp8_e4m3_block():
    # amax 17: floor(log2(17)) = 4, X = 2**(4 - 8) = 2**-4 (E8M0 123).
    # 3.3 * 16 = 52.8 = 1.65 * 2**5: mantissa 1.625 (0.1100.101), back 3.25.
    # -0.1 * 16 = -1.6: 1.625 (1.0111.101), back -0.1015625.
    # 17 * 16 = 272 = 1.0625 * 2**8, a tie between 1.0 and 1.125: the even 1.0
    # (0.1111.000), back 16.
    q = fp8.block_quantize(_block([3.3, -0.1, 17.0]), "mxfp8_e4m3")
    assert _bits(q.scales) == [123, 0] and _bits(q.elements)[:3] == [0x65, 0xBD, 0x78]
    assert _values(q.dequantize())[:3].tolist() == [3.25, -0.1015625, 16.0]


def test_hand_computed_mxfp8_e5m2_block():
    # amax 100: floor(log2(100)) = 6, X = 2**(6 - 15) = 2**-9 (E8M0 118).
    # 100 * 512 = 51200 = 1.5625 * 2**15: mantissa 1.5 (0.11110.10), back 96.
    # 0.3 * 512 = 153.6 = 1.2 * 2**7: 1.25 (0.10110.01), back 0.3125.
    q = fp8.block_quantize(_block([100.0, 0.3]), "mxfp8_e5m2")
    assert _bits(q.scales) == [118, 0] and _bits(q.elements)[:2] == [0x7A, 0x59]
    assert _values(q.dequantize())[:2].tolist() == [96.0, 0.3125]


def test_hand_computed_mxfp4_block():
    # amax 20: floor(log2(20)) = 4, X = 2**(4 - 2) = 4 (E8M0 129). 20 / 4 = 5, a tie
    # between 4 and 6: the even 4 (0.11.0), back 16: the OCP rule clips the block's
    # own amax. 1.3 / 4 = 0.325: 0.5 (0.00.1), back 2.
    q = fp8.block_quantize(_block([20.0, 1.3]), "mxfp4")
    assert _bits(q.scales) == [129, 0] and _bits(q.elements)[:2] == [0b0110, 0b0001]
    assert _values(q.dequantize())[:2].tolist() == [16.0, 2.0]


def test_hand_computed_nvfp4_two_level_scale():
    # Tensor amax 2688 * 2 = 5376: tensor scale 5376 / (448 * 6) = 2 (float32).
    # Block 1: amax 1; 1 / 2 / 6 = 0.08333 = 1.333 * 2**-4 rounds in E4M3 to
    # 1.375 * 2**-4 = 0.0859375 (0.0011.011). Elements: 1 / 2 / 0.0859375 = 5.818
    # -> 6 (0.11.1), 0.5 / 2 / 0.0859375 = 2.909 -> 3 (0.10.1); back 6 * 0.0859375
    # * 2 = 1.03125 and 0.515625. Block 2: amax 5376, 5376 / 2 / 6 = 448 (0.1111.110),
    # its element 5376 / 2 / 448 = 6.
    x = np.concatenate([_block([1.0, 0.5], 16), _block([5376.0], 16)])
    q = fp8.block_quantize(x, fp8.NVFP4)
    assert float(q.tensor_scale) == 2.0
    assert _bits(q.scales) == [0x1B, 0x7E]
    assert _bits(q.elements)[:2] == [0b0111, 0b0101] and _bits(q.elements)[16] == 7
    values = _values(q.dequantize())
    assert values[:2].tolist() == [1.03125, 0.515625] and values[16] == 5376.0
    # A given tensor scale (calibrated, or JAX's `global_scale`) replaces x's own.
    q1 = fp8.block_quantize(x, fp8.NVFP4, tensor_scale=1.0)
    assert float(q1.tensor_scale) == 1.0 and _bits(q1.scales)[1] == 0x7E  # 448
    assert _values(q1.dequantize())[16] == 448.0 * 6  # 5376 / 448 saturates to 6


def test_hand_computed_fp8_1x128_block():
    # amax 3: s = 3 / 448 in float32. 3 / s = 448 (0.1111.110); 1 / s = 149.33 =
    # 1.1667 * 2**7 rounds to 1.125 * 2**7 = 144 (0.1110.001), back 144 * s.
    q = fp8.block_quantize(_block([3.0, 1.0], 256), "fp8_1x128")
    s = np.float32(3) / np.float32(448)
    assert _bits(q.scales) == [float(s), 0.0]
    assert _bits(q.elements)[:2] == [0x7E, 0x71]
    assert _values(q.dequantize())[:2].tolist() == [3.0, float(np.float32(144) * s)]


def test_2d_tiles():
    # 128x256 in 128x128 tiles (DeepSeek-V3's weights): one float32 scale per tile,
    # amax / 448: 448 -> 1, 896 -> 2. A tile is the same whichever of its two axes
    # the blocks are said to run along.
    x = np.zeros((128, 256), np.float32)
    x[5, 7], x[100, 3], x[127, 130], x[0, 255] = 448.0, -1.0, 896.0, 1.0
    q = fp8.block_quantize(x, fp8.FP8_128X128)
    assert (q.axis, q.tile_axis) == (1, 0) and q.scales.shape == (1, 2)
    assert _bits(q.scales) == [[1.0, 2.0]]
    np.testing.assert_array_equal(q.dequantize(), x)  # 1 / 2 = 0.5 is exact
    t = fp8.block_quantize(x, fp8.FP8_128X128, axis=0)  # tiles along axis 1 too
    assert t.tile_axis == 1 and _bits(t.scales) == _bits(q.scales)
    assert _bits(t.elements) == _bits(q.elements)
    # NVFP4 with 16x16 tiles (Transformer Engine's for weights): a (32, 48) tensor
    # has 2x3 E4M3 scales; each tile's scale is its own amax's.
    nv = dataclasses.replace(fp8.NVFP4, name="nvfp4_16x16", block=(16, 16))
    w = np.ones((32, 48), np.float32)
    w[20, 40] = 6.0
    q = fp8.block_quantize(w, nv, tensor_scale=1.0)
    assert q.scales.shape == (2, 3) and q.scales.dtype == fp8.E4M3
    # 1 / 6 -> 0.171875 (0.0100.011) everywhere but tile (1, 2): 6 / 6 = 1 (0x38).
    assert _bits(q.scales) == [[0x23] * 3, [0x23, 0x23, 0x38]]
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        fp8.block_quantize(np.ones(128, np.float32), fp8.FP8_128X128)
    with pytest.raises(ValueError, match="Expected `tile_axis`"):
        fp8.block_quantize(w, fp8.FP8_128X128, tile_axis=1)


def test_partial_last_block_and_axes():
    # 40 along the axis: one block of 32 and one of the last 8 (as if zero padded):
    # two scales, the second from its own 8 values. Blocks along axis 0 likewise.
    x = np.ones((3, 40), np.float32)
    x[:, 35] = 448.0
    q = fp8.block_quantize(x, fp8.MXFP8_E4M3)
    assert q.scales.shape == (3, 2) and q.elements.shape == (3, 40)
    assert _bits(q.scales)[0] == [127 - 8, 127]  # amax 1: 2**(0 - 8); 448: 1
    np.testing.assert_array_equal(q.dequantize(), x)
    qt = fp8.block_quantize(x.T, fp8.MXFP8_E4M3, axis=0)
    assert qt.scales.shape == (2, 3) and qt.axis == 0
    assert _bits(qt.elements) == _bits(np.asarray(q.elements).T)
    # Under jit: the same bits.
    jitted = jax.jit(lambda x: fp8.block_quantize(x, fp8.MXFP8_E4M3))(x)
    assert _bits(jitted.elements) == _bits(q.elements)
    assert _bits(jitted.scales) == _bits(q.scales)
    with pytest.raises(ValueError, match="Expected `axis` within"):
        fp8.block_quantize(x, fp8.MXFP4, axis=2)
    with pytest.raises(ValueError, match="Expected `tensor_scale=None`"):
        fp8.block_quantize(x, fp8.MXFP4, tensor_scale=1.0)
    with pytest.raises(ValueError, match="of a float dtype"):
        fp8.block_quantize(np.ones(32, np.int32), fp8.MXFP4)


def test_round_to_nearest_ties_to_even():
    # MXFP4, X = 1 (amax 6): 2.5 -> 2, 3.5 -> 4, 5 -> 4, 0.25 -> 0, 0.75 -> 1,
    # 1.25 -> 1, 1.75 -> 2: each tie to the neighbour with an even mantissa bit.
    x = _block([6.0, 2.5, 3.5, 5.0, 0.25, 0.75, 1.25, 1.75])
    q = _values(fp8.block_fake_quantize(x, "mxfp4"))
    assert q[:8].tolist() == [6.0, 2.0, 4.0, 4.0, 0.0, 1.0, 1.0, 2.0]
    # MXFP8 E4M3, X = 1 (amax 448): 1 + 1/16 -> 1, 1 + 3/16 -> 1.25, and in the
    # subnormals 1.5 * 2**-9 -> 2 * 2**-9, 0.5 * 2**-9 -> 0.
    x = _block([448.0, 1 + 1 / 16, 1 + 3 / 16, 1.5 * 2**-9, 0.5 * 2**-9])
    q = _values(fp8.block_fake_quantize(x, "mxfp8_e4m3"))
    assert q[1:5].tolist() == [1.0, 1.25, 2 * 2**-9, 0.0]


def test_stochastic_rounding_is_unbiased_and_only_to_neighbours():
    # MXFP4 with X = 1: 2.25 lies a quarter of the way from 2 to 3, 0.1 a fifth of
    # the way from 0 to 0.5, -4.5 a quarter of the way from -4 to -6. Over 4096 keys
    # each is rounded to one of those two only, its mean the value (4 sigma:
    # sqrt(0.25 * 0.75 / 4096) * 4 = 0.027 of the gap).
    def draws(x, name, keys):
        fq = lambda k: fp8.block_fake_quantize(x, name, key=k)  # noqa: E731
        return _values(jax.jit(jax.vmap(fq))(keys))

    keys = jax.random.split(_key(0), 4096)
    x = _block([6.0, 2.25, 0.1, -4.5])
    mx4 = draws(x, "mxfp4", keys)
    assert mx4.shape == (4096, 64)
    cases = [(1, 2.25, {2.0, 3.0}, 1.0), (2, 0.1, {0.0, 0.5}, 0.5)]
    cases.append((3, -4.5, {-4.0, -6.0}, 2.0))
    for i, value, neighbours, gap in cases:
        assert set(np.unique(mx4[:, i]).tolist()) == neighbours
        assert abs(mx4[:, i].mean() - value) < 0.027 * gap
    assert set(np.unique(mx4[:, 0]).tolist()) == {6.0}  # representable: kept
    # Eagerly, one key: that key's draws. The scales do not depend on the key.
    q = fp8.block_quantize(x, "mxfp4", key=keys[5])
    np.testing.assert_array_equal(q.dequantize(), mx4[5])
    assert _bits(q.scales) == _bits(fp8.block_quantize(x, "mxfp4").scales)
    # E4M3 elements: 1 + 2**-5 is a quarter of the way from 1 to 1.125.
    e4m3 = draws(_block([448.0, 1 + 2**-5]), "mxfp8_e4m3", keys)[:, 1]
    assert set(np.unique(e4m3).tolist()) == {1.0, 1.125}
    assert abs(e4m3.mean() - (1 + 2**-5)) < 0.027 * 0.125


# JAX's quantizer, compiled once (op by op it compiles some twenty programs). Under
# jit XLA multiplies by rounded reciprocals where JAX's code divides (see `_div` in
# lowtrain/fp8/_blocks.py), which could move a value at a rounding boundary; these
# inputs have none, jitted or not.
_jax_quantize = jax.jit(_compat.scaled_dot_quantize, static_argnums=1)


def _spread_blocks(seed: int, octaves: int) -> np.ndarray:
    # One shape for both of JAX's modes (blocks of 32 and 16): normal values, each
    # block of 32 scaled by 2**k, k from -octaves to octaves.
    rng = np.random.default_rng(seed)
    k = rng.integers(-octaves, octaves, size=(4, 8, 4)).repeat(32, axis=-1)
    return (rng.standard_normal((4, 8, 128)) * 2.0**k).astype(np.float32)


def test_agrees_with_jax_quantizer_mxfp8():
    # JAX's quantizer for `jax.nn.scaled_dot_general` rounds the E8M0 scale of
    # `amax / 448` up ("pow2_ceil"); with that rule the elements and scales are JAX's
    # bit for bit.
    x = _spread_blocks(0, 12)
    ceil = fp8.MXFP8_E4M3_CEIL  # the `mxfp8` recipe's format
    assert ceil == dataclasses.replace(
        fp8.MXFP8_E4M3, name="mxfp8_e4m3_ceil", scale_rule="pow2_ceil"
    )
    assert fp8.block_recipe("mxfp8").activations is ceil
    q = fp8.block_quantize(x, ceil)
    elements, scales = _jax_quantize(x, "mxfp8")
    assert (elements.dtype, scales.dtype) == (fp8.E4M3, fp8.E8M0)
    assert scales.shape == q.scales.shape == (4, 8, 4)
    assert _bits(q.elements) == _bits(elements)
    assert _bits(q.scales) == _bits(scales)
    # OCP's rule (floor) gives a scale half as large where amax / 2**floor(log2)
    # is above 448 / 256 = 1.75. Where they differ: amax 480. Floor: 2**(8 - 8) =
    # 1, 480 clips to 448. Up: 480 / 448 = 1.07 -> 2, 480 / 2 = 240 (0.1110.111).
    floor = _values(fp8.block_quantize(x, fp8.MXFP8_E4M3).scales)
    assert set(np.unique(_values(scales) / floor).tolist()) <= {1.0, 2.0}
    block = _block([480.0])
    assert _values(fp8.block_fake_quantize(block, fp8.MXFP8_E4M3))[0] == 448.0
    assert _values(fp8.block_fake_quantize(block, ceil))[0] == 480.0


def test_agrees_with_jax_quantizer_nvfp4():
    # With the same tensor scale (JAX's `global_scale`), the E4M3 scales and the E2M1
    # elements are JAX's bit for bit, where the block scale is not zero. (Where a
    # block's scale underflows E4M3, JAX divides by zero and stores +-6 or, for a
    # block of zeros, the -0 of a NaN cast; here such a block's elements are 0.
    # Both dequantize to 0.)
    x = _spread_blocks(1, 4)  # E4M3 scales span 2**-9 to 448
    g = (np.abs(x).max() / np.float32(448 * 6)).reshape(1)
    q = fp8.block_quantize(x, fp8.NVFP4, tensor_scale=g)
    elements, scales = _jax_quantize(x, "nvfp4", g)
    assert (elements.dtype, scales.dtype) == (fp8.E2M1, fp8.E4M3)
    assert (_values(scales) > 0).all()
    assert _bits(q.elements) == _bits(elements)
    assert _bits(q.scales) == _bits(scales)
    # The tensor scale block_quantize computes itself is that same amax / 2688.
    assert float(fp8.block_quantize(x, fp8.NVFP4).tensor_scale) == float(g[0])


def test_nvfp4_divides_in_jax_order_under_jit():
    # NVFP4's elements are `(x / s_t) / s_b`, two roundings, as JAX's quantizer
    # computes them; XLA folds two divisions into `x / (s_t * s_b)`, which rounds
    # once and moves this element from 5.0000005 (-> 6) to the tie 5.0 (-> 4).
    x = np.zeros((2, 16), np.float32)
    x[0, :2], x[1, 0] = [489.0, 407.51917], 912.84283  # s_b 240, s_t amax / 2688
    s_t = np.float32(x.max() / np.float32(2688))
    assert np.float32(x[0, 1] / s_t) / np.float32(240) > 5.0
    assert x[0, 1] / np.float32(s_t * np.float32(240)) == 5.0  # the folded order
    q = fp8.block_quantize(x, fp8.NVFP4)
    assert _values(q.scales)[0, 0] == 240.0 and _values(q.elements)[0, :2].tolist() == [
        6.0,
        6.0,
    ]
    elements, _ = _jax_quantize(x, "nvfp4", s_t.reshape(1))
    assert _bits(q.elements) == _bits(elements)
    fake = jax.jit(lambda x: fp8.block_fake_quantize(x, fp8.NVFP4))(x)
    np.testing.assert_array_equal(fake, q.dequantize())


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2, fp8.E2M1])
def test_float_rounding_is_the_cast_bit_for_bit(dtype):
    # The quantizers round in float32 arithmetic (XLA:CPU's casts to FP8 and FP4
    # are emulated, value by value); that rounding is ml_dtypes' cast bit for bit,
    # signed zeros and NaN included, over every 61st float32 within the format's
    # range (its subnormals, normals, ties and largest value among them).
    top = np.float32(jnp.finfo(dtype).max)
    bits = np.arange(0, 0x7F800000, 61, dtype=np.uint32)
    v = bits.view(np.float32)
    v = v[v <= top]
    nan = [np.nan] if dtype != fp8.E2M1 else []  # E2M1 has none (a block's is 0)
    v = np.concatenate([v, -v, [top, -top, *nan]]).astype(np.float32)
    want = v.astype(dtype).astype(np.float32)
    got = np.asarray(jax.jit(_nearest, static_argnums=1)(v, dtype))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _specials(shape, seed) -> np.ndarray:
    # Values over 2**-40 to 2**20, with a block of zeros, one of tiny values (its
    # E4M3 scale underflows in NVFP4), and an infinity and a NaN in their blocks.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-40, 20, shape)
    x = x.astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0, :16], flat[1, :16] = 0.0, 1e-30
    flat[2, 3], flat[-1, -1] = np.inf, np.nan
    return x


@pytest.mark.parametrize("name", NAMES)
def test_fake_quantize_is_the_round_trip_bit_for_bit(name):
    # `block_fake_quantize` (what a simulated GEMM multiplies: the rounded values
    # times their scales, no narrow dtypes in between) is `block_quantize` then
    # `dequantize`, for each axis, with 2-D tiles, axes shorter than a block and
    # partial blocks, rounded to nearest or stochastically, special values in.
    fmt = fp8.block_format(name)
    x = _specials((40, 3, 150), 1)
    for axis, rounding in [(-1, "nearest"), (0, "stochastic"), (1, "nearest")]:
        fq = fp8.block_fake_quantize(x, fmt, axis=axis, rounding=rounding)
        q = fp8.block_quantize(x, fmt, axis=axis, rounding=rounding)
        np.testing.assert_array_equal(
            fq.view(np.uint32), q.dequantize().view(np.uint32)
        )


def test_no_narrow_casts_or_transposes_in_a_fake_quantize():
    # XLA:CPU emulates casts to FP8 and FP4 value by value: a fake quantization
    # rounds in float arithmetic and makes no narrow array. Blocks along a leading
    # axis are split in place: no transpose either.
    x = jax.ShapeDtypeStruct((64, 96), F32)
    for name in ["mxfp8_e4m3_ceil", "nvfp4", "fp8_128x128"]:
        fq = functools.partial(fp8.block_fake_quantize, format=name, axis=0)
        jaxpr = jax.make_jaxpr(fq)(x)
        dtypes = {str(v.aval.dtype) for e in iter_eqns(jaxpr) for v in e.outvars}
        assert not dtypes & {"float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"}, name
        assert not [e for e in iter_eqns(jaxpr) if e.primitive.name == "transpose"]
        hlo = jax.jit(fq).lower(x).compile().as_text()
        assert "f8e4m3fn" not in hlo and "f4e2m1fn" not in hlo, name


def test_stochastic_draws_follow_the_blocks_not_the_memory_layout():
    # Without a key each value's draw hashes its position in the blocks laid out
    # one after another: the same tensor blocked along axis 0, or transposed and
    # blocked along axis 1, rounds alike.
    x = _specials((48, 40), 2)
    for name in ["nvfp4", "mxfp4", "fp8_128x128"]:
        a = fp8.block_fake_quantize(x, name, axis=0, rounding="stochastic")
        b = fp8.block_fake_quantize(x.T, name, axis=1, rounding="stochastic")
        np.testing.assert_array_equal(
            a.view(np.uint32), np.asarray(b).T.view(np.uint32)
        )


def _matmul(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def test_block_dot_general_forward_and_vjp_are_the_fake_quantized_dots():
    rng = np.random.default_rng(0)
    x, w, g = (
        rng.standard_normal(s).astype(np.float32) for s in [(8, 64), (64, 48), (8, 48)]
    )
    dn = (((1,), (0,)), ((), ()))
    E4, E5 = "mxfp8_e4m3", "mxfp8_e5m2"
    fq = fp8.block_fake_quantize

    def f(x, w):
        return fp8.block_dot_general(x, w, dn, E4, grad_format=E5)

    @jax.jit
    def run(x, w, g):
        y, vjp = jax.vjp(f, x, w)
        # Forward: blocks along K. d x = g w^T contracts N: g and w in blocks along
        # N. d w = x^T g contracts M: x and g in blocks along M. g through E5M2.
        expected = (
            _matmul(fq(x, E4, axis=1), fq(w, E4, axis=0)),
            _matmul(fq(g, E5, axis=1), fq(w, E4, axis=1).T),
            _matmul(fq(x, E4, axis=0).T, fq(g, E5, axis=0)),
        )
        # The same with E4M3 for g: what a backward ignoring `grad_format` gives.
        dx_e4m3 = _matmul(fq(g, E4, axis=1), fq(w, E4, axis=1).T)
        return (y, *vjp(g)), expected, dx_e4m3

    got, expected, dx_e4m3 = run(x, w, g)
    for a, b in zip(got, expected):
        assert a.dtype == F32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert np.abs(_values(got[1]) - _values(dx_e4m3)).max() > 0.1
    # In bfloat16 (traced only): the output and gradients in the operands' dtype.
    bf16 = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in (x, w, g)]
    shapes = jax.eval_shape(lambda x, w, g: (f(x, w), jax.vjp(f, x, w)[1](g)), *bf16)
    assert [a.dtype for a in jax.tree.leaves(shapes)] == [jnp.bfloat16] * 3
    out = jax.eval_shape(
        lambda x, w: fp8.block_dot_general(x, w, dn, out_dtype=F32), *bf16[:2]
    )
    assert out.dtype == F32


def test_block_dot_general_batched_tiles_and_stochastic_gradient():
    # A batched einsum, DeepSeek-V3 style: activations in 1x128 blocks, weights in
    # 128x128 tiles. Backward: d b contracts M, so a's blocks run along M (128x1).
    rng = np.random.default_rng(1)
    a, b, g = (
        rng.standard_normal(s).astype(np.float32)
        for s in [(2, 4, 256), (2, 256, 130), (2, 4, 130)]
    )
    dn = (((2,), (1,)), ((0,), (0,)))
    fq = fp8.block_fake_quantize
    A, W = "fp8_1x128", "fp8_128x128"

    def f(a, b, key=None):
        return fp8.block_dot_general(a, b, dn, A, rhs_format=W, key=key)

    def einsum(spec, *xs):
        return jnp.einsum(spec, *xs, precision=HIGHEST)

    @jax.jit
    def run(a, b, g, key):
        y, vjp = jax.vjp(f, a, b)
        wq = fq(b, W, axis=1, tile_axis=2)  # the same tiles whichever axis is "K"
        expected = (
            einsum("bmk,bkn->bmn", fq(a, A), wq),
            einsum("bmn,bkn->bmk", fq(g, A, axis=2), wq),
            einsum("bmk,bmn->bkn", fq(a, A, axis=1), fq(g, A, axis=1)),
        )
        # With `key`, the cotangent rounds stochastically.
        stochastic = jax.vjp(functools.partial(f, key=key), a, b)[1](g)[0]
        return (y, *vjp(g)), expected, stochastic

    got, expected, da7 = run(a, b, g, _key(7))
    for x, y in zip(got, expected):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-5)
    # The gradient is a function of the key, near the rounded-to-nearest one.
    np.testing.assert_array_equal(run(a, b, g, _key(7))[2], da7)
    da8 = run(a, b, g, _key(8))[2]
    assert not np.array_equal(da7, da8) and not np.array_equal(da7, got[1])
    np.testing.assert_allclose(da7, got[1], rtol=0.2, atol=2.0)


def test_block_dot_general_errors():
    x, w = np.ones((4, 32), np.float32), np.ones((32, 8), np.float32)
    with pytest.raises(ValueError, match="one contracting dimension per operand"):
        fp8.block_dot_general(
            np.ones((4, 2, 16)), np.ones((2, 16, 8)), (((1, 2), (0, 1)), ((), ()))
        )
    with pytest.raises(ValueError, match="Expected a free"):
        fp8.block_dot_general(np.ones(32), w, (((0,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="Expected a block format"):
        fp8.block_dot_general(x, w, (((1,), (0,)), ((), ())), "mxfp6")
