"""`async_filter_jit`: `eqx.filter_jit`'s calling convention (arrays traced, every
other leaf static) with JAX's asynchronous dispatch kept.

Equinox 0.13's `filter_jit` waits for every call's results before it returns (to
report `eqx.error_if` failures where they happen), so a training loop built on it
runs the host and the device in turn: the host's work per step (the next batch, its
copy to the device, reading the last loss) adds to every step instead of overlapping
it. On a GPU step of a few milliseconds that cost 20-30% (docs/performance.md). The
Trainer's step has no `eqx.error_if`, so it does not need that wait.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

_ARRAY = object()  # in a static key: "an array was here"
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)  # what `eqx.is_array` accepts

# `donate` -> what `_AsyncJit._run` donates of (static key, first, rest, fn arrays).
_DONATE = {"none": (), "all-except-first": (2,)}


class _Static(eqx.Module):
    """The non-array part of an output: a pytree with no leaves, carried out of the
    jitted function in its output structure."""

    key: Any = eqx.field(static=True)


def _split(tree: PyTree) -> tuple[list, tuple]:
    """`(arrays, key)`: the leaves of `tree` that are arrays (None elsewhere), and a
    hashable key for the rest (its structure and its non-array leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(x, _ARRAY_TYPES) for x in leaves]  # `eqx.is_array`
    arrays = [x if a else None for x, a in zip(leaves, is_array)]
    static = tuple(_ARRAY if a else x for x, a in zip(leaves, is_array))
    return arrays, (treedef, static)


def _join(arrays: list, key: tuple) -> PyTree:
    treedef, static = key
    leaves = [a if s is _ARRAY else s for a, s in zip(arrays, static, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


class _AsyncJit:
    def __init__(self, fn: Callable, donate: str):
        self.fn = fn
        self.donate = donate
        # A callable pytree (an `eqx.Module`) has its arrays traced, never donated.
        self._fn_arrays, self._fn_key = _split(fn)
        self._jitted = jax.jit(
            self._run, static_argnums=0, donate_argnums=_DONATE[donate]
        )

    def _run(self, key, first_arrays, rest_arrays, fn_arrays):
        first_key, rest_key = key
        fn = _join(fn_arrays, self._fn_key)
        args, kwargs = _join(rest_arrays, rest_key)
        out = fn(_join(first_arrays, first_key), *args, **kwargs)
        out_arrays, out_key = _split(out)
        return out_arrays, _Static(out_key)

    def __get__(self, instance, owner):
        # As a method's decorator: `instance.method(x)` is `self(instance, x)`.
        return self if instance is None else functools.partial(self, instance)

    def _arguments(self, args, kwargs):
        if not args:
            raise TypeError(
                f"Expected at least one positional argument to {self!r}, got none. "
                "Call it as the function it wraps is called."
            )
        first_arrays, first_key = _split(args[0])
        rest_arrays, rest_key = _split((args[1:], kwargs))
        return (first_key, rest_key), first_arrays, rest_arrays

    def __call__(self, *args, **kwargs):
        key, first, rest = self._arguments(args, kwargs)
        try:
            with warnings.catch_warnings():
                # Donated buffers that no output can reuse (an int counter, say):
                # nothing to act on, as `eqx.filter_jit(donate="all...")` says.
                warnings.filterwarnings(
                    "ignore", message="Some donated buffers were not usable"
                )
                out_arrays, out_static = self._jitted(key, first, rest, self._fn_arrays)
        except ValueError as e:
            if "Non-hashable static arguments" not in str(e):
                raise
            raise TypeError(
                f"Expected every non-array leaf of the arguments of {self!r} to be "
                "hashable (it is compiled in as a constant), got an unhashable one "
                f"instead ({e}). Make it an array, or a hashable value (a tuple "
                "rather than a list)."
            ) from e
        return _join(out_arrays, out_static.key)

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """`jax.jit(...).lower` for these arguments: `.compile()`, `.as_text()`."""
        key, first, rest = self._arguments(args, kwargs)
        return self._jitted.lower(key, first, rest, self._fn_arrays)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"async_filter_jit({name}, donate={self.donate!r})"


def async_filter_jit(
    fn: Callable[..., Any],
    *,
    donate: Literal["none", "all-except-first"] = "none",
) -> Callable[..., Any]:
    """`fn` compiled as `eqx.filter_jit` compiles it, returning without waiting for
    the device.

    Every array leaf of the arguments (JAX or NumPy) is traced, every other leaf is
    static (compiled in; it must be hashable), and `fn`'s outputs may hold non-array
    leaves too, as with `eqx.filter_jit`. The arrays of `fn` itself, if it is a
    pytree (an `eqx.Module`), are traced too (never donated), and it decorates
    methods. Unlike `eqx.filter_jit` (Equinox 0.13), which waits for each call's
    results, the call returns as soon as the computation is queued (JAX's
    asynchronous dispatch), so the host prepares the next step while the device runs
    this one. `eqx.error_if` failures inside `fn` then surface at the
    next read of a result rather than at the call. `donate="all-except-first"`
    donates every array of the arguments after the first (the state of a train step
    called as `step(batch, state)`); `Trainer.compiled_step` is built with it.
    `.lower(*args)` gives JAX's `Lowered` (`.compile()`, `.as_text()`).

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from lowtrain.train import async_filter_jit

    model = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.key(0))  # holds jax.nn.relu

    @async_filter_jit
    def predict(model, x):
        return jax.vmap(model)(x)

    y = predict(model, jnp.ones((16, 4)))  # returns before the device is done
    assert y.shape == (16, 1)
    assert jnp.allclose(y, eqx.filter_jit(predict.fn)(model, jnp.ones((16, 4))))
    ```
    """
    if donate not in _DONATE:
        raise ValueError(
            f"Expected `donate` in {tuple(_DONATE)}, got {donate!r} instead. Use "
            "'all-except-first' to donate the arrays of every argument but the "
            "first (a train step's state), or 'none'."
        )
    if not callable(fn):
        raise TypeError(
            f"Expected a function to compile, got {type(fn).__name__} instead. "
            "Pass the function itself: `async_filter_jit(step)`."
        )
    return _AsyncJit(fn, donate)
