"""Stop signals: a run told to stop (a cluster's SIGTERM, Ctrl-C's SIGINT, SLURM's
SIGUSR1 before a requeue) finishes the step in flight, saves it, and says so.

`SignalWatch` notes the first signal and lets the loop decide when to stop; a
second one of the same kind acts at once, as if no handler were there (SIGINT
raises `KeyboardInterrupt`, SIGTERM ends the process). `Preempted` is what
`Trainer.fit` raises after its checkpoint is written.
"""

from __future__ import annotations

import difflib
import logging
import signal
import threading
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("lowtrain")

DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT")


class Preempted(Exception):
    """`Trainer.fit` stopped by a signal: the step it reached (`step`), where that
    step was saved (`path`, None without a `checkpoint_dir`), and the signal's name
    (`signal`). `exit_code` is the shell's status for a process ended by that
    signal (128 + its number: 143 for SIGTERM, 130 for SIGINT).

    **Arguments:**

    - `signum`: the number of the signal received (`signal.SIGTERM`, ...).
    - `step`: the step the run reached.
    - `path`: where that step was saved, or None (default): not saved.

    ```python
    import signal
    from lowtrain.train import Preempted

    e = Preempted(signal.SIGTERM, 120, "run/ckpt_000120")
    assert str(e).startswith("stopped by SIGTERM at step 120, saved to run/ckpt")
    assert e.exit_code == 143
    ```
    """

    def __init__(self, signum: int, step: int, path=None):
        self.signal = signal.Signals(signum).name
        self.step, self.path = step, path
        self.exit_code = 128 + int(signum)
        where = (
            f"saved to {path}" if path is not None else "not saved (no checkpoint_dir)"
        )
        super().__init__(f"stopped by {self.signal} at step {step}, {where}")


def check_stop_signals(
    signals: Sequence[str | int] | None,
) -> tuple[signal.Signals, ...]:
    """`fit`'s `stop_signals` as `signal.Signals`: names ("SIGTERM") or numbers;
    None or () watches none."""
    if signals is None:
        return ()
    if isinstance(signals, str | int):
        signals = (signals,)
    out = []
    for s in signals:
        try:
            out.append(signal.Signals[s] if isinstance(s, str) else signal.Signals(s))
        except (KeyError, ValueError):
            close = difflib.get_close_matches(str(s), signal.Signals.__members__, 1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ValueError(
                "Expected stop signals named as in the `signal` module (SIGTERM, "
                f"SIGINT, SIGUSR1, ...) or given by number, got {s!r} instead.{hint}"
            ) from None
    if signal.SIGKILL in out or getattr(signal, "SIGSTOP", None) in out:
        raise ValueError(
            "Expected stop signals a process can catch, got SIGKILL or SIGSTOP, "
            "which no process can. Use SIGTERM (what schedulers send first)."
        )
    return tuple(dict.fromkeys(out))


class SignalWatch:
    """A context that notes the first of `signals` received (`received`: its
    number, or None) instead of dying of it; a second signal of a kind already
    received acts as it would without the watch. Watches nothing outside the main
    thread (Python delivers signals to the main thread only)."""

    def __init__(self, signals: Sequence[signal.Signals]):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            log.warning(
                "received %s: finishing the step in flight, then saving and "
                "stopping (send it again to stop at once)",
                signal.Signals(signum).name,
            )
            return
        # A second signal: the behaviour the process had before the watch.
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        signal.raise_signal(signum)

    def __enter__(self) -> SignalWatch:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def install(self) -> None:
        """Handle the signals (from now until `restore`)."""
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                previous = signal.signal(s, self._handle)
                self._previous[s] = signal.SIG_DFL if previous is None else previous

    def restore(self) -> None:
        """The handlers the process had before `install`."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()


def agree(received: int | None, due: bool) -> tuple[int | None, bool]:
    """What every process of a multi-process run does at this step: stop if any
    process was signalled (the highest-numbered signal names it), save on time if
    any process's clock says so. One small all-gather; call it at a step where
    every process calls it."""
    from jax.experimental import multihost_utils

    mine = np.array([received or 0, int(due)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    signum = int(every[:, 0].max())
    return (signum or None), bool(every[:, 1].any())
