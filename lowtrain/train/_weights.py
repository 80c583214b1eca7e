"""Weights in and out: the model alone from a training checkpoint (`load_model`),
and a model's arrays as a safetensors file (`save_safetensors`, `load_safetensors`).

A safetensors file names each array by its path in the model, the keys joined by
dots (`layers.0.weight` for `model.layers[0].weight`, `blocks.qkv.kernel`), and stores
it with its own dtype: bfloat16 as `BF16`, float8_e4m3fn as `F8_E4M3`, float8_e5m2 as
`F8_E5M2`, so PyTorch and the Hugging Face tools read the same values. Only array
leaves are written (`eqx.filter(model, eqx.is_array)`); the structure, activation
functions and static fields come from the model passed to `load_safetensors`, so
nothing is unpickled.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from ._checkpoint import (
    _FORMAT,
    CheckpointCorruptError,
    _checkpointer,
    _describe,
    _is_key,
    _read_arrays,
    _read_meta,
    check_checkpoint_files,
    list_checkpoints,
    verify,
)

# -- shared: the array leaves of a model, real or abstract -----------------------------


def _is_target(x) -> bool:
    # An array to fill, or its shape and dtype alone (`eqx.filter_eval_shape`).
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _targets(tree: PyTree) -> list[tuple[tuple, Any]]:
    """(key path, leaf) of every array (or `ShapeDtypeStruct`) leaf of `tree`, in
    flattening order."""
    dynamic = eqx.filter(tree, _is_target)
    return jax.tree_util.tree_flatten_with_path(dynamic)[0]


def _stored(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype of what is stored for `x`: its key data for a PRNG key."""
    if _is_key(x):
        return jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _place(value, like) -> Any:
    """`value` (what was stored for `like`: a host array, or a JAX array already in
    `like`'s sharding) as `like` holds it: a NumPy array for a NumPy leaf, a PRNG key
    of `like`'s implementation for a key, else a JAX array in `like`'s sharding (on
    the default device without one)."""
    sharding = getattr(like, "sharding", None)
    if _is_key(like):
        impl = jax.random.key_impl(
            like if isinstance(like, jax.Array) else jnp.zeros((), like.dtype)
        )
        key = jax.random.wrap_key_data(jnp.asarray(value), impl=impl)
        return key if sharding is None else jax.device_put(key, sharding)
    if isinstance(like, np.ndarray):
        return np.array(value, copy=True)
    if isinstance(value, jax.Array):  # orbax read it into `like`'s sharding
        return value
    if sharding is None:
        return jnp.asarray(value)
    # Every process holds all of `value`: each places its own shards.
    return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])


def _rebuild(like: PyTree, values: list) -> PyTree:
    dynamic, static = eqx.partition(like, _is_target)
    structure = jax.tree.structure(dynamic)
    return eqx.combine(jax.tree.unflatten(structure, values), static)


# -- the model alone from a training checkpoint ----------------------------------------

_LIKE = {"model": "like_model", "model_state": "like_state"}
_FIX = {
    "model": (
        "Build `like_model` as the `TrainState` holds it: the same architecture and "
        "sizes, its parameters in the stored dtype (the policy's `param_dtype`), e.g. "
        "`trainer.init(key=...).model`, or `precision.cast_params(model)`."
    ),
    "model_state": (
        "Build `like_state` as the `TrainState` holds it, e.g. "
        "`eqx.nn.make_with_state(Model)(...)[1]` with the same sizes."
    ),
}


def _field_entries(meta: dict, field: str) -> list[tuple[int, dict, str]]:
    """(index, entry, path within the field) of the arrays of `meta` that lie under
    the `TrainState` field `field` (`.model` but not `.model_state`)."""
    under = re.compile(rf"^\.{field}(?=$|[.\[])")
    return [
        (i, entry, entry["path"][len(field) + 1 :])
        for i, entry in enumerate(meta["leaves"])
        if under.match(entry["path"])
    ]


