"""Checkpoints on orbax-checkpoint: sharded, multi-process, atomic, verified.

A checkpoint is an orbax directory with two items:

    arrays/  every array leaf of the state (`eqx.filter(state, eqx.is_array)`) in
             flattening order, as a list; PRNG keys as their `jax.random.key_data`.
             Orbax writes each array's shards from the processes that hold them
             (one replica each) and restores them straight into the target shardings.
    meta/    JSON: the format number; for each array its path
             (`jax.tree_util.keystr`), dtype, shape and checksum; and `extra`, what
             the caller stored beside the state (the recipes: their config, their
             data's fingerprint).

The checksum of an array is a Fletcher-style pair over its bytes read as 32-bit
words `w_i`: `(sum w_i, sum (i + 1) * w_i)` modulo 2**32, computed where the array
lives (on the devices that hold its shards, each process for its own, so a
multi-process save stays parallel). Any one flipped bit changes the first sum, a
swap of two words the second. Each process also records the CRC-32 of every file it
wrote (`lowtrain_files.process_<i>.json`), so damage anywhere in the checkpoint is
found, also in bytes a restore would not read. A save is read back and checked
before it counts (`Checkpoints`); a load is checked before its values are used,
and every float array must be finite. A mismatch raises `CheckpointCorruptError`
naming the checkpoint and the array (or file).

Everything that is not an array (the tree structure, activation functions, static
hyperparameters) comes from the state passed to `load_checkpoint`, so nothing is
unpickled. Before orbax reads any array, `meta` is compared with that state, and a
mismatch names the first differing array. Orbax writes into a temporary directory and
renames it when every process is done, so a process killed mid-save leaves only
complete checkpoints under their final names.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import zlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

_FORMAT = 3  # 1: single-file `.lowtrain`; 2: orbax without checksums
_PREFIX = "ckpt"  # `fit` names its checkpoints ckpt_<step, 8 digits>
_NAME = re.compile(rf"^{_PREFIX}_(\d+)$")
_CORRUPT = "corrupt_"  # a checkpoint that failed its check, set aside by `restore`
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


class CheckpointCorruptError(ValueError):
    """A checkpoint whose files or arrays cannot be read, do not match their
    checksums, or hold non-finite floats. The message names the checkpoint and the
    array or file; `Trainer.fit(resume=True)` sets such a checkpoint aside and
    resumes from the one before.

    ```python
    import pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = lowtrain.save_checkpoint(
        pathlib.Path(tempfile.mkdtemp()) / "c", {"w": jnp.ones(1000)}
    )
    chunk = max(path.rglob("d/*"), key=lambda f: f.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    chunk.write_bytes(bytes(data))
    try:
        lowtrain.load_checkpoint(path, {"w": jnp.zeros(1000)})
    except lowtrain.CheckpointCorruptError as e:
        assert str(path) in str(e)
    else:
        raise AssertionError("the flip was not found")
    ```
    """


log = logging.getLogger("lowtrain")


def _words(x: jax.Array) -> jax.Array:
    """The bytes of `x` as a flat array of unsigned words, widened to uint32 (one
    word per element of 1, 2 or 4 bytes; two per element of 8)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


def _fletcher(x) -> jax.Array:
    # `(sum w_i, sum (i + 1) * w_i)` mod 2**32 (see the module docstring).
    w = _words(x)
    i = jnp.arange(1, w.size + 1, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * i, dtype=jnp.uint32)])


@jax.jit
def _digests(arrays: list) -> tuple[list, list]:
    """Each array's checksum, and for each float array whether it is all finite."""
    sums = [_fletcher(x) for x in arrays]
    finite = [
        jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True
        for x in arrays
    ]
    return sums, finite


def _saved_arrays(state: PyTree) -> list:
    return [jax.random.key_data(x) if _is_key(x) else x for _, x in _leaves(state)]


def _checksums(arrays: list) -> list[list[int]]:
    sums, _ = _digests(arrays)
    # Replicated results: every process holds the whole pair.
    return [[int(v) for v in np.asarray(jax.device_get(s))] for s in sums]


def _meta(state: PyTree, arrays: list, extra: dict | None) -> dict:
    return {
        "format": _FORMAT,
        "leaves": [
            {
                "path": p,
                "dtype": str(x.dtype),
                "shape": list(x.shape),
                "checksum": sums,
            }
            for (p, x), sums in zip(_leaves(state), _checksums(arrays))
        ],
        "extra": extra or {},
    }


