"""`Report`: the rows `track` returns, a plain-text table of the worst, and JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._plot import plot_report
from ._stats import FORMATS, finish, lost


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(
            f"Expected a format among {', '.join(FORMATS)}, got {fmt!r} instead."
        )
    return fmt


class Report:
    """The statistics of every float tensor of one run of a tracked function.

    `rows` is a list of dicts in program order, one per float input of the tracked
    function (`primitive` "input") and one per float output of each equation:
    `name` (the `jax.named_scope`/Equinox scope path and the primitive, joined by
    "/"), `primitive`, `pass` (`"fwd"`, or `"bwd"` for the transposed
    program), `dtype`, `shape`, `size` (values seen: inside a loop, over all
    iterations), `rms`, `absmax`, `zero` (the fraction of values that are zero, or
    NaN: what a cast already flushed), and `underflow`/`overflow`: dicts from each of
    `FORMATS` (`"float16"`, `"bfloat16"`, `"float8_e4m3fn"`, `"float8_e5m2"`) to the
    fraction of the nonzero values that would round to zero / past the format's
    largest finite value if cast as they are (round to nearest even; 0.0 when all
    values are zero).

    ```python
    import jax.numpy as jnp
    import lowtrain.numerics

    _, report = lowtrain.numerics.track(lambda x: x * 1e3)(jnp.ones(4))
    x_row, row = report.rows  # the input, then the product
    assert x_row["name"] == "input[1][0]" and row["name"] == "mul"
    assert row["rms"] == 1e3 and row["overflow"]["float8_e4m3fn"] == 1.0
    assert "mul" in report.table()
    ```
    """

    def __init__(self, rows: Sequence[dict]):
        # Rows read back from `to_json` hold non-finite numbers as strings.
        num = lambda v: float(v) if isinstance(v, str) else v  # noqa: E731
        self.rows = [
            r | {"rms": num(r["rms"]), "absmax": num(r["absmax"])} for r in rows
        ]

    @classmethod
    def from_stats(cls, metas, moments: np.ndarray, counts: np.ndarray) -> Report:
        """Rows from `track`'s per-tensor records; empty ones (the branches of a
        `cond` not taken) are dropped."""
        rows = []
        for (name, prim, pass_, dtype, shape), stats in zip(
            metas, finish(moments, counts)
        ):
            if stats["size"]:
                rows.append(
                    {"name": name, "primitive": prim, "pass": pass_, "dtype": dtype}
                    | {"shape": list(shape), **stats}
                )
        return cls(rows)

    def worst(self, n: int = 5, fmt: str = "float8_e4m3fn") -> list[dict]:
        """The `n` rows that a cast to `fmt` hurts most: by the fraction lost
        (underflow + overflow), then by size."""
        _check_format(fmt)
        ranked = sorted(self.rows, key=lambda r: (-lost(r, fmt), -r["size"]))
        return [r for r in ranked[:n] if lost(r, fmt) > 0]

    def table(self, fmt: str = "float8_e4m3fn", limit: int = 20) -> str:
        """Plain text: the `limit` worst rows for `fmt` (see `worst`), worst first,
        with their RMS, absmax and underflow/overflow percentages in `fmt`."""
        rows = self.worst(limit, fmt)
        head = f"{'pass':4} {'under%':>7} {'over%':>6} {'rms':>9} {'absmax':>9}  "
        lines = [
            f"worst {len(rows)} of {len(self.rows)} tensors in {fmt}",
            head + "name",
        ]
        for r in rows:
            lines.append(
                f"{r['pass']:4} {100 * r['underflow'][fmt]:7.2f} "
                f"{100 * r['overflow'][fmt]:6.2f} {r['rms']:9.3g} {r['absmax']:9.3g}  "
                f"{r['name']} {r['dtype']}[{','.join(map(str, r['shape']))}]"
            )
        return "\n".join(lines)

    def to_json(self) -> list[dict[str, Any]]:
        """The rows with non-finite numbers as strings (`"nan"`, `"inf"`)."""
        fix = lambda v: v if not isinstance(v, float) or math.isfinite(v) else str(v)  # noqa: E731
        return [
            {
                k: (
                    {f: fix(x) for f, x in v.items()} if isinstance(v, dict) else fix(v)
                )
                for k, v in r.items()
            }
            for r in self.rows
        ]

    def plot(self, path, fmt: str = "float8_e4m3fn") -> None:
        """Write a PNG to `path`: one row per tensor in program order, log2 RMS of the
        forward and backward tensors, the range of `fmt` shaded (smallest subnormal to
        largest finite value), tensors that lose values in `fmt` marked."""
        plot_report(self, path, _check_format(fmt))
