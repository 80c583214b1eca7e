"""What a traced program depends on besides its inputs: settings a caller holds
while it traces (the Trainer's FSDP mesh and remat policy, `train/_layer.py`). The
transforms that cache their traces (`amp`, `scalify`, `rewrite`, `unit_scale`, each
an `eqx.filter_jit`) key them on `trace_key()` too, so a model traced under one
setting is never reused under another."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Hashable, Iterator

_SETTINGS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "lowtrain_trace_settings", default=()
)


@contextlib.contextmanager
def trace_setting(value: Hashable) -> Iterator[None]:
    """Within this block, `trace_key()` includes `value` (hashable)."""
    token = _SETTINGS.set((*_SETTINGS.get(), value))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def trace_key() -> tuple:
    """The settings in effect: a static argument of each cached transform."""
    return _SETTINGS.get()
