"""Metrics: the JSONL log, the learning rate, the gradient norm, the weighted mean
of eval metrics."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

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
    return _rate(_find_injected(opt_state)[1], schedule, applied)


def _is_injected(x) -> bool:  # an `optax.inject_hyperparams` state
    return isinstance(getattr(x, "hyperparams", None), dict)


def _has_learning_rate(x) -> bool:
    return _is_injected(x) and "learning_rate" in x.hyperparams


def _find_injected(opt_state: PyTree) -> tuple[tuple | None, Any]:
    """`(key path, state)` of the first `inject_hyperparams` state with a learning
    rate in `opt_state` (in `jax.tree.leaves` order), or `(None, None)`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)
    return next(((p, x) for p, x in flat if _has_learning_rate(x)), (None, None))


def _at(tree: PyTree, path: tuple):
    """The subtree of `tree` at `path` (keys as `tree_flatten_with_path` gives
    them), or None where a key does not apply."""
    try:
        for key in path:
            if isinstance(key, jax.tree_util.GetAttrKey):
                tree = getattr(tree, key.name)
            elif isinstance(key, jax.tree_util.SequenceKey):
                tree = tree[key.idx]
            elif isinstance(key, jax.tree_util.DictKey):
                tree = tree[key.key]
            else:  # FlattenedIndexKey: no way in but flattening
                return None
    except (AttributeError, LookupError, TypeError):
        return None
    return tree


def _rate(injected, schedule, applied: int) -> float | None:
    if injected is not None:
        # Under the Scalify precision it is a ScaledArray.
        return float(np.asarray(injected.hyperparams["learning_rate"]))
    if schedule is None:
        return None
    if callable(schedule):
        return float(schedule(max(applied - 1, 0)))
    return float(schedule)


class LearningRates:
    """`learning_rate(opt_state, schedule, applied)` for the optimizer states of
    one Trainer, called as `rates(opt_state, schedule, applied)`. Its states share
    one structure, so where their `inject_hyperparams` state is (or that they have
    none) is found once, not by walking the whole state (moments as large as the
    model) at every log; it is searched anew if it is not where it was found."""

    def __init__(self):
        self._path: tuple | None = None
        self._searched = False

    def __call__(
        self, opt_state: PyTree, schedule: Callable | float | None, applied: int
    ) -> float | None:
        injected = None if self._path is None else _at(opt_state, self._path)
        moved = self._path is not None and not _has_learning_rate(injected)
        if moved or not self._searched:
            self._path, injected = _find_injected(opt_state)
            self._searched = True
        return _rate(injected, schedule, applied)


def to_json(value):
    """A JSON-ready copy of a metric: Python numbers, lists and dicts."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if hasattr(value, "tolist"):  # numpy and JAX arrays and scalars
        return value.tolist()
    return value


def read_jsonl(path) -> list[dict]:
    """The records of a JSONL file, skipping a torn last line (a process killed
    while writing it): every complete line is one JSON object."""
    records = []
    path = pathlib.Path(path)
    if not path.exists():
        return records
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # the torn last line
            raise ValueError(
                f"Expected one JSON object per line in {path}, got a broken line "
                f"{i + 1} instead: {line[:80]!r}. Fix or move the file."
            ) from None
    return records


class JsonlWriter:
    """Appends one JSON object per line to `path`, flushed after each.

    Non-finite floats are written as `NaN` / `Infinity`, as Python's `json` does.
    With `after_step` (a run that goes on from that step), the file is first made
    one row per step again: a torn last line is dropped, and the rows of later
    steps (written before a crash, and about to be written again) are moved to
    `<path>.replaced`, so nothing is lost.
    """

    def __init__(self, path, after_step: int | None = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if after_step is not None and self.path.exists():
            self._repair(after_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def _repair(self, after_step: int) -> None:
        records = read_jsonl(self.path)
        keep = [r for r in records if r.get("step", 0) <= after_step]
        later = [r for r in records if r.get("step", 0) > after_step]
        text = "".join(json.dumps(r) + "\n" for r in keep)
        if text == self.path.read_text(encoding="utf-8"):
            return
        if later:
            with open(f"{self.path}.replaced", "a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in later)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        temp.write_text(text, encoding="utf-8")
        temp.replace(self.path)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(to_json(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def batch_size(batch: PyTree) -> int:
    """The number of examples of a batch: the leading axis of its first leaf."""
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves else 0


def mean_metrics(evaluate: Callable[[PyTree], dict], data: Iterable[PyTree]) -> dict:
    """The mean of each metric `evaluate(batch)` returns over the batches of `data`,
    each batch weighted by its number of examples (the leading axis of its first
    leaf; 1 for a batch without one)."""
    totals: dict[str, float] = {}
    count = 0
    for batch in data:
        metrics = evaluate(batch)
        if not isinstance(metrics, dict):
            raise TypeError(
                "Expected `evaluate` to return a dict of scalars such as "
                f"{{'loss': loss}}, got {type(metrics).__name__} instead."
            )
        weight = max(batch_size(batch), 1)
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + weight * float(value)
        count += weight
    if not count:
        raise ValueError("Expected at least one batch in the eval data, got none.")
    return {name: total / count for name, total in totals.items()}
