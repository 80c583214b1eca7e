"""What lowtrain asks of the devices a program runs on."""

from __future__ import annotations

from collections.abc import Sequence

import jax


def any_gpu(devices: Sequence[jax.Device]) -> bool:
    """Whether XLA's GPU runtime runs any of `devices` (CUDA or ROCm). That runtime
    runs a `conditional` by copying its predicate to the host and waiting for the
    device (`ConditionalThunk`), so a step meant to stay queued avoids branches
    there."""
    return any(d.platform == "gpu" for d in devices)
