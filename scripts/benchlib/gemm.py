"""Where an FP8 GEMM pays: one linear layer's forward and backward (three GEMMs, as
in training) at square widths, in bfloat16 and in FP8 with current and with static
scaling, timed interleaved in one process.

For each width `d`, `x` is `(tokens, d)` and `w` is `(d, d)`; the timed function is
the gradient of `sum(dot(x, w) * g)` with respect to `x` and `w` (the forward GEMM
and both backward ones, as a training step runs them) with every operand in
bfloat16:

- `bf16`: `lax.dot_general` in bfloat16 (float32 accumulation);
- `fp8 current`: `lowtrain.fp8.fp8_dot_general`, each operand scaled by its own amax
  (an extra pass over each tensor), E4M3 forward, E5M2 backward;
- `fp8 static`: the same with static scale 1 (unit scaling's FP8: a cast, no amax).

The ratio `bf16 / fp8` above 1 means FP8 pays at that width; the smallest width
where it does is the break-even a shape filter (`precision.min_dim`) can use.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from lowtrain.fp8 import fp8_dot_general

from . import report

BF16 = jnp.bfloat16
DN = (((1,), (0,)), ((), ()))
WIDTHS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
KINDS = ("bf16", "fp8 current", "fp8 static")


def _product(kind: str):
    if kind == "bf16":
        return lambda x, w: lax.dot_general(x, w, DN, preferred_element_type=BF16)
    scale = None if kind == "fp8 current" else 1.0
    return lambda x, w: fp8_dot_general(x, w, DN, out_dtype=BF16, scale=scale)


def _step(kind: str):
    product = _product(kind)

    def loss(x, w, g):
        return jnp.sum(product(x, w).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def measure(tokens: int, widths=WIDTHS, reps: int = 20, rounds: int = 5) -> list[dict]:
    """One row per width: the median seconds of each kind's forward + backward
    (`reps` calls queued and timed together, `rounds` rounds interleaved)."""
    rows = []
    for d in widths:
        k1, k2, k3 = jax.random.split(jax.random.key(d), 3)
        x = jax.random.normal(k1, (tokens, d), BF16)
        w = (jax.random.normal(k2, (d, d)) / d**0.5).astype(BF16)
        g = jax.random.normal(k3, (tokens, d), BF16)
        fns = {kind: _step(kind) for kind in KINDS}
        for fn in fns.values():
            jax.block_until_ready(fn(x, w, g))  # compile
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(rounds):
            for kind, fn in fns.items():
                start = time.perf_counter()
                for _ in range(reps):
                    out = fn(x, w, g)
                jax.block_until_ready(out)
                times[kind].append((time.perf_counter() - start) / reps)
        med = {kind: statistics.median(ts) for kind, ts in times.items()}
        rows.append(
            {
                "tokens": tokens,
                "width": d,
                **{f"{kind}_s": med[kind] for kind in KINDS},
                "tflops_bf16": 6 * tokens * d * d / med["bf16"] / 1e12,
            }
        )
    return rows


def break_even(rows: list[dict], kind: str) -> int | None:
    """The smallest width from which `kind` is faster than bf16 at every larger
    width measured, or None."""
    found = None
    for row in reversed(rows):
        if row[f"{kind}_s"] < row["bf16_s"]:
            found = row["width"]
        else:
            break
    return found


def markdown(rows: list[dict]) -> str:
    """The GEMM table and the break-even widths."""
    lines = [
        f"Linear layer forward + backward, {rows[0]['tokens']} tokens x width d, "
        "weights d x d, bf16 operands:",
        "",
        "| d | bf16 (ms) | bf16 TFLOP/s | fp8 current (ms) | fp8 static (ms) "
        "| bf16 / fp8 current | bf16 / fp8 static |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, cur, st = r["bf16_s"], r["fp8 current_s"], r["fp8 static_s"]
        lines.append(
            f"| {r['width']} | {1e3 * b:.3f} | {r['tflops_bf16']:.0f} "
            f"| {1e3 * cur:.3f} | {1e3 * st:.3f} | **{b / cur:.2f}** "
            f"| **{b / st:.2f}** |"
        )
    for kind in KINDS[1:]:
        found = break_even(rows, kind)
        text = "not reached" if found is None else f"d >= {found}"
        lines.append(f"\nFP8 pays ({kind}): {text}")
    return "\n".join(lines)


def main(argv=None) -> None:
    """`bench.py gemm`: the table to `--out` (gemm.md, gemm.json) and stdout."""
    parser = argparse.ArgumentParser(
        prog="bench.py gemm", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tokens", type=int, default=16384, help="rows of x")
    parser.add_argument("--out", default="bench_out", help="folder for the files")
    parser.add_argument("--quick", action="store_true", help="tiny widths, seconds")
    args = parser.parse_args(argv)
    quick = dict(widths=(32, 64), reps=2, rounds=2) if args.quick else {}
    rows = measure(64 if args.quick else args.tokens, **quick)
    device = jax.devices()[0].device_kind
    table = f"Machine: {report.machine()}\nDevice: {device}\n\n{markdown(rows)}"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm.md").write_text(table + "\n")
    (out / "gemm.json").write_text(json.dumps({"device": device, "rows": rows}))
    print(table)
