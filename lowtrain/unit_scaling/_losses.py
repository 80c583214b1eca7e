"""Unit-scaled losses: `cross_entropy` and `mse_loss`.

A loss returns its usual value (the mean over the batch), but its gradient is not
divided by the batch size: each example's gradient is scaled to unit RMS instead, so
the backward pass starts at unit scale whatever the batch (Adam does not see the
constant factor; with SGD it is part of the learning rate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._core import at_least_float32, leading_size
from ._scale import scale_bwd, scale_fwd


def cross_entropy(
    logits: Float[Array, "*batch vocab"],
    labels: Int[Array, "*batch"],
    mult: float = 1.0,
) -> Float[Array, ""]:
    """The mean cross-entropy of `softmax(mult * logits)` against integer `labels`,
    computed in at least float32, with a unit-scaled gradient.

    Value: `mean(logsumexp(mult * logits) - mult * logits[label])` over all leading
    axes (`batch` rows), as `optax.softmax_cross_entropy_with_integer_labels` gives.

    Scales: gradient of `logits` `vocab / sqrt(vocab - 1)` times `softmax - one_hot`
    per row, not divided by `batch` (for near-uniform predictions `softmax -
    one_hot` has RMS `sqrt(vocab - 1) / vocab`, so the gradient has unit RMS);
    `mult` scales the logits in the forward pass only, so it does not change the
    gradient's scale.

    ```python
    import jax
    import jax.numpy as jnp
    import optax
    import lowtrain.unit_scaling.functional as U

    logits = jax.random.normal(jax.random.key(0), (32, 10))
    labels = jnp.arange(32) % 10
    plain = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    assert jnp.allclose(U.cross_entropy(logits, labels), plain)
    grad = jax.grad(U.cross_entropy)(logits, labels)
    assert 0.9 < jnp.sqrt(jnp.mean(grad**2)) < 1.1
    ```
    """
    if (
        logits.ndim < 1
        or tuple(labels.shape) != tuple(logits.shape[:-1])
        or not jnp.issubdtype(labels.dtype, jnp.integer)
        or logits.shape[-1] < 2
    ):
        raise ValueError(
            "`cross_entropy` expected logits of shape (..., vocab) with vocab >= 2 "
            "and integer labels of shape (...), got logits "
            f"{tuple(logits.shape)} and {labels.dtype} labels {tuple(labels.shape)} "
            "instead."
        )
    vocab = logits.shape[-1]
    batch = leading_size(logits, 1)
    logits = scale_fwd(scale_bwd(logits, vocab / (vocab - 1) ** 0.5), mult)
    logits = at_least_float32(logits)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    # A label outside [0, vocab) reads NaN (the gather's fill), never a class
    # counted from the end.
    labels = jnp.where(labels < 0, vocab, labels)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)
    return scale_fwd(-jnp.sum(picked), 1 / batch)


def mse_loss(
    input: Float[Array, "*shape"], target: Float[Array, "*shape"]
) -> Float[Array, ""]:
    """The mean squared error `mean((input - target) ** 2)`, with unit-scaled
    gradients.

    Scales: gradients of `input` and `target` `8 ** -0.5` times those of the sum
    of squares (`±2 (input - target)`, RMS `sqrt(8)` for independent unit-normal
    inputs), not divided by the number of elements.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.unit_scaling.functional as U

    x, t = jax.random.normal(jax.random.key(0), (2, 4096))
    assert jnp.allclose(U.mse_loss(x, t), jnp.mean((x - t) ** 2))
    grad = jax.grad(U.mse_loss)(x, t)
    assert 0.9 < jnp.sqrt(jnp.mean(grad**2)) < 1.1
    ```
    """
    if input.shape != target.shape:
        raise ValueError(
            "`mse_loss` expected `input` and `target` of one shape, got "
            f"{tuple(input.shape)} and {tuple(target.shape)} instead."
        )
    input = scale_bwd(input, 8**-0.5)
    target = scale_bwd(target, 8**-0.5)
    diff = input - target
    return scale_fwd(jnp.sum(diff * diff), 1 / max(input.size, 1))