def _check_field(path, field: str, entries: list, like: PyTree) -> None:
    """Raise `ValueError` naming the first array where the checkpoint's arrays under
    `field` (`entries`) and those of `like` differ."""
    arg, fix = _LIKE[field], _FIX[field]
    expected = _targets(like)
    if expected and not entries:
        raise ValueError(
            f"Expected arrays under `.{field}` in checkpoint {path}, got none there: "
            "it is not the checkpoint of a `TrainState` that "
            + (
                "has a model (load other checkpoints with `lowtrain.load_checkpoint`)."
                if field == "model"
                else "has a `model_state`. Pass `like_state=None`."
            )
        )
    for i in range(max(len(entries), len(expected))):
        want = got = "no more arrays"
        if i < len(expected):
            key_path, x = expected[i]
            x_path = jax.tree_util.keystr(key_path)
            want = f"`{x_path}` {_describe(str(x.dtype), x.shape)}"
        if i < len(entries):
            entry, e_path = entries[i][1], entries[i][2]
            got = f"`{e_path}` {_describe(entry['dtype'], entry['shape'])}"
        if i >= len(expected) or i >= len(entries) or x_path != e_path:
            raise ValueError(
                f"Checkpoint {path} does not match the structure of `{arg}`: at "
                f"array {i} of `.{field}` expected {want}, got {got} instead "
                f"({len(expected)} arrays in `{arg}`, {len(entries)} under "
                f"`.{field}` in the checkpoint). {fix}"
            )
        if want != got:
            raise ValueError(
                f"Checkpoint {path} does not match `{arg}` at `{x_path}` "
                f"(`.{field}{x_path}` in the checkpoint): expected "
                f"{want.split(' ', 1)[1]}, got {got.split(' ', 1)[1]} instead. {fix}"
            )


_SKIP = ocp.PLACEHOLDER  # an array orbax does not read


def _restore_target(x) -> tuple[Any, Any]:
    """Orbax's (item, restore args) for the like leaf `x`: into `x`'s sharding for a
    JAX array (or a `ShapeDtypeStruct` with one), else to host memory."""
    stored = _stored(x)
    sharding = getattr(x, "sharding", None)
    if sharding is not None and not _is_key(x):
        item = jax.ShapeDtypeStruct(stored.shape, stored.dtype, sharding=sharding)
        return item, ocp.ArrayRestoreArgs(
            sharding=sharding, global_shape=stored.shape, dtype=stored.dtype
        )
    item = jax.ShapeDtypeStruct(stored.shape, stored.dtype)
    return item, ocp.RestoreArgs(restore_type=np.ndarray, dtype=stored.dtype)


def _resolve(path) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """The checkpoint `path` names (the newest `ckpt_<step>` in a folder of them)
    and the older checkpoints beside it."""
    path = pathlib.Path(path).resolve()
    if not path.exists():
        raise FileNotFoundError(
            f"Expected a lowtrain checkpoint directory, or a folder of them "
            f"(`ckpt_<step>`, as `Trainer.fit` writes), got {path}, which does not "
            "exist. Pass the `checkpoint_dir` of the run or one checkpoint in it."
        )
    found = [p for _, p in list_checkpoints(path)]
    return (found[-1], found[:-1]) if found else (path, [])


def load_model(path, like_model: PyTree, like_state: PyTree | None = None):
    """The model of a lowtrain training checkpoint, without its optimizer state.

    `path` is a checkpoint directory written by `lowtrain.save_checkpoint` or
    `Trainer.fit` (`<checkpoint_dir>/ckpt_<step>`), or a folder of them (a run's
    `checkpoint_dir`): then its newest, `lowtrain.latest_checkpoint(path)`. Only the
    arrays under the `TrainState`'s `model` field are read, and each is checked as
    `lowtrain.load_checkpoint` checks it: the checkpoint's file digests, then each
    array's checksum and that its floats are finite (`CheckpointCorruptError`
    naming the checkpoint and the array otherwise; the newest of a folder is not
    skipped: the message names the checkpoint before it, to pass instead).

    `like_model` gives everything but the values: the structure, the non-array
    leaves, and each array's dtype, shape and sharding, as the `TrainState` holds
    the model (parameters in the policy's `param_dtype`, e.g.
    `trainer.init(key=...).model`); its array leaves may be `jax.ShapeDtypeStruct`s
    (`eqx.filter_eval_shape`), so no second copy of the model is allocated. A
    mismatch raises `ValueError` before any array is read, naming the first array
    whose path, dtype or shape differs.

    With `like_state` (an `eqx.nn.State`, such as BatchNorm's running statistics),
    the arrays under the `TrainState`'s `model_state` field are read too, and
    `(model, state)` is returned.

    ```python
    import pathlib, tempfile
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    x = jnp.ones((8, 2))
    data = lowtrain.ArrayBatches({"x": x, "y": x.sum(1, keepdims=True)}, 4)
    trainer = Fit(eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.1))
    runs = pathlib.Path(tempfile.mkdtemp())
    state = trainer.fit(
        trainer.init(key=jax.random.key(1)), data, steps=2,
        checkpoint_dir=runs / "ckpt", progress=False,
    )
    like = eqx.nn.Linear(2, 1, key=jax.random.key(7))
    model = lowtrain.load_model(runs / "ckpt", like)
    assert (model.weight == state.model.weight).all()
    ```
    """
    path, older = _resolve(path)
    likes = {"model": like_model}
    if like_state is not None:
        likes["model_state"] = like_state
    try:
        with _checkpointer() as checkpointer:
            check_checkpoint_files(path)  # every file, the metadata's too, first
            meta = _read_meta(path, checkpointer)
            if meta.get("format") != _FORMAT:
                raise ValueError(
                    f"Expected checkpoint format {_FORMAT} (with checksums) in "
                    f"{path}, got {meta.get('format')!r} instead. Load it with the "
                    "lowtrain version that wrote it."
                )
            # For each field, the checkpoint's index of each of its like's leaves.
            indices = {}
            for field, like in likes.items():
                entries = _field_entries(meta, field)
                _check_field(path, field, entries, like)
                indices[field] = [i for i, _, _ in entries]
            leaf_of = {
                i: x
                for field, like in likes.items()
                for i, (_, x) in zip(indices[field], _targets(like))
            }
            # Orbax reads the arrays wanted and skips the placeholders (the
            # optimizer state, the step, the key, ...).
            targets = [
                _restore_target(leaf_of[i]) if i in leaf_of else (_SKIP, _SKIP)
                for i in range(len(meta["leaves"]))
            ]
            items, args = zip(*targets) if targets else ((), ())
            restore = ocp.args.PyTreeRestore(item=list(items), restore_args=list(args))
            restored = _read_arrays(
                path,
                lambda: checkpointer.restore(
                    path, args=ocp.args.Composite(arrays=restore)
                ),
            )["arrays"]
        wanted = sorted(leaf_of)
        verify(
            path,
            {"leaves": [meta["leaves"][i] for i in wanted]},
            [restored[i] for i in wanted],
        )
    except CheckpointCorruptError as e:
        if not older:
            raise
        raise CheckpointCorruptError(
            f"{e} To load the model of the checkpoint before it, pass its path: "
            f"{older[-1]}"
        ) from e
    out = [
        _rebuild(like, [_place(restored[i], leaf_of[i]) for i in indices[field]])
        for field, like in likes.items()
    ]
    return out[0] if like_state is None else tuple(out)


