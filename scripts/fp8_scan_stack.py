"""Why the fp8 step got faster on the CPU when `lowtrain.fp8` began saving its FP8
residuals as `uint8` bits: a `lax.scan` that stacks E4M3 arrays (as a layer scan
stacks each layer's FP8 residuals for the backward pass) against one that stacks
their bits, interleaved, on the char-GPT's activation shape.

    python scripts/fp8_scan_stack.py          # prints a markdown table
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from benchlib import report
from jax import lax

E4M3 = jnp.float8_e4m3fn


def stacking(bits: bool):
    """`f(x)`: quantize each of `x`'s slices to E4M3 inside a scan, stack them (as
    E4M3, or as their `uint8` bits, bitcast back after the scan) and sum them."""

    def f(x):
        def body(scale, xi):
            q = (xi * scale).astype(E4M3)
            return scale, lax.bitcast_convert_type(q, jnp.uint8) if bits else q

        _, ys = lax.scan(body, jnp.float32(1.0), x)
        if bits:
            ys = lax.bitcast_convert_type(ys, E4M3)
        return jnp.sum(ys.astype(jnp.float32))

    return jax.jit(f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="per round")
    args = parser.parse_args(argv)
    # 4 layers of (batch 32, context 64, width 512): the char-GPT's MLP activations.
    x = jax.random.normal(jax.random.key(0), (4, 32, 64, 512))
    fns = {"float8_e4m3fn": stacking(False), "uint8 bits": stacking(True)}
    results = {name: float(fn(x)) for name, fn in fns.items()}  # compiles
    assert len(set(results.values())) == 1, results  # the same values either way
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                out = fn(x)
            out.block_until_ready()
            times[name].append((time.perf_counter() - start) / args.calls)
    print(f"Machine: {report.machine()}\n")
    print("| scan stacks | ms per call (median of rounds) | / uint8 bits |")
    print("|---|---:|---:|")
    base = statistics.median(times["uint8 bits"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {1e3 * t:.2f} | **{t / base:.2f}** |")


if __name__ == "__main__":
    main()
