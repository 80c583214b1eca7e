"""Unit-scaled nonlinearities: `gelu`, `silu`, `silu_glu`, `softmax`, `dropout`.

Their scales are u-μP's empirical models (Blake et al. 2024, reproduced from the
`unit-scaling` library): each is exact in two limits of the input multiplier `mult`
(the op is applied to `mult * x`) and interpolated geometrically in between.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from . import constraints as _constraints
from ._core import logarithmic_interpolation, scale_elementwise
from ._scale import scale_bwd, scale_fwd
from .constraints import gmean

# For unit-normal x: relu(x) has standard deviation sqrt((1 - 1/pi) / 2), a linear
# x / 2 has RMS 1/2, and their slopes (a step, 1/2) have RMS sqrt(1/2) and 1/2.
_RELU_OUTPUT = (2 / (1 - 1 / math.pi)) ** 0.5
_LINEAR_HALF = 2.0
_RELU_GRAD = 2**0.5


def _gate_alpha(mult: float) -> float:
    # sigmoid(log(4 mult^2)): 0 where the gate is linear (small mult), 1 where it is
    # a step (large mult).
    return 1 / (1 + 0.25 / mult**2)


def gelu(
    x: Float[Array, "*shape"],
    mult: float = 1.0,
    constraint: _constraints.Constraint | None = gmean,
    approximate: bool = False,
) -> Float[Array, "*shape"]:
    """A unit-scaled `jax.nn.gelu(mult * x) / mult` (exact erf form by default).

    Scales, for unit-normal `x` and cotangent (u-μP's model, between the linear limit
    `mult -> 0`, where gelu is `x / 2`, and the relu limit `mult -> inf`):

    - output: from 2 to `sqrt(2 / (1 - 1/pi))`, about 1.77 at `mult=1`;
    - gradient of `x`: from 2 to `sqrt(2)`, about 1.52 at `mult=1`;
    - tied by `constraint` (default `gmean`, about 1.64 for both at `mult=1`).

    **Arguments:**

    - `x`: the input, a float array of any shape.
    - `mult`: the input multiplier (> 0; default 1.0): gelu is applied to `mult * x`
      and its output divided by `mult`, so a larger `mult` makes it more relu-like.
    - `constraint`: ties the output and input-gradient scales (a function of
      `lowtrain.unit_scaling.constraints`; default `gmean`); None keeps them apart.
    - `approximate`: False (default) for the exact erf form, True for the tanh
      approximation (`jax.nn.gelu`'s `approximate`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = jax.random.normal(jax.random.key(0), (4096,))
    y = U.gelu(x, constraint=None)
    assert jnp.allclose(y, 1.77 * jax.nn.gelu(x, approximate=False), rtol=1e-2)
    assert 0.9 < jnp.sqrt(jnp.mean(y**2)) < 1.2
    ```
    """
    alpha = _gate_alpha(mult)
    output_scale = logarithmic_interpolation(alpha, _LINEAR_HALF, _RELU_OUTPUT)
    grad_scale = logarithmic_interpolation(alpha, _LINEAR_HALF, _RELU_GRAD)

    def f(x):
        return jax.nn.gelu(x * mult, approximate=approximate) / mult

    return scale_elementwise(f, output_scale, grad_scale, constraint)(x)


def _silu(x, mult: float):
    return x * jax.nn.sigmoid(x * mult)


def silu(
    x: Float[Array, "*shape"],
    mult: float = 1.0,
    constraint: _constraints.Constraint | None = gmean,
) -> Float[Array, "*shape"]:
    """A unit-scaled `x * sigmoid(mult * x)` (SiLU, or swish with slope `mult`).

    Scales, for unit-normal `x` and cotangent (between the linear limit, `x / 2`,
    and the relu limit, as for `gelu`): output from 2 to `sqrt(2 / (1 - 1/pi))`
    (about 1.77 at `mult=1`); gradient of `x` from 2 to `sqrt(2)` with weight
    `sigmoid(log(mult**2))` (about 1.68 at `mult=1`); tied by `constraint` (default
    `gmean`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = jax.random.normal(jax.random.key(0), (4096,))
    assert 0.9 < jnp.sqrt(jnp.mean(U.silu(x) ** 2)) < 1.2
    ```
    """
    output_scale = logarithmic_interpolation(
        _gate_alpha(mult), _LINEAR_HALF, _RELU_OUTPUT
    )
    grad_scale = logarithmic_interpolation(
        1 / (1 + 1 / mult**2), _LINEAR_HALF, _RELU_GRAD
    )
    return scale_elementwise(_silu, output_scale, grad_scale, constraint)(x, mult)


def glu_scale(mult: float = 1.0) -> float:
    # `silu_glu`'s one scale (2 ** 0.75 at `mult=1`; see its docstring).
    return logarithmic_interpolation(1 / (1 + 1 / mult**2), _LINEAR_HALF, _RELU_GRAD)


def silu_glu(
    x: Float[Array, "*shape"], gate: Float[Array, "*shape"], mult: float = 1.0
) -> Float[Array, "*shape"]:
    """A unit-scaled gated linear unit `x * silu(gate)` (SwiGLU's gating).

    One scale `s`, from 2 (linear gate) to `sqrt(2)` (step gate) with weight
    `sigmoid(log(mult**2))` (about 1.68 at `mult=1`), multiplies the output and the
    gradients of both `x` and `gate`: for unit-normal inputs and cotangent the
    forward and backward scales are close enough that one number serves all three,
    so there is no constraint to choose.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x, g = jax.random.normal(jax.random.key(0), (2, 4096))
    assert 0.7 < jnp.sqrt(jnp.mean(U.silu_glu(x, g) ** 2)) < 1.3
    ```
    """
    if x.shape != gate.shape:
        raise ValueError(
            "`silu_glu` expected `x` and `gate` of one shape, got "
            f"{tuple(x.shape)} and {tuple(gate.shape)} instead."
        )
    scale = glu_scale(mult)
    x = scale_bwd(x, scale)
    gate = scale_bwd(gate, scale)
    return scale_fwd(x * _silu(gate, mult), scale)


def softmax(
    x: Float[Array, "*shape"],
    axis: int = -1,
    mult: float = 1.0,
    constraint: _constraints.Constraint | None = gmean,
) -> Float[Array, "*shape"]:
    """A unit-scaled `jax.nn.softmax(mult * x, axis)`: its outputs sum to about `n`
    rather than 1, where `n = x.shape[axis]`.

    Scales, for unit-normal `x` and cotangent, u-μP's model between the flat limit
    (small `mult`: every output `1 / n`) and the one-hot limit (large `mult`), with
    weight `sigmoid(log(mult**2 / 4))`: output from `n` to `sqrt(n)`; gradient of `x`
    from `n / mult` to `sqrt(n / mult)`; tied by `constraint` (default `gmean`; at
    `mult=1` both are `n ** 0.9`).

    **Arguments:**

    - `x`: the logits, a float array of any shape.
    - `axis`: the axis (an int) normalized over (default -1, the last); it sets
      `n = x.shape[axis]`.
    - `mult`: the input multiplier (an inverse temperature, > 0; default 1.0): the
      softmax is of `mult * x`.
    - `constraint`: ties the output and input-gradient scales (default `gmean`);
      None keeps them apart.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = jax.random.normal(jax.random.key(0), (8, 256))
    y = U.softmax(x)
    assert jnp.allclose(y / 256**0.9, jax.nn.softmax(x), rtol=1e-4, atol=1e-7)
    ```
    """
    n = x.shape[axis]
    alpha = 1 / (1 + 4 / mult**2)
    output_scale = logarithmic_interpolation(alpha, n, n**0.5)
    grad_scale = logarithmic_interpolation(alpha, n / mult, (n / mult) ** 0.5)

    def f(x):
        return jax.nn.softmax(x * mult, axis=axis)

    return scale_elementwise(f, output_scale, grad_scale, constraint)(x)


def dropout(
    x: Float[Array, "*shape"],
    p: float,
    *,
    key: PRNGKeyArray | None,
    inference: bool = False,
) -> Float[Array, "*shape"]:
    """Unit-scaled dropout: each entry is zeroed with probability `p`, the kept ones
    are multiplied by `(1 - p) ** -0.5` (not `1 / (1 - p)`), so the RMS stays 1.

    Scales: output and gradient of `x` both `sqrt(1 - p)` around the usual inverted
    dropout (no constraint: they are equal). With `inference=True` (or `p=0`) it
    multiplies by `sqrt(1 - p)` forward and backward, the expected value of the
    training-time output, and needs no `key`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x = jax.random.normal(jax.random.key(0), (4096,))
    y = U.dropout(x, 0.5, key=jax.random.key(1))
    assert 0.9 < jnp.sqrt(jnp.mean(y**2)) < 1.1
    assert (U.dropout(x, 0.75, key=None, inference=True) == x * 0.5).all()
    ```
    """
    if not 0 <= p < 1:
        raise ValueError(f"Expected a dropout probability `p` in [0, 1), got {p}.")
    scale = (1 - p) ** 0.5
    if inference or p == 0:
        return scale_elementwise(lambda x: x, scale, scale, None)(x)
    if key is None:
        raise ValueError(
            "`dropout` got `key=None` in training mode. Pass a PRNG key "
            "(`key=jax.random.key(0)`) or `inference=True`."
        )
    keep = jax.random.bernoulli(key, 1 - p, x.shape)

    def f(x):
        return jnp.where(keep, x / (1 - p), jnp.zeros_like(x))

    return scale_elementwise(f, scale, scale, None)(x)
