"""`ArrayBatches`: deterministic batches as a function of the step."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from jaxtyping import PyTree


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
    `lowtrain.Trainer.fit(eval_data=...)` does.

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
    assert [b["y"].tolist() for b in lowtrain.ArrayBatches(data, 5, shuffle=False)] == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
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

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[PyTree]:
        return (self(i) for i in range(self.steps_per_epoch))
