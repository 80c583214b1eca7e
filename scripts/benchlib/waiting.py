"""The Trainer's step as it was compiled up to git 8cf1783: by `eqx.filter_jit`,
which waits for each call's results (Equinox 0.13), instead of
`lowtrain.train.async_filter_jit`; to compare the two (`scripts/fit_overhead.py`,
`scripts/dispatch_check.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import equinox as eqx

import lowtrain.train._trainer as trainer_module


@contextlib.contextmanager
def waiting_steps() -> Iterator[None]:
    """Trainers whose `compiled_step` is first used inside this block compile it with
    `eqx.filter_jit` (same filtering and donation, but each call waits)."""
    original = trainer_module.async_filter_jit
    trainer_module.async_filter_jit = lambda fn, donate: eqx.filter_jit(
        fn, donate=donate
    )
    try:
        yield
    finally:
        trainer_module.async_filter_jit = original
