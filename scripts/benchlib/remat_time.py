"""What the Trainer's `remat` costs in time and saves in memory: the recipes' GPT
(a shape of `benchlib.memory.MODELS`, default the GPT at 8 layers, width 512,
context 64, batch 32) trained on one device with `remat="none"`, `"dots"` and
`"full"`, from the same state on the same batch.

Per policy: the median seconds per step over `--steps` steps, interleaved in
rounds of 5 (`benchlib.timing.interleaved`: a slow spell of a shared machine hits
all three alike), its ratio to `"none"`, and XLA's temporaries of the compiled
step. The steps compute the same values (`tests/test_sharding.py` checks it); the
loss of each one's last step is printed to show it. On a CPU only the ratios mean
anything, and float32 (the default `--precision fp32`) is the precision a CPU
computes natively.

    python scripts/bench.py remat
    python scripts/bench.py remat --model gpt_tiny --steps 20
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from lowtrain.recipes import gpt
from lowtrain.recipes import internal as recipes
from lowtrain.recipes.internal import decay_mask

from . import memory, throughput
from .timing import interleaved, median_iqr

MiB = 2**20
POLICIES = ("none", "dots", "full")


def trainers(model: str, precision: str, extra=()):
    """`({policy: (trainer, state)}, batch)` for `model` in `precision`."""
    overrides, vocab = memory.MODELS[model]
    recipe = throughput.RECIPES[precision]
    cfg, config = throughput.compose_config(recipe, [*overrides, *extra])
    built, trainer_class = gpt.build_model(config.model, vocab, key=jax.random.key(0))
    optimizer = recipes.optimizer(cfg, config.trainer.steps, decay_mask, built)
    options = recipes.trainer_options(config)
    out = {}
    for policy in POLICIES:
        trainer = trainer_class(built, optimizer, **{**options, "remat": policy})
        out[policy] = (trainer, trainer.init(key=jax.random.key(1)))
    rng = np.random.default_rng(0)
    shape = (config.trainer.batch_size, config.model.block_size + 1)
    tokens = rng.integers(0, vocab, shape, dtype=np.int32)
    return out, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_8x512", help=",".join(memory.MODELS))
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    built, batch = trainers(args.model, args.precision, args.set)
    fns, states, temps = {}, {}, {}
    for policy, (trainer, state) in built.items():
        step = trainer.compiled_step
        compiled = step.lower(batch, state).compile()
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
        fns[policy] = _stepper(step)
        states[policy] = (state,)
    times, losses = interleaved(
        fns, states, (batch,), steps=args.steps, round_len=5, warmup=2
    )
    base = median_iqr(times["none"])[0]
    print(
        f"{args.model}, {args.precision}, {jax.devices()[0].platform}: "
        f"{args.steps} steps each, interleaved in rounds of 5\n"
    )
    print("| remat | s/step (median) | / none | temporaries (MiB) | last loss |")
    print("|---|---:|---:|---:|---:|")
    for policy in POLICIES:
        median, _ = median_iqr(times[policy])
        print(
            f"| {policy} | {median:.4f} | {median / base:.2f} "
            f"| {temps[policy] / MiB:.1f} | {float(losses[policy]):.6f} |"
        )


def _stepper(step):
    # `interleaved` calls `fn(*state, *batch)` and expects `(*state, loss)`.
    def run(state, batch):
        state, metrics = step(batch, state)
        return state, metrics["loss"]

    return run


if __name__ == "__main__":
    main()
