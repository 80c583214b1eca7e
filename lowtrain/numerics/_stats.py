"""The statistics of one tensor, computed inside the compiled program.

Each float tensor becomes two small arrays: `moments = [absmax, sumsq]` (float32, with
`sumsq` the sum of `(x / absmax)^2`, so it cannot overflow) and `counts = [size,
nonzero, underflow per format..., overflow per format...]` (int32). Two such records
`merge` exactly (a loop's iterations, a `cond`'s branches); `finish` turns one into
the numbers a report row holds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float, Int

# The formats a report checks, by the names `ml_dtypes` and `jnp.dtype` give them.
FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _rounds_to(value: float, fmt: str) -> float:
    with np.errstate(over="ignore"):  # the point: does it overflow?
        return float(np.array(value, np.float32).astype(getattr(ml_dtypes, fmt, fmt)))


def _thresholds(fmt: str) -> tuple[float, bool, float, bool]:
    """`(under, under_inclusive, over, over_inclusive)`: a nonzero `|x|` rounds to
    zero iff `|x| < under` (`<=` if inclusive), and past the largest finite value iff
    `|x| > over` (`>=` if inclusive), under round-to-nearest-even.

    Both bounds are the midpoints between two neighbours of the format (0 and the
    smallest subnormal; the largest finite value and the next step up), exact in
    float32; whether the midpoint itself goes down or up is asked of `ml_dtypes`.
    """
    info = ml_dtypes.finfo(getattr(ml_dtypes, fmt, fmt))
    tiny = float(info.smallest_subnormal)
    big = float(info.max)
    ulp = 2.0 ** (math.floor(math.log2(big)) - info.nmant)
    under, over = tiny / 2, big + ulp / 2
    under_inclusive = _rounds_to(under, fmt) == 0.0
    over_inclusive = not math.isfinite(_rounds_to(over, fmt))
    return under, under_inclusive, over, over_inclusive


THRESHOLDS = {fmt: _thresholds(fmt) for fmt in FORMATS}
N_COUNTS = 2 + 2 * len(FORMATS)
CHUNK = 1024  # values per chunk of `batch_stats`


def _lowest_kept() -> np.ndarray:
    # Per check, the smallest float32 `|x|` it counts: `|x| >= bound` is "not lost to
    # underflow" for the first four and "overflow" for the last four. So all counts
    # are one broadcast comparison and one reduction (each separate reduction costs
    # XLA compile time, per tensor of the program).
    up = lambda v: np.nextafter(np.float32(v), np.float32(np.inf))  # noqa: E731
    bounds = []
    for fmt in FORMATS:
        under, inclusive, _, _ = THRESHOLDS[fmt]
        # Not below float32's smallest normal: XLA's CPU backend flushes float32
        # subnormals to zero, so those (bfloat16's smallest values) count as lost.
        bound = up(under) if inclusive else np.float32(under)
        bounds.append(max(bound, np.finfo(np.float32).tiny))
    for fmt in FORMATS:
        _, _, over, inclusive = THRESHOLDS[fmt]
        bounds.append(np.float32(over) if inclusive else up(over))
    return np.array(bounds, np.float32)


_BOUNDS = _lowest_kept()


def tensor_stats(x: Array) -> tuple[Float[Array, " 2"], Int[Array, " n"]]:
    """`(moments, counts)` of `x` as stored (see the module docstring)."""
    a = jnp.abs(x.astype(jnp.float32)).reshape(-1)
    absmax = jnp.max(a, initial=0.0)
    safe = jnp.where(absmax > 0, absmax, 1.0)
    sumsq = jnp.sum(jnp.square(a / safe))
    nonzero = jnp.sum(a > 0, dtype=jnp.int32, keepdims=True)  # NaN: not counted
    kept = jnp.sum(a[None, :] >= jnp.asarray(_BOUNDS)[:, None], axis=1, dtype=jnp.int32)
    n = len(FORMATS)
    size = jnp.full((1,), a.size, jnp.int32)
    counts = [size, nonzero, nonzero - kept[:n], kept[n:]]
    return jnp.stack([absmax, sumsq]), jnp.concatenate(counts)


def empty_stats() -> tuple[Float[Array, " 2"], Int[Array, " n"]]:
    """The record of no values: `merge`'s identity."""
    return jnp.zeros(2, jnp.float32), jnp.zeros(N_COUNTS, jnp.int32)


