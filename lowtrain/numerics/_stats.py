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
from jax import lax
from jaxtyping import Array, Float, Int

# The formats a report checks, by the names `ml_dtypes` and `jnp.dtype` give them.
FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")


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
# Values per concatenated group of `batch_stats`: 16 MB of float32, under glibc's
# largest mmap threshold (32 MB), so that a freed group's memory is reused by the
# next step's instead of being mapped (and page-faulted) afresh: measured on the GPT
# step of `scripts/bench.py numerics`, 2**22 1.8x, 2**23 2.4x, one group 2.1x.
GROUP = 2**22
# Tensors of this many values or more are read where they lie, not copied into a
# group: on the same GPT step, 2**16 1.18-1.28x, 2**17 1.26-1.28x, 2**18
# 1.33-1.37x, with 20-21 s, 17-19 s and 16 s to compile the tracked step (1.75-1.98x
# and 11 s copying every tensor; 2 s the plain step).
ALONE = 2**17


def _bits(value: float) -> int:
    return int(np.array(value, np.float32).view(np.int32))


def _lowest_counted() -> np.ndarray:
    # Per check, the smallest float32 bit pattern of `|x|` it counts (for `|x| >= 0`
    # the bit patterns, as int32, are ordered as the values): nonzero, not lost to
    # underflow per format, overflow per format, infinite or NaN, NaN. Bit
    # patterns, not float comparisons, so float32 subnormals (bfloat16's smallest
    # values) count exactly: XLA's CPU backend flushes them to zero in float
    # arithmetic.
    lowest = [1]
    for fmt in FORMATS:
        under, inclusive, _, _ = THRESHOLDS[fmt]
        lowest.append(_bits(under) + inclusive)
    for fmt in FORMATS:
        _, _, over, inclusive = THRESHOLDS[fmt]
        lowest.append(_bits(over) + (not inclusive))
    lowest.append(_bits(np.inf))  # infinite or NaN
    lowest.append(_bits(np.inf) + 1)  # NaN
    return np.array(lowest, np.int32)


_LOWEST = _lowest_counted()


def _at_least(bits: Array, lowest: int) -> Array:
    # 1 where `bits >= lowest`, else 0, as int32 arithmetic: XLA's CPU backend
    # vectorises a sum of this inside a reduction, not of a comparison.
    return lax.shift_right_logical(jnp.int32(lowest - 1) - bits, jnp.int32(31))


def _ratio(x: Array, top: Array) -> Array:
    # `x / top` for `0 <= x <= top`, `top > 0`. XLA's CPU backend divides by
    # multiplying with the reciprocal, which is 0 (flushed) for `top >= 2**126`:
    # both are moved by a factor of 4 towards 1 first.
    s = jnp.where(top >= 1, np.float32(0.25), np.float32(4.0))
    return (x * s) / (top * s)


def empty_stats(layers: int = 0) -> tuple[Float[Array, "*L 2"], Int[Array, "*L n"]]:
    """The record of no values: `merge`'s identity (one per layer with `layers`)."""
    lead = (layers,) if layers else ()
    return jnp.zeros((*lead, 2), jnp.float32), jnp.zeros((*lead, N_COUNTS), jnp.int32)


def merge(a, b):
    """The record of the values of records `a` and `b` together (exact); records
    with a leading layer axis merge layer by layer."""
    (am, ac), (bm, bc) = a, b
    amax, asq, bmax, bsq = am[..., 0], am[..., 1], bm[..., 0], bm[..., 1]
    top = jnp.maximum(amax, bmax)
    safe = jnp.where(top > 0, top, 1.0)
    sumsq = asq * jnp.square(_ratio(amax, safe)) + bsq * jnp.square(_ratio(bmax, safe))
    return jnp.stack([top, sumsq], -1), ac + bc


