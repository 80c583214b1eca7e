"""What the Trainer's step holds per device on N devices, planned without allocating
anything: the recipes' GPT built on shapes only (`eqx.filter_eval_shape`), its
`TrainState` placed as the Trainer places it (`Trainer.layout`), and the
step (`precision.wrap_step(train_step)`, what `Trainer.compiled_step` runs) lowered
on abstract arrays and compiled for N devices of a 1-D "data" mesh; XLA's memory
analysis of the compiled step gives, per device:

- arguments: the state's shards and the batch's;
- temporaries: everything else the step holds at its peak (activations, gathered
  parameters, gradients, optimizer temporaries);
- their sum, and its ratio to replicated at the same N;
- collectives: the bytes the step's all-gathers, reduce-scatters and all-reduces
  write per device, counted from the optimized HLO with each loop body counted once
  per trip where XLA states its trip count.

On a CPU, N host devices are forced by `XLA_FLAGS=--xla_force_host_platform_device_
count` (the command re-runs itself with it); the figures are XLA's CPU buffer
assignment, which computes 16-bit floats in float32 (a GPU's are smaller).

`--largest` finds, for each layout and each width of `--widths`, the deepest GPT of
the family (width w: w / 128 heads, MLP 4w, context 2048, GPT-2's vocabulary,
batch 8, scanned blocks, `trainer.remat` as `--set` gives it) whose step fits
`--budget-gib` per device (default 80, an H100): the step planned at 2 and 4
blocks gives the bytes per block (a scanned block's state and saved activations
are the same at every depth) and the depth the budget allows; the step planned at
that depth checks it, and a line through the last two planned depths gives the
next until it gives one already planned. The row is the deepest planned depth
that fits.

    python scripts/bench.py memory                         # gpt_8x512, N = 1 2 4 8
    python scripts/bench.py memory --models gpt_1b,gpt_7b --devices 8
    python scripts/bench.py memory --largest --devices 8 --set trainer.remat=dots
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from lowtrain.recipes import gpt
from lowtrain.recipes import internal as recipes
from lowtrain.recipes.internal import decay_mask

from . import throughput

MiB = 2**20
# Model -> (Hydra overrides of `recipe=gpt_<precision>`, vocabulary).
MODELS = {
    # A tiny GPT for the test suite: 2 layers, width 64, context 16, batch 32.
    "gpt_tiny": (
        [
            "model.n_layer=2",
            "model.n_head=4",
            "model.n_embd=64",
            "model.block_size=16",
            "trainer.batch_size=32",
        ],
        64,
    ),
    # The GPT of the FSDP acceptance: 8 layers, width 512, context 64, batch 32.
    "gpt_8x512": (
        [
            "model.n_layer=8",
            "model.n_head=8",
            "model.n_embd=512",
            "model.block_size=64",
            "trainer.batch_size=32",
        ],
        256,
    ),
    "gpt_1b": (["model=gpt_1b", "trainer.batch_size=8"], 50304),
    # A 7B shape (LLaMA-2 7B's width and depth, GPT-2's MLP), context 2048.
    "gpt_7b": (
        [
            "model=gpt_1b",
            "model.n_layer=32",
            "model.n_head=32",
            "model.n_embd=4096",
            "trainer.batch_size=8",
        ],
        50304,
    ),
}
# Layout -> the Trainer's options on N devices (None: not on N).
LAYOUTS = {
    "replicated": lambda n: {"sharding": "replicated"},
    "fsdp": lambda n: {"sharding": "fsdp"},
    # FSDP x tensor parallelism: {fsdp: N/2, tensor: 2}, the GPT's logical axes.
    "fsdp_tp": lambda n: (
        None
        if n < 2 or n % 2
        else {"mesh": {"fsdp": n // 2, "tensor": 2}, "sharding": "fsdp"}
    ),
    # Data parallel x tensor parallelism: {data: N/2, tensor: 2}.
    "tp": lambda n: (
        None
        if n < 2 or n % 2
        else {"mesh": {"data": n // 2, "tensor": 2}, "sharding": "replicated"}
    ),
}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def build(model: str, precision: str, layout: str, n: int, extra=()):
    """`(trainer, abstract state, abstract batch)` of `model` in `precision` on the
    first `n` devices with `layout` (a key of `LAYOUTS`)."""
    overrides, vocab = MODELS[model]
    recipe = throughput.RECIPES[precision]
    cfg, config = throughput.compose_config(recipe, [*overrides, *extra])
    make = lambda k: gpt.build_model(config.model, vocab, key=k)
    key = jax.random.key(0)
    abstract, trainer_class = eqx.filter_eval_shape(make, key)
    optimizer = recipes.optimizer(cfg, config.trainer.steps, decay_mask, abstract)
    options = {
        **recipes.trainer_options(config),
        **LAYOUTS[layout](n),
        "axis_names": gpt.AXIS_NAMES,
        "devices": jax.devices()[:n],
    }
    trainer = trainer_class(abstract, optimizer, **options)

    def fresh(k):
        return trainer_class(make(k)[0], optimizer, **options).init(key=k)

    state = eqx.filter_eval_shape(fresh, key)
    placed = lambda x, sharding: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding
    )
    state = jax.tree.map(placed, state, trainer.layout.shardings(state))
    batch_sharding = NamedSharding(trainer.mesh, trainer.layout.batch_spec())
    shape = (config.trainer.batch_size, config.model.block_size)
    batch = {
        k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
        for k in ("x", "y")
    }
    return trainer, state, batch


def compile_step(trainer, state, batch):
    """The compiled step of `trainer` on the abstract `state` and `batch` (the
    state donated, as `compiled_step` donates it)."""
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    dynamic, static = eqx.partition(state, is_abstract)
    step = trainer.precision.wrap_step(lambda b, s: trainer.train_step(s, b))

    def run(dynamic, batch):
        new, metrics = step(batch, eqx.combine(dynamic, static))
        return eqx.filter(new, eqx.is_array), metrics["loss"]

    return jax.jit(run, donate_argnums=0).lower(dynamic, batch).compile()


_SHAPE = re.compile(
    r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64|f8e4m3fn|f8e5m2)\[([\d,]*)\]"
)
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


FLOATS = ("bf16", "f16", "f32", "f64", "f8e4m3fn", "f8e5m2")


def collective_bytes(hlo: str, dtypes=tuple(_BYTES)) -> dict[str, int]:
    """Bytes written per device by each kind of collective in the optimized `hlo`
    text: each op's result shape(s) of `dtypes` (HLO's names; default all), an op
    inside a while loop's body times the trip count XLA records for it
    (`known_trip_count`), else once."""
    bodies = {}  # computation name -> trip count of the loop it is the body of
    for line in hlo.splitlines():
        body = re.search(r"body=%?([\w.\-]+)", line)
        count = re.search(r'known_trip_count"?:\{"?n"?:"?(\d+)', line)
        if " while(" in line and body and count:
            bodies[body.group(1)] = int(count.group(1))
    totals = dict.fromkeys(COLLECTIVES, 0)
    trips = 1
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(", line)
        if head:  # a computation begins (instructions are indented)
            trips = bodies.get(head.group(1), 1)
            continue
        for kind in COLLECTIVES:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                result = line.split("=", 1)[1].split(kind)[0]
                size = sum(
                    _BYTES[d] * math.prod(int(x) for x in s.split(",") if x)
                    for d, s in _SHAPE.findall(result)
                    if d in dtypes
                )
                totals[kind] += size * trips
    return totals


def _ways(mesh, spec) -> int:
    # The number of parts `spec` splits an array into on `mesh`.
    parts = [(p,) if isinstance(p, str) else p for p in spec if p]
    return math.prod(mesh.shape[a] for part in parts for a in part)


def measure(model: str, precision: str, layout: str, n: int, extra=()) -> dict:
    """One row: the per-device bytes of the step (see the module docstring)."""
    trainer, state, batch = build(model, precision, layout, n, extra)
    compiled = compile_step(trainer, state, batch)
    analysis = compiled.memory_analysis()
    collectives = collective_bytes(compiled.as_text())
    arrays = jax.tree.leaves(
        eqx.filter(state.model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    )
    params = sum(math.prod(x.shape) for x in arrays)
    # The bytes of the parameters the layout splits, and per device what an
    # all-gather of each over the FSDP axis writes (whole, or still split over
    # "tensor"), by the model's field they are in.
    placement, split, gathered = trainer.layout, 0, collections.Counter()
    for path, x in jax.tree_util.tree_flatten_with_path(state.model)[0]:
        if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding.is_fully_replicated:
            continue
        nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        split += nbytes
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        whole = placement.spec(name, x.shape, gathered=True)
        if whole != placement.spec(name, x.shape):
            field = jax.tree_util.keystr(path[:1], simple=True)
            gathered[field] += nbytes // _ways(placement.mesh, whole)
    return {
        "model": model,
        "precision": precision,
        "layout": layout,
        "devices": n,
        "parameters": params,
        "split_parameter_bytes": split,
        "gathered_bytes_by_field": dict(gathered),
        "arguments": analysis.argument_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
        "collectives": collectives,
        # The all-gathers of floats: the parameters' (not the integer labels').
        "float_all_gather": collective_bytes(compiled.as_text(), FLOATS)["all-gather"],
    }


GiB = 2**30


def family(width: int, layers: int) -> list[str]:
    """The overrides of the family's GPT of `width` and `layers` blocks."""
    return [
        "model=gpt_1b",
        f"model.n_layer={layers}",
        f"model.n_head={width // 128}",
        f"model.n_embd={width}",
        "model.scan_layers=true",
        "trainer.batch_size=8",
    ]


