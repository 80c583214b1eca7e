"""The bytes the Trainer's loss saves for the backward pass, by dtype, for the bench's
models in each precision: what peak memory grows with on a GPU, measurable on a CPU
(whose compiled step computes half precision in float32, so XLA's memory analysis
there shows no saving).

Each case is `scripts/bench.py`'s (`benchlib.throughput.make_case`: the recipe's
Trainer and precision) with optional Hydra overrides per row; the loss is
`trainer.loss(precision.wrap_model(model), precision.inputs(batch))`, differentiated
with respect to the model's arrays, and the residuals are those of
`jax.ad_checkpoint.print_saved_residuals` (`lowtrain._compat.saved_residual_avals`),
traced on shapes only: nothing is allocated, so GPT-2 small at 16 x 1024 tokens runs
in seconds. Counted in the jaxpr, before XLA fuses or rematerialises anything.

    python scripts/bench.py saved-bytes --model gpt_small
    python scripts/bench.py saved-bytes --model gpt \
        --rows fp32 bf16:precision.residuals=half
    python scripts/bench.py saved-bytes --model gpt_small --set model.attention=einsum
"""

from __future__ import annotations

import argparse
import collections

import equinox as eqx
import jax
import numpy as np

from lowtrain import _compat

from . import report, throughput

ROWS = [
    "fp32",
    "bf16",
    "bf16:precision.residuals=half",
    "fp16",
    "fp16:precision.residuals=half",
    "fp8",
    "fp8:precision.residuals=half",
]
MiB = 2**20


def saved_bytes(model_name: str, row: str, common: tuple = ()) -> dict[str, int]:
    """`{dtype: bytes}` saved for the backward pass by the case `row`
    ("<precision>[:override[,override...]]"), with the Hydra overrides `common`
    first."""
    precision, _, overrides = row.partition(":")
    extra = [*common, *(o for o in overrides.split(",") if o)]
    case = throughput.make_case(model_name, precision, None, extra)
    params, static = eqx.partition(case.trainer.model, eqx.is_array)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    batch = throughput.synthetic_data(case)(0)

    def loss(params):
        model = eqx.combine(params, static)
        return case.trainer_loss(model, batch["x"], batch["y"], jax.random.key(0))

    totals: dict[str, int] = collections.defaultdict(int)
    for aval in _compat.saved_residual_avals(loss, params):
        totals[str(aval.dtype)] += int(np.prod(aval.shape)) * aval.dtype.itemsize
    return dict(totals)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py saved-bytes", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="gpt_small", choices=sorted(throughput.SIZES)
    )
    parser.add_argument("--rows", nargs="+", default=ROWS)
    throughput.add_set_argument(parser, "row", "model.attention=einsum")
    args = parser.parse_args(argv)
    print(f"Machine: {report.machine()}\n")
    results = {row: saved_bytes(args.model, row, tuple(args.set)) for row in args.rows}
    reference = sum(results.get("fp32", {}).values()) or None
    common = "".join(f", {o}" for o in args.set)
    print(
        f"Saved for the backward pass, `model={args.model}{common}` (MiB):\n\n"
        "| precision | total | float32 | 16-bit | FP8 | other | total / fp32 |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    for row, totals in results.items():
        total = sum(totals.values())
        f32 = totals.get("float32", 0)
        half = totals.get("bfloat16", 0) + totals.get("float16", 0)
        # `lowtrain.fp8` saves its FP8 operands as their bits (uint8).
        fp8 = sum(
            v for k, v in totals.items() if k.startswith("float8") or k == "uint8"
        )
        other = total - f32 - half - fp8
        ratio = "–" if reference is None else f"{total / reference:.3f}"
        cells = [total, f32, half, fp8, other]
        print(
            f"| {row} | "
            + " | ".join(f"{c / MiB:.1f}" for c in cells)
            + f" | {ratio} |"
        )
