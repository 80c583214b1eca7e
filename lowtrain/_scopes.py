"""Named scopes that lowtrain's transforms agree on (the core: no lowtrain imports).

`AMP_STOP_SCOPE` marks a region that `lowtrain.amp` leaves in the precision it was
written in (`lowtrain.amp_stop` opens it). `lowtrain.fp8` opens it around its own
casts, which choose every dtype themselves; it lives here, below both, so neither
imports the other for it.

`match_scope` is how `amp`'s scope rules and `rewrite`'s scope rules pick the entry
for an equation: the same matching in both.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

AMP_STOP_SCOPE = "lowtrain.amp_stop"

_MISSING = object()


def match_scope(
    table: Sequence[tuple[str, Any]], scopes: Sequence[str], default: Any = None
) -> Any:
    """The value of `table` (pairs of scope name or glob, value) for an equation
    inside `scopes` (outermost first): the outermost scope that matches wins, and
    for one scope an exact name beats a glob; `default` when none matches."""
    exact = dict(table)
    for scope in scopes:
        found = exact.get(scope, _MISSING)
        if found is not _MISSING:
            return found
        for pattern, value in table:
            if fnmatch.fnmatchcase(scope, pattern):
                return value
    return default