def largest(layout: str, width: int, n: int, budget: float, precision, extra):
    """The deepest GPT of `width` whose step fits `budget` bytes per device with
    `layout` on `n` devices: a row of the search (see the module docstring)."""

    def plan(depth):
        overrides = [*family(width, depth), *extra]
        row = measure("gpt_1b", precision, layout, n, overrides)
        return row["arguments"] + row["temporaries"], depth, row["parameters"]

    # A line through the last two planned depths gives the next, until it gives
    # one already planned.
    points = [plan(2), plan(4)]
    row = {"layout": layout, "devices": n, "width": width}
    for _ in range(6):
        (b0, d0, _), (b1, d1, _) = points[-2:]
        per_block = (b1 - b0) / (d1 - d0)
        rest = b1 - d1 * per_block
        depth = int((budget - rest) // per_block) if per_block > 0 else 0
        row.update(bytes_per_block=per_block, bytes_outside_blocks=rest)
        if depth < 1 or any(depth == d for _, d, _ in points):
            break
        points.append(plan(depth))
    fits = [p for p in points if p[0] <= budget]
    if not fits:
        return {**row, "layers": 0, "parameters": 0, "planned": None}
    planned, depth, parameters = max(fits, key=lambda p: p[1])
    return {**row, "layers": depth, "parameters": parameters, "planned": planned}


def largest_table(rows: list[dict], budget: float) -> str:
    lines = [
        f"| layout | devices | width | GiB per block | GiB outside the blocks "
        f"| blocks that fit {budget / GiB:.0f} GiB | parameters | planned at that "
        "depth (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        planned = "-" if r["planned"] is None else f"{r['planned'] / GiB:.1f}"
        lines.append(
            f"| {r['layout']} | {r['devices']} | {r['width']} "
            f"| {r['bytes_per_block'] / GiB:.2f} "
            f"| {r['bytes_outside_blocks'] / GiB:.1f} "
            f"| {r['layers']} | {r['parameters'] / 1e9:.1f}B | {planned} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The markdown table of `rows`, each total against replicated at its N."""
    base = {
        (r["model"], r["precision"], r["devices"]): r["arguments"] + r["temporaries"]
        for r in rows
        if r["layout"] == "replicated"
    }
    lines = [
        "| model | precision | layout | devices | arguments (MiB) | temporaries (MiB) "
        "| sum (MiB) | / replicated | all-gather / reduce-scatter / all-reduce (MiB) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        total = r["arguments"] + r["temporaries"]
        ref = base.get((r["model"], r["precision"], r["devices"]))
        ratio = f"{total / ref:.2f}x" if ref else "-"
        c = r["collectives"]
        moved = " / ".join(
            f"{c[k] / MiB:.1f}" for k in ("all-gather", "reduce-scatter", "all-reduce")
        )
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['layout']} | {r['devices']} "
            f"| {r['arguments'] / MiB:.1f} | {r['temporaries'] / MiB:.1f} "
            f"| {total / MiB:.1f} | {ratio} | {moved} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt_8x512", help=",".join(MODELS))
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--layouts", default="replicated,fsdp,fsdp_tp")
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--largest", action="store_true", help="search the deepest GPT that fits"
    )
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--widths", default="2048,4096,8192")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.devices.split(",")]
    unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        parser.error(f"expected --layouts among {', '.join(LAYOUTS)}, got {unknown}")
    if len(jax.devices()) < max(counts):
        if jax.default_backend() != "cpu":
            sys.exit(f"Expected {max(counts)} devices, got {len(jax.devices())}.")
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={max(counts)}"
        )
        argv = sys.argv[1:] if argv is None else ["memory", *argv]
        script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench.py")
        sys.exit(subprocess.call([sys.executable, script, *argv], env=env))
    if args.largest:
        budget = args.budget_gib * GiB
        found = []
        for layout in args.layouts.split(","):
            for width in (int(w) for w in args.widths.split(",")):
                for n in counts:
                    if LAYOUTS[layout](n) is None:
                        continue
                    found.append(
                        largest(layout, width, n, budget, args.precision, args.set)
                    )
                    print(largest_table(found, budget).splitlines()[-1], flush=True)
        print("\n" + largest_table(found, budget))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found, f, indent=2)
        return
    rows = []
    for model in args.models.split(","):
        for n in counts:
            for layout in args.layouts.split(","):
                if LAYOUTS[layout](n) is None:
                    continue
                rows.append(measure(model, args.precision, layout, n, args.set))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print("\n" + table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
