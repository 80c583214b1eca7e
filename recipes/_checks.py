"""The value checks of the config schemas: each error names the key."""

from __future__ import annotations


def positive(value, key: str) -> None:
    if not value > 0:
        raise ValueError(f"Expected `{key}` > 0, got {value} instead.")


def at_least(value, low, key: str) -> None:
    if not value >= low:
        raise ValueError(f"Expected `{key}` >= {low}, got {value} instead.")


def one_of(value, choices: tuple, key: str) -> None:
    if value not in choices:
        names = " or ".join(repr(c) for c in choices)
        raise ValueError(f"Expected `{key}` {names}, got {value!r} instead.")
