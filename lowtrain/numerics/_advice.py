"""`worst_casts`: the casts of a casts report that lose most, with what to do."""

from __future__ import annotations

import math

from ._report import Report

NEGLIGIBLE = 1e-3  # a cast losing less than this fraction needs no advice


def _advice(row: dict) -> str:
    fmt = row["dtype"]
    flush, sat = row["underflow"][fmt], row["overflow"][fmt]
    site = row.get("site")
    where = row["name"].split("/")[-1]
    keep = f"keep it wide: `precision.keep=[{where!r}]`"
    if site is not None and site["rhs"]:
        keep = (
            f"keep it wide: `precision.keep=[{where}@"
            f"{'x'.join(map(str, site['rhs']))}]` (or `precision.auto=true`)"
        )
    if flush + sat < NEGLIGIBLE:
        return f"loses under {NEGLIGIBLE:.1%}: nothing to fix"
    if site is None:  # a plain cast to float16/bfloat16
        if flush > sat:
            return "underflows: scale it up (a loss scale) or keep it in float32"
        return "overflows: scale it down, or keep it in float32 (bfloat16's range)"
    if flush >= sat:
        # How far below the format the values sit: the scale that would lift them.
        steps = max(0, math.ceil(-math.log2(max(row["rms"], 1e-38))) - 2)
        scale = f"a scale of 2**{steps} before the cast" if steps else "a scale"
        return f"flushes to zero: {keep}, or {scale} (per-tensor scaling: fp8)"
    return f"saturates: {keep}, or a scale below 1 (current scaling: fp8)"


def worst_casts(report: Report, n: int = 5) -> list[dict]:
    """The `n` casts (default 5) of `report`, a casts report
    (`track(fn, casts=True)`), that lose the most of their nonzero values in the
    format they are cast to (underflow + overflow, after the cast's scale), worst
    first, each a dict: `name`, `pass`, `role` (of an FP8 cast in its matmul, else
    None), `layer`, `dtype` (the format), `shape`, `rms`, `absmax`, `underflow`,
    `overflow` (fractions in that format) and `advice` (what fixes it: keep the
    matmul wide with `precision.keep=[...]`, a scale, or a wider format). Only
    low-format casts are ranked, and only those that lose something (fewer than `n`
    when fewer do); a report of every tensor has none.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.numerics
    import lowtrain.unit_scaling as uu

    def head(x, w):
        with jax.named_scope("head"):
            return jnp.sum(x @ w) * 1e-9  # its gradient is below E5M2's range

    grad = jax.grad(uu.simulate_fp8(head), argnums=1)
    tracked = lowtrain.numerics.track(grad, casts=True)
    _, report = tracked(jnp.ones((4, 8)), jnp.ones((8, 2)))
    (worst,) = lowtrain.numerics.worst_casts(report, 1)
    assert worst["name"] == "head" and worst["role"] == "grad"
    assert worst["underflow"] == 1.0
    assert "precision.keep" in worst["advice"]
    ```
    """
    if not isinstance(report, Report):
        raise TypeError(
            f"Expected a `lowtrain.numerics.Report`, got {report!r} instead."
        )
    if report.kind != "casts":
        return []
    out = []
    for r in report.worst(n, None):
        fmt = r["dtype"]  # `worst` ranks only casts that lose something
        site = r.get("site")
        out.append(
            {
                "name": r["name"],
                "pass": r["pass"],
                "role": site["role"] if site else None,
                "layer": r.get("layer"),
                "dtype": fmt,
                "shape": r["shape"],
                "rms": r["rms"],
                "absmax": r["absmax"],
                "underflow": r["underflow"][fmt],
                "overflow": r["overflow"][fmt],
                "advice": _advice(r),
            }
        )
    return out
