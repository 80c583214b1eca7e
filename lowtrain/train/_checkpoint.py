"""Checkpoints: atomic writes, checksums, and validation against the state loaded into.

A checkpoint file holds only arrays. Its layout:

    MAGIC (16 bytes)
    header length (8 bytes, little endian)
    header (JSON, utf-8)
    array bytes, one array after the other, each in C order
    SHA-256 of everything above (32 bytes)

The header lists each array leaf of the state (`eqx.partition(state, eqx.is_array)`)
in flattening order: its path (`jax.tree_util.keystr`), dtype, shape, offset and size
in the array bytes. PRNG keys are stored as their `jax.random.key_data`. Everything that
is not an array (the tree structure, activation functions, static hyperparameters) comes
from the state passed to `load_checkpoint`, so nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

MAGIC = b"LOWTRAIN-CKPT-1\n"
_FORMAT = 1
_DIGEST = 32  # bytes of SHA-256
_NAME = re.compile(r"^ckpt_(\d+)\.lowtrain$")


def checkpoint_path(directory, step: int) -> pathlib.Path:
    """The file name `fit` gives the checkpoint of step `step`."""
    return pathlib.Path(directory) / f"ckpt_{step:08d}.lowtrain"


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(x) -> np.ndarray:
    if _is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise ValueError(
                "Expected the state's arrays to be replicated (as `lowtrain.Trainer` "
                f"keeps them), got one sharded as {x.sharding} instead."
            )
        x = x.addressable_data(0)  # every process holds a full copy
    return np.ascontiguousarray(np.asarray(x))


def _leaves(state: PyTree):
    dynamic = eqx.filter(state, eqx.is_array)
    return jax.tree_util.tree_flatten_with_path(dynamic)[0]


def _describe(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _write_file(path: pathlib.Path, chunks) -> None:
    """Write `chunks` (bytes) to `path`, then flush and fsync it."""
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path, state: PyTree) -> pathlib.Path:
    """Write the arrays of `state` to `path` atomically.

    The file is written to a temporary file in the same directory, flushed and
    fsync'ed, then renamed over `path` (`os.replace`), so a process killed while
    writing leaves any previous file at `path` intact. The format (see
    `lowtrain/train/_checkpoint.py`) holds every array leaf with its path, dtype and
    shape, and a SHA-256 checksum; non-array leaves are not saved. Returns `path`.

    ```python
    import pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = pathlib.Path(tempfile.mkdtemp()) / "state.lowtrain"
    lowtrain.save_checkpoint(path, {"w": jnp.ones(3), "step": jnp.int32(7)})
    like = {"w": jnp.zeros(3), "step": jnp.int32(0)}
    assert int(lowtrain.load_checkpoint(path, like)["step"]) == 7
    ```
    """
    path = pathlib.Path(path)
    leaves, entries, offset = [], [], 0
    for key_path, x in _leaves(state):
        data = _to_host(x)
        entries.append(
            {
                "path": jax.tree_util.keystr(key_path),
                "dtype": str(x.dtype),
                "shape": list(x.shape),
                "offset": offset,
                "nbytes": data.nbytes,
            }
        )
        leaves.append(data)
        offset += data.nbytes
    header = json.dumps({"format": _FORMAT, "leaves": entries}).encode()
    hasher = hashlib.sha256()

    def chunks():
        for chunk in (MAGIC, len(header).to_bytes(8, "little"), header, *leaves):
            chunk = memoryview(chunk).cast("B")
            hasher.update(chunk)
            yield chunk
        yield hasher.digest()

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        _write_file(tmp, chunks())
        os.replace(tmp, path)  # atomic on POSIX and Windows
    finally:
        tmp.unlink(missing_ok=True)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def _read(path: pathlib.Path) -> tuple[dict, memoryview]:
    raw = path.read_bytes()
    if not raw.startswith(MAGIC):
        raise ValueError(
            f"Expected a lowtrain checkpoint at {path} (a file starting with "
            f"{MAGIC!r}), got a file starting with {raw[: len(MAGIC)]!r} instead. "
            "Pass a file written by `lowtrain.save_checkpoint` or `Trainer.fit`."
        )
    body, stored = raw[:-_DIGEST], raw[-_DIGEST:]
    actual = hashlib.sha256(body).digest()
    if len(raw) < len(MAGIC) + 8 + _DIGEST or actual != stored:
        raise ValueError(
            f"Checkpoint {path} is corrupt: expected SHA-256 {stored.hex()[:16]}..., "
            f"got {actual.hex()[:16]}... instead: the file was truncated or changed "
            "after it was written. Delete it and load an earlier checkpoint (`fit` "
            "keeps the last `keep_checkpoints` in its `checkpoint_dir`)."
        )
    start = len(MAGIC) + 8
    size = int.from_bytes(raw[len(MAGIC) : start], "little")
    header = json.loads(raw[start : start + size])
    if header.get("format") != _FORMAT:
        raise ValueError(
            f"Expected checkpoint format {_FORMAT} in {path}, got "
            f"{header.get('format')!r} instead. Load it with the lowtrain version "
            "that wrote it."
        )
    return header, memoryview(body)[start + size :]


def load_checkpoint(path, like: PyTree) -> PyTree:
    """Read the checkpoint at `path` into a pytree shaped like `like`.

    `like` gives everything but the array values: the tree structure, the non-array
    leaves, and each array's expected path, dtype, shape and placement (the values
    are put on `like`'s shardings). Raises `ValueError` if the file is not a lowtrain
    checkpoint, is corrupt (its SHA-256 checksum does not match), or does not match
    `like` (naming the first array whose path, dtype or shape differs).

    ```python
    import pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = lowtrain.save_checkpoint(
        pathlib.Path(tempfile.mkdtemp()) / "w.lowtrain", {"w": jnp.ones(2)}
    )
    try:
        lowtrain.load_checkpoint(path, {"w": jnp.ones(3)})
    except ValueError as e:
        message = str(e)
    assert "expected float32[3], got float32[2]" in message
    ```
    """
    path = pathlib.Path(path)
    header, data = _read(path)
    saved, expected = header["leaves"], _leaves(like)
    fix = (
        "Load it into a state built exactly as the one that was saved (same model, "
        "optimizer, policy and loss scale), or start a new run in another directory."
    )
    paths = [jax.tree_util.keystr(p) for p, _ in expected]
    for i in range(max(len(saved), len(expected))):
        want = (
            f"`{paths[i]}` {_describe(str(expected[i][1].dtype), expected[i][1].shape)}"
            if i < len(expected)
            else "no more arrays"
        )
        got = (
            f"`{saved[i]['path']}` {_describe(saved[i]['dtype'], saved[i]['shape'])}"
            if i < len(saved)
            else "no more arrays"
        )
        if i >= len(expected) or i >= len(saved) or paths[i] != saved[i]["path"]:
            raise ValueError(
                f"Checkpoint {path} does not match the structure of the state it is "
                f"loaded into: at array {i} expected {want}, got {got} instead "
                f"({len(expected)} arrays expected, {len(saved)} in the file). {fix}"
            )
        if want != got:
            raise ValueError(
                f"Checkpoint {path} does not match the state it is loaded into at "
                f"`{paths[i]}`: expected {want.split(' ', 1)[1]}, got "
                f"{got.split(' ', 1)[1]} instead. {fix}"
            )
    values = []
    for (_, x), entry in zip(expected, saved):
        dtype = jax.random.key_data(x).dtype if _is_key(x) else x.dtype
        buf = data[entry["offset"] : entry["offset"] + entry["nbytes"]]
        value = np.frombuffer(buf, dtype=dtype).copy()
        if _is_key(x):
            value = jax.random.wrap_key_data(
                value.reshape(jax.random.key_data(x).shape), impl=jax.random.key_impl(x)
            )
        else:
            value = value.reshape(x.shape)
        if isinstance(x, jax.Array):
            value = jax.device_put(value, x.sharding)
        values.append(value)
    dynamic, static = eqx.partition(like, eqx.is_array)
    treedef = jax.tree.structure(dynamic)
    return eqx.combine(jax.tree.unflatten(treedef, values), static)


def latest_checkpoint(directory) -> pathlib.Path | None:
    """The checkpoint with the highest step in `directory` that `fit` wrote, or None.

    Only complete files named `ckpt_<step>.lowtrain` count; temporary files left by
    an interrupted write are ignored. The file is not read (see `load_checkpoint`).

    ```python
    import tempfile
    import lowtrain

    assert lowtrain.latest_checkpoint(tempfile.mkdtemp()) is None
    ```
    """
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def list_checkpoints(directory) -> list[tuple[int, pathlib.Path]]:
    """(step, path) of every checkpoint `fit` wrote in `directory`, oldest first."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune_checkpoints(directory, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints in `directory`, and temporary
    files that an interrupted write left (one process writes to a directory)."""
    for _, p in list_checkpoints(directory)[:-keep]:
        p.unlink(missing_ok=True)
    for p in pathlib.Path(directory).glob("ckpt_*.lowtrain.tmp*"):
        if not p.name.endswith(f".tmp{os.getpid()}"):
            p.unlink(missing_ok=True)
