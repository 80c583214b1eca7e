"""Where one of `scripts/bench.py`'s steps spends its device time.

    python scripts/profile_step.py --model gpt_small --precision bf16
    python scripts/profile_step.py --set model.scan_layers=true --triton-gemm on

Builds the bench's case (the recipe's Trainer at that size, synthetic tokens), runs
three warm-up steps, traces `--steps` more with `jax.profiler`, and prints the device
ops of the trace summed by name (milliseconds per step, share of the device time),
largest first, with the share of the GEMM kernels (cuBLAS/cuBLASLt calls and
XLA's GEMM fusions) among them. The trace stays in `--out`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys

import jax
from benchlib import throughput

from lowtrain.train import use_triton_gemm

GEMM_MARKS = ("gemm", "cublas", "matmul", "xmma", "cutlass", "sm90")


def device_ops(trace_dir: pathlib.Path) -> dict[str, float]:
    """Microseconds per op name, summed over the trace's device (GPU) events."""
    paths = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(
            f"Expected a perfetto_trace.json.gz under {trace_dir}, got none. Trace "
            "with `jax.profiler.trace(dir, create_perfetto_trace=True)`."
        )
    path = paths[-1]  # the newest trace
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "GPU" in str(e.get("args", {}).get("name", ""))
    }
    totals: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            totals[e["name"]] += float(e.get("dur", 0))
    return totals


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small", choices=list(throughput.SIZES))
    parser.add_argument("--precision", default="bf16", choices=list(throughput.RECIPES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="profile_out")
    throughput.add_triton_gemm_argument(parser)
    throughput.add_set_argument(parser, "profile", "model.scan_layers=true")
    args = parser.parse_args(argv)
    use_triton_gemm(args.triton_gemm == "on")  # before JAX first uses the device
    if jax.default_backend() != "gpu":
        sys.exit(
            f"Expected a GPU backend (the device ops are read from GPU events), got "
            f"{jax.default_backend()!r}. Run it where `jax.devices()` lists a GPU."
        )
    case = throughput.make_case(args.model, args.precision, None, args.set)
    data = throughput.synthetic_data(case)
    fn, state = throughput.lowtrain_step(case)
    batch = jax.device_put(data(0))
    for _ in range(3):
        *state, loss = jax.block_until_ready(fn(*state, batch))
    out = pathlib.Path(args.out)
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        for _ in range(args.steps):
            *state, loss = fn(*state, batch)
        jax.block_until_ready(loss)
    totals = device_ops(out)
    total = sum(totals.values())
    gemm = sum(v for k, v in totals.items() if any(m in k.lower() for m in GEMM_MARKS))
    print(
        f"{args.model} / {args.precision}: {total / 1e3 / args.steps:.2f} ms of device"
        f" ops per step, GEMM kernels {gemm / total:.1%}"
    )
    print("| op | ms/step | share |\n|---|---:|---:|")
    for name, us in totals.most_common(args.top):
        print(f"| {name[:90]} | {us / 1e3 / args.steps:.2f} | {us / total:.1%} |")


if __name__ == "__main__":
    main()
