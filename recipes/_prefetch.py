"""`Prefetch`: batches prepared ahead on a background thread, same batches as before."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_POLL = 0.1  # seconds a blocked worker waits before checking it should stop


class Prefetch:
    """`data(step)` computed `depth` steps ahead by a background thread.

    `prefetch(step)` returns exactly `data(step)`: the worker computes `data(s)`,
    `data(s + 1)`, ... from the last step asked for, so the usual sequential calls of
    `Trainer.fit` never wait for host-side work (indexing, cropping) while the device
    computes. Asking for any other step restarts the worker there, so the batch stays
    a function of the step and a resumed run is exact. Only the worker calls `data`.
    Other attributes (`steps_per_epoch`) are `data`'s. Call `close()` when done, or
    use it as a context manager.
    """

    def __init__(self, data: Callable[[int], Any], depth: int = 4):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"Expected an int `depth` >= 1, got {depth!r} instead.")
        self.data, self.depth = data, depth
        self._next: int | None = None  # the step the queue's head holds
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue()

    def __getattr__(self, name: str):
        if name == "data":  # not yet set: do not recurse
            raise AttributeError(name)
        return getattr(self.data, name)

    def _work(self, start: int, stop: threading.Event, out: queue.Queue) -> None:
        step = start
        while not stop.is_set():
            try:
                item = (step, self.data(step), None)
            except BaseException as e:  # handed to the caller, raised there
                item = (step, None, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def _restart(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=self._work,
            args=(step, self._stop, self._queue),
            name="lowtrain-prefetch",
            daemon=True,
        )
        self._thread.start()
        self._next = step

    def __call__(self, step: int) -> Any:
        step = int(step)
        if step != self._next or self._thread is None:
            self._restart(step)
        got, batch, error = self._queue.get()
        self._next = step + 1
        if error is not None:
            self.close()
            raise error
        assert got == step  # the worker runs in order from `_next`
        return batch

    def close(self) -> None:
        """Stop the worker thread (it is restarted by the next call)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._next = None

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
