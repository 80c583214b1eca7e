"""Benchmark `lowtrain.amp` against the same mixed precision written by hand.

Everything runs in one process and is printed as markdown tables, which are the source
of truth for `docs/performance.md`. The models are the recipes' own, from
`scripts/benchlib/models.py`: `lowtrain.recipes.mnist.MLP` (784-512-512-10, batch 128)
and `lowtrain.recipes.gpt.GPT` (4 layers, 4 heads, width 128, context 64, batch 16,
vocabulary 64, the blocks under `lax.scan`).

1. Train-step time. A training step (`eqx.filter_value_and_grad` and an `optax.adam`
   update, jitted with `eqx.filter_jit`) whose loss is `lowtrain.amp(loss, policy)`,
   against the same step written by hand in the style of jmp/mpx: parameters and
   inputs cast to the compute dtype, matmuls in half precision, and layer norm,
   softmax, GELU and the cross-entropy upcast to float32 by hand and cast back before
   the next matmul, i.e. the placement the default AMP policy gives; for the "fp8"
   preset, each matmul a `lowtrain.fp8.fp8_dot_general` called by hand (its operands
   as they come, the rest in bfloat16). Both compute the same loss (the table checks
   it), under "fp16", "bf16" and "fp8". A second hand-written step sums its bias
   gradients in float32 as `amp` does (plain autodiff sums them in half precision):
   amp against it is the cost of the transform itself. Each time is the
   median over `--steps` steps after warmup; the variants alternate in rounds of 5
   steps (A, B, C, D, A, B, ...; amp with `residuals="half"` is timed too).
2. Trace and compile time of the same two steps: `eqx.filter_jit(step).lower(...)`
   (tracing, which includes the AMP re-interpretation, and lowering), then
   `.compile()`, from cold caches (`jax.clear_caches()` and fresh functions before
   each measurement); the median over 5 repetitions (1 with `--quick`).
3. Bytes of the residuals that reverse-mode differentiation saves for the backward pass
   of the GPT loss, for the float32 loss, `amp` under "fp16" and "bf16", and the
   hand-written half-precision losses (`scripts/benchlib/residuals.py`: the residual
   set of `jax.ad_checkpoint.print_saved_residuals`, each attributed to the primitive
   and `jax.named_scope` that produce it); then a breakdown of what stays in float32
   under "fp16". Residuals are counted in the jaxpr, before XLA fuses or
   rematerialises anything; for comparison, the table also gives the temporary buffer
   size XLA reports for the compiled value and gradient (`memory_analysis()`; skipped
   with `--quick`).

Run it from the repository root:

    python scripts/bench.py amp              # 200 timed steps per variant, ~8 minutes
    python scripts/bench.py amp --quick      # 20 timed steps, about a minute
    python scripts/bench.py amp --steps 500  # more steps for steadier medians
"""

from __future__ import annotations

import argparse
import time

from . import models, report

ROUND = 5  # steps per variant in each round of the interleaved timing


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="bench.py amp", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per variant, at least 20 (default 200; 20 with --quick); "
        "the MLP, whose steps are short and noisy, runs 5 times as many",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="20 timed steps and one cold compile per variant, no XLA memory "
        "analysis (about a minute)",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 20 if args.quick else 200
    if args.steps < 20:
        parser.error("--steps must be at least 20")
    args.round = ROUND
    args.warmup = 2 if args.quick else 3
    args.compile_reps = 1 if args.quick else 5
    return args


def main(argv=None) -> None:
    """Run the three measurements and print them as markdown."""
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"Machine: {report.machine()}", flush=True)
    print(
        f"Settings: {args.steps} timed steps per variant in rounds of {args.round} "
        f"(A, B, C, D, A, ...) after {args.warmup} warmup steps; "
        f"{args.compile_reps} cold compile(s) per variant.\n",
        flush=True,
    )
    cases = models.make_cases()
    step_table = report.step_time_table(cases, args)
    compile_table = report.compile_time_table(cases, args)
    residuals = report.residual_tables(cases[1], xla_memory=not args.quick)
    print("\n## Train-step time (median ± half IQR)\n")
    print(step_table)
    print("\n## Trace + compile time (cold caches, median)\n")
    print(compile_table)
    print(f"\n## Residuals saved for the backward pass: {cases[1].name}\n")
    print(residuals)
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")
