"""The value checks of the config schemas: each error names the key."""

from __future__ import annotations

import math
import signal


def positive(value, key: str) -> None:
    if not value > 0:
        raise ValueError(f"Expected `{key}` > 0, got {value} instead.")
    if not value < math.inf:
        raise ValueError(f"Expected `{key}` a finite number > 0, got {value} instead.")


def at_least(value, low, key: str) -> None:
    if not value >= low:
        raise ValueError(f"Expected `{key}` >= {low}, got {value} instead.")


def one_of(value, choices: tuple, key: str) -> None:
    if value not in choices:
        names = " or ".join(repr(c) for c in choices)
        raise ValueError(f"Expected `{key}` {names}, got {value!r} instead.")


def stop_signals(names, key: str) -> None:
    catchable = set(signal.Signals.__members__) - {"SIGKILL", "SIGSTOP"}
    bad = [n for n in names if n not in catchable]
    if bad:
        raise ValueError(
            f"Expected `{key}` names of signals a process can catch (SIGTERM, SIGINT, "
            f"SIGUSR1, ...), got {', '.join(map(repr, bad))} instead."
        )
