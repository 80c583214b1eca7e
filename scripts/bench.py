"""One benchmark command: step time, tokens/s, MFU, memory and compile time of GPTs
from the char-GPT to the widths where FP8 pays, in every precision the recipes have.

The models (`--models`), on synthetic tokens but the first: `gpt`, the recipes'
char-GPT (4 layers, width 128, context 64, batch 32); `gpt_small`, GPT-2 small's
shape (12 layers, width 768, context 1024, vocabulary 50304, batch 32); `gpt_1b`
(24 layers, width 2048, context 2048, batch 2: 1.3B parameters); `gpt_4k` (4 layers
of an 8B model's shape: width 4096, MLP 4x, context 2048, batch 8). The GPU sizes
use fused attention and the lean cross-entropy (`model.cross_entropy=lean`), and
fit one 80 GB GPU in bf16 with AdamW state. The precisions (`--precisions`): fp32,
bf16, fp16, fp8, fp8_delayed, scalify_fp8 from `recipe=gpt_<precision>`; unit_fp32,
unit_bf16, unit_fp16, unit_fp8: `model=gpt_unit` at the same shape from
`recipe=gpt_unit_<precision>`; on request only, mxfp8, fp8_block, nvfp4
(block-scaled, simulated on every backend) from `recipe=gpt_<precision>`. The
Trainer is built as `python -m lowtrain` builds it (`scripts/benchlib/throughput.py`)
and its compiled step is timed:

- step time: `--steps` (>= 20) steps after warm-up, interleaved in rounds of 5 with
  the same step written by hand with explicit casts (`benchlib.models`: the float32
  loss for fp32, mixed precision placed by hand for bf16/fp16, jmp/mpx style, and
  for fp8 with each matmul a `lowtrain.fp8.fp8_dot_general` called by hand;
  unit_fp32: the unit-scaled model's own float32 loss; unit_bf16/fp16/fp8: the
  unit-scaled model with its casts and FP8 matmuls written by hand,
  `benchlib.unit_twin`; no twin for scalify_fp8 and fp8_delayed, nor at gpt_1b and
  gpt_4k unless `--hand yes`) in the same process; each round's 5 steps queue one
  after another as in training (both steps compiled by
  `lowtrain.train.async_filter_jit`, so the host dispatches the next while the
  device runs one) and are timed together: the median over rounds of the time per
  step; `lowtrain / hand` is their ratio;
- tokens/s; MFU: model FLOPs (6 x parameters x tokens + attention) per second over
  the device's dense peak for the precision's matmul dtype (H100 SXM, H200, A100;
  "unknown" elsewhere, e.g. on a CPU);
- peak memory: on a GPU `peak_bytes_in_use` of the device after the Trainer's first
  step, each case in its own process; on a CPU XLA's memory analysis of the compiled
  step (arguments + outputs - donated + temporaries);
- compile time: the step's first call (trace, compile and one step) minus its median;
- FP8 GEMMs: on a GPU, the `__cublas$lt$matmul$f8` custom calls and the Triton GEMM
  fusions of FP8 operands in the optimized HLO (XLA's autotuner picks either)
  against all its GEMMs (forward and backward) and the matmuls the precision keeps
  wide (by `keep` or `precision.min_dim`: the dots of non-FP8 operands written in
  the program);
- the Trainer's overhead (char-GPT only): `Trainer.fit` against a plain loop calling
  the same compiled step on the same data, interleaved (`benchlib/overhead.py`);
- the targets of docs/performance.md for each model, from these rows: bf16 against
  fp32, the best FP8 precision against bf16 and unit_fp8 against the best other
  (step time), every FP8 dot an FP8 GEMM, bf16's MFU, bf16's peak memory against
  fp32's, the largest lowtrain / hand and fit / plain; met or missed (speed and
  memory of low precision get no verdict on a CPU, which emulates it).

Other measurements are commands (`python scripts/bench.py COMMAND --help`):

- `launch`: the step's compile at a program's first launch (an empty persistent
  compilation cache) and at its second (`benchlib/launch.py`);
- `gemm`: where an FP8 GEMM pays: one linear layer's forward and backward at
  widths 256 to 8192, in bf16 and FP8 (current and static scaling), with the
  break-even width (`benchlib/gemm.py`);
- `vmap`: `jax.vmap(amp(model))` (the per-example Equinox way) against
  `amp(jax.vmap(model))`, and the Trainer with a per-example loss against a batched
  model: step time and temporary memory (`benchlib/vmap_cost.py`);
- `amp`: `lowtrain.amp` against the same mixed precision written by hand on the
  recipes' MLP and GPT: step time, trace and compile time, saved residuals
  (`benchlib/amp_hand.py`);
- `scalify`, `unit`, `numerics`: the cost of `lowtrain.scalify`, of unit scaling
  and of `lowtrain.numerics.track` against the plain step of the same dtype;
- `memory`: what the step holds per device on N devices (replicated, FSDP, FSDP x
  TP), planned on abstract arrays, and the deepest GPT that fits a budget
  (`benchlib/memory.py`);
- `remat`: the Trainer's `remat` policies' step time and temporaries
  (`benchlib/remat_time.py`);
- `twin-hlo`: what the compiled lowtrain step does that its hand-cast twin does not
  (XLA's fusions and bytes);
- `saved-bytes`: the bytes each precision's loss saves for the backward pass, by
  dtype, at any model size (traced on shapes only);
- `zoo`: the gradient error against float32 of small models written the way their
  users write them (Equinox's examples, diffrax, Flax linen and NNX, einops) under
  bf16, fp16 and fp8, next to a hand cast's or an FP8 emulation's
  (`benchlib/zoo.py`; `tests/test_zoo.py` holds lowtrain to it).

Writes `bench.md`, `bench.json` and `bench.png` (tokens/s) to `--out`; with
`--save-hlo DIR` each step's optimized HLO too. A case that fails (out of memory,
say) is a table row saying why, and the script exits non-zero after the others.

    python scripts/bench.py                      # gpt and gpt_small, every precision
    python scripts/bench.py --models gpt         # the char-GPT only (CPU-sized)
    python scripts/bench.py --quick              # a tiny GPT, 20 steps: seconds
    python scripts/bench.py --precisions fp32,bf16 --out /tmp/bench
    python scripts/bench.py --models gpt_1b,gpt_4k --precisions bf16,fp8,unit_fp8
    python scripts/bench.py --models gpt_small --precisions bf16,fp8 \\
        --set precision.min_dim=1024        # Hydra overrides for every case
    python scripts/bench.py gemm                 # FP8's break-even width
    python scripts/bench.py vmap                 # per-example against batched
    python scripts/bench.py zoo                  # the model zoo's gradient errors
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from benchlib import (
    amp_hand,
    benchtable,
    gemm,
    launch,
    memory,
    numerics_step,
    overhead,
    remat_time,
    report,
    saved_bytes,
    scalify_step,
    throughput,
    timing,
    twin_hlo,
    unit_step,
    vmap_cost,
    zoo,
)

from lowtrain.train import use_compilation_cache, use_triton_gemm

PRECISIONS = list(throughput.RECIPES)
# The default cases: all but the block-scaled precisions, which every backend here
# simulates (`--precisions bf16,mxfp8,fp8_block,nvfp4` measures what that costs).
SIMULATED = ("mxfp8", "fp8_block", "nvfp4")
DEFAULT_PRECISIONS = [p for p in PRECISIONS if p not in SIMULATED]
MODELS = ["gpt", "gpt_small", "gpt_1b", "gpt_4k"]
DEFAULT_MODELS = ["gpt", "gpt_small"]
# The twin holds a second copy of the weights and the optimizer state: at these sizes
# the two do not fit one 80 GB GPU together (`--hand yes` to try).
NO_TWIN = ("gpt_1b", "gpt_4k")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 20 steps")
    parser.add_argument("--out", default="bench_out", help="folder for the files")
    parser.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help=",".join(MODELS)
    )
    parser.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS))
    parser.add_argument("--steps", type=int, default=None, help="timed steps (>= 20)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: recipe")
    parser.add_argument(
        "--overhead-steps", type=int, default=None, help="steps per fit/loop chunk"
    )
    parser.add_argument(
        "--overhead-rounds", type=int, default=None, help="timed chunks of each"
    )
    parser.add_argument(
        "--isolate",
        choices=["auto", "yes", "no"],
        default="auto",
        help="each case in its own process (auto: on a GPU, for peak memory)",
    )
    parser.add_argument(
        "--hand",
        choices=["auto", "yes", "no"],
        default="auto",
        help=f"time the hand-cast twin too (auto: all but {', '.join(NO_TWIN)})",
    )
    parser.add_argument(
        "--save-hlo", default=None, help="folder for each step's optimized HLO text"
    )
    parser.add_argument(
        "--compile-cache",
        default="default",
        help="JAX's persistent compilation cache: a folder, `default` (as "
        "`python -m lowtrain`: lowtrain.train.default_compilation_cache()) or `off`",
    )
    throughput.add_triton_gemm_argument(parser)
    throughput.add_set_argument(parser, "case", "precision.residuals=half")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.precisions = args.precisions.split(",")
    for name, given, known in [
        ("--models", args.models, MODELS),
        ("--precisions", args.precisions, PRECISIONS),
    ]:
        if unknown := set(given) - set(known):
            parser.error(f"Expected {name} from {known}, got {sorted(unknown)}.")
    if args.quick:
        args.models = ["quick"]
        args.batch_size = args.batch_size or 4
    args.steps = args.steps or (20 if args.quick else 40)
    if args.steps < 20:
        parser.error(f"Expected --steps >= 20, got {args.steps} instead.")
    args.overhead_steps = args.overhead_steps or (10 if args.quick else 50)
    args.overhead_rounds = args.overhead_rounds or (2 if args.quick else 4)
    return args


def measure(model_name: str, precision: str, args) -> dict:
    """One row: see the module docstring."""
    case = throughput.make_case(model_name, precision, args.batch_size, args.set)
    data = throughput.synthetic_data(case)
    batch = jax.device_put(data(0))
    gpu = jax.default_backend() == "gpu"
    builders = {"lowtrain": throughput.lowtrain_step}
    hand = args.hand == "yes" or (args.hand == "auto" and model_name not in NO_TWIN)
    if case.hand_loss is not None and hand:
        builders["hand"] = throughput.hand_step
    fns, states, first, memory = {}, {}, {}, None
    for name, build in builders.items():
        fns[name], state = build(case)
        t0 = time.perf_counter()  # the first call compiles
        *state, _ = jax.block_until_ready(fns[name](*state, batch))
        first[name], states[name] = time.perf_counter() - t0, tuple(state)
        if gpu and name == "lowtrain":  # before the hand step allocates anything
            memory = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    # A separate compile for XLA's view of the step (its buffers are donated below).
    hlo, analysis, lowered = throughput.compile_step(case, states["lowtrain"][0], batch)
    times, losses = timing.interleaved(
        fns, states, (batch,), steps=args.steps, round_len=5, warmup=2, per_round=True
    )
    step = {name: statistics.median(ts) for name, ts in times.items()}
    if args.save_hlo:  # to read what XLA made of the step (fusions, FP8 GEMMs)
        folder = pathlib.Path(args.save_hlo)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{model_name}_{precision}.hlo.txt").write_text(hlo)
    if gpu:
        cublaslt, triton, gemms = throughput.count_fp8_gemms(hlo)
        fp8_gemms = {"cublaslt": cublaslt, "triton": triton}
    else:
        memory, fp8_gemms, gemms = throughput.analysis_bytes(analysis), None, None
    # The matmuls the precision keeps wide: dots written in the program on operands
    # that are not FP8 (on a CPU every one: it multiplies dequantized FP8 values,
    # `lowtrain.fp8.f8_dot_lowering`).
    dots, fp8_dots = throughput.count_dots(lowered)
    peak = throughput.peak_flops(precision)
    flops = case.flops()
    row = {
        "model": model_name,
        "precision": precision,
        "parameters": case.parameters(),
        "batch": case.batch_size,
        "context": case.block_size,
        "timed_steps": len(times["lowtrain"]) * 5,  # rounds of 5
        "step_s": step["lowtrain"],
        "step_iqr_s": timing.median_iqr(times["lowtrain"])[1],
        "tokens_per_s": case.tokens / step["lowtrain"],
        "flops_per_step": flops,
        "mfu": None if peak is None else flops / step["lowtrain"] / peak,
        "memory_bytes": memory,
        "memory_source": "peak_bytes_in_use" if gpu else "XLA memory analysis",
        "compile_s": first["lowtrain"] - step["lowtrain"],
        "hand_step_s": step.get("hand"),
        "vs_hand": step["lowtrain"] / step["hand"] if "hand" in step else None,
        "loss": float(losses["lowtrain"]),
        "fp8_gemms": fp8_gemms,
        "gemms": gemms,
        "wide_dots": dots - fp8_dots,
    }
    if model_name in ("gpt", "quick"):
        row["overhead"] = overhead.trainer_overhead(
            case, data, chunk=args.overhead_steps, rounds=args.overhead_rounds
        )
    return row


def measure_isolated(model_name: str, precision: str, args) -> dict:
    """`measure` in a child process (a GPU's peak memory is per process)."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            __file__,
            *(["--quick"] if args.quick else ["--models", model_name]),
            *("--precisions", precision, "--out", out, "--isolate", "no"),
            *("--steps", str(args.steps), "--overhead-steps", str(args.overhead_steps)),
            *("--overhead-rounds", str(args.overhead_rounds)),
            *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
            *(["--save-hlo", args.save_hlo] if args.save_hlo else []),
            *("--hand", args.hand, "--compile-cache", args.compile_cache),
            *("--triton-gemm", args.triton_gemm),
            *(arg for override in args.set for arg in ("--set", override)),
        ]
        child = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE)
        sys.stderr.write(child.stderr.decode(errors="replace"))
        if child.returncode == 0:
            return json.loads((pathlib.Path(out) / "bench.json").read_text())["rows"][0]
    # A case that fails (out of memory, say) is a row saying why; the others run on.
    lines = child.stderr.decode(errors="replace").strip().splitlines() or ["no output"]
    error = f"exit {child.returncode}: {lines[-1][:300]}"
    return {"model": model_name, "precision": precision, "error": error}


