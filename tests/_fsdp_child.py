"""FSDP against replicated: loss trajectories and per-device bytes of the state.

For each case, trains the same model from the same state for `--steps` steps with
`lowtrain.Trainer(sharding="replicated")` and `sharding="fsdp"` on all devices, and
reports both loss trajectories and the bytes of parameters + optimizer state that
one device holds (the most over devices, from each array's `addressable_shards`),
against the bytes of the whole state. Run it with 8 CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python tests/_fsdp_child.py gpt_fp32 gpt_bf16 gpt_fp8

Cases: `gpt_fp32`, `gpt_bf16`, `gpt_fp8` (the recipes' GPT: 2 layers, 4 heads,
width 64, context 16, vocabulary 64, its blocks under `lax.scan`, under that AMP
policy), `gpt_scalify` (`Scalify("p=f32,c=f16")`), `gpt_unit` (the unit-scaled
`uu.TransformerDecoder`, bf16), `delayed_fp8` (two `fp8.Fp8Linear(delayed=True)`
layers, width 128), `gpt_wide_bf16` (the GPT at 8 layers, width 512, context 64,
vocabulary 256, bf16, `remat="dots"`: under FSDP a layer gathered at a time;
AdamW warming up to 1e-3 over 100 steps, as the recipes train it). Batch 32,
`optax.adam(3e-3)` but for that one. Prints a table, then one JSON line
(`tests/test_sharding.py` reads it).

`--layouts` (default `fsdp`): the layouts each case runs in besides replicated:
`fsdp`, and `fsdp_tp`: a mesh `{fsdp: 4, tensor: 2}` with the GPT's logical axis
names (`gpt.AXIS_NAMES`: attention heads, MLP and vocabulary split over "tensor").
"""

from __future__ import annotations

import argparse
import collections
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowtrain
import lowtrain.fp8 as fp8
import lowtrain.unit_scaling as uu
from lowtrain.recipes._config import GPTConfig
from lowtrain.recipes.gpt import AXIS_NAMES, GPT, GptTrainer, UnitGptTrainer

VOCAB, LENGTH, BATCH, WIDTH = 64, 16, 32, 64


def gpt_batch(step: int) -> dict:
    """Tokens with something to learn: each odd position is its left neighbour + 1."""
    rng = np.random.default_rng(step)
    data = rng.integers(0, VOCAB, (BATCH, LENGTH + 1), dtype=np.int32)
    data[:, 1::2] = (data[:, ::2][:, : data[:, 1::2].shape[1]] + 1) % VOCAB
    return {"x": data[:, :-1], "y": data[:, 1:]}


class Fp8Regression(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def regression_batch(step: int) -> dict:
    x = np.random.default_rng(step).normal(size=(BATCH, 32)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, ::-1] * 2.0)}


def wide_batch(step: int) -> dict:
    """`gpt_wide_bf16`'s batch: 32 x 64 tokens of 256, as `gpt_batch` makes them."""
    rng = np.random.default_rng(step)
    data = rng.integers(0, 256, (BATCH, 65), dtype=np.int32)
    data[:, 1::2] = (data[:, ::2][:, : data[:, 1::2].shape[1]] + 1) % 256
    return {"x": data[:, :-1], "y": data[:, 1:]}


def build(case: str, key):
    """(Trainer class, model, trainer keyword arguments, data) of one case."""
    if case == "gpt_wide_bf16":  # 8 layers of width 512: one gathered at a time
        model = GPT(GPTConfig(8, 8, 512, 64, True), 256, key=key)
        options = {"precision": "bf16", "remat": "dots"}
        return GptTrainer, model, options, wide_batch
    if case == "delayed_fp8":
        k1, k2 = jax.random.split(key)
        model = eqx.nn.Sequential(
            [
                fp8.Fp8Linear(32, 128, delayed=True, key=k1),
                eqx.nn.Lambda(jax.nn.relu),
                fp8.Fp8Linear(128, 32, delayed=True, key=k2),
            ]
        )
        return Fp8Regression, model, {}, regression_batch
    if case == "gpt_unit":
        model = uu.TransformerDecoder(WIDTH, VOCAB, layers=2, heads=4, key=key)
        return UnitGptTrainer, model, {"precision": "bf16"}, gpt_batch
    model = GPT(GPTConfig(2, 4, WIDTH, LENGTH, True), VOCAB, key=key)
    options = {
        "gpt_fp32": {"precision": "fp32"},
        "gpt_bf16": {"precision": "bf16"},
        "gpt_fp8": {"precision": "fp8"},
        "gpt_scalify": {"precision": lowtrain.train.Scalify("p=f32,c=f16")},
    }[case]
    return GptTrainer, model, options, gpt_batch


def device_bytes(tree) -> tuple[int, int, int]:
    """(the most bytes one device holds, the bytes of the whole tree, the number of
    arrays not fully replicated) over the arrays of `tree`."""
    per_device: dict = collections.Counter()
    total = sharded = 0
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        total += x.nbytes
        sharded += not x.sharding.is_fully_replicated
        for shard in x.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values()), total, sharded


LAYOUTS = {
    "replicated": {"sharding": "replicated"},
    "fsdp": {"sharding": "fsdp"},
    "fsdp_tp": {"mesh": {"fsdp": 4, "tensor": 2}, "axis_names": AXIS_NAMES},
}


def run(case: str, layout: str, steps: int) -> dict:
    cls, model, options, data = build(case, jax.random.key(0))
    # The wide GPT with the recipes' optimizer: AdamW, the learning rate warming up.
    warmup = optax.adamw(optax.linear_schedule(0.0, 1e-3, 100), weight_decay=0.1)
    optimizer = warmup if case == "gpt_wide_bf16" else optax.adam(3e-3)
    trainer = cls(model, optimizer, **LAYOUTS[layout], **options)
    state = trainer.init(key=jax.random.key(1))
    most, total, sharded = device_bytes((state.model, state.opt_state))
    losses = []
    for step in range(steps):
        state, metrics = trainer.compiled_step(trainer.shard_batch(data(step)), state)
        losses.append(float(metrics["loss"]))
    out = {
        "losses": losses,
        "device_bytes": most,
        "total_bytes": total,
        "sharded_arrays": sharded,
    }
    if case == "delayed_fp8":
        out["amax_history_max"] = float(
            jnp.max(state.model.layers[0].x_scale.amax_history)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", default="fsdp")
    args = parser.parse_args()
    results = {}
    print(f"{len(jax.devices())} devices ({jax.devices()[0].platform})")
    print(
        "| case | layout | final loss, replicated | max abs loss diff | bytes per "
        "device, replicated | bytes per device, layout | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in args.cases:
        rep = run(case, "replicated", args.steps)
        results[case] = {"replicated": rep}
        for layout in args.layouts.split(","):
            other = results[case][layout] = run(case, layout, args.steps)
            diff = np.max(np.abs(np.subtract(rep["losses"], other["losses"])))
            ratio = other["device_bytes"] / rep["device_bytes"]
            print(
                f"| {case} | {layout} | {rep['losses'][-1]:.4f} | {diff:.2e} | "
                f"{rep['device_bytes']} | {other['device_bytes']} | {ratio:.4f} |"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
