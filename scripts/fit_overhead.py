"""Where the Trainer's overhead over a plain loop could come from: the host work
`Trainer.fit` does per step besides calling the compiled step, timed on its own.

1. `shard_batch` (what `fit` does to each batch) against a plain `jax.device_put`,
   the one-step-late non-finite check (`check_loss` on a ready loss) and
   `step_info` (every `log_every` steps): best of 7 repetitions, on the char-GPT's
   batch (32 x 64 tokens).
2. `fit` against a plain loop over the same `trainer.compiled_step` on a tiny GPT
   (`bench.py --quick`'s, steps of 1-2 ms, so host work shows): 15 pairs of
   100-step chunks; the median per-step difference.
3. The char-GPT itself: 4 pairs of 2-step chunks of `fit` and the plain loop (a
   fixed cost per `fit` call would show here).
4. Dispatch: on the tiny GPT at batch 32 (steps of 2-3 ms here, as the char-GPT's
   on an H100), `fit` and the plain loop with the Trainer's step compiled by
   `eqx.filter_jit` (which waits for each step's results: what the Trainer used
   up to git 8cf1783) and by `lowtrain.train.async_filter_jit` (what it uses now):
   7 pairs of 100-step chunks each, medians. On a CPU the "device" is the host's
   own cores, so host work competes with the step unless XLA keeps to one thread
   and another core is free, as a GPU would leave the host free:

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
        python scripts/fit_overhead.py
"""

from __future__ import annotations

import contextlib
import statistics
import time
import timeit

import jax
from benchlib import report, throughput
from benchlib.waiting import waiting_steps

from lowtrain.train._fit import check_loss, step_info


def best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def chunk_pairs(
    model: str, chunk: int, pairs: int, batch_size: int | None = None, wait=False
) -> list[tuple[float, float]]:
    """`pairs` of (fit, plain loop) seconds for `chunk` steps of `model` in fp32;
    `wait`: the step compiled by `eqx.filter_jit` (waits for its results)."""
    if batch_size is None:
        batch_size = 4 if model == "quick" else None
    case = throughput.make_case(model, "fp32", batch_size)
    data, trainer = throughput.synthetic_data(case), case.trainer
    with waiting_steps() if wait else contextlib.nullcontext():
        step = trainer.compiled_step  # built once: `fit` calls this one too
    fit = trainer.init(key=jax.random.key(1))
    fit = trainer.fit(fit, data, steps=2, progress=False)
    plain = trainer.init(key=jax.random.key(1))
    for s in range(2):
        plain, _ = step(data(s), plain)
    out = []
    for _ in range(pairs):
        n = int(fit.step)
        t0 = time.perf_counter()
        fit = trainer.fit(fit, data, steps=n + chunk, log_every=25, progress=False)
        fit = jax.block_until_ready(fit)
        f = time.perf_counter() - t0
        n = int(plain.step)
        t0 = time.perf_counter()
        for s in range(n, n + chunk):
            plain, _ = step(data(s), plain)
        jax.block_until_ready(plain)
        out.append((f, time.perf_counter() - t0))
    return out


def main() -> None:
    print(f"Machine: {report.machine()}\n")
    case = throughput.make_case("gpt", "fp32", None)
    trainer, batch = case.trainer, throughput.synthetic_data(case)(0)
    state = trainer.init(key=jax.random.key(1))
    state, metrics = trainer.compiled_step(trainer.shard_batch(batch), state)
    jax.block_until_ready(state)
    clock = (0, time.perf_counter())
    rows = {
        "shard_batch": best_us(lambda: trainer.shard_batch(batch), 300),
        "jax.device_put": best_us(lambda: jax.device_put(batch), 300),
        "check_loss (ready)": best_us(lambda: check_loss(0, metrics["loss"]), 300),
        "step_info": best_us(
            lambda: step_info(trainer, state, metrics, batch, clock, 1), 50
        ),
    }
    print("| host work per call | us |\n|---|---:|")
    for name, us in rows.items():
        print(f"| {name} | {us:.0f} |")
    pairs = chunk_pairs("quick", 100, 15)
    diffs = [(f - p) / 100 * 1e3 for f, p in pairs]
    fit = statistics.median(f for f, _ in pairs) / 100 * 1e3
    plain = statistics.median(p for _, p in pairs) / 100 * 1e3
    print(
        f"\nTiny GPT, 15 pairs of 100-step chunks: fit {fit:.3f} ms/step, plain "
        f"{plain:.3f} ms/step; median per-step difference "
        f"{statistics.median(diffs):.3f} ms"
    )
    pairs = chunk_pairs("gpt", 2, 4)
    shown = ", ".join(f"{f:.2f}/{p:.2f}" for f, p in pairs)
    print(f"Char-GPT, 2-step chunks, fit/plain seconds: {shown}")
    print(
        "\nTiny GPT, batch 32, 7 pairs of 100-step chunks (ms/step, medians):\n\n"
        "| step compiled by | fit | plain loop | fit / plain |\n|---|---:|---:|---:|"
    )
    for name, wait in [("eqx.filter_jit (waits)", True), ("async_filter_jit", False)]:
        pairs = chunk_pairs("quick", 100, 7, batch_size=32, wait=wait)
        fit = statistics.median(f for f, _ in pairs) / 100 * 1e3
        plain = statistics.median(p for _, p in pairs) / 100 * 1e3
        print(f"| {name} | {fit:.3f} | {plain:.3f} | {fit / plain:.3f} |")


if __name__ == "__main__":
    main()