_FILES = "lowtrain_files"  # the file digests: lowtrain_files.process_<i>.json
_OWNER = re.compile(r"^ocdbt\.process_(\d+)$")


def _owner(relative: pathlib.Path) -> int:
    # The process that wrote a file of a checkpoint: its own `ocdbt.process_<i>`
    # folder's; process 0 for the files every process shares.
    for part in relative.parts:
        if m := _OWNER.match(part):
            return int(m.group(1))
    return 0


def _crc(file: pathlib.Path) -> int:
    value = 0
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            value = zlib.crc32(block, value)
    return value


def write_file_digests(path: pathlib.Path) -> None:
    """After a checkpoint at `path` is complete: each process records the CRC-32 of
    the files it wrote (process 0 also of the shared ones) in
    `lowtrain_files.process_<i>.json`, so that damage to any byte of any file, read
    by a restore or not, is found (`check_file_digests`)."""
    me = jax.process_index()
    files = {}
    for f in sorted(path.rglob("*")):
        relative = f.relative_to(path)
        if f.is_file() and not f.name.startswith(_FILES) and _owner(relative) == me:
            files[str(relative)] = _crc(f)
    record = {"processes": jax.process_count(), "crc32": files}
    with tempfile.NamedTemporaryFile(
        "w", dir=path, prefix=f".{_FILES}", delete=False, encoding="utf-8"
    ) as f:
        json.dump(record, f)
    pathlib.Path(f.name).replace(path / f"{_FILES}.process_{me}.json")


def _digest_record(path: pathlib.Path, record: pathlib.Path) -> dict:
    # A digests file as written (`write_file_digests`), or the checkpoint is corrupt.
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
        ok = isinstance(data.get("processes"), int) and isinstance(data["crc32"], dict)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, AttributeError) as e:
        data, ok, why = None, False, f"{type(e).__name__}: {e}"
    else:
        why = "not the fields lowtrain writes"
    if not ok or not all(isinstance(v, int) for v in data["crc32"].values()):
        raise CheckpointCorruptError(
            f"Checkpoint {path} is corrupt: its file digests {record.name} are "
            f"damaged ({why}). Resume from an earlier checkpoint "
            "(`Trainer.fit(resume=True)` does)."
        )
    return data


def check_file_digests(path: pathlib.Path) -> None:
    """Raise `CheckpointCorruptError` unless every file the digests of `path`
    record is there with its CRC-32 (see `write_file_digests`)."""
    first = path / f"{_FILES}.process_0.json"
    if not first.is_file():
        raise CheckpointCorruptError(
            f"Checkpoint {path} has no file digests ({first.name}): it was not "
            "completed and checked (a crash during the save?). Resume from an "
            "earlier checkpoint."
        )
    processes = _digest_record(path, first)["processes"]
    for i in range(processes):
        record = path / f"{_FILES}.process_{i}.json"
        if not record.is_file():
            raise CheckpointCorruptError(
                f"Checkpoint {path} lacks {record.name}: process {i} did not finish "
                "its part of the save. Resume from an earlier checkpoint."
            )
        crcs = _digest_record(path, record)["crc32"]
        for name, crc in crcs.items():
            file = path / name
            if not file.is_file() or _crc(file) != crc:
                how = "is missing" if not file.is_file() else "does not match its CRC"
                raise CheckpointCorruptError(
                    f"Checkpoint {path} is corrupt: its file {name} {how}. Resume "
                    "from an earlier checkpoint (`Trainer.fit(resume=True)` does)."
                )


def verify(path: pathlib.Path, meta: dict, arrays: list, finite: bool = True) -> None:
    """Raise `CheckpointCorruptError` unless every one of `arrays` (as read from the
    checkpoint at `path`) has the checksum `meta` holds for it and (with `finite`)
    every float one is finite."""
    sums, all_finite = _digests(arrays)
    for entry, got, ok in zip(meta["leaves"], sums, all_finite):
        got = [int(v) for v in np.asarray(jax.device_get(got))]
        if got != list(entry["checksum"]):
            raise CheckpointCorruptError(
                f"Checkpoint {path} is corrupt: the bytes of `{entry['path']}` "
                f"({_describe(entry['dtype'], entry['shape'])}) do not match the "
                f"checksum written with them ({entry['checksum']}, read {got}). Resume "
                "from an earlier checkpoint (`Trainer.fit(resume=True)` does)."
            )
        if finite and not bool(ok):
            raise CheckpointCorruptError(
                f"Checkpoint {path} holds non-finite values in `{entry['path']}`: a "
                "state that diverged was saved. Resume from an earlier checkpoint."
            )