def merge_stacked(moments, counts, apart: int = 0):
    """The record of records stacked along their leading axes (a scan's), keeping
    the last `apart` axes before the record's own (a layer axis, say) apart."""
    lead = moments.shape[moments.ndim - 1 - apart : -1]
    moments = moments.reshape(-1, *lead, 2)
    top = jnp.max(moments[..., 0], axis=0, initial=0.0)
    safe = jnp.where(top > 0, top, 1.0)
    sumsq = jnp.sum(moments[..., 1] * jnp.square(_ratio(moments[..., 0], safe)), 0)
    return jnp.stack([top, sumsq], -1), counts.reshape(-1, *lead, N_COUNTS).sum(0)


def finish(moments: np.ndarray, counts: np.ndarray) -> list[dict]:
    """Records' numbers, on the host (`moments` `(n, 2)`, `counts` `(n, N_COUNTS)`):
    per record `size`, `rms`, `absmax`, `zero` (the fraction of values that are zero,
    or NaN), and `underflow`/`overflow` as fractions of the nonzero values per format
    (0 if none). In numpy over all records at once: a report has hundreds."""
    moments = np.asarray(moments, np.float64).reshape(-1, 2)
    counts = np.asarray(counts, np.int64).reshape(-1, N_COUNTS)
    absmax, sumsq = moments[:, 0], moments[:, 1]
    size, nonzero = counts[:, 0], counts[:, 1]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        rms = np.where(size > 0, absmax * np.sqrt(sumsq / np.maximum(size, 1)), 0.0)
        # e.g. a -inf attention mask (a NaN would make absmax NaN)
        rms = np.where(np.isinf(absmax), np.inf, rms)
        zero = np.where(size > 0, 1.0 - nonzero / np.maximum(size, 1), 0.0)
        frac = np.where(
            nonzero[:, None] > 0, counts[:, 2:] / np.maximum(nonzero, 1)[:, None], 0.0
        )
    n = len(FORMATS)
    rows = zip(
        size.tolist(), rms.tolist(), absmax.tolist(), zero.tolist(), frac.tolist()
    )
    return [
        {
            "size": s,
            "rms": r,
            "absmax": a,
            "zero": z,
            "underflow": dict(zip(FORMATS, f[:n])),
            "overflow": dict(zip(FORMATS, f[n:])),
        }
        for s, r, a, z, f in rows
    ]


def lost(row: dict, fmt: str) -> float:
    """The fraction of a report row's nonzero values that a cast to `fmt` would lose
    (to zero or past the largest finite value)."""
    return row["underflow"][fmt] + row["overflow"][fmt]