def step_main(argv=None) -> None:
    """The step benchmark (the default command): see the module docstring."""
    args = parse_args(argv)
    use_triton_gemm(args.triton_gemm == "on")  # before JAX first uses the device
    # As `python -m lowtrain` launches: a step compiled before is read from the
    # cache (the compile column then times the read; `bench.py launch` times both).
    use_compilation_cache(args.compile_cache)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = jax.default_backend() == "gpu"
    isolate = args.isolate == "yes" or (args.isolate == "auto" and gpu)
    start = time.perf_counter()
    machine = report.machine()
    device = (
        f"{jax.devices()[0].device_kind} ({throughput.device_name() or 'peak unknown'})"
    )
    print(f"Machine: {machine}\nDevice: {device}", flush=True)
    rows = []
    for model_name in args.models:
        for precision in args.precisions:
            run = measure_isolated if isolate else measure
            rows.append(run(model_name, precision, args))
            print(benchtable.row_line(rows[-1]), flush=True)
            # Written after every row: a long run interrupted keeps what it measured.
            tables = benchtable.markdown(rows, machine, device, args, gpu)
            (out / "bench.md").write_text(tables + "\n")
            meta = {"machine": machine, "device": device, "argv": sys.argv[1:]}
            targets = benchtable.targets(rows, gpu)
            rows_json = json.dumps({**meta, "rows": rows, "targets": targets}, indent=2)
            (out / "bench.json").write_text(rows_json)
    print("\n" + tables)
    benchtable.bar_chart(rows, out / "bench.png", device)
    print(
        f"\nWrote {out}/bench.md, bench.json, bench.png "
        f"({time.perf_counter() - start:.0f} s)"
    )
    if failed := [f"{r['model']}/{r['precision']}" for r in rows if "error" in r]:
        sys.exit(f"{len(failed)} case(s) failed: {', '.join(failed)} (see the table)")


# The commands besides the step benchmark: each a module of `benchlib` with
# `main(argv)` and the docstring that says what it measures.
COMMANDS = {
    "gemm": gemm,
    "launch": launch,
    "memory": memory,
    "remat": remat_time,
    "vmap": vmap_cost,
    "amp": amp_hand,
    "scalify": scalify_step,
    "unit": unit_step,
    "numerics": numerics_step,
    "twin-hlo": twin_hlo,
    "saved-bytes": saved_bytes,
    "zoo": zoo,
}


def main(argv=None) -> None:
    """`bench.py [COMMAND] [options]`: the step benchmark, or one of `COMMANDS`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]].main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    return step_main(argv)


if __name__ == "__main__":
    main()