def _check(path: pathlib.Path, meta: dict, like: PyTree) -> None:
    """Raise `ValueError` naming the first array where `meta` and `like` differ."""
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"Expected checkpoint format {_FORMAT} (with checksums) in {path}, got "
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


def _targets(arrays: list, host: bool = False) -> list:
    """Orbax's targets for `arrays`: each one's shape, dtype and sharding (with
    `host`, a NumPy array of its shape and dtype: read to host memory)."""
    targets = []
    for x in arrays:
        if isinstance(x, jax.Array) and not host:
            targets.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding))
        else:  # a numpy array: restored as one, on every process
            targets.append(np.zeros(x.shape, x.dtype))
    return targets


def _restore_args(like: PyTree) -> ocp.args.Composite:
    """Orbax's targets: each array's shape, dtype and sharding from `like`."""
    like_arrays = [
        jax.random.key_data(x) if _is_key(x) else x for _, x in _leaves(like)
    ]
    return ocp.args.Composite(
        arrays=ocp.args.StandardRestore(_targets(like_arrays)),
        meta=ocp.args.JsonRestore(),
    )


def _read_arrays(path: pathlib.Path, restore) -> Any:
    """`restore()` (orbax reading `path`), its failures named: a missing, truncated
    or undecodable file is a `CheckpointCorruptError` naming the checkpoint."""
    try:
        return restore()
    except Exception as e:  # tensorstore's and orbax's errors, re-raised as one kind
        raise CheckpointCorruptError(
            f"Checkpoint {path} could not be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no message'}): a file of it is "
            "missing, truncated or damaged. Resume from an earlier checkpoint "
            "(`Trainer.fit(resume=True)` does)."
        ) from e


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


def check_checkpoint_files(path: pathlib.Path) -> None:
    # Every file of a checkpoint checked against its digests before any is read. A
    # `fit` step folder (`ckpt_<step>`) or a folder with any part of a checkpoint is
    # one, damaged or not (an emptied step folder is corrupt); a path with nothing of
    # one is left to `_read_meta`'s error, which says what was expected.
    parts = ("meta", "arrays", f"{_FILES}.process_0.json")
    if path.is_dir() and (
        _NAME.match(path.name) or any((path / p).exists() for p in parts)
    ):
        check_file_digests(path)


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_checkpoint(path, state: PyTree, *, extra: dict | None = None) -> pathlib.Path:
    """Write the arrays of `state` to the checkpoint directory `path`, read them back
    and check them, and return `path`.

    Every process of a multi-process run must call it with the same `path` and its
    part of the same state: orbax writes each shard once, from a process that holds
    it. The checkpoint is written to a temporary directory and renamed to `path`
    when complete (an existing checkpoint at `path` is deleted first). It holds each
    array leaf with its path, dtype, shape and checksum (see
    `lowtrain/train/_checkpoint.py`), and `extra` (JSON data, read back by
    `checkpoint_extra`); non-array leaves are not saved. What was written is read
    again and checked against the checksums (`CheckpointCorruptError` if not).

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
    arrays = _saved_arrays(state)
    meta = _meta(state, arrays, extra)
    with _checkpointer() as checkpointer:
        checkpointer.save(path, args=_args(arrays, meta), force=True)
        _read_back(path, lambda a: checkpointer.restore(path, args=a), arrays, meta)
    write_file_digests(path)
    return path


def _args(arrays: list, meta: dict) -> ocp.args.Composite:
    return ocp.args.Composite(
        arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
    )


def _read_back(path: pathlib.Path, restore, arrays: list, meta: dict) -> None:
    """Read the arrays just saved from `path` (to host memory on one process, so
    the devices hold no second copy of the state; into their shardings on several)
    and check them against the checksums written (`restore(args)`: orbax's restore
    of that checkpoint)."""
    host = jax.process_count() == 1
    targets = ocp.args.StandardRestore(_targets(arrays, host=host))
    got = _read_arrays(path, lambda: restore(ocp.args.Composite(arrays=targets)))
    # The bytes only: a state with NaNs may be saved (to look at), not resumed from.
    verify(path, meta, got["arrays"], finite=False)


def load_checkpoint(path, like: PyTree) -> PyTree:
    """Read the checkpoint directory `path` into a pytree shaped like `like`.

    `like` gives everything but the array values: the tree structure, the non-array
    leaves, and each array's expected path, dtype, shape and sharding (orbax reads
    each process's shards straight into `like`'s shardings, which may differ from
    those saved, e.g. another number of devices). Raises `ValueError`, before any
    array is read, if `path` is not a lowtrain checkpoint or does not match `like`
    (naming the first array whose path, dtype or shape differs), and
    `CheckpointCorruptError` if an array cannot be read, does not match its
    checksum or holds non-finite floats (naming the array).

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
        check_checkpoint_files(path)  # every file, the metadata's too, first
        meta = _read_meta(path, checkpointer)
        _check(path, meta, like)
        restored = _read_arrays(
            path, lambda: checkpointer.restore(path, args=_restore_args(like))
        )
    verify(path, meta, restored["arrays"])
    return _rebuild(like, restored["arrays"])