def _chunks(size: int) -> int:
    # Chunks of `CHUNK` values a tensor of `size` values takes (at least one).
    return -(-max(size, 1) // CHUNK)


def _padded(x: Array) -> Float[Array, " n"]:
    # `x` flat in float32, zero-padded to whole chunks (a no-op for most tensors).
    v = x.astype(jnp.float32).reshape(-1)
    return jnp.pad(v, (0, _chunks(v.size) * CHUNK - v.size))


# The sum of squares of a chunk is taken in float32 at a scale, `|x| * 2**e` for
# `e` in SCALES: a sum of 1024 squares does not overflow while the largest value is
# below 2**(58 - e), and the squares that count (above 2**-24 of the largest one)
# stay normal numbers while it is above 2**(-51 - e). Each scale's range,
# [2**-151, 2**-42], [2**-90, 2**19] and [2**19, 2**128], covers the chunks it is
# used for (largest `|x|` below 2**-60, below 2**19, the rest): exact to float32
# rounding for any values. The first scale is needed so rarely that its sums are
# computed only when some chunk needs them.
SCALES = (100, 39, -70)
SPLITS = (2.0**-60, 2.0**19)
# The smallest bit pattern of `|x|` for which a chunk needs its high-scale sum: below
# it, that sum is zero.
_HIGH_FROM = _bits(SPLITS[1])


def _add(p, q):
    return [s + t for s, t in zip(p, q)]


def _packed_flags(bits: Array) -> list[Array]:
    # Every count of `_LOWEST` for each value, two to an int32 (16 bits each: a chunk
    # counts at most CHUNK = 1024 of each), so one reduction with few accumulators
    # counts them all.
    flags = [_at_least(bits, int(lowest)) for lowest in _LOWEST]
    flags += [jnp.zeros_like(bits)] * (len(flags) % 2)
    return [a + (b << 16) for a, b in zip(flags[::2], flags[1::2])]


def _unpack(packed: Int[Array, "chunks p"]) -> Int[Array, "chunks n"]:
    # `_packed_flags`' sums per chunk, unpacked: (chunks, len(_LOWEST)).
    both = jnp.stack([packed & 0xFFFF, packed >> 16], -1)
    return both.reshape(packed.shape[0], -1)[:, : len(_LOWEST)]


def _chunk_sums(v: Float[Array, " n"]):
    """Per chunk of `v` (float32, whole chunks): the largest `|x|` (as its bit
    pattern), the sum of squares at the middle of SCALES, and every count of
    `_LOWEST` (nonzero, not lost to underflow per format, overflow per format,
    infinite or NaN, NaN).

    One variadic reduction, reading `v` once: XLA's CPU backend fuses it with the
    reads and vectorises it, as it does for an integer maximum (of the bit
    patterns), integer counts (packed two to an int32) and one float sum, not for a
    float maximum or two float sums.
    """
    bits = (lax.bitcast_convert_type(v, jnp.int32) & 0x7FFFFFFF).reshape(-1, CHUNK)
    a = lax.bitcast_convert_type(bits, jnp.float32)
    packed = _packed_flags(bits)
    operands = [bits, jnp.square(a * np.float32(2.0 ** SCALES[1])), *packed]
    init = [np.int32(0), np.float32(0)] + [np.int32(0)] * len(packed)

    def first(p, q):
        return [jnp.maximum(p[0], q[0])] + _add(p[1:], q[1:])

    top, mid, *counts = lax.reduce(operands, init, first, (1,))
    return top, mid, _unpack(jnp.stack(counts, 1))


def _high_sums(v: Float[Array, " n"]):
    """Per chunk of `v`: the sum of squares at the last of SCALES. A second read,
    needed only where some chunk holds a value of 2**19 or more (else zero)."""
    a = jnp.abs(v).reshape(-1, CHUNK)
    return jnp.sum(jnp.square(a * np.float32(2.0 ** SCALES[2])), 1)


def _low_sums(v: Float[Array, " n"]) -> Float[Array, " chunks"]:
    scaled = jnp.abs(v).reshape(-1, CHUNK) * np.float32(2.0 ** SCALES[0])
    return jnp.sum(jnp.square(scaled), 1)


def _read_materialised(fn, never, xs: list):
    """`fn(xs)`, inside a `cond` whose predicate is always true at run time but not
    known to the compiler, so that XLA reads each of `xs` from memory: otherwise it
    fuses the ops that make a tensor into the statistics' reductions and computes
    them again there, unvectorised (measured on the GPT step of
    `scripts/bench.py numerics`: 1.60x the plain step with it, 1.98x without;
    reading the large tensors in place instead of copying them, 1.25x with it,
    1.9-2.1x without). `never(xs)`, the other branch, never runs; it returns
    what `fn` does, in values no statistic could be mistaken for (NaN).
    """
    first = next((x for x in xs if x.size), None)
    if first is None:
        return fn(xs)
    bits = lax.bitcast_convert_type(first.reshape(-1)[0].astype(jnp.float32), jnp.int32)
    return lax.cond((bits | 1) != 0, fn, never, xs)


def batch_stats(xs: list) -> tuple[Float[Array, "n 2"], Int[Array, "n c"]]:
    """The `(moments, counts)` record of each of `xs`, stacked.

    Each tensor is read in chunks of `CHUNK` values (dense reductions per chunk, see
    `_chunk_sums`), the chunks' results then combined per tensor (segment ops over
    the few chunks). Tensors of `ALONE` values or more are read where they lie;
    smaller consecutive ones are concatenated in groups of up to `GROUP` values, so
    that XLA compiles one reduction per group instead of one per small tensor.
    """
    n = len(xs)
    sizes = [x.size for x in xs]
    groups: list[list[int]] = []
    current: list[int] | None = None  # the group small tensors join
    filled = 0  # values in it
    for i, s in enumerate(sizes):
        if s >= ALONE:
            groups.append([i])
            current = None
            continue
        if current is None or filled + s > GROUP:
            current, filled = [], 0
            groups.append(current)
        current.append(i)
        filled += s

    n_chunks = sum(_chunks(s) for s in sizes)

    def chunk_pass(xs):
        parts = [
            _padded(xs[g[0]])
            if len(g) == 1
            else jnp.concatenate([_padded(xs[i]) for i in g])
            for g in groups
        ]

        def per_chunk(fn):  # `fn` of every part, its results concatenated
            return jax.tree.map(lambda *r: jnp.concatenate(r), *map(fn, parts))

        top_bits, mid, counts = per_chunk(_chunk_sums)
        # A second read only if some chunk holds values of 2**19 or more (for its
        # RMS: every count is in the first), a third only if some chunk is tiny
        # (below SPLITS[0]); in most batches of tensors neither.
        high = lax.cond(
            jnp.any(top_bits >= _HIGH_FROM),
            lambda: per_chunk(_high_sums),
            lambda: jnp.zeros_like(mid),
        )
        chunk_max = lax.bitcast_convert_type(top_bits, jnp.float32)
        tiny = (chunk_max > 0) & (chunk_max < SPLITS[0])
        low = lax.cond(
            jnp.any(tiny), lambda: per_chunk(_low_sums), lambda: jnp.zeros_like(mid)
        )
        return chunk_max, mid, high, counts, low

    def never(xs):
        nan = jnp.full(n_chunks, np.nan, jnp.float32)
        return nan, nan, nan, jnp.zeros((n_chunks, len(_LOWEST)), jnp.int32), nan

    chunk_max, mid, high, chunk_counts, low = _read_materialised(
        chunk_pass, never, list(xs)
    )
    owner = np.concatenate(
        [np.full(_chunks(sizes[i]), i, np.int32) for g in groups for i in g]
    )
    # Each chunk's sum of squares at its scale, over its maximum (0 for zeros). The
    # scale's index is the number of SPLITS at or below the maximum (2 for a NaN).
    which = sum((~(chunk_max < np.float32(t))).astype(jnp.int32) for t in SPLITS)
    scale = jnp.asarray(np.float32([2.0**e for e in SCALES]))[which]
    ref = jnp.where(chunk_max > 0, chunk_max, 1.0) * scale  # ref**2 is normal
    chunk_sq = jnp.stack([low, mid, high], 1)[jnp.arange(which.size), which]
    chunk_sq = chunk_sq / (ref * ref)
    seg = dict(segment_ids=owner, num_segments=n, indices_are_sorted=True)
    absmax = jnp.maximum(jax.ops.segment_max(chunk_max, **seg), 0.0)
    top = jnp.where(absmax > 0, absmax, 1.0)[owner]
    sumsq = jax.ops.segment_sum(chunk_sq * jnp.square(_ratio(chunk_max, top)), **seg)
    flags = jax.ops.segment_sum(chunk_counts, **seg)
    k = len(FORMATS)
    counted, kept = flags[:, :1], flags[:, 1 : 1 + k]
    over, nonfinite, nan = flags[:, 1 + k : -2], flags[:, -2:-1], flags[:, -1:]
    size = jnp.asarray(np.array(sizes, np.int32))[:, None]
    # NaN is in every flag (its bit pattern is above all), and counted in none. An
    # infinity is nonzero but no overflow: a cast keeps it (a -inf attention mask).
    counts = jnp.concatenate([size, counted - nan, counted - kept, over - nonfinite], 1)
    return jnp.stack([absmax, sumsq], 1), counts


def rounding_error(x: Array, fmt: str) -> Array:
    """`x - round(x)` in float32: what rounding `x` to nearest in `fmt` loses,
    saturating at its largest value (0 where `x` is not finite)."""
    x = x.astype(jnp.float32)
    top = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    rounded = jnp.clip(x, -top, top).astype(fmt).astype(jnp.float32)
    return jnp.where(jnp.isfinite(x), x - rounded, 0.0)
