"""Metrics: the JSONL log, the learning rate, the gradient norm."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree


def global_norm(tree: PyTree) -> Float[Array, ""]:
    """The L2 norm of all float arrays of `tree`, summed in float32."""
    # In f32: the squares of f16 gradients overflow f16 long before the norm does.
    squares = [
        jnp.sum(jnp.square(x.astype(jnp.float32)))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


def learning_rate(
    opt_state: PyTree, schedule: Callable | float | None, applied: int
) -> float | None:
    """The learning rate of the most recent applied update, if it can be known.

    From an `optax.inject_hyperparams` state's `hyperparams["learning_rate"]` if the
    optimizer has one; else `schedule(applied - 1)` for a schedule (`schedule(0)` before
    any update), `schedule` itself for a number, and None without either.
    """

    def is_injected(x):
        return isinstance(getattr(x, "hyperparams", None), dict)

    for s in jax.tree.leaves(opt_state, is_leaf=is_injected):
        if is_injected(s) and "learning_rate" in s.hyperparams:
            # Under transform="scalify" it is a ScaledArray.
            return float(np.asarray(s.hyperparams["learning_rate"]))
    if schedule is None:
        return None
    if callable(schedule):
        return float(schedule(max(applied - 1, 0)))
    return float(schedule)


def to_json(value):
    """A JSON-ready copy of a metric: Python numbers, lists and dicts."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if hasattr(value, "tolist"):  # numpy and JAX arrays and scalars
        return value.tolist()
    return value


class JsonlWriter:
    """Appends one JSON object per line to `path`, flushed after each.

    Non-finite floats are written as `NaN` / `Infinity`, as Python's `json` does.
    """

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(to_json(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
