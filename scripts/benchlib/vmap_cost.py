"""`jax.vmap(amp(model))`, the per-example way Equinox code is written, against the
batched form `amp(jax.vmap(model))`, and the Trainer with a per-example `loss`
against one whose model takes the batch: step time and temporary memory in one
process.

The model is the README's MLP (`eqx.nn.MLP(784, 10, 512, 2)`, per example) on a
batch of `--batch` random images with labels; the loss is the float32
cross-entropy. For each policy (fp16, bf16, fp8):

- `vmap(amp(m))`, `amp(vmap(m))`: the value and gradient with respect to the
  model, compiled (`eqx.filter_jit`);
- `Trainer, per-example loss` (`jax.vmap(model)(x)` in `loss`) and `Trainer,
  batched model` (the model a module that vmaps the MLP inside): each Trainer's
  compiled step (`trainer.compiled_step`, the optimizer included);

timed interleaved in rounds (the median time per call over rounds), with XLA's
temporary buffer size of the compiled program. `float32` is the same gradient
without `amp`. The rule the table checks: the per-example form costs what the
batched form does (ratio 1.0 within noise), because `amp` runs the batched program
when a `jax.vmap` is around it.

    python scripts/bench.py vmap                 # batch 256, fp16, bf16, fp8
    python scripts/bench.py vmap --batch 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import lowtrain

from . import report

POLICIES = ("fp16", "bf16", "fp8")
MiB = 2**20


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


class _Batched(eqx.Module):
    """The MLP on a batch: `jax.vmap` inside the model (the batched form)."""

    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


class _PerExample(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        return _ce(jax.vmap(model)(batch["x"]), batch["y"])


class _WholeBatch(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        return _ce(model(batch["x"]), batch["y"])


def _gradient(loss):
    return eqx.filter_jit(eqx.filter_value_and_grad(loss))


def cases(policy: str, batch: int) -> dict:
    """`{name: (fn, args)}` for one policy: `fn(*args)` runs one call; each `fn`
    has `.lower(*args)`."""
    mlp = eqx.nn.MLP(784, 10, 512, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch, 784))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    data = {"x": x, "y": y}
    found = {
        "vmap(amp(m))": (
            _gradient(lambda m: _ce(jax.vmap(lowtrain.amp(m, policy))(x), y)),
            (mlp,),
        ),
        "amp(vmap(m))": (
            _gradient(lambda m: _ce(lowtrain.amp(_Batched(m), policy)(x), y)),
            (mlp,),
        ),
    }
    for name, trainer_class, model in [
        ("Trainer, per-example loss", _PerExample, mlp),
        ("Trainer, batched model", _WholeBatch, _Batched(mlp)),
    ]:
        trainer = trainer_class(model, optax.sgd(1e-3), precision=policy)
        state = trainer.init(key=jax.random.key(3))
        step = trainer.compiled_step
        # The step donates its state: a fresh copy of it for each call.
        found[name] = (_Fresh(step, state), (data,))
    return found


class _Fresh:
    """`compiled_step(batch, state)` called on a fresh copy of `state` each time
    (the step donates it), with the compiled program's `lower`."""

    def __init__(self, step, state):
        self.step, self.state = step, state

    def _copy(self):
        return jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, self.state)

    def __call__(self, batch):
        return self.step(batch, self._copy())

    def lower(self, batch):
        return self.step.lower(batch, self.state)


def _temp_bytes(fn, args) -> int:
    compiled = fn.lower(*args).compile()
    inner = getattr(compiled, "compiled", compiled)
    return inner.memory_analysis().temp_size_in_bytes


def measure(batch: int, policies=POLICIES, reps: int = 10, rounds: int = 7) -> list:
    """One row per (policy, form): median seconds per call and temporary bytes."""
    mlp = eqx.nn.MLP(784, 10, 512, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch, 784))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    f32 = _gradient(lambda m: _ce(jax.vmap(m)(x), y))
    rows = []
    for policy in policies:
        fns = {"float32": (f32, (mlp,)), **cases(policy, batch)}
        for fn, args in fns.values():
            jax.block_until_ready(fn(*args))  # compile
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, (fn, args) in fns.items():
                start = time.perf_counter()
                for _ in range(reps):
                    out = fn(*args)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / reps)
        for name, (fn, args) in fns.items():
            rows.append(
                {
                    "policy": policy,
                    "form": name,
                    "batch": batch,
                    "step_s": statistics.median(times[name]),
                    "temp_bytes": _temp_bytes(fn, args),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    """The table, each form's time and memory also over its batched counterpart."""
    lines = [
        "| policy | form | batch | step (ms) | temp (MiB) | time / batched "
        "| temp / batched |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    pairs = {
        "vmap(amp(m))": "amp(vmap(m))",
        "Trainer, per-example loss": "Trainer, batched model",
    }
    by = {(r["policy"], r["form"]): r for r in rows}
    for r in rows:
        base = by.get((r["policy"], pairs.get(r["form"], "")))
        ratio = "–" if base is None else f"**{r['step_s'] / base['step_s']:.2f}**"
        mem = (
            "–"
            if base is None or not base["temp_bytes"]
            else f"**{r['temp_bytes'] / base['temp_bytes']:.2f}**"
        )
        lines.append(
            f"| {r['policy']} | {r['form']} | {r['batch']} | {1e3 * r['step_s']:.2f} "
            f"| {r['temp_bytes'] / MiB:.2f} | {ratio} | {mem} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py vmap", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="batch 16, 2 rounds")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    if unknown := set(policies) - {"fp16", "bf16", "fp8"}:
        parser.error(f"Expected --policies from fp16,bf16,fp8, got {sorted(unknown)}.")
    batch, rounds = (16, 2) if args.quick else (args.batch, args.rounds)
    print(f"Machine: {report.machine()}\n")
    print(
        markdown(measure(batch, policies, reps=2 if args.quick else 10, rounds=rounds))
    )