def merge(a, b):
    """The record of the values of records `a` and `b` together (exact)."""
    (amax, asq), (bmax, bsq) = a[0], b[0]
    top = jnp.maximum(amax, bmax)
    safe = jnp.where(top > 0, top, 1.0)
    sumsq = asq * jnp.square(amax / safe) + bsq * jnp.square(bmax / safe)
    return jnp.stack([top, sumsq]), a[1] + b[1]


def merge_stacked(moments, counts):
    """The record of records stacked along their leading axes (a scan's)."""
    moments = moments.reshape(-1, 2)
    top = jnp.max(moments[:, 0], initial=0.0)
    safe = jnp.where(top > 0, top, 1.0)
    sumsq = jnp.sum(moments[:, 1] * jnp.square(moments[:, 0] / safe))
    return jnp.stack([top, sumsq]), counts.reshape(-1, N_COUNTS).sum(0)


def finish(moments: np.ndarray, counts: np.ndarray) -> dict:
    """A record's numbers, on the host: `size`, `rms`, `absmax`, `zero` (the
    fraction of values that are zero, or NaN), and `underflow`/`overflow` as
    fractions of the nonzero values per format (0 if none)."""
    absmax, sumsq = (float(v) for v in moments)
    size, nonzero = int(counts[0]), int(counts[1])
    rms = absmax * math.sqrt(sumsq / size) if size else 0.0
    if math.isinf(absmax) and not math.isnan(sumsq):  # e.g. a -inf attention mask
        rms = math.inf
    n = len(FORMATS)
    frac = lambda c: int(c) / nonzero if nonzero else 0.0  # noqa: E731
    return {
        "size": size,
        "rms": rms,
        "absmax": absmax,
        "zero": 1.0 - nonzero / size if size else 0.0,
        "underflow": {f: frac(c) for f, c in zip(FORMATS, counts[2 : 2 + n])},
        "overflow": {f: frac(c) for f, c in zip(FORMATS, counts[2 + n :])},
    }


def lost(row: dict, fmt: str) -> float:
    """The fraction of a report row's nonzero values that a cast to `fmt` would lose
    (to zero or past the largest finite value)."""
    return row["underflow"][fmt] + row["overflow"][fmt]


def batch_stats(xs: list) -> tuple[Float[Array, "n 2"], Int[Array, "n c"]]:
    """`tensor_stats` of each of `xs`, stacked, in a few ops over all of them at once:
    XLA compiles a handful of large ops instead of a few per tensor.

    The absolute values of all tensors are concatenated, each zero-padded to whole
    chunks of `CHUNK`, and reduced per chunk (dense, fast reductions); the chunks'
    results are then combined per tensor (segment ops over the few chunks).
    """
    n = len(xs)
    sizes = [x.size for x in xs]
    chunks = [max(1, -(-s // CHUNK)) for s in sizes]
    pieces = [
        jnp.pad(jnp.abs(x.astype(jnp.float32)).reshape(-1), (0, c * CHUNK - s))
        for x, s, c in zip(xs, sizes, chunks)
    ]
    a = jnp.concatenate(pieces).reshape(-1, CHUNK)  # (all chunks, CHUNK)
    owner = np.repeat(np.arange(n, dtype=np.int32), chunks)  # each chunk's tensor
    seg = dict(segment_ids=owner, num_segments=n, indices_are_sorted=True)
    absmax = jnp.maximum(jax.ops.segment_max(jnp.max(a, 1), **seg), 0.0)
    safe = jnp.where(absmax > 0, absmax, 1.0)
    sumsq = jax.ops.segment_sum(jnp.sum(jnp.square(a / safe[owner][:, None]), 1), **seg)
    # Counts per chunk as float32 sums (exact below 2^24; XLA's CPU backend reduces
    # float32 several times faster than int32), one reduction per threshold.
    positive = a > 0  # NaN: not counted (and zero padding neither)
    flags = [positive] + [positive & (a >= b) for b in _BOUNDS]
    per_chunk = jnp.stack([jnp.sum(f.astype(jnp.float32), 1) for f in flags], 1).astype(
        jnp.int32
    )  # (all chunks, 1 + 2 * formats)
    counts = jax.ops.segment_sum(per_chunk, **seg)
    k = len(FORMATS)
    nonzero, kept = counts[:, :1], counts[:, 1:]
    size = jnp.asarray(np.array(sizes, np.int32))[:, None]
    counts = jnp.concatenate([size, nonzero, nonzero - kept[:, :k], kept[:, k:]], 1)
    return jnp.stack([absmax, sumsq], 1), counts
