"""Scale constraints: how an op's separate forward and backward scales are tied.

Unit scaling gives each op an ideal output scale (for unit-RMS outputs) and ideal
input-gradient scales (for unit-RMS gradients). Where the op's output feeds the rest
of the network *and* its gradient flows back through it on the same path (not a
parameter's gradient, which leaves the graph), both must be the same number, or
the backward pass no longer computes the derivative of the forward one. A
constraint picks that number from the candidates `(output_scale, *grad_scales)`:
`gmean` (the paper's default: both are off by the same factor), `hmean` (Glorot's
choice), `amean`, or one of them alone (`to_output_scale`, `to_grad_input_scale`,
`to_left_grad_scale`, `to_right_grad_scale`). `None` instead of a constraint leaves
the scales separate: gradients are then off by a constant factor, which Adam-style
optimizers do not see (use it only where that is acceptable, e.g. after the last
residual add).

```python
import lowtrain.unit_scaling as uu

assert uu.constraints.gmean(4.0, 1.0) == 2.0
assert uu.constraints.to_output_scale(4.0, 1.0) == 4.0
```
"""

from __future__ import annotations

import math
from collections.abc import Callable

Constraint = Callable[..., float]


def gmean(*scales: float) -> float:
    """The geometric mean of `scales` (the recommended unit-scaling constraint).

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.gmean(4.0, 1.0) == 2.0
    ```
    """
    return math.prod(scales) ** (1 / len(scales))


def hmean(*scales: float) -> float:
    """The harmonic mean of `scales` (Glorot's choice for `(fan_in, fan_out)`).

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.hmean(1.0, 3.0) == 1.5
    ```
    """
    return len(scales) / sum(1 / s for s in scales)


def amean(*scales: float) -> float:
    """The arithmetic mean of `scales`.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.amean(1.0, 3.0) == 2.0
    ```
    """
    return sum(scales) / len(scales)


def to_output_scale(output_scale: float, *grad_input_scales: float) -> float:
    """`output_scale`: unit outputs, gradients off by the ratio.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.to_output_scale(4.0, 1.0, 2.0) == 4.0
    ```
    """
    return output_scale


def to_grad_input_scale(output_scale: float, grad_input_scale: float) -> float:
    """`grad_input_scale`: unit input gradients, outputs off by the ratio.

    **Arguments:**

    - `output_scale`: the op's ideal output scale (not used).
    - `grad_input_scale`: its input's ideal gradient scale, returned.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.to_grad_input_scale(4.0, 1.0) == 1.0
    ```
    """
    return grad_input_scale


def to_left_grad_scale(
    output_scale: float, left_grad_scale: float, right_grad_scale: float
) -> float:
    """`left_grad_scale`, for ops with two inputs `(left, right)`.

    **Arguments:**

    - `output_scale`: the op's ideal output scale (not used).
    - `left_grad_scale`: the left input's ideal gradient scale, returned.
    - `right_grad_scale`: the right input's ideal gradient scale (not used).

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.to_left_grad_scale(4.0, 1.0, 2.0) == 1.0
    ```
    """
    return left_grad_scale


def to_right_grad_scale(
    output_scale: float, left_grad_scale: float, right_grad_scale: float
) -> float:
    """`right_grad_scale`, for ops with two inputs `(left, right)`.

    **Arguments:**

    - `output_scale`: the op's ideal output scale (not used).
    - `left_grad_scale`: the left input's ideal gradient scale (not used).
    - `right_grad_scale`: the right input's ideal gradient scale, returned.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.to_right_grad_scale(4.0, 1.0, 2.0) == 2.0
    ```
    """
    return right_grad_scale


def apply(
    constraint: Constraint | None, output_scale: float, *grad_scales: float
) -> tuple[float, ...]:
    """`(output_scale, *grad_scales)` after `constraint`: every scale replaced by the
    constrained one, or all unchanged for `None`.

    **Arguments:**

    - `constraint`: a function of the scales returning the one they all take
      (`gmean`, ..., or your own), or None; anything else raises `TypeError`.
    - `output_scale`: the op's ideal output scale (for a unit-RMS output).
    - `*grad_scales`: the ideal gradient scales of its inputs, in order.

    ```python
    import lowtrain.unit_scaling as uu

    assert uu.constraints.apply(uu.constraints.gmean, 4.0, 1.0) == (2.0, 2.0)
    assert uu.constraints.apply(None, 4.0, 1.0) == (4.0, 1.0)
    ```
    """
    if constraint is None:
        return (output_scale, *grad_scales)
    if not callable(constraint):
        raise TypeError(
            "Expected `constraint` to be a function of the scales such as "
            f"`lowtrain.unit_scaling.constraints.gmean`, or None, got {constraint!r} "
            "instead."
        )
    tied = float(constraint(output_scale, *grad_scales))
    return (tied,) * (1 + len(grad_scales))
