"""The model zoo's gradient errors: how far each model's mixed-precision gradients
are from float32, with `lowtrain.amp` and with the reference it must match.

For each model of `benchlib.zoo_models.ZOO` and each policy, the gradient of the
model's loss (with respect to its float32 parameters) three ways, on the same data,
keys and parameters:

- float32: `eqx.filter_value_and_grad(loss)`, the reference gradient `g32`;
- lowtrain: `lowtrain.amp(loss, policy)`; under "fp16" with loss scaling,
  `lowtrain.scaled_value_and_grad` from a `lowtrain.DynamicLossScale()` (2**15),
  backed off by halves while the gradients are not finite;
- the reference: for "bf16" and "fp16" the **hand cast**, the same loss on the
  parameters and inputs cast to the compute dtype by hand (every inexact array, with
  `jax.tree.map`), its loss and outputs cast back to float32, loss-scaled the same
  way for "fp16"; for "fp8" an **FP8 emulation** written here, independent of
  `lowtrain.fp8`: every matmul and convolution takes its operands rounded through
  E4M3 (`jnp.float8_e4m3fn`, ml_dtypes' rounding, after a clip to +-448) with
  per-tensor current scaling (the tensor's amax mapped to 448), and computes both
  input gradients from those operands and its output cotangent rounded through E5M2
  (amax to 57344), as docs/guides/fp8.md documents lowtrain's "fp8" policy;
  everything else runs in float32. It places these ops with `lowtrain.rewrite`,
  which replaces each `dot_general` / `conv_general_dilated` of the program and
  runs the rest as written (a `custom_vjp`'s own backward rule, such as diffrax's
  adjoints, is a program like the forward one: its matmuls round as forward ones).

The error of a gradient `g` is `|g - g32| / |g32|`, norms over the whole gradient
pytree. The bounds the zoo tests hold lowtrain to (`bound`): at most `HAND_SLACK`
times the hand cast's error for bf16/fp16, at most `FP8_SLACK` times the
emulation's plus `FP8_FLOOR` for fp8.

    python scripts/bench.py zoo                    # every model and policy
    python scripts/bench.py zoo --models cnn,unet --policies fp8 --out /tmp/zoo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import sys
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import lowtrain

POLICIES = ("bf16", "fp16", "fp8")
F32 = jnp.float32

# lowtrain rounds what the hand cast rounds (matmul and convolution operands) and
# less (float32 where the policy says, inputs cast where they are used), so its error
# is at most the hand cast's up to noise: which values round which way, which ReLU
# masks flip near zero. Measured (`bench.py zoo`, CPU): lowtrain / hand cast from 0.00
# (the diffusion models, whose hand cast rounds the time) to 1.07 (stateful, fp16).
# The models are sized so that no single flipped ReLU decides (the MNIST CNN at batch
# 16: 0.5% or 7% error in bf16, by one flip).
HAND_SLACK = 1.5
# lowtrain's FP8 rounds the operands the emulation rounds, and also rounds each
# product and the elementwise ops on it to bfloat16, which the emulation keeps in
# float32: twice the emulation's error, plus about the largest bf16 error of the
# table (1.5e-2). Measured: lowtrain / emulation from 0.24 to 1.54 (the neural ODEs).
FP8_SLACK = 2.0
FP8_FLOOR = 0.02
# Loss-scaled fp16 steps start from `lowtrain.DynamicLossScale()` (2**15) and back
# off by halves while the gradients are not finite, at most this many times, as the
# Trainer's first steps would (the scale is an input of the compiled step).
BACKOFFS = 15


@contextlib.contextmanager
def user_code():
    """The promotion rules the zoo's models are written for, JAX's defaults: standard
    dtype promotion, rank promotion allowed (the test suite makes both strict)."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


BOUNDS = (
    f"bf16, fp16: lowtrain's error <= {HAND_SLACK} x the hand cast's; fp8: <= "
    f"{FP8_SLACK} x the FP8 emulation's + {FP8_FLOOR}"
)


def bound(policy: str, reference_error: float) -> float:
    """The largest gradient error the zoo tests accept from lowtrain."""
    if policy == "fp8":
        return FP8_SLACK * reference_error + FP8_FLOOR
    return HAND_SLACK * reference_error


# -- the hand cast --------------------------------------------------------------------


def cast_inexact(tree, dtype):
    """Every inexact array of `tree` cast to `dtype`; other leaves unchanged."""
    cast = lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x
    return jax.tree.map(cast, tree)


