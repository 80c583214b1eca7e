"""The host work `Trainer.fit` does per step beyond a plain loop over the same
compiled step, in microseconds, with the device's work taken out.

The char-GPT of each precision is built as `scripts/bench.py` builds it
(`benchlib.throughput.make_case`) and its step compiled; then `trainer.compiled_step`
is replaced by a stand-in that returns at once: the state it was given and, each
call, a fresh metrics dict whose loss and gradient norm are new device arrays (ready,
not yet read), so that what `fit` reads costs what it costs after a real step. Both
`fit` and the plain loop `state, _ = trainer.compiled_step(data(s), state)` then run
on that stand-in, and what is left of their time is their own host work:

- `bench`: `fit` in calls of 50 steps with the recipe's `log_every` (25), as
  `bench.py`'s overhead rows run it, less the plain loop, per step;
- `loop`: the per-step cost alone (500 steps, `log_every=None`: one log, at the end);
- `log`: what a step that logs adds (`log_every=1` against `None`, 200 steps);
- `call`: a one-step `fit` call less one plain step (planning, the bar, one log).

Each is `fit`'s median over `--rounds` runs less the plain loop's median. Also
counted per step of the `bench` setting: blocking device-to-host reads (a `float`,
`int` or `np.asarray` of a device array: where the host waits for the device) and
`jax.device_put` calls. On the real step, `fit` waits for step `s - 1`'s loss after
queueing step `s` when `stop_on_nonfinite` is on (fp32, bf16 and the unit
precisions: no loss scale); that wait overlaps the device's work unless the host is
the bottleneck.

With `--real`, also the tiny GPT (`bench.py --quick`'s, batch 4) in each precision
on the real step, as `bench.py` measures it (`benchlib.overhead.trainer_overhead`:
`fit` and the plain loop in alternating 100-step calls, `--rounds` of each, the
median ms per step and their ratio). On a CPU the step runs on
the host's own cores; to leave the host a core of its own as a GPU does, run XLA on
one thread (still, these steps of under a millisecond vary by 10% between runs on a
shared machine: the stand-in's microseconds are the measurement):

    python scripts/fit_host_overhead.py --precisions fp32,unit_fp32
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
        python scripts/fit_host_overhead.py --real
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import overhead, report, throughput


@contextlib.contextmanager
def counting():
    """Counts blocking device-to-host reads and `jax.device_put` calls."""
    array_type = type(jnp.zeros(()))
    value, put = array_type._value, jax.device_put
    counts = {"reads": 0, "puts": 0}

    def counted_value(self):
        counts["reads"] += 1
        return value.fget(self)

    def counted_put(*args, **kwargs):
        counts["puts"] += 1
        return put(*args, **kwargs)

    array_type._value, jax.device_put = property(counted_value), counted_put
    try:
        yield counts
    finally:
        array_type._value, jax.device_put = value, put


class StandIn:
    """A compiled step that returns at once: `(state, fresh metrics)`."""

    def __init__(self, metrics: dict, n: int):
        fresh = lambda x: jax.device_put(np.asarray(x))  # a new, unread device array
        self.pool = [
            dict(metrics, loss=fresh(metrics["loss"]), grad_norm=fresh(0.5))
            for _ in range(n)
        ]
        jax.block_until_ready(self.pool)

    def __call__(self, batch, state):
        return state, self.pool.pop()


def host_overhead(precision: str, rounds: int) -> dict:
    case = throughput.make_case("gpt", precision, None)
    trainer, data = case.trainer, throughput.synthetic_data(case)
    log_every = case.config.trainer.log_every
    state = trainer.init(key=jax.random.key(1))
    state = trainer.fit(state, data, steps=2, log_every=log_every, progress=False)
    state, metrics = trainer.compiled_step(data(2), state)
    state = jax.block_until_ready(state)
    start = int(state.step)
    real_step = trainer.compiled_step

    def fit(steps, log):
        trainer.fit(state, data, steps=start + steps, log_every=log, progress=False)

    def plain(steps, log):
        s = state
        for k in range(start, start + steps):
            s, _ = trainer.compiled_step(data(k), s)

    def per_step(run, steps, log, calls=1):
        trainer.__dict__["compiled_step"] = StandIn(metrics, steps * calls)
        t0 = time.perf_counter()
        for _ in range(calls):
            run(steps, log)
        return (time.perf_counter() - t0) / (steps * calls)

    def extra(steps, log, calls=1):
        fits, plains = [], []
        for _ in range(rounds):
            fits.append(per_step(fit, steps, log, calls))
            plains.append(per_step(plain, steps, log, calls))
        return statistics.median(fits) - statistics.median(plains), fits, plains

    try:
        bench, fits, plains = extra(50, log_every, calls=4)
        loop = extra(500, None)[0]
        log = extra(200, 1)[0] - extra(200, None)[0]
        call = extra(1, None, calls=50)[0]
        trainer.__dict__["compiled_step"] = StandIn(metrics, 50)
        with counting() as counts:
            fit(50, log_every)
    finally:
        trainer.__dict__["compiled_step"] = real_step
    return {
        "precision": precision,
        "stop_on_nonfinite": trainer.stop_on_nonfinite,
        "fit_us": statistics.median(fits) * 1e6,
        "plain_us": statistics.median(plains) * 1e6,
        "bench_us": bench * 1e6,
        "loop_us": loop * 1e6,
        "log_us": log * 1e6,
        "call_us": call * 1e6,
        "reads": counts["reads"] / 50,
        "puts": counts["puts"] / 50,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,unit_fp32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--real", action="store_true", help="the tiny GPT's real step")
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    print(f"Machine: {report.machine()}\n")
    print(
        "Char-GPT, stand-in step (us per step; fit - plain):\n\n"
        "| precision | stop_on_nonfinite | fit | plain | bench (50-step calls, "
        "log_every 25) | loop | log step | fit call | host reads / step | "
        "device_puts / step |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for precision in precisions:
        r = host_overhead(precision, args.rounds)
        print(
            f"| {precision} | {r['stop_on_nonfinite']} | {r['fit_us']:.1f} | "
            f"{r['plain_us']:.1f} | {r['bench_us']:.1f} | {r['loop_us']:.1f} | "
            f"{r['log_us']:.0f} | {r['call_us']:.0f} | {r['reads']:.2f} | "
            f"{r['puts']:.2f} |"
        )
    if args.real:
        print(
            "\nTiny GPT, real step, 100-step calls (ms per step, medians):\n\n"
            "| precision | fit | plain | fit / plain |\n|---|---:|---:|---:|"
        )
        for precision in precisions:
            # The bench's own measurement (`benchlib.overhead`), on the tiny GPT.
            case = throughput.make_case("quick", precision, 4)
            r = overhead.trainer_overhead(
                case, throughput.synthetic_data(case), chunk=100, rounds=args.rounds
            )
            print(
                f"| {precision} | {r['fit_s'] * 1e3:.3f} | {r['plain_s'] * 1e3:.3f} | "
                f"{r['ratio']:.3f} |"
            )


if __name__ == "__main__":
    main()
