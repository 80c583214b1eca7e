"""The Trainer's step with `lowtrain.train.apply_if_finite` (a select) against the
same step with `optax.apply_if_finite` (a `lax.cond`): where they part, and by how
much.

For each precision, the char-GPT's Trainer is built as the recipes build it
(`benchlib.throughput.make_case`, `model=gpt`) twice: once with each wrapper around
the recipe's optimizer. Both run `--steps` steps of `trainer.compiled_step` on the
same synthetic batches from the same initial state. Printed per precision: the first
step whose state or metrics differ in any bit (NaN equal to NaN), the skipped steps
(non-finite gradients), the largest absolute difference of a weight after the last
step (Adam's normalised steps carry a last-bit difference in a near-zero gradient to
a full step of the learning rate), and both last losses.

    python scripts/finite_check.py                 # every precision, 20 steps
    python scripts/finite_check.py --precisions fp16 --steps 40
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from benchlib import throughput  # noqa: E402

from lowtrain.train import apply_if_finite  # noqa: E402
from lowtrain.train._finite import NEVER  # noqa: E402

DEFAULT = "fp32,bf16,fp16,fp8,scalify_fp8,unit_fp32,unit_fp16,unit_fp8"


def run(precision: str, wrapper, steps: int) -> list:
    """The states and metrics of `steps` steps with `wrapper` around the optimizer."""
    case = throughput.make_case("gpt", precision, None)
    trainer = case.trainer
    trainer.optimizer = wrapper(case.optimizer, NEVER)  # before the step compiles
    data = throughput.synthetic_data(case)
    state = trainer.init(key=jax.random.key(1))
    out = []
    for s in range(steps):
        state, metrics = trainer.compiled_step(data(s), state)
        out.append(jax.device_get((state, metrics)))
    return out


def compare(a: list, b: list) -> tuple[int | None, int]:
    """The first step whose state or metrics differ (None: none), and the skipped
    steps (a non-finite gradient) among them."""
    skipped = 0
    for s, (x, y) in enumerate(zip(a, b, strict=True)):
        lx, ly = jax.tree.leaves(x), jax.tree.leaves(y)
        if len(lx) != len(ly):
            return s, skipped
        for u, v in zip(lx, ly):
            if jax.dtypes.issubdtype(getattr(u, "dtype", None), jax.dtypes.prng_key):
                u, v = jax.random.key_data(u), jax.random.key_data(v)
            u, v = np.asarray(u), np.asarray(v)
            if u.dtype != v.dtype or u.shape != v.shape:
                return s, skipped
            if not np.array_equal(u, v, equal_nan=u.dtype.kind in "fc"):
                return s, skipped
        skipped += not bool(x[1]["grads_finite"])
    return None, skipped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default=DEFAULT)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    unknown = set(precisions) - set(throughput.RECIPES)
    if unknown:
        parser.error(
            f"Expected --precisions from {', '.join(throughput.RECIPES)}, got "
            f"{', '.join(sorted(unknown))} instead."
        )
    print(f"jax {jax.__version__}, optax {optax.__version__}, {args.steps} steps")
    for p in precisions:
        ours = run(p, apply_if_finite, args.steps)
        ref = run(p, optax.apply_if_finite, args.steps)
        first, skipped = compare(ours, ref)
        weights = zip(*(jax.tree.leaves(x[-1][0].model) for x in (ours, ref)))
        diff = max(
            float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
            for u, v in weights
        )
        losses = [float(x[-1][1]["loss"]) for x in (ours, ref)]
        where = "identical" if first is None else f"first differs at step {first}"
        print(
            f"{p}: {where}; {skipped} skipped; weights' largest difference "
            f"{diff:.2e}; last loss {losses[0]:.7f} (select) {losses[1]:.7f} (cond)"
        )


if __name__ == "__main__":
    main()
