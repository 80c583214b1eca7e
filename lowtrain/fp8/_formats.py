"""The two FP8 formats of the FP8 formats paper (Micikevicius et al., 2022)."""

import jax.numpy as jnp

# E4M3 (no infinities; NaN is the only special value): weights and activations.
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# E5M2 (IEEE-like, with infinities): gradients, which need range more than precision.
E5M2 = jnp.dtype(jnp.float8_e5m2)

E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448.0
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344.0


def fp8_max(dtype) -> float:
    """The largest finite value of the FP8 dtype `dtype` (448 for E4M3, 57344 for
    E5M2); any other dtype raises a `ValueError`.

    ```python
    import lowtrain.fp8 as fp8

    assert fp8.fp8_max(fp8.E4M3) == 448.0
    ```
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (E4M3, E5M2):
        raise ValueError(
            f"Expected an FP8 dtype (lowtrain.fp8.E4M3 or E5M2), got {dtype} instead."
        )
    return float(jnp.finfo(dtype).max)