def checkpoint_extra(path) -> dict:
    """The `extra` JSON data saved with the checkpoint at `path` (`{}` if none).

    ```python
    import pathlib, tempfile
    import jax.numpy as jnp
    import lowtrain

    path = pathlib.Path(tempfile.mkdtemp()) / "state"
    lowtrain.save_checkpoint(path, {"w": jnp.ones(2)}, extra={"vocab": "abc"})
    assert lowtrain.checkpoint_extra(path) == {"vocab": "abc"}
    ```
    """
    path = pathlib.Path(path).resolve()
    with _checkpointer() as checkpointer:
        check_checkpoint_files(path)
        return dict(_read_meta(path, checkpointer).get("extra") or {})


def latest_checkpoint(directory, *, check_files: bool = False) -> pathlib.Path | None:
    """The checkpoint with the highest step in `directory` that `fit` wrote, or None.

    Only complete checkpoints (directories named `ckpt_<step>`) count; the temporary
    directories an interrupted save leaves and symbolic links are ignored. Nothing
    is read (see `load_checkpoint`), unless `check_files`: then the newest whose
    every file matches the digests saved with it, a damaged one set aside (renamed
    `corrupt_ckpt_<step>`, with a warning) as `Trainer.fit(resume=True)` does.

    ```python
    import tempfile
    import lowtrain

    assert lowtrain.latest_checkpoint(tempfile.mkdtemp()) is None
    ```
    """
    found = list_checkpoints(directory)
    if not check_files:
        return found[-1][1] if found else None
    for _, path in reversed(found):
        try:
            check_file_digests(path)
            return path
        except CheckpointCorruptError as e:
            _set_aside(path, e)
    return None


def _set_aside(path: pathlib.Path, error: CheckpointCorruptError) -> None:
    # A damaged checkpoint, renamed: kept for a look, no longer a checkpoint.
    aside = path.with_name(_CORRUPT + path.name)
    if jax.process_index() == 0:
        path.rename(aside)
    log.warning("%s Set aside as %s; trying the one before.", error, aside.name)


_LINKS_SEEN: set[pathlib.Path] = set()  # said once per process


