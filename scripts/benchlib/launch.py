"""Launch time: what compiling one of the bench's steps costs at a program's first
launch (an empty persistent compilation cache) and at its second (the cache the
first one filled), each launch a fresh process, as `python -m lowtrain` starts.

For each precision, two launches in their own processes share one new, empty cache
folder (`lowtrain.train.use_compilation_cache`); each builds the case as
`scripts/bench.py` does (`throughput.make_case`: the recipe's Trainer at that size)
and times the Trainer's step traced and lowered (`lower`) and compiled (`compile`:
XLA's passes and, on a GPU, its GEMM autotuning; on a cache hit, the executable
read back). `entries` counts the cache's files after the launch: the second launch
adds none when every program it compiles was found.

    python scripts/bench.py launch --model gpt_small --precisions bf16,fp8
    python scripts/bench.py launch --precisions fp8 --triton-gemm on   # XLA's default
    python scripts/bench.py launch --quick          # a tiny GPT: seconds
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import jax

from lowtrain.train import use_compilation_cache, use_triton_gemm

from . import report, throughput


def one_launch(model: str, precision: str, batch_size, sets, cache: str) -> dict:
    """In this process: the case built and its step lowered and compiled, with the
    persistent cache in `cache`; seconds of each part."""
    use_compilation_cache(cache)
    t0 = time.perf_counter()
    case = throughput.make_case(model, precision, batch_size, sets)
    state = jax.block_until_ready(case.trainer.init(key=jax.random.key(1)))
    batch = jax.device_put(throughput.synthetic_data(case)(0))
    t1 = time.perf_counter()
    lowered = case.trainer.compiled_step.lower(batch, state)
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    entries = sum(1 for p in pathlib.Path(cache).iterdir() if p.is_file())
    return {
        "build_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "entries": entries,
    }


def _child(args, precision: str, cache: str) -> dict:
    command = [
        *(sys.executable, "-m", "benchlib.launch", "--child", "--model", args.model),
        *("--precisions", precision, "--cache", cache),
        *("--triton-gemm", args.triton_gemm),
        *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
        *(arg for override in args.set for arg in ("--set", override)),
    ]
    here = pathlib.Path(__file__).resolve().parent.parent  # scripts/
    child = subprocess.run(command, cwd=here, capture_output=True, text=True)
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines() or ["no output"]
        return {"error": f"exit {child.returncode}: {lines[-1][:300]}"}
    return json.loads(child.stdout.strip().splitlines()[-1])


def measure(args) -> list[dict]:
    """One row per precision: its first and second launch."""
    rows = []
    for precision in args.precisions:
        with tempfile.TemporaryDirectory(prefix="lowtrain-launch-") as cache:
            first = _child(args, precision, cache)
            second = _child(args, precision, cache) if "error" not in first else {}
        rows.append(
            {
                "model": args.model,
                "precision": precision,
                "first": first,
                "second": second,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | precision | launch | lower (s) | compile (s) | lower + compile (s) "
        "| cache entries |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        for launch in ("first", "second"):
            r = row[launch]
            if "error" in r:
                lines.append(
                    f"| {row['model']} | {row['precision']} | {launch} | "
                    f"{r['error']} | | | |"
                )
            elif r:
                lines.append(
                    f"| {row['model']} | {row['precision']} | {launch} | "
                    f"{r['lower_s']:.1f} | {r['compile_s']:.1f} | "
                    f"{r['lower_s'] + r['compile_s']:.1f} | {r['entries']} |"
                )
    by = {r["precision"]: r["first"].get("compile_s") for r in rows}
    if by.get("bf16") and len(by) > 1:
        lines.append("")
        for name, seconds in by.items():
            if name != "bf16" and seconds:
                lines.append(
                    f"First-launch compile {name} / bf16: {seconds / by['bf16']:.2f}x"
                )
    return "\n".join(lines)


def main(argv=None) -> None:
    """`bench.py launch`: the table to `--out` (launch.md, launch.json) and stdout."""
    parser = argparse.ArgumentParser(
        prog="bench.py launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="gpt_small", choices=list(throughput.SIZES))
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--batch-size", type=int, default=None, help="default: bench's")
    parser.add_argument("--out", default="bench_out", help="folder for the files")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT: seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    throughput.add_triton_gemm_argument(parser)
    throughput.add_set_argument(parser, "launch", "model.scan_layers=true")
    args = parser.parse_args(argv)
    use_triton_gemm(args.triton_gemm == "on")  # before JAX first uses the device
    args.precisions = args.precisions.split(",")
    if unknown := set(args.precisions) - set(throughput.RECIPES):
        parser.error(
            f"Expected --precisions from {list(throughput.RECIPES)}, got "
            f"{sorted(unknown)} instead."
        )
    if args.quick:
        args.model, args.batch_size = "quick", args.batch_size or 4
    if args.child:
        row = one_launch(
            args.model, args.precisions[0], args.batch_size, args.set, args.cache
        )
        print(json.dumps(row))
        return
    rows = measure(args)
    table = f"Machine: {report.machine()}\nDevice: {jax.devices()[0].device_kind}\n\n"
    table += markdown(rows)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.md").write_text(table + "\n")
    (out / "launch.json").write_text(json.dumps({"rows": rows}, indent=2))
    print(table)
    if any("error" in r[k] for r in rows for k in ("first", "second") if r[k]):
        sys.exit("A launch failed (see the table).")


if __name__ == "__main__":
    main()