# -- safetensors -----------------------------------------------------------------------

# Each dtype safetensors stores, by its tag in the file. (Not int4 or float4: their
# NumPy arrays are not packed as safetensors packs them.)
_TAGS = {
    "BOOL": np.dtype(bool),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "C64": np.dtype(np.complex64),
}
_DTYPES = {dtype: tag for tag, dtype in _TAGS.items()}


def _safetensors():
    """The `safetensors` package, or an `ImportError` naming the extra."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "Expected the `safetensors` package for safetensors files, got none "
            "installed. Install it with `pip install 'lowtrain[safetensors]'`."
        ) from None
    return safetensors


def _key_name(key) -> str:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _named(model: PyTree) -> dict[str, tuple[str, Any]]:
    """`{name: (keystr path, leaf)}` of the array leaves of `model`, named by their
    key paths joined by dots (`layers.0.weight`), in flattening order."""
    named: dict[str, tuple[str, Any]] = {}
    for key_path, x in _targets(model):
        name = ".".join(_key_name(k) for k in key_path)
        path = jax.tree_util.keystr(key_path)
        if name in named:
            raise ValueError(
                f"Expected one array per safetensors name, got two named `{name}`: "
                f"`{named[name][0]}` and `{path}` (dict keys with dots in them?). "
                "Rename one of the keys."
            )
        named[name] = (path, x)
    return named


def _host(name: str, x) -> np.ndarray:
    """`x` as the host array that is stored: its key data for a PRNG key."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(
            f"Expected arrays this process holds whole, got `{name}` sharded across "
            "processes. Gather it first (`jax.experimental.multihost_utils."
            "process_allgather(model, tiled=True)`) and save from one process."
        )
    return np.asarray(x)


