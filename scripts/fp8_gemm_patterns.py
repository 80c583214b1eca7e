"""Which ways of writing a scaled FP8 matmul does XLA compile to a cuBLASLt FP8 GEMM?

    python scripts/fp8_gemm_patterns.py        # on a Hopper GPU (H100/H200)

For each of the GPT-2-small step's matmul shapes (batch 16 x 1024 tokens: a
projection, its weight and input gradients, attention's two batched einsums) and each
candidate pattern, prints whether the optimized HLO holds a `__cublas$lt$matmul$f8`
call and the compiled function's median time against the plain bfloat16 matmul:

- `qdq`: `dot(convert(a8) * sa, convert(b8) * sb)` in bfloat16, the quantize-dequantize
  pattern XLA's GEMM rewriter documents (what `lowtrain.fp8` emitted first);
- `qdq_f32`: the same, dequantized to float32, `preferred_element_type` float32;
- `f8_dot`: `dot(a8, b8)` on the FP8 arrays themselves, float32 accumulation, then
  `* (sa * sb)` and the cast to bfloat16.

Every variant includes the current-scaling quantization of both operands (one amax
each), as the training step does.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import lowtrain.fp8 as fp8

BF16, F32 = jnp.bfloat16, jnp.float32
GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'
# name: (lhs shape, rhs shape, dimension numbers, rhs format)
SHAPES = {
    "fc forward (x @ w)": ((16384, 768), (768, 3072), (((1,), (0,)), ((), ())), "e4m3"),
    "fc input grad (g @ w.T)": (
        (16384, 3072),
        (768, 3072),
        (((1,), (1,)), ((), ())),
        "e4m3",
    ),
    "fc weight grad (x.T @ g)": (
        (16384, 768),
        (16384, 3072),
        (((0,), (0,)), ((), ())),
        "e5m2",
    ),
    "attention scores (bqhd,bkhd)": (
        (16, 1024, 12, 64),
        (16, 1024, 12, 64),
        (((3,), (3,)), ((0, 2), (0, 2))),
        "e4m3",
    ),
    "attention values (bhqk,bkhd)": (
        (16, 12, 1024, 1024),
        (16, 1024, 12, 64),
        (((3,), (1,)), ((0, 1), (0, 2))),
        "e4m3",
    ),
}


def quantized(a, b, rhs_format):
    fb = fp8.E5M2 if rhs_format == "e5m2" else fp8.E4M3
    sa, sb = fp8.current_scale(a, fp8.E4M3), fp8.current_scale(b, fb)
    return fp8.quantize(a, fp8.E4M3, sa), sa, fp8.quantize(b, fb, sb), sb


def patterns(dn, rhs_format):
    def bf16(a, b):
        return lax.dot_general(a, b, dn, preferred_element_type=BF16)

    def qdq(a, b):
        qa, sa, qb, sb = quantized(a, b, rhs_format)
        da, db = fp8.dequantize(qa, sa, BF16), fp8.dequantize(qb, sb, BF16)
        return lax.dot_general(da, db, dn, preferred_element_type=BF16)

    def qdq_f32(a, b):
        qa, sa, qb, sb = quantized(a, b, rhs_format)
        da, db = fp8.dequantize(qa, sa, F32), fp8.dequantize(qb, sb, F32)
        return lax.dot_general(da, db, dn, preferred_element_type=F32).astype(BF16)

    def f8_dot(a, b):
        qa, sa, qb, sb = quantized(a, b, rhs_format)
        out = lax.dot_general(qa, qb, dn, preferred_element_type=F32)
        return (out * (sa * sb)).astype(BF16)

    return {"bf16": bf16, "qdq": qdq, "qdq_f32": qdq_f32, "f8_dot": f8_dot}


def median_ms(fn, *args, n=20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| matmul | pattern | FP8 GEMMs | ms | vs bf16 |\n|---|---|---:|---:|---:|")
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(SHAPES)))
    for name, (sa, sb, dn, rhs_format) in SHAPES.items():
        a = jax.random.normal(next(keys), sa, BF16)
        b = jax.random.normal(next(keys), sb, BF16)
        base = None
        for pattern, fn in patterns(dn, rhs_format).items():
            jitted = jax.jit(fn)
            gemms = jitted.lower(a, b).compile().as_text().count(GEMM)
            ms = median_ms(jitted, a, b)
            base = base or ms
            print(f"| {name} | {pattern} | {gemms} | {ms:.3f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