def hand_cast(loss, dtype):
    """`loss` run on parameters and inputs cast to `dtype`, its outputs cast back to
    float32: mixed precision the way it is written by hand."""

    def hand(model, *inputs):
        with warnings.catch_warnings():
            # A state cast to half that the model updates from float32 statistics
            # (NNX's BatchNorm): JAX warns of the implicit cast; the hand cast is
            # the reference, not the subject.
            warnings.filterwarnings(
                "ignore", "scatter inputs have incompatible types", FutureWarning
            )
            out = loss(cast_inexact(model, dtype), *cast_inexact(inputs, dtype))
        return cast_inexact(out, F32)

    return hand


# -- the FP8 emulation -----------------------------------------------------------------

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def round_trip(x, dtype):
    """`x` through the FP8 format `dtype` with per-tensor current scaling: divided by
    `amax / max`, clipped to the format's range, cast (nearest-even, subnormals kept),
    cast back and multiplied by the scale."""
    top = float(jnp.finfo(dtype).max)
    x32 = x.astype(F32)
    amax = jnp.max(jnp.abs(x32))
    # Never zero: at least float32's smallest normal (a zero tensor stays zero).
    scale = jnp.maximum(amax / top, jnp.finfo(F32).tiny)
    data = jnp.clip(x32 / scale, -top, top).astype(dtype)
    return (data.astype(F32) * scale).astype(x.dtype)


def _fp8_emulated(op, lhs, rhs):
    # `op(lhs, rhs)` on E4M3 operands; both input gradients from the E5M2 cotangent
    # and the E4M3 operands (the residuals), as an FP8 training matmul computes them.
    @jax.custom_vjp
    def product(lhs, rhs):
        return op(round_trip(lhs, E4M3), round_trip(rhs, E4M3))

    def fwd(lhs, rhs):
        ql, qr = round_trip(lhs, E4M3), round_trip(rhs, E4M3)
        return op(ql, qr), (ql, qr)

    def bwd(residuals, g):
        _, vjp = jax.vjp(op, *residuals)
        return vjp(round_trip(g, E5M2))

    product.defvjp(fwd, bwd)
    return product(lhs, rhs)


FP8_EMULATION_RULES = {
    "dot_general": _fp8_emulated,
    "conv_general_dilated": _fp8_emulated,
}


def fp8_emulation(loss):
    """`loss` with every matmul and convolution emulated in FP8 (float32 elsewhere)."""
    return lowtrain.rewrite(loss, FP8_EMULATION_RULES)


# -- gradients and errors -------------------------------------------------------------


def transformed(loss, how: str, policy: str | None):
    """The loss `how` ("fp32", "lowtrain", "hand", "emulation") runs it."""
    if how == "fp32":
        return loss
    if how == "lowtrain":
        return lowtrain.amp(loss, policy)
    if how == "hand":
        return hand_cast(loss, lowtrain.get_policy(policy).compute_dtype)
    if how == "emulation":
        return fp8_emulation(loss)
    raise ValueError(
        f"Expected `how` among fp32, lowtrain, hand, emulation, got {how!r} instead."
    )


def value_and_grad(fn, policy: str | None):
    """`(model, inputs, loss_scale) -> (loss, aux, grads, finite)` of `fn`; under
    "fp16" loss-scaled with `loss_scale` (ignored otherwise)."""
    if policy == "fp16":
        scaled = lowtrain.scaled_value_and_grad(fn, has_aux=True)

        def step(model, inputs, loss_scale):
            ((value, aux), grads), _, finite = scaled(loss_scale, model, *inputs)
            return value, aux, grads, finite

    else:
        plain = eqx.filter_value_and_grad(fn, has_aux=True)

        def step(model, inputs, loss_scale):
            (value, aux), grads = plain(model, *inputs)
            return value, aux, grads, lowtrain.all_finite(grads)

    return step


def traced_step(loss, model, inputs, how: str, policy: str | None = None):
    """The gradient step of `loss` at `model` run `how` under `policy`, traced once:
    `(jaxpr, run)`, the step's program and a function that compiles and runs it,
    returning `(loss, aux, grads, finite)` (non-array leaves None); under "fp16"
    from a loss scale of 2**15, halved while the gradients are not finite."""
    step = value_and_grad(transformed(loss, how, policy), policy)
    scale = lowtrain.DynamicLossScale()
    dynamic, static = eqx.partition((model, inputs, scale), eqx.is_array)

    def flat(dynamic):
        return eqx.filter(step(*eqx.combine(dynamic, static)), eqx.is_array)

    traced = jax.jit(flat).trace(dynamic)

    def run():
        compiled, scale = traced.lower().compile(), lowtrain.DynamicLossScale()
        for _ in range(BACKOFFS if policy == "fp16" else 0):
            out = compiled(eqx.filter((model, inputs, scale), eqx.is_array))
            if bool(out[3]):
                return out
            scale = scale.adjust(jnp.array(False))
        return compiled(eqx.filter((model, inputs, scale), eqx.is_array))

    return traced.jaxpr, run


