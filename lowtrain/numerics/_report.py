"""`Report`: the rows `track` returns, a plain-text table of the worst, and JSON."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..fp8.internal import Site
from ._plot import plot_report
from ._stats import FORMATS, finish, lost

KINDS = ("all", "casts")


class Meta(NamedTuple):
    """What `track` knows of a record before it runs: the row's `name`,
    `primitive`, `pass_`, `dtype` (for a cast, the format cast to), `shape`, the
    FP8 cast `site` (or None), and `layers`: 0, or the number of rows the record
    holds, one per iteration of the scan it is in."""

    name: str
    primitive: str
    pass_: str
    dtype: str
    shape: tuple
    site: Site | None = None
    layers: int = 0


# `track`'s record of what an FP8 cast's rounding loses: not a row of its own, the
# `error` of the cast's row.
CAST_ERROR = "fp8_cast_error"


def _site_json(site: Site | None) -> dict | None:
    if site is None:
        return None
    return {
        "format": site.fmt,
        "role": site.role,
        "gemm": list(site.gemm),
        "rhs": list(site.rhs),
        "applied": site.applied,
        "scaling": site.scaling,
        "stochastic": site.stochastic,
    }


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(
            f"Expected a format among {', '.join(FORMATS)}, got {fmt!r} instead."
        )
    return fmt


class Report:
    """The statistics of every float tensor of one run of a tracked function (`kind`
    "all"), or of every tensor it casts to a narrower format (`kind` "casts",
    `track(fn, casts=True)`).

    `rows` is a list of dicts in program order, one per float input of the tracked
    function (`primitive` "input") and one per float output of each equation:
    `name` (the `jax.named_scope`/Equinox scope path and the primitive, joined by
    "/"), `primitive`, `pass` (`"fwd"`, or `"bwd"` for the transposed
    program), `dtype`, `shape`, `size` (values seen: inside a loop, over all
    iterations), `rms`, `absmax`, `zero` (the fraction of values that are zero, or
    NaN: what a cast already flushed), and `underflow`/`overflow`: dicts from each of
    `FORMATS` (`"float16"`, `"bfloat16"`, `"float8_e4m3fn"`, `"float8_e5m2"`,
    `"float4_e2m1fn"`) to the
    fraction of the nonzero values that would round to zero / past the format's
    largest finite value if cast as they are (round to nearest even; 0.0 when all
    values are zero; an infinity is no overflow, a cast keeps it). A casts
    report's rows also have `layer` (the iteration of the scan they are in, or
    None) and `site` (None for a cast to float16 or bfloat16; for an FP8 cast a
    dict: `format`, `role` "lhs", "rhs" or "grad", `gemm` `[batch, M, N, K]` of its
    matmul, `rhs` the shape of the matmul's right operand, `applied` False for a
    shadow, `scaling` the block format of a block-scaled cast (its value read after
    each block's scale; `""` for one scale per tensor), `stochastic` whether it
    rounds stochastically) and `error` (the RMS of what rounding to nearest in the
    format loses, over the RMS of the value: 0.03 for Gaussian values in E4M3);
    their `dtype` is the format cast to (the element format of a block-scaled
    one).

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

    def __init__(self, rows: Sequence[dict], kind: str | None = None):
        # Rows read back from `to_json` hold non-finite numbers as strings.
        num = lambda v: float(v) if isinstance(v, str) else v  # noqa: E731
        self.rows = [
            r | {"rms": num(r["rms"]), "absmax": num(r["absmax"])} for r in rows
        ]
        if kind is None:  # rows read back: a casts report's rows have a `site`
            kind = "casts" if any("site" in r for r in self.rows) else "all"
        if kind not in KINDS:
            raise ValueError(
                f"Expected a report kind among {', '.join(KINDS)}, got {kind!r} "
                "instead."
            )
        self.kind = kind

    @classmethod
    def from_stats(
        cls, metas, moments: np.ndarray, counts: np.ndarray, kind: str = "all"
    ) -> Report:
        """Rows from `track`'s per-tensor records (a record with `layers` holds one
        row per layer); empty ones (the branches of a `cond` not taken) are
        dropped."""
        rows = []
        stats = iter(finish(moments, counts))
        cast_rows: dict = {}  # the last cast's rows by layer: where its error goes
        # A cast repeated outside a scan (an unrolled stack of layers): numbered.
        key = lambda m: (m.name, m.pass_, m.site)  # noqa: E731
        casts = [m for m in metas if m.primitive != CAST_ERROR]
        repeats = Counter(key(m) for m in casts if m.site is not None and not m.layers)
        seen: Counter = Counter()
        for meta in metas:
            if meta.primitive == CAST_ERROR:  # the relative error of the cast before
                for layer in range(meta.layers) if meta.layers else [None]:
                    row, cast = next(stats), cast_rows.get(layer)
                    if cast is not None:
                        rms = cast["rms"]
                        cast["error"] = row["rms"] / rms if rms > 0 else 0.0
                continue
            cast_rows = {}
            for layer in range(meta.layers) if meta.layers else [None]:
                row = next(stats)
                at = layer
                if kind == "casts" and layer is None and repeats[key(meta)] > 1:
                    layer = seen[key(meta)]
                    seen[key(meta)] += 1
                if not row["size"]:
                    continue
                head = {"name": meta.name, "primitive": meta.primitive}
                head |= {"pass": meta.pass_, "dtype": meta.dtype}
                head |= {"shape": list(meta.shape)}
                if kind == "casts":
                    head |= {"layer": layer, "site": _site_json(meta.site)}
                rows.append(head | row)
                cast_rows[at] = rows[-1]
        return cls(rows, kind)

    def judged(self, row: dict, fmt: str | None) -> str:
        """The format `row` is judged in: `fmt`, or (None) the format a casts
        report's row is cast to."""
        if fmt is not None:
            return _check_format(fmt)
        if self.kind != "casts":
            raise ValueError(
                "Expected a format for a report of every tensor (kind 'all'), got "
                "None instead: only a casts report knows each tensor's format. Pass "
                "`fmt=`, or track with `track(fn, casts=True)`."
            )
        return row["dtype"]

    def worst(self, n: int = 5, fmt: str | None = "float8_e4m3fn") -> list[dict]:
        """The `n` rows that a cast to `fmt` hurts most (`fmt=None`, in a casts
        report: each row's own format): by the fraction lost (underflow +
        overflow), then by size."""
        key = lambda r: lost(r, self.judged(r, fmt))  # noqa: E731
        ranked = sorted(self.rows, key=lambda r: (-key(r), -r["size"]))
        return [r for r in ranked[:n] if key(r) > 0]

    def table(self, fmt: str | None = "float8_e4m3fn", limit: int = 20) -> str:
        """Plain text: the `limit` worst rows for `fmt` (see `worst`; None: each
        row's own format, in a casts report), worst first, with their RMS, absmax
        and underflow/overflow percentages in that format."""
        rows = self.worst(limit, fmt)
        head = f"{'pass':4} {'under%':>7} {'over%':>6} {'rms':>9} {'absmax':>9}  "
        lines = [
            f"worst {len(rows)} of {len(self.rows)} tensors in "
            f"{fmt or 'the formats they are cast to'}",
            head + "name",
        ]
        for r in rows:
            f = self.judged(r, fmt)
            layer = f" layer {r['layer']}" if r.get("layer") is not None else ""
            role = f" {r['site']['role']}" if r.get("site") else ""
            lines.append(
                f"{r['pass']:4} {100 * r['underflow'][f]:7.2f} "
                f"{100 * r['overflow'][f]:6.2f} {r['rms']:9.3g} {r['absmax']:9.3g}  "
                f"{r['name']}{role}{layer} {r['dtype']}"
                f"[{','.join(map(str, r['shape']))}]"
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

    def plot(self, path, fmt: str = "float8_e4m3fn", plan=None) -> None:
        """Write a PNG to `path`. A casts report (see `track(casts=True)`): its FP8
        casts by name, as unit-scaling's visualiser draws a model, one column per
        layer (and one for the casts outside the layer scan), in each the matmuls
        by scope and their casts (forward `lhs`, `rhs`, backward `grad`), each a
        bar of log2 RMS to log2 absmax over its format's range (E4M3 forward, E5M2
        backward), casts losing more than 1% marked; with `plan` (a
        `lowtrain.numerics.Plan`), the matmuls it keeps wide marked too. A report
        of every tensor, or a casts report with no matmul's FP8 casts (scalify
        casts its own way): one row per tensor in program order, log2 RMS forward and
        backward over the range of `fmt`, tensors that lose values in `fmt`
        marked."""
        plot_report(self, path, _check_format(fmt), plan)