def save_safetensors(model: PyTree, path, *, metadata: dict | None = None):
    """Write the array leaves of `model` to the safetensors file `path` and return
    `path`.

    Each array is named by its path in `model`, the keys joined by dots
    (`layers.0.weight`), and stored bit for bit in its own dtype, tagged as
    safetensors tags it (`F32`, `F16`, `BF16`, `F8_E4M3` for float8_e4m3fn,
    `F8_E5M2`, integers, `BOOL`); a PRNG key as its `jax.random.key_data`.
    Non-array leaves are not written: `load_safetensors` takes them from the model
    it fills. `metadata` (str to str) goes into the file's header, where
    `safetensors.safe_open(path, "np").metadata()` reads it. The file is written
    beside `path` and renamed, so `path` is never half written. A dtype safetensors
    has no tag for (float8_e4m3b11fnuz, int4, ...) raises `TypeError`.

    ```python
    import pathlib, tempfile
    import equinox as eqx
    import jax
    import lowtrain

    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    model = lowtrain.Policy(param_dtype="bfloat16").cast_to_param(model)
    path = pathlib.Path(tempfile.mkdtemp()) / "model.safetensors"
    lowtrain.save_safetensors(model, path, metadata={"step": "100"})

    from safetensors import safe_open

    with safe_open(path, "np") as f:
        assert sorted(f.keys())[0] == "layers.0.bias"
        assert f.metadata() == {"step": "100"}
    ```
    """
    safetensors = _safetensors()
    path = pathlib.Path(path)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError(
            "Expected `metadata` to map strings to strings (safetensors' header "
            f"holds text), got {metadata!r} instead. Convert the values with "
            "`str` or `json.dumps`."
        )
    tensors = {}
    for name, (_, x) in _named(model).items():
        value = _host(name, x)
        if value.dtype not in _DTYPES:
            raise TypeError(
                f"Expected dtypes safetensors stores ({', '.join(map(str, _DTYPES))}), "
                f"got `{name}` of dtype {value.dtype} instead. Cast it first, e.g. "
                "`eqx.tree_at(lambda m: m.<the array>, model, replace_fn=lambda x: "
                "x.astype(jnp.float32))`."
            )
        # C order; a 0-d array stays 0-d (`np.ascontiguousarray` makes it 1-d).
        tensors[name] = np.asarray(value, order="C")
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    safetensors.numpy.save_file(tensors, temp, metadata=metadata)
    temp.replace(path)
    return path


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """`{name: array}` of the safetensors file `path`, each array of the dtype its
    tag names (`BF16` as bfloat16, `F8_E4M3` as float8_e4m3fn, ...)."""
    safetensors = _safetensors()
    try:
        raw = safetensors.deserialize(path.read_bytes())
    except safetensors.SafetensorError as e:
        raise ValueError(
            f"Expected a safetensors file at {path}, got one that cannot be read "
            f"({e}). Write it again with `lowtrain.save_safetensors`."
        ) from None
    arrays = {}
    for name, tensor in raw:
        if tensor["dtype"] not in _TAGS:
            raise TypeError(
                f"Expected a safetensors dtype lowtrain reads ({', '.join(_TAGS)}), "
                f"got {tensor['dtype']} for `{name}` in {path} instead."
            )
        dtype = _TAGS[tensor["dtype"]]
        arrays[name] = np.frombuffer(tensor["data"], dtype).reshape(tensor["shape"])
    return arrays


def load_safetensors(path, like_model: PyTree) -> PyTree:
    """The model shaped like `like_model` with the arrays of the safetensors file
    `path` (as `save_safetensors` names them: `layers.0.weight`).

    `like_model` gives the structure, the non-array leaves, and each array's name,
    dtype, shape and sharding (its array leaves may be `jax.ShapeDtypeStruct`s, from
    `eqx.filter_eval_shape`). Every name of `like_model` must be in the file and the
    file must hold no other; each array must have the dtype and shape of its leaf.
    Otherwise `ValueError` names the missing or extra names, or the first array
    that differs. Values are not converted: a bfloat16 file loads into a bfloat16
    model, bit for bit.

    ```python
    import pathlib, tempfile
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import lowtrain

    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    path = lowtrain.save_safetensors(
        model, pathlib.Path(tempfile.mkdtemp()) / "linear.safetensors"
    )
    like = eqx.filter_eval_shape(eqx.nn.Linear, 3, 2, key=jax.random.key(1))
    back = lowtrain.load_safetensors(path, like)
    assert (back.weight == model.weight).all() and (back.bias == model.bias).all()
    ```
    """
    path = pathlib.Path(path)
    named = _named(like_model)
    arrays = _read_safetensors(path)
    missing = [n for n in named if n not in arrays]
    extra = sorted(n for n in arrays if n not in named)
    if missing or extra:
        raise ValueError(
            f"Expected the arrays of `like_model` in {path}, got a file that "
            + (f"lacks {missing}" if missing else "")
            + (" and " if missing and extra else "")
            + (f"has others, {extra}" if extra else "")
            + f" ({len(named)} arrays in `like_model`, {len(arrays)} in the file). "
            "Build `like_model` as the saved model was built (same class, sizes "
            "and options)."
        )
    values = []
    for name, (_, x) in named.items():
        value, stored = arrays[name], _stored(x)
        if value.dtype != stored.dtype or value.shape != stored.shape:
            want = _describe(str(stored.dtype), stored.shape)
            got = _describe(str(value.dtype), value.shape)
            raise ValueError(
                f"Expected `{name}` in {path} to be {want} as in `like_model`, got "
                f"{got} instead. Build `like_model` with the saved sizes and dtypes "
                "(cast with `lowtrain.Policy(param_dtype=...).cast_to_param(model)`),"
                " load, and cast the result as you need."
            )
        values.append(_place(value, x))
    return _rebuild(like_model, values)
