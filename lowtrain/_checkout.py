"""`lowtrain.recipes` and `lowtrain.conf` when lowtrain is imported from a checkout.

The distribution ships `recipes/` and `conf/` as `lowtrain/recipes` and
`lowtrain/conf` (see setup.py); an editable install maps them the same way. But
Python imports `lowtrain` from the checkout itself whenever the checkout's root comes
first on `sys.path`: `python -m lowtrain` run from the repository root, or pytest
(which puts the root on `sys.path` because `tests/` is a package). There,
`lowtrain/recipes` does not exist; this finder, consulted last, finds the two
packages beside `lowtrain/` instead. It answers for those two names only, and only if
nothing before it found them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_MAPPED = {"lowtrain.recipes": _ROOT / "recipes", "lowtrain.conf": _ROOT / "conf"}


class CheckoutFinder:
    """A `sys.meta_path` finder for `lowtrain.recipes` and `lowtrain.conf`."""

    @staticmethod
    def find_spec(name, path=None, target=None) -> importlib.machinery.ModuleSpec:
        folder = _MAPPED.get(name)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def install() -> None:
    """Append `CheckoutFinder` to `sys.meta_path` (once)."""
    if CheckoutFinder not in sys.meta_path:
        sys.meta_path.append(CheckoutFinder)
