"""Checkpoints on orbax-checkpoint: sharded, multi-process, atomic, checked on load.

A checkpoint is an orbax directory with two items:

    arrays/  every array leaf of the state (`eqx.filter(state, eqx.is_array)`) in
             flattening order, as a list; PRNG keys as their `jax.random.key_data`.
             Orbax writes each array's shards from the processes that hold them
             (one replica each) and restores them straight into the target shardings.
    meta/    JSON: the format number and, for each array, its path
             (`jax.tree_util.keystr`), dtype and shape.

Everything that is not an array (the tree structure, activation functions, static
hyperparameters) comes from the state passed to `load_checkpoint`, so nothing is
unpickled. Before orbax reads any array, `meta` is compared with that state, and a
mismatch names the first differing array. Orbax writes into a temporary directory and
renames it when every process is done, so a process killed mid-save leaves only
complete checkpoints under their final names. The single-file `.lowtrain` format of
lowtrain 0.1 is not read any more.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

_FORMAT = 2  # 1: the single-file `.lowtrain` format of lowtrain 0.1
_PREFIX = "ckpt"  # `fit` names its checkpoints ckpt_<step, 8 digits>
_NAME = re.compile(rf"^{_PREFIX}_(\d+)$")
_FIX = (
    "Load it into a state built exactly as the one that was saved (same model, "
    "optimizer, policy and loss scale), or start a new run in another directory."
)


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _leaves(state: PyTree) -> list[tuple[str, Any]]:
    dynamic = eqx.filter(state, eqx.is_array)
    flat = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    return [(jax.tree_util.keystr(path), x) for path, x in flat]


def _describe(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _meta(state: PyTree) -> dict:
    return {
        "format": _FORMAT,
        "leaves": [
            {"path": p, "dtype": str(x.dtype), "shape": list(x.shape)}
            for p, x in _leaves(state)
        ],
    }


def _save_args(state: PyTree) -> ocp.args.Composite:
    arrays = [jax.random.key_data(x) if _is_key(x) else x for _, x in _leaves(state)]
    return ocp.args.Composite(
        arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(_meta(state))
    )


def _check(path: pathlib.Path, meta: dict, like: PyTree) -> None:
    """Raise `ValueError` naming the first array where `meta` and `like` differ."""
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"Expected checkpoint format {_FORMAT} in {path}, got "
            f"{meta.get('format')!r} instead. Load it with the lowtrain version "
            "that wrote it."
        )
    saved, expected = meta["leaves"], _leaves(like)
    for i in range(max(len(saved), len(expected))):
        want = got = "no more arrays"
        if i < len(expected):
            x = expected[i][1]
            want = f"`{expected[i][0]}` {_describe(str(x.dtype), x.shape)}"
        if i < len(saved):
            entry = saved[i]
            got = f"`{entry['path']}` {_describe(entry['dtype'], entry['shape'])}"
        if i >= len(expected) or i >= len(saved) or expected[i][0] != saved[i]["path"]:
            raise ValueError(
                f"Checkpoint {path} does not match the structure of the state it is "
                f"loaded into: at array {i} expected {want}, got {got} instead "
                f"({len(expected)} arrays expected, {len(saved)} in the checkpoint). "
                f"{_FIX}"
            )
        if want != got:
            raise ValueError(
                f"Checkpoint {path} does not match the state it is loaded into at "
                f"`{expected[i][0]}`: expected {want.split(' ', 1)[1]}, got "
                f"{got.split(' ', 1)[1]} instead. {_FIX}"
            )


def _restore_args(like: PyTree) -> ocp.args.Composite:
    """Orbax's targets: each array's shape, dtype and sharding from `like`."""
    targets = []
    for _, x in _leaves(like):
        if _is_key(x):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array):
            targets.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding))
        else:  # a numpy array: restored as one, on every process
            targets.append(np.zeros_like(x))
    return ocp.args.Composite(
        arrays=ocp.args.StandardRestore(targets), meta=ocp.args.JsonRestore()
    )


def _rebuild(like: PyTree, values: list) -> PyTree:
    out = []
    for (_, x), value in zip(_leaves(like), values):
        if _is_key(x):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(x))
        out.append(value)
    dynamic, static = eqx.partition(like, eqx.is_array)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(dynamic), out), static)


def _read_meta(path: pathlib.Path, checkpointer) -> dict:
    if path.is_file():
        raise ValueError(
            f"Expected a checkpoint directory written by lowtrain (orbax), got the "
            f"file {path} instead. Single-file `.lowtrain` checkpoints of lowtrain "
            "0.1 are no longer read: load it with lowtrain 0.1, or train anew."
        )
    try:
        meta = checkpointer.restore(
            path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
    except (FileNotFoundError, KeyError):  # no checkpoint, or no `meta` item
        meta = None
    if not isinstance(meta, dict):
        raise ValueError(
            f"Expected a lowtrain checkpoint at {path} (an orbax directory with the "
            "items `arrays` and `meta`), got none there. Pass a directory written by "
            "`lowtrain.save_checkpoint` or `Trainer.fit`."
        )
    return meta


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_checkpoint(path, state: PyTree) -> pathlib.Path:
    """Write the arrays of `state` to the checkpoint directory `path`, and return it.

    Every process of a multi-process run must call it with the same `path` and its
    part of the same state: orbax writes each shard once, from a process that holds
    it. The checkpoint is written to a temporary directory and renamed to `path`
    when complete (an existing checkpoint at `path` is deleted first). It holds each
    array leaf with its path, dtype and shape (see `lowtrain/train/_checkpoint.py`);
    non-array leaves are not saved.

    ```python
    import pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = pathlib.Path(tempfile.mkdtemp()) / "state"
    lowtrain.save_checkpoint(path, {"w": jnp.ones(3), "step": jnp.int32(7)})
    like = {"w": jnp.zeros(3), "step": jnp.int32(0)}
    assert int(lowtrain.load_checkpoint(path, like)["step"]) == 7
    ```
    """
    path = pathlib.Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _checkpointer() as checkpointer:
        checkpointer.save(path, args=_save_args(state), force=True)
    return path


def load_checkpoint(path, like: PyTree) -> PyTree:
    """Read the checkpoint directory `path` into a pytree shaped like `like`.

    `like` gives everything but the array values: the tree structure, the non-array
    leaves, and each array's expected path, dtype, shape and sharding (orbax reads
    each process's shards straight into `like`'s shardings, which may differ from
    those saved, e.g. another number of devices). Raises `ValueError`, before any
    array is read, if `path` is not a lowtrain checkpoint or does not match `like`
    (naming the first array whose path, dtype or shape differs).

    ```python
    import pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = lowtrain.save_checkpoint(
        pathlib.Path(tempfile.mkdtemp()) / "w", {"w": jnp.ones(2)}
    )
    try:
        lowtrain.load_checkpoint(path, {"w": jnp.ones(3)})
    except ValueError as e:
        message = str(e)
    assert "expected float32[3], got float32[2]" in message
    ```
    """
    path = pathlib.Path(path).resolve()
    with _checkpointer() as checkpointer:
        _check(path, _read_meta(path, checkpointer), like)
        restored = checkpointer.restore(path, args=_restore_args(like))
    return _rebuild(like, restored["arrays"])


def latest_checkpoint(directory) -> pathlib.Path | None:
    """The checkpoint with the highest step in `directory` that `fit` wrote, or None.

    Only complete checkpoints (directories named `ckpt_<step>`) count; the temporary
    directories an interrupted save leaves are ignored. Nothing is read (see
    `load_checkpoint`).

    ```python
    import tempfile
    import lowtrain

    assert lowtrain.latest_checkpoint(tempfile.mkdtemp()) is None
    ```
    """
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def list_checkpoints(directory) -> list[tuple[int, pathlib.Path]]:
    """(step, path) of every complete checkpoint `fit` wrote in `directory`, oldest
    first."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


class Checkpoints:
    """The checkpoints `Trainer.fit` writes: an orbax `CheckpointManager` on
    `directory` keeping the newest `keep`, or nothing if `directory` is None.

    `save(step, state)` is called by every process. With `asynchronous`, it returns
    once the arrays are copied to host memory and orbax writes them on a background
    thread; the next `save` and `close` wait for that write first.
    """

    def __init__(self, directory, keep: int, asynchronous: bool = False):
        self._manager = None
        if directory is None:
            return
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            step_prefix=_PREFIX,
            step_format_fixed_length=8,
            enable_async_checkpointing=bool(asynchronous),
            cleanup_tmp_directories=True,  # what a killed save left behind
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            pathlib.Path(directory).resolve(),
            options=options,
            item_names=("arrays", "meta"),
        )

    def save(self, step: int, state: PyTree) -> None:
        if self._manager is not None:
            self._manager.save(step, args=_save_args(state), force=True)

    def close(self) -> None:
        """Wait for a pending asynchronous save; release orbax's threads."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
