"""What `Trainer.fit` reads its batches from, a function of the step: in-memory arrays
(`ArrayBatches`), any iterator (`from_iterable`), a grain dataset (`from_grain`); and
how a data position travels with a checkpoint."""

from __future__ import annotations

import inspect
import logging
import pathlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from ._checkpoint import checkpoint_extra

log = logging.getLogger("lowtrain")


class ArrayBatches:
    """Batches of in-memory arrays, a pure function of the step, for exact resume.

    `arrays` is a pytree of arrays (numpy or JAX, kept on the host as numpy) that share
    their leading dimension `n`. An epoch has `steps_per_epoch = n // batch_size`
    batches; the last `n % batch_size` examples of each epoch's order are dropped, so
    every batch has the same shape and the train step compiles once. `batches(step)`
    returns the arrays at indices `order[i * batch_size : (i + 1) * batch_size]`
    where `epoch, i = divmod(step, steps_per_epoch)` and `order` is
    `numpy.random.default_rng((seed, epoch)).permutation(n)` (or `arange(n)` with
    `shuffle=False`). Iterating gives the batches of one epoch in order, as
    `lowtrain.Trainer.fit(eval_data=...)` does, and then the last `n % batch_size`
    examples as a smaller batch, so an evaluation sees every example (in a
    multi-process run that last batch is left out: its rows would not split
    evenly); `len()` counts it.

    In a multi-process run each process passes its own `process_index` and the
    `process_count` (`jax.process_index()`, `jax.process_count()`): `batch_size` stays
    the global batch, and each call returns only this process's contiguous share of
    it, rows `[k * b, (k + 1) * b)` of the global batch where `k = process_index` and
    `b = batch_size // process_count` (as `lowtrain.Trainer.shard_batch` expects).

    ```python
    import numpy as np
    import lowtrain

    data = {"x": np.arange(10.0), "y": np.arange(10)}
    batches = lowtrain.ArrayBatches(data, 4, seed=0)
    assert batches.steps_per_epoch == 2
    b = batches(5)  # epoch 2, second batch; the same on every call
    assert b["x"].shape == (4,) and (b["x"] == batches(5)["x"]).all()
    assert [b["y"].tolist() for b in lowtrain.ArrayBatches(data, 4, shuffle=False)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],  # the last, partial batch: iterating sees every example
    ]
    ```
    """

    def __init__(
        self,
        arrays: PyTree,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ):
        """**Arguments:**

        - `arrays`: a pytree of arrays (numpy or JAX) that share their leading
          dimension `n`, the number of examples.
        - `batch_size`: the global batch size, an int in `[1, n]`.
        - `seed`: the seed of the shuffle (each epoch's order is
          `default_rng((seed, epoch)).permutation(n)`); default 0.
        - `shuffle`: whether each epoch's order is shuffled; if False it is
          `arange(n)`. Default True.
        - `process_index`: this process's index, in `[0, process_count)`; default 0.
        - `process_count`: the number of processes, which divides `batch_size`;
          default 1.
        """
        leaves, paths = [], []
        for path, x in jax.tree_util.tree_flatten_with_path(arrays)[0]:
            paths.append(jax.tree_util.keystr(path) or "arrays")
            leaves.append(np.asarray(x))
        if not leaves:
            raise ValueError("Expected at least one array in `arrays`, got none.")
        sizes = {p: (x.shape[0] if x.ndim else None) for p, x in zip(paths, leaves)}
        n = sizes[paths[0]]
        if n is None or any(s != n for s in sizes.values()):
            raise ValueError(
                "Expected every array in `arrays` to share its leading dimension "
                f"(the number of examples), got "
                f"{', '.join(f'{p}: {n}' for p, n in sizes.items())} instead."
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(
                f"Expected an int `batch_size`, got {batch_size!r} instead."
            )
        if not 1 <= batch_size <= n:
            raise ValueError(
                f"Expected `batch_size` between 1 and the number of examples ({n}), "
                f"got {batch_size} instead."
            )
        self._rows = self.process_rows(batch_size, process_index, process_count)
        self.process_index, self.process_count = process_index, process_count
        self.arrays = jax.tree.unflatten(jax.tree.structure(arrays), leaves)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.num_examples = n
        self.steps_per_epoch = n // batch_size
        self._order = (None, None)  # (epoch, permutation): the last epoch used

    @staticmethod
    def process_rows(
        batch_size: int, process_index: int = 0, process_count: int = 1
    ) -> slice:
        """The rows of a global batch of `batch_size` that process `process_index` of
        `process_count` loads: a contiguous `batch_size // process_count` of them.

        ```python
        import lowtrain

        assert lowtrain.ArrayBatches.process_rows(8, 1, 2) == slice(4, 8)
        ```
        """
        if not (0 <= process_index < process_count and batch_size % process_count == 0):
            raise ValueError(
                f"Expected 0 <= process_index < process_count and a batch size "
                f"divisible by `process_count`, got process_index={process_index}, "
                f"process_count={process_count} and batch size {batch_size} instead. "
                "Use a global batch size that is a multiple of the number of processes."
            )
        share = batch_size // process_count
        return slice(process_index * share, (process_index + 1) * share)

    def order(self, epoch: int) -> np.ndarray:
        """The order of the examples in epoch `epoch`."""
        if self._order[0] != epoch:
            if self.shuffle:
                perm = np.random.default_rng((self.seed, epoch)).permutation(
                    self.num_examples
                )
            else:
                perm = np.arange(self.num_examples)
            self._order = (epoch, perm)
        return self._order[1]

    def __call__(self, step: int) -> PyTree:
        step = int(step)
        if step < 0:
            raise ValueError(f"Expected a step >= 0, got {step} instead.")
        epoch, i = divmod(step, self.steps_per_epoch)
        first = i * self.batch_size  # of the global batch; this process's rows:
        rows = slice(first + self._rows.start, first + self._rows.stop)
        index = self.order(epoch)[rows]
        return jax.tree.map(lambda x: x[index], self.arrays)

    def _remainder(self) -> slice | None:
        # The last partial batch of an epoch in order, on one process only.
        rest = self.num_examples % self.batch_size
        if not rest or self.process_count > 1:
            return None
        return slice(self.num_examples - rest, self.num_examples)

    def __len__(self) -> int:
        return self.steps_per_epoch + (self._remainder() is not None)

    def __iter__(self) -> Iterator[PyTree]:
        yield from (self(i) for i in range(self.steps_per_epoch))
        rows = self._remainder()
        if rows is not None:
            index = self.order(0)[rows]
            yield jax.tree.map(lambda x: x[index], self.arrays)


class IterableBatches:
    """`data(step) -> batch` over an iterable, read in order; see `from_iterable`."""

    def __init__(self, source: Iterable | Callable[[], Iterable]):
        self._factory = source if callable(source) and not _iterable(source) else None
        if self._factory is None and not _iterable(source):
            raise TypeError(
                "Expected an iterable of batches or a function returning one, got "
                f"{type(source).__name__} instead."
            )
        self._source = source
        self._it: Iterator | None = None
        self._next = 0  # the step the next batch read is for
        self.epochs = 0  # times a factory's iterable ran out

    def _make(self, epoch: int) -> Iterator:
        try:
            takes_epoch = bool(inspect.signature(self._factory).parameters)
        except (TypeError, ValueError):  # a builtin without a signature
            takes_epoch = False
        return iter(self._factory(epoch) if takes_epoch else self._factory())

    def _restart(self) -> None:
        if self._factory is not None:
            self.epochs = 0
            self._it = self._make(0)
        elif self._it is None:
            self._it = iter(self._source)
        else:
            raise ValueError(
                "Expected the steps of a plain iterator in order, got a step before "
                f"the next one ({self._next}) instead: an iterator cannot go back. "
                "Pass a function that makes the iterable anew, "
                "`from_iterable(lambda: make_loader())`."
            )
        self._next = 0

    def _read(self, step: int):
        try:
            return next(self._it)
        except StopIteration:
            if self._factory is None:
                raise ValueError(
                    f"The iterator ran out at step {step}: expected a batch for "
                    "every step of `fit`. Train for fewer steps, or pass a function "
                    "that makes the iterable anew (each call a new epoch)."
                ) from None
        self.epochs += 1
        self._it = self._make(self.epochs)
        try:
            return next(self._it)
        except StopIteration:
            raise ValueError(
                "Expected the function passed to `from_iterable` to make a "
                "non-empty iterable, got an empty one."
            ) from None

    def __call__(self, step: int) -> PyTree:
        step = int(step)
        if self._it is None or step < self._next:
            self._restart()
        if step > self._next:  # a resume: read and drop the batches before it
            log.info(
                "from_iterable: skipping %d batches to step %d", step - self._next, step
            )
        while self._next < step:
            self._read(self._next)
            self._next += 1
        batch = self._read(step)
        self._next = step + 1
        return batch


def _iterable(x) -> bool:
    return hasattr(x, "__iter__") or hasattr(x, "__next__")


def from_iterable(source: Iterable | Callable[[], Iterable]) -> IterableBatches:
    """`data(step) -> batch` for `Trainer.fit` from `source`: any iterable of batches
    (a generator, a PyTorch `DataLoader`, a tf.data iterator), or a function that
    makes one, each call an epoch: `make()` or `make(epoch)` (0, 1, ...: seed the
    epoch's shuffle with it). Anything else raises `TypeError`.

    The batches are read in order: `data(s)` is the `s`-th batch read. A resumed run
    starts at the checkpoint's step `s`: the batches before it are read again and
    dropped (a function makes the iterable anew for that; a plain iterator is read
    on from where it is, so pass a fresh one). So a resume sees the same batches as
    the first run exactly when the iterable gives the same batches each time it is
    made (a seeded shuffle). When a function's iterable runs out, it is called
    again (the next epoch); a plain iterator that runs out is an error.

    ```python
    import lowtrain

    def batches():  # a seeded source: the same batches each time
        for i in range(3):
            yield {"x": [float(i)]}

    data = lowtrain.train.from_iterable(batches)
    assert [data(s)["x"][0] for s in range(5)] == [0.0, 1.0, 2.0, 0.0, 1.0]
    resumed = lowtrain.train.from_iterable(batches)
    assert resumed(4)["x"][0] == 1.0  # steps 0-3 read and dropped
    ```
    """
    return IterableBatches(source)


class GrainBatches:
    """`data(step) -> batch` over a grain dataset; see `from_grain`."""

    def __init__(self, dataset, batch_size, process_index, process_count):
        import grain

        self.dataset = dataset
        self.process_index = (
            jax.process_index() if process_index is None else process_index
        )
        self.process_count = (
            jax.process_count() if process_count is None else process_count
        )
        self._iterator = None
        self._next = 0
        if isinstance(dataset, grain.MapDataset):
            self.random_access = True
            self.batch_size = batch_size
            if batch_size is not None:
                self._rows = ArrayBatches.process_rows(
                    batch_size, self.process_index, self.process_count
                )
                self.steps_per_epoch = len(dataset) // batch_size
            else:
                self._rows = None
                self.steps_per_epoch = len(dataset)
            return
        if batch_size is not None:
            raise ValueError(
                "Expected `batch_size` only with a `grain.MapDataset` (random access), "
                f"got batch_size={batch_size} with a {type(dataset).__name__}. "
                "Batch the pipeline itself (`.batch(n)`)."
            )
        self.random_access = False
        self.batch_size = None
        self._iterator = iter(dataset)
        if not (
            hasattr(self._iterator, "get_state")
            and hasattr(self._iterator, "set_state")
        ):
            raise TypeError(
                "Expected a grain `MapDataset`, `IterDataset` or `DataLoader` (whose "
                "iterators save their position), got "
                f"{type(dataset).__name__} instead. For another iterable use "
                "`lowtrain.train.from_iterable`."
            )

    def __call__(self, step: int) -> PyTree:
        step = int(step)
        if self.random_access:
            if self.batch_size is None:
                batch = self.dataset[step]
                if self.process_count == 1:
                    return batch
                n = _leading(batch)
                rows = ArrayBatches.process_rows(
                    n, self.process_index, self.process_count
                )
                return jax.tree.map(lambda x: np.asarray(x)[rows], batch)
            first = step * self.batch_size
            examples = [
                self.dataset[first + i]
                for i in range(self._rows.start, self._rows.stop)
            ]
            return jax.tree.map(
                lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples
            )
        if step != self._next:
            raise ValueError(
                f"Expected the steps of a grain iterator in order ({self._next} next), "
                f"got step {step} instead. `Trainer.fit` restores its position from "
                "the checkpoint it resumes from; outside `fit`, call "
                "`set_state(...)` first."
            )
        self._next = step + 1
        return next(self._iterator)

    def get_state(self) -> dict | None:
        """The position to resume from (JSON data); None for random access, which
        needs none (a batch is a function of the step)."""
        if self.random_access:
            return None
        state = self._iterator.get_state()
        if isinstance(state, bytes):  # a DataLoader's: JSON text as bytes
            state = {"bytes": state.decode()}
        return {"next": self._next, "iterator": state}

    def set_state(self, state: dict | None) -> None:
        if self.random_access or state is None:
            return
        inner = state["iterator"]
        if isinstance(inner, dict) and set(inner) == {"bytes"}:
            inner = inner["bytes"].encode()
        self._iterator.set_state(inner)
        self._next = int(state["next"])


def _leading(batch: PyTree) -> int:
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves else 0


def from_grain(
    dataset,
    batch_size: int | None = None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> GrainBatches:
    """`data(step) -> batch` for `Trainer.fit` from a grain dataset (extra `grain`).

    - A `grain.MapDataset` of examples with `batch_size` (the global batch): batch
      `s` stacks examples `s * batch_size + r` for this process's rows `r` (as
      `ArrayBatches.process_rows`), read by index: each process reads its share
      only, and a batch is a function of the step, so a resume needs nothing
      saved. Index past the end is grain's next epoch (a shuffled dataset
      reshuffles). A `MapDataset` already batched (no `batch_size`): batch `s` is
      `dataset[s]`, of which each process keeps its rows.
    - A `grain.IterDataset` or `grain.DataLoader` (batched by its own pipeline,
      sharded by it, e.g. `ShardByJaxProcess`): read in order; its iterator's
      position (`get_state`) is saved with each checkpoint `fit` writes and set
      back (`set_state`) when `fit` resumes, so the run goes on with the batch
      after the checkpoint's.

    **Arguments:**

    - `dataset`: a `grain.MapDataset`, `grain.IterDataset` or `grain.DataLoader`
      (above); another type raises `TypeError`.
    - `batch_size`: the global batch size, for a `MapDataset` of single examples
      only (with another dataset it raises `ValueError`); None (default): the
      dataset is batched already.
    - `process_index`: keyword-only; this process's index, which picks its rows
      of a `MapDataset`'s batches; None (default): `jax.process_index()`.
    - `process_count`: keyword-only; the number of processes sharing a
      `MapDataset`'s batches; None (default): `jax.process_count()`.

    ```python
    import grain
    import numpy as np
    import lowtrain

    examples = grain.MapDataset.source(np.arange(10.0)).map(lambda x: {"x": x})
    data = lowtrain.train.from_grain(examples, batch_size=4)
    assert data(1)["x"].tolist() == [4.0, 5.0, 6.0, 7.0] and data.steps_per_epoch == 2

    stream = lowtrain.train.from_grain(examples.to_iter_dataset().batch(4))
    first = stream(0)
    position = stream.get_state()  # what fit saves with a checkpoint
    second = stream(1)
    again = lowtrain.train.from_grain(examples.to_iter_dataset().batch(4))
    again.set_state(position)  # what fit does on resume
    assert (again(1)["x"] == second["x"]).all()
    ```
    """
    try:
        import grain  # noqa: F401
    except ImportError:
        raise ImportError(
            "Expected the `grain` package for `from_grain`, got none installed. "
            "Install it: pip install 'lowtrain[grain]'."
        ) from None
    return GrainBatches(dataset, batch_size, process_index, process_count)


_POSITION = "data_position"  # the key of a data position in a checkpoint's extra


def with_data_position(extra: dict | None, data: Any) -> dict | None:
    """`extra` with the position of `data` (its `get_state()`), if it has one."""
    get = getattr(data, "get_state", None)
    if get is None:
        return extra
    position = get()
    if position is None:
        return extra
    return {**(extra or {}), _POSITION: position}


def restore_data_position(data: Any, path: pathlib.Path | None) -> None:
    """Set `data`'s position (`set_state`) to the one saved with the checkpoint at
    `path`, which `fit` resumes from."""
    setter = getattr(data, "set_state", None)
    if path is None or setter is None:
        return
    position = checkpoint_extra(path).get(_POSITION)
    if position is None and data.get_state() is not None:
        raise ValueError(
            f"Expected the data position saved with the checkpoint {path}, got none: "
            "it was written without this data source. Resume with the data it was "
            "trained with, or start a new run."
        )
    setter(position)