def gradients(loss, model, inputs, how: str, policy: str | None = None):
    """`(loss, aux, grads, finite)` of `loss` at `model` run `how` under `policy`."""
    return traced_step(loss, model, inputs, how, policy)[1]()


def relative_error(grads, reference) -> float:
    """`|grads - reference| / |reference|`, norms over all the leaves (float64)."""
    ours, ref = jax.tree.leaves(grads), jax.tree.leaves(reference)
    if len(ours) != len(ref):
        raise ValueError(f"Expected {len(ref)} gradient leaves, got {len(ours)}.")
    num = sum(
        float(np.sum((np.float64(a) - np.float64(b)) ** 2)) for a, b in zip(ours, ref)
    )
    den = sum(float(np.sum(np.float64(b) ** 2)) for b in ref)
    return (num / den) ** 0.5


def measure(name: str, policies=POLICIES, seed: int = 0) -> list[dict]:
    """One row per policy: lowtrain's gradient error and its reference's for the zoo
    model `name` (a policy that raises: a row with the error)."""
    from .zoo_models import ZOO  # diffrax, Flax, einops: only for this command

    with user_code():
        model, inputs, loss = ZOO[name](jax.random.key(seed))
        g32 = gradients(loss, model, inputs, "fp32")[2]
    rows = []
    for policy in policies:
        reference = "emulation" if policy == "fp8" else "hand"
        row = {
            "model": name,
            "policy": policy,
            "reference": "fp8 emulation" if policy == "fp8" else "hand cast",
        }
        try:
            errors = {}
            for how in ("lowtrain", reference):
                with user_code():
                    _, _, grads, finite = gradients(loss, model, inputs, how, policy)
                finite = bool(finite)
                errors[how] = relative_error(grads, g32) if finite else float("inf")
        except Exception as e:  # a case that fails is a row saying why
            first = (str(e).strip().splitlines() or [""])[0][:200]
            rows.append({**row, "error": f"{type(e).__name__}: {first}"})
            continue
        rows.append(
            {
                **row,
                "lowtrain_error": errors["lowtrain"],
                "reference_error": errors[reference],
                "ratio": errors["lowtrain"] / errors[reference],
                "bound": bound(policy, errors[reference]),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """The table: one row per model and policy; a failed case says why."""
    lines = [
        "| model | policy | lowtrain error | reference | reference error "
        "| lowtrain / reference | within bound |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            failed = f"| {r['model']} | {r['policy']} | failed: {r['error']} "
            lines.append(failed + "| | | | |")
            continue
        ok = "yes" if r["lowtrain_error"] <= r["bound"] else "**no**"
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['lowtrain_error']:.2e} "
            f"| {r['reference']} | {r['reference_error']:.2e} | {r['ratio']:.2f} "
            f"| {ok} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    """`bench.py zoo`: the table to `--out` (zoo.md, zoo.json) and stdout."""
    from . import report
    from .zoo_models import ZOO

    parser = argparse.ArgumentParser(
        prog="bench.py zoo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", default=",".join(ZOO), help=",".join(ZOO))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default="bench_out", help="folder for the files")
    args = parser.parse_args(argv)
    models, policies = args.models.split(","), args.policies.split(",")
    for flag, given, known in [
        ("--models", models, list(ZOO)),
        ("--policies", policies, list(POLICIES)),
    ]:
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"Expected {flag} from {known}, got {unknown} instead.")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = report.machine()
    print(f"Machine: {machine}", flush=True)
    rows, start = [], time.perf_counter()
    # Tiny programs: XLA's optimizations cost more to compile than they save (the
    # errors agree with optimized programs' to 1e-6).
    optimize = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        for name in models:
            for row in measure(name, policies):
                rows.append(row)
                print(markdown([row]).splitlines()[-1], flush=True)
    finally:
        jax.config.update("jax_disable_most_optimizations", optimize)
    table = markdown(rows)
    legend = f"Gradient error: |g - g32| / |g32| over the whole gradient. {BOUNDS}."
    (out / "zoo.md").write_text(f"Machine: {machine}\n\n{legend}\n\n{table}\n")
    finite = lambda v: v if not isinstance(v, float) or math.isfinite(v) else None
    rows_json = [{k: finite(v) for k, v in row.items()} for row in rows]
    meta = {"machine": machine, "bounds": BOUNDS}
    (out / "zoo.json").write_text(json.dumps({**meta, "rows": rows_json}, indent=2))
    seconds = time.perf_counter() - start
    print(f"\n{table}\n\nWrote {out}/zoo.md, zoo.json ({seconds:.0f} s)")
    if failed := [f"{r['model']}/{r['policy']}" for r in rows if "error" in r]:
        sys.exit(f"{len(failed)} case(s) failed: {', '.join(failed)} (see the table)")