def list_checkpoints(directory) -> list[tuple[int, pathlib.Path]]:
    """(step, path) of every complete checkpoint `fit` wrote in `directory`, oldest
    first."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_symlink():
            # Never a checkpoint: loading or rotating it would reach outside the run.
            if p not in _LINKS_SEEN:
                _LINKS_SEEN.add(p)
                log.warning(
                    "%s is a symbolic link (to %s), not a checkpoint this run wrote: "
                    "ignored, never loaded nor deleted. Move it out of %s.",
                    p,
                    os.readlink(p),
                    directory,
                )
        elif m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _check_writable(directory: pathlib.Path) -> None:
    # Found now, not at the first save an hour into the run.
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        raise PermissionError(
            f"Expected a checkpoint directory this process can write, got {directory} "
            f"({e.strerror or e}). Fix its permissions or pass another directory."
        ) from None


class Checkpoints:
    """The checkpoints `Trainer.fit` writes in `directory` (nothing if it is None):
    `ckpt_<step>` directories written by orbax, each read back and checked against
    its checksums before it counts, and the newest `keep_checkpoints` checked ones
    kept (an older one is deleted only once a newer one has passed its check, so
    the newest checked checkpoint is never deleted).

    `save(step, state, extra)` is called by every process. With `asynchronous`, it
    returns once the arrays are copied to host memory and orbax writes them on a
    background thread; the check of that checkpoint runs at the next `save` or at
    `close`, which wait for the write first. A check that fails raises
    `CheckpointCorruptError`: the run stops rather than go on without a checkpoint.
    """

    def __init__(self, directory, keep_checkpoints: int, asynchronous: bool = False):
        self._manager = None
        self._keep = keep_checkpoints
        self._asynchronous = bool(asynchronous)
        self._pending: tuple[int, list, dict] | None = None  # saved, not yet checked
        if directory is None:
            return
        self.directory = pathlib.Path(directory).resolve()
        _check_writable(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotation is ours: only after a check passes
            step_prefix=_PREFIX,
            step_format_fixed_length=8,
            enable_async_checkpointing=bool(asynchronous),
            cleanup_tmp_directories=True,  # what a killed save left behind
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("arrays", "meta")
        )

    def save(
        self, step: int, state: PyTree, extra: dict | None = None
    ) -> pathlib.Path | None:
        """Save `state` as step `step`; return the checkpoint's path (None without a
        directory). Asynchronously, it is complete and checked at the next `save`
        or `close`."""
        if self._manager is None:
            return None
        self._check_pending()
        arrays = _saved_arrays(state)
        meta = _meta(state, arrays, extra)
        try:
            with _orbax_quiet():
                self._manager.save(step, args=_args(arrays, meta), force=True)
        except Exception as e:
            self._failed(step, e)
        self._pending = (step, arrays, meta)
        if not self._asynchronous:
            self._check_pending()
        return self.directory / f"{_PREFIX}_{step:08d}"

    def _check_pending(self) -> None:
        # Wait for the last save, read it back, and only then rotate.
        if self._pending is None:
            return
        step, arrays, meta = self._pending
        self._pending = None
        try:
            with _orbax_quiet():
                self._manager.wait_until_finished()
        except Exception as e:
            self._failed(step, e)
        path = self.directory / f"{_PREFIX}_{step:08d}"
        _read_back(path, lambda a: self._manager.restore(step, args=a), arrays, meta)
        write_file_digests(path)
        # The checkpoints this run wrote: folders, never a link to elsewhere.
        ours = [step for step, _ in list_checkpoints(self.directory)]
        for old in ours[: -self._keep]:
            self._manager.delete(old)

    def _failed(self, step: int, error: Exception) -> None:
        # A save that failed: a full disk is said in one sentence, its partial
        # folder removed (the checkpoints before it are complete and untouched);
        # anything else is raised as it is.
        if not _disk_full(error):
            raise error
        for partial in self.directory.glob(f"{_PREFIX}_{step:08d}*"):
            if partial.is_dir() and not partial.is_symlink():
                shutil.rmtree(partial, ignore_errors=True)
        kept = [p.name for _, p in list_checkpoints(self.directory)]
        raise OSError(
            errno.ENOSPC,
            f"No space left on device while saving step {step} to {self.directory}: "
            "the partial save was removed, the checkpoints before it are intact ("
            + (", ".join(kept) or "none")
            + "). Free space there (or pass a checkpoint folder with room) and "
            "resume.",
        ) from None

    def close(self) -> None:
        """Wait for a pending asynchronous save and check it; release orbax's
        threads."""
        if self._manager is not None:
            try:
                self._check_pending()
            finally:
                self._manager.close()
                self._manager = None


def _disk_full(error: BaseException) -> bool:
    # ENOSPC, as Python raises it or as TensorStore words it (orbax's writer).
    while error is not None:
        if getattr(error, "errno", None) == errno.ENOSPC:
            return True
        text = str(error)
        if "No space left on device" in text or "os_error_code='28'" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def _orbax_quiet():
    # Orbax logs each of its threads' exceptions (with tracebacks) on the `absl`
    # logger before raising the same one here, where it is reported once.
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def restore_latest(directory, like: PyTree) -> tuple[PyTree, pathlib.Path] | None:
    """The newest checkpoint in `directory` that passes its checks, loaded into
    `like`'s structure, and its path; None if `directory` holds no checkpoint.

    A newer checkpoint that fails (`CheckpointCorruptError`: unreadable, a checksum
    mismatch, non-finite values) is renamed `corrupt_ckpt_<step>` (kept, for a look,
    but no longer a checkpoint) and the next older one is tried, each with a warning
    on the `lowtrain` logger. If none passes, the last error is raised. (A
    checkpoint of another state, a `ValueError` of `load_checkpoint`, is raised at
    once: that is not damage.)"""
    found = list_checkpoints(directory)
    error = None
    for _, path in reversed(found):
        try:
            return load_checkpoint(path, like), path
        except CheckpointCorruptError as e:
            error = e
            _set_aside(path, e)
    if error is not None:
        raise CheckpointCorruptError(
            f"No checkpoint in {directory} passes its checks (the last: {error}). "
            "Start the run anew in another directory."
        ) from error
    return None
