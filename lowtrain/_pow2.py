"""Exact power-of-two rounding, shared by `lowtrain.fp8` and `lowtrain.scalify`."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

POW2_MODES = ("down", "up", "none")


def pow2_round(x: ArrayLike, mode: str = "down") -> Array:
    """Round positive `x` to a power of two: "down" (the largest power of two <= x),
    "up" (the smallest >= x) or "none" (unchanged). Zero and non-finite values pass
    through. Exact (`frexp`/`ldexp`; `exp2(floor(log2 x))` is not, on every backend).
    Power-of-two scales make rescaling exact in every float format.

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
    mantissa, exponent = jnp.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= m < 1
    down = jnp.ldexp(jnp.ones_like(x), exponent - 1)
    rounded = down if mode == "down" else jnp.where(mantissa == 0.5, x, 2 * down)
    ok = jnp.isfinite(x) & (x > 0)
    return jnp.where(ok, rounded, x)
