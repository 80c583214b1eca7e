"""Loss scales (no-op, static, dynamic), `all_finite` and `scaled_value_and_grad`."""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree


def _is_float_array(x) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _f32_scalar(value, what: str) -> Float[Array, ""]:
    x = jnp.asarray(value)
    if x.shape != () or not jnp.issubdtype(x.dtype, jnp.number):
        raise ValueError(
            f"Expected a positive finite scalar for `{what}`, got {value!r} instead."
        )
    x = x.astype(jnp.float32)  # an f16/bf16 scale is kept in f32 from here on
    if not isinstance(x, jax.core.Tracer) and not (0 < float(x) < math.inf):
        raise ValueError(
            f"Expected a positive finite scalar for `{what}`, got {value!r} instead "
            "(as float32)."
        )
    return x


def _number(value, what: str, *, low: float, high: float, closed: str = "") -> float:
    """A Python float in (low, high); `closed` names the ends allowed: "low", "high"."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    ok = (low <= v if "low" in closed else low < v) and (
        v <= high if "high" in closed else v < high
    )
    if not ok:
        lo = "[" if "low" in closed else "("
        hi = "]" if "high" in closed else ")"
        raise ValueError(
            f"Expected `{what}` in {lo}{low}, {high}{hi}, got {value!r} instead."
        )
    return v


def _in_compute_dtype(x) -> jnp.dtype:
    # f16/bf16 leaves are scaled in f32 (2**15 times a large f16 gradient overflows
    # f16); f32, f64 and complex leaves in their own dtype.
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return x.dtype


class AbstractLossScale(eqx.Module):
    """The interface every loss scale shares; subclass it for your own (the
    built-ins, `NoOpLossScale`, `StaticLossScale` and `DynamicLossScale`, are final).

    - `scale(tree)`: the loss (or any pytree) multiplied by the scale;
    - `unscale(tree)`: the gradients divided by it, each back in its dtype;
    - `adjust(grads_finite)`: the loss scale for the next step;
    - `value`: the current scale, a float32 scalar (1 where nothing is scaled);
    - `at_floor()`: whether it can back off no further; `floor()`: that floor.

    `lowtrain.Trainer`, `scaled_value_and_grad` and `TrainState` take any of them.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain

    class Halving(lowtrain.AbstractLossScale):
        # Halves after a non-finite step, never grows.
        value: jnp.ndarray = eqx.field(converter=jnp.float32, default=2.0**10)

        def scale(self, tree):
            return jax.tree.map(lambda x: x * self.value, tree)

        def unscale(self, tree):
            return jax.tree.map(lambda g: (g / self.value).astype(g.dtype), tree)

        def adjust(self, grads_finite):
            return Halving(jnp.where(grads_finite, self.value, self.value / 2))

    ls = Halving().adjust(jnp.array(False))
    assert float(ls.value) == 512.0 and not bool(ls.at_floor())
    ```
    """

    @abc.abstractmethod
    def scale(self, tree: PyTree) -> PyTree:
        """`tree` (the loss, or any pytree) multiplied by the scale."""

    @abc.abstractmethod
    def unscale(self, tree: PyTree) -> PyTree:
        """`tree` (the gradients) divided by the scale, each leaf back in its dtype."""

    @abc.abstractmethod
    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> AbstractLossScale:
        """The loss scale for the next step, given `grads_finite` (a bool scalar:
        whether every gradient of this step was finite)."""

    @property
    def value(self) -> Float[Array, ""]:
        """The current scale (float32 scalar): 1 unless overridden."""
        return jnp.float32(1.0)

    def at_floor(self) -> Bool[Array, ""]:
        """Whether the scale can back off no further (a skipped step at the floor
        cannot be cured by a lower scale). False but for a `DynamicLossScale` at
        its `min_scale`."""
        return jnp.asarray(False)

    def floor(self) -> float | None:
        """The lowest scale it backs off to, or None where it never backs off."""
        return None


class NoOpLossScale(AbstractLossScale):
    """A loss scale that does nothing, so one training loop serves every precision.

    `scale(tree)` and `unscale(tree)` return `tree` unchanged and `adjust(finite)`
    returns `self`. `lowtrain.Trainer` uses it unless the policy computes in float16.

    ```python
    import jax.numpy as jnp
    import lowtrain

    ls = lowtrain.NoOpLossScale()
    assert ls.scale(jnp.float32(3.0)) == 3.0
    assert ls.adjust(jnp.array(False)) is ls
    ```
    """

    def scale(self, tree: PyTree) -> PyTree:
        return tree

    def unscale(self, tree: PyTree) -> PyTree:
        return tree

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> NoOpLossScale:
        return self


class StaticLossScale(AbstractLossScale):
    """A fixed loss scale.

    `scale(tree)` multiplies every float leaf by the scale (in at least float32, and
    returns it in at least float32); `unscale(tree)` divides every float leaf by it in
    at least float32 and casts each result back to its leaf's dtype; non-float leaves
    pass through. `adjust(finite)` returns `self`. The scale is stored as a float32
    scalar array in `loss_scale`, whatever dtype it is given in.

    ```python
    import jax.numpy as jnp
    import lowtrain

    ls = lowtrain.StaticLossScale(jnp.float16(1024))
    assert ls.loss_scale.dtype == jnp.float32
    g = ls.unscale(jnp.array([2048.0], jnp.float16))
    assert g.dtype == jnp.float16 and g[0] == 2.0
    ```
    """

    loss_scale: Float[Array, ""]

    def __init__(self, scale: ArrayLike):
        """**Arguments:**

        - `scale`: the loss scale, a positive finite scalar (any numeric dtype;
          stored as float32).
        """
        self.loss_scale = _f32_scalar(scale, "scale")

    @property
    def value(self) -> Float[Array, ""]:
        return self.loss_scale

    def scale(self, tree: PyTree) -> PyTree:
        return _scale(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale(tree, self.loss_scale)

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> StaticLossScale:
        return self


class DynamicLossScale(AbstractLossScale):
    """A loss scale adjusted after every step exactly as `torch.amp.GradScaler` does.

    `adjust(grads_finite)` returns a new `DynamicLossScale`:

    - if `grads_finite` is False: `scale = max(scale * backoff_factor, min_scale)` and
      `counter = 0`;
    - if it is True: `counter += 1`; when `counter == growth_interval`, then
      `counter = 0` and `scale = min(scale * growth_factor, max_scale)`, except that
      the scale stays where it was if that product is not finite in float32.

    So after `growth_interval` consecutive finite steps the scale grows once. The
    counter is `counter` (int32), the scale `loss_scale` (float32, whatever dtype it
    is given in). All other arguments are static Python numbers: they survive `jit`
    and pytree flatten/unflatten. Unlike GradScaler, the scale never backs off below
    `min_scale` and never grows above `max_scale`. `scale` and `unscale` are as for
    `lowtrain.StaticLossScale`. With `lowtrain.scaled_value_and_grad` the gradients
    are unscaled with the scale used to compute them, before `adjust`.

    ```python
    import jax.numpy as jnp
    import lowtrain

    ls = lowtrain.DynamicLossScale(scale=2.0**15, growth_interval=2)
    ls = ls.adjust(jnp.array(False))  # overflow: back off
    assert ls.loss_scale == 2.0**14 and ls.counter == 0
    ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))  # 2 good steps: grow
    assert ls.loss_scale == 2.0**15 and ls.counter == 0
    ```
    """

    loss_scale: Float[Array, ""]
    counter: Int[Array, ""]
    growth_interval: int = eqx.field(static=True)
    growth_factor: float = eqx.field(static=True)
    backoff_factor: float = eqx.field(static=True)
    min_scale: float = eqx.field(static=True)
    max_scale: float = eqx.field(static=True)

    def __init__(
        self,
        scale: ArrayLike = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ):
        """**Arguments:**

        - `scale`: the starting loss scale, a positive finite scalar in
          `[min_scale, max_scale]` (stored as float32); default `2**15`.
        - `growth_interval`: the number of consecutive finite steps after which the
          scale grows, an int in `[1, 2**31 - 1]`; default 2000.
        - `growth_factor`: what the scale is multiplied by when it grows, a float
          `> 1`; default 2.
        - `backoff_factor`: what the scale is multiplied by after a non-finite
          step, a float in `(0, 1)`; default 0.5.
        - `min_scale`: the lowest scale it backs off to, a finite float `> 0`;
          default 1.
        - `max_scale`: the highest scale it grows to, a float `>= min_scale` (may be
          `inf`); default `2**24`.
        """
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(
                "Expected an int `growth_interval` (steps between growths), got "
                f"{growth_interval!r} instead."
            )
        self.growth_interval = int(
            _number(
                growth_interval,
                "growth_interval",
                low=1,
                high=2**31 - 1,
                closed="lowhigh",
            )
        )
        self.growth_factor = _number(
            growth_factor, "growth_factor", low=1, high=math.inf
        )
        self.backoff_factor = _number(backoff_factor, "backoff_factor", low=0, high=1)
        self.min_scale = _number(min_scale, "min_scale", low=0, high=math.inf)
        self.max_scale = _number(
            max_scale, "max_scale", low=self.min_scale, high=math.inf, closed="lowhigh"
        )
        self.loss_scale = _f32_scalar(scale, "scale")
        try:
            start = float(self.loss_scale)
        except jax.errors.ConcretizationTypeError:  # built under a transform
            start = None
        if start is not None and not self.min_scale <= start <= self.max_scale:
            raise ValueError(
                f"Expected the starting `scale` in [min_scale, max_scale] = "
                f"[{self.min_scale:g}, {self.max_scale:g}], got {start:g} instead: "
                "outside it every step would be skipped or the scale pinned. Pass a "
                "scale inside that range, or widen it."
            )
        self.counter = jnp.zeros((), jnp.int32)

    def scale(self, tree: PyTree) -> PyTree:
        return _scale(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale(tree, self.loss_scale)

    @property
    def value(self) -> Float[Array, ""]:
        return self.loss_scale

    def at_floor(self) -> Bool[Array, ""]:
        return self.loss_scale <= self.min_scale

    def floor(self) -> float:
        return float(self.min_scale)

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> DynamicLossScale:
        finite = jnp.asarray(grads_finite, jnp.bool_)
        backed_off = jnp.maximum(self.loss_scale * self.backoff_factor, self.min_scale)
        count = self.counter + 1
        grow = count >= self.growth_interval
        grown = jnp.minimum(self.loss_scale * self.growth_factor, self.max_scale)
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        new_scale = jnp.where(
            finite, jnp.where(grow, grown, self.loss_scale), backed_off
        )
        new_counter = jnp.where(finite & ~grow, count, 0)
        return eqx.tree_at(
            lambda s: (s.loss_scale, s.counter),
            self,
            (new_scale.astype(jnp.float32), new_counter.astype(jnp.int32)),
        )


def _scale(tree: PyTree, scale: Float[Array, ""]) -> PyTree:
    def leaf(x):
        if not _is_float_array(x):
            return x
        dtype = _in_compute_dtype(x)
        return x.astype(dtype) * scale.astype(dtype)

    return jax.tree.map(leaf, tree)


def _unscale(tree: PyTree, scale: Float[Array, ""]) -> PyTree:
    def leaf(x):
        if not _is_float_array(x):
            return x
        dtype = _in_compute_dtype(x)
        return (x.astype(dtype) / scale.astype(dtype)).astype(x.dtype)

    return jax.tree.map(leaf, tree)


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """True (a bool scalar array) if no float array in `tree` holds an inf or a NaN.

    Non-float leaves are ignored; an empty tree is finite.

    ```python
    import jax.numpy as jnp
    import lowtrain

    assert lowtrain.all_finite({"a": jnp.ones(3), "n": 7})
    assert not lowtrain.all_finite([jnp.ones(2), jnp.array([1.0, jnp.inf])])
    ```
    """
    checks = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_float_array(x)
    ]
    if not checks:
        return jnp.array(True)
    return jnp.all(jnp.stack(checks))


def redo_while_nonfinite(attempt: Callable, loss_scale: AbstractLossScale, redos: int):
    """The last `attempt(ls) -> (ls, ..., finite)`: redone at the backed-off scale
    while not `finite`, at most `redos` times (one `lax.while_loop`)."""
    result = attempt(loss_scale)
    # Only a dynamic scale changes between attempts: others would compute the same.
    if redos == 0 or not isinstance(loss_scale, DynamicLossScale):
        return result
    dynamic, static = eqx.partition(result, eqx.is_array)

    def cond(carry):
        return ~carry[1][-1] & (carry[0] < redos)

    def body(carry):
        ls = eqx.combine(carry[1], static)[0]
        new = attempt(ls.adjust(jnp.array(False)))
        return carry[0] + 1, eqx.partition(new, eqx.is_array)[0]

    _, dynamic = lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), dynamic))
    return eqx.combine(dynamic, static)


class _ScaledValueAndGrad(eqx.Module):
    fn: Callable
    has_aux: bool = eqx.field(static=True)
    redo_on_nan: int = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fn

    @property
    def __signature__(self) -> inspect.Signature:
        # `inspect.signature` would otherwise follow `__wrapped__` and miss the loss
        # scale argument (and `eqx.filter_jit` binds arguments with it).
        first = inspect.Parameter("loss_scale", inspect.Parameter.POSITIONAL_ONLY)
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):
            kinds = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
            params = [
                inspect.Parameter(n, k) for n, k in zip(("args", "kwargs"), kinds)
            ]
        return inspect.Signature([first, *params])

    def __call__(self, loss_scale: AbstractLossScale, x, /, *args, **kwargs):
        if not isinstance(loss_scale, AbstractLossScale):
            raise TypeError(
                "Expected a loss scale (e.g. `lowtrain.DynamicLossScale()`) as the "
                f"first argument, got {type(loss_scale).__name__} instead. Call it "
                "as `g(loss_scale, params, *args)`."
            )

        def scaled_loss(x, ls, args, kwargs):
            out = self.fn(x, *args, **kwargs)
            loss, aux = out if self.has_aux else (out, None)
            loss = jnp.asarray(loss)
            if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
                raise TypeError(
                    "Expected `fn` to return a float scalar loss"
                    f"{' as the first of (loss, aux)' if self.has_aux else ''}, got "
                    f"{loss.dtype}{list(loss.shape)} instead. Reduce it (e.g. "
                    "`jnp.mean`), or pass `has_aux=True` if `fn` returns (loss, aux)."
                )
            loss = loss.astype(jnp.float32)
            # Scaled in f32: the cotangent that enters the backward pass is the scale.
            return ls.scale(loss), (loss, aux)

        value_and_grad = eqx.filter_value_and_grad(scaled_loss, has_aux=True)

        def attempt(ls):
            (_, (loss, aux)), grads = value_and_grad(x, ls, args, kwargs)
            grads = ls.unscale(grads)  # with the scale that produced them
            return ls, loss, aux, grads, all_finite(grads)

        ls, loss, aux, grads, finite = redo_while_nonfinite(
            attempt, loss_scale, self.redo_on_nan
        )
        value = (loss, aux) if self.has_aux else loss
        return (value, grads), ls.adjust(finite), finite


def scaled_value_and_grad(
    fn: Callable, *, has_aux: bool = False, redo_on_nan: int = 0
) -> Callable[..., Any]:
    """`eqx.filter_value_and_grad` with loss scaling.

    Returns `g`, called as
    `(value, grads), new_loss_scale, grads_finite = g(loss_scale, x, *args, **kwargs)`:

    - `fn(x, *args, **kwargs)` returns a float scalar loss (or `(loss, aux)` with
      `has_aux=True`; then `value` is `(loss, aux)`). As in Equinox, `grads` is with
      respect to the inexact arrays of the first argument `x` (other leaves are None).
    - The loss is cast to float32 and multiplied by the scale; the gradients of that
      are divided by the same scale (the one used, not the adjusted one) in at least
      float32 and returned in each parameter's dtype. `value` is the loss unscaled,
      in float32.
    - `grads_finite` (bool scalar) says whether every gradient is finite; the loss and
      `aux` are not looked at, so a NaN in `aux` never changes the scale.
      `new_loss_scale = loss_scale.adjust(grads_finite)`.
    - `redo_on_nan=N` (for a `DynamicLossScale`): while the gradients are non-finite
      and fewer than N redos were done, the scale is backed off
      (`adjust(False)`) and forward and backward are computed again, inside one
      `lax.while_loop`. The returned values are those of the last attempt and
      `new_loss_scale` is the last scale used, adjusted by its outcome.

    ```python
    import jax.numpy as jnp
    import lowtrain

    def loss(w, x):
        return jnp.sum((w * x) ** 2)

    g = lowtrain.scaled_value_and_grad(loss)
    ls = lowtrain.DynamicLossScale(scale=2.0**10)
    (value, grads), ls, finite = g(ls, jnp.ones(3), jnp.arange(3.0))
    assert value == 5.0 and grads.tolist() == [0.0, 2.0, 8.0] and finite
    ```
    """
    if not callable(fn):
        raise TypeError(f"Expected a callable `fn`, got {fn!r} instead.")
    bad = isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, int)
    if bad or redo_on_nan < 0:
        raise ValueError(
            f"Expected a non-negative int `redo_on_nan`, got {redo_on_nan!r} instead."
        )
    return _ScaledValueAndGrad(fn, bool(has_aux), redo_on_nan)
