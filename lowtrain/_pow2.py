"""Exact power-of-two rounding, shared by `lowtrain.fp8` and `lowtrain.scalify`."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

POW2_MODES = ("down", "up", "none")


def pow2_round(x: ArrayLike, mode: str = "down") -> Array:
    """Round positive `x` (cast to float32) to a power of two, as `mode` says: "down"
    (the default: the largest power of two <= x), "up" (the smallest >= x) or "none"
    (unchanged). Zero, negative and non-finite values pass through. Exact, subnormals
    included (computed on the bit pattern; `exp2(floor(log2 x))` is not exact on
    every backend). Power-of-two scales make rescaling exact in every float format.

    ```python
    import lowtrain.scalify as scalify

    assert scalify.pow2_round(5.0) == 4.0 and scalify.pow2_round(5.0, "up") == 8.0
    assert scalify.pow2_round(1e6) == 2.0**19
    ```
    """
    if mode not in POW2_MODES:
        raise ValueError(
            f"Expected a power-of-two rounding mode in {POW2_MODES}, got {mode!r}."
        )
    x = jnp.asarray(x, jnp.float32)
    if mode == "none":
        return x
    # On the float32 bit pattern, in integer arithmetic (a handful of ops that XLA
    # fuses into their consumers; float arithmetic would flush subnormals on CPU): a
    # normal number's power of two below it clears its mantissa; a subnormal's is
    # its highest set bit.
    bits = lax.bitcast_convert_type(x, jnp.int32)
    normal = bits >= _SMALLEST_NORMAL
    top = lax.shift_left(jnp.int32(1), 31 - lax.clz(bits))
    down = jnp.where(normal, bits & _EXPONENT, top)
    if mode == "up":
        # The next power of two: one exponent step up (a subnormal's: one bit up,
        # which reaches the smallest normal exactly; float32's largest: inf).
        up = jnp.where(normal, down + _SMALLEST_NORMAL, lax.shift_left(down, 1))
        down = jnp.where(down == bits, bits, up)
    rounded = lax.bitcast_convert_type(down, jnp.float32)
    ok = (bits > 0) & (bits < _EXPONENT)  # positive and finite (below +inf's bits)
    return jnp.where(ok, rounded, x)


_EXPONENT = 0x7F800000  # float32's exponent bits, +inf's bit pattern; sign 0 here
_SMALLEST_NORMAL = 0x00800000  # 2**-126, one step of the exponent field
