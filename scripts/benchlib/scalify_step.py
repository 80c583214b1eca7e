"""Step time of a scalified training step against the plain step of the same dtype.

The models are those of `bench.py amp`, the recipes' own
(`scripts/benchlib/models.py`): `lowtrain.recipes.mnist.MLP` (784-512-512-10, batch
128) and `lowtrain.recipes.gpt.GPT` (4 layers, width 128, context 64, batch 16, the
blocks under `lax.scan`). Both steps are the same Python function
(`benchlib.timing.make_step`: forward, gradient, an `optax.adam` update on float32
gradients) jitted with `eqx.filter_jit`; the scalified one runs under
`lowtrain.scalify.scalify` on float16 `ScaledArray` weights (float32 `ScaledArray` Adam
moments), as `lowtrain.train.Scalify` stores them, the plain one on float16 arrays
(float32 moments). Float inputs are float16 in both. Medians of interleaved rounds,
in one process; the ratio is what we report. The last column is the loss of each
variant's last step (on the one batch it trains on): the plain float16 step has no
loss scale and no float32 islands, and the GPT's gradients overflow in it (the first
LayerNorm's `rsqrt` derivative exceeds float16's range), so its loss is nan.

    python scripts/bench.py scalify            # ~3 minutes on 2 CPU cores
    python scripts/bench.py scalify --quick
"""

from __future__ import annotations

import argparse
import statistics

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import lowtrain.scalify as sc

from . import models, report, timing

F16, F32 = jnp.float16, jnp.float32


def compare(case: models.Case, steps: int, rounds: int) -> str:
    """A table row: median step times (plain float16, scalified float16), ratio."""
    opt = optax.adam(1e-3)
    step = timing.make_step(models.loss, opt)
    moments = opt.init(eqx.filter(case.model, eqx.is_inexact_array))
    fns = {"plain": eqx.filter_jit(step), "scalify": eqx.filter_jit(sc.scalify(step))}
    states = {
        "plain": (models.cast_floats(case.model, F16), moments),
        "scalify": (
            sc.as_scaled_array(case.model, dtype=F16),
            sc.as_scaled_array(moments),
        ),
    }
    batch = models.cast_floats(case.batch, F16)
    # The first round (compilation included) warms up.
    times, losses = timing.interleaved(
        fns, states, batch, steps=steps * rounds, round_len=steps, warmup=steps
    )
    plain_t, scal_t = (statistics.median(times[k]) for k in ("plain", "scalify"))
    plain_l, scal_l = (float(sc.asarray(losses[k], F32)) for k in ("plain", "scalify"))
    return (
        f"| {case.name} | {len(times['plain'])} | {1e3 * plain_t:.2f} "
        f"| {1e3 * scal_t:.2f} | **{scal_t / plain_t:.2f}** "
        f"| {plain_l:.3f} / {scal_l:.3f} |"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py scalify", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    args = parser.parse_args(argv)
    steps, rounds = (5, 2) if args.quick else (10, 20)
    rows = [
        f"Machine: {report.machine()}",
        "",
        "| step | timed steps | plain f16 (ms) | scalify f16 (ms) | scalify / plain "
        "| last loss, plain / scalify |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with jax.numpy_dtype_promotion("standard"):
        for case in models.make_cases():
            rows.append(compare(case, steps, rounds))
            print(rows[-1], flush=True)
    print("\n".join(rows))
