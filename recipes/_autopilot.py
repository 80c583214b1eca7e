"""`precision.auto=true`: the FP8 autopilot (`lowtrain.train.Autopilot`) built from
an FP8 precision's config.

The autopilot is a callback of the run's one `fit`: at step 1 and every
`precision.auto_every` steps it tracks `precision.auto_batches` batches, makes a
`lowtrain.numerics.Plan` and switches the Trainer to the precision that runs it
(`precision.keep` = the configured entries and the plan's), the state kept in
memory. It leaves `plan.json` and `plan.txt` in the run directory, one
`metrics.jsonl` row per plan (`"event": "plan"`) and a log line per change; a
resumed run goes on with the plan in effect at its checkpoint's step.

The model's structure does not depend on the plan (the recipes' precisions keep a
matmul wide at call time), so the state carries over from one plan to the next as it
is.

    python -m lowtrain recipe=gpt precision=fp8_naive precision.auto=true
    python -m lowtrain recipe=gpt precision=nvfp4 precision.auto=true \\
        'precision.formats=[nvfp4,mxfp8,fp8]'
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import hydra.utils

import lowtrain

from ._config import AUTO_FIELDS


def build_precision(
    precision_config,
    keep: Sequence[str],
    routes: Sequence[str] | None = None,
    base: str | None = None,
):
    """The `lowtrain.train.Precision` that `precision_config` (an FP8 precision's
    config dataclass) builds with `keep` as its `precision.keep` (and, for a
    block-scaled one choosing formats, `routes` and `base` as its own)."""
    fields = dataclasses.asdict(precision_config)
    fields.pop("name")
    fields["keep"] = list(keep)
    if routes is not None:
        fields["routes"], fields["base"] = list(routes), base
    return hydra.utils.instantiate(fields)


def autopilot(precision_config, out: pathlib.Path | None) -> lowtrain.train.Autopilot:
    """The `Autopilot` of an FP8 precision's config with `auto=true`, writing its
    plans to `out` (the run directory)."""
    p = precision_config
    missing = [f for f in AUTO_FIELDS if not hasattr(p, f)]
    if missing or not getattr(p, "auto", False):
        raise ValueError(
            "Expected an FP8 precision config with `auto=true` for the autopilot, "
            f"got {type(p).__name__} with auto={getattr(p, 'auto', None)!r} instead."
        )
    common = dict(
        every=p.auto_every,
        batches=p.auto_batches,
        max_flush_fwd=p.auto_max_flush_fwd,
        max_flush_bwd=p.auto_max_flush_bwd,
        max_saturate=p.auto_max_saturate,
        min_dim=getattr(p, "min_dim", 0),
        keep=list(getattr(p, "keep", [])),
        directory=out,
    )
    formats = getattr(p, "formats", None)
    if formats is None:
        return lowtrain.train.Autopilot(lambda keep: build_precision(p, keep), **common)
    return lowtrain.train.Autopilot(
        lambda keep, routes, base: build_precision(p, keep, routes, base),
        formats=list(formats),
        max_error_fwd=p.auto_max_error_fwd,
        max_error_bwd=p.auto_max_error_bwd,
        min_share=p.auto_min_share,
        **common,
    )
