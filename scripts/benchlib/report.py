"""The machine line and the markdown tables the benchmarks print."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import platform
import subprocess
from collections.abc import Callable

import equinox as eqx
import jax
import jaxlib
import numpy as np
import optax

import lowtrain
from lowtrain import _compat

from . import models, residuals, timing

MiB = 2**20
POLICIES = ("fp16", "bf16", "fp8")


def machine() -> str:
    """A one-line description of the backend, CPU and library versions."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count()
    return (
        f"JAX backend {jax.default_backend()} ({jax.device_count()} device), "
        f"CPU {cpu} with {cores} cores; jax {jax.__version__}, "
        f"jaxlib {jaxlib.__version__}, equinox {eqx.__version__}, "
        f"optax {optax.__version__}, lowtrain {lowtrain.__version__}{_git()}, "
        f"Python {platform.python_version()}"
    )


def _git() -> str:
    """` (git <commit>[, modified])` of the lowtrain checkout, or "" outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(lowtrain.__file__)))
    try:
        run = functools.partial(
            subprocess.run, cwd=root, capture_output=True, text=True, check=True
        )
        commit = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--", "lowtrain"]).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f" (git {commit}{', lowtrain/ modified' if dirty.strip() else ''})"


def step_time_table(cases: list[models.Case], args) -> str:
    """Markdown table of train-step times, amp against hand, per model and dtype."""
    rows = [
        "| model | policy | timed steps | amp step (ms) | hand step (ms) | amp / hand "
        "| amp, residuals=half (ms) | half / hand "
        "| max \\|loss(amp) − loss(other)\\| |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        for policy in POLICIES:
            steps = args.steps * case.step_factor
            res = timing.time_steps(case, policy, steps, args.round, args.warmup)
            (a, a_iqr), (h, h_iqr) = res["amp"], res["hand"]
            r, r_iqr = res["amp_half"]
            gap = models.loss_gap(case, policy)
            rows.append(
                f"| {case.name} | {policy} | {steps} "
                f"| {1e3 * a:.2f} ± {5e2 * a_iqr:.2f} "
                f"| {1e3 * h:.2f} ± {5e2 * h_iqr:.2f} | **{a / h:.3f}** "
                f"| {1e3 * r:.2f} ± {5e2 * r_iqr:.2f} | **{r / h:.3f}** | {gap:.1e} |"
            )
            print(f"  timed {case.name} / {policy}: amp/hand = {a / h:.3f}", flush=True)
    return "\n".join(rows)


def compile_time_table(cases: list[models.Case], args) -> str:
    """Markdown table of trace+lower and compile times, amp against hand."""
    rows = [
        "| model | policy | amp trace+lower (s) | hand trace+lower (s) "
        "| amp compile (s) | hand compile (s) | trace+lower ratio | total ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        for policy in POLICIES:
            res = timing.time_compile(case, policy, args.compile_reps)
            (al, ac), (hl, hc) = res["amp"], res["hand"]
            rows.append(
                f"| {case.name} | {policy} | {al:.2f} | {hl:.2f} | {ac:.2f} "
                f"| {hc:.2f} | {al / hl:.2f} | **{(al + ac) / (hl + hc):.2f}** |"
            )
            print(f"  compiled {case.name} / {policy}", flush=True)
    return "\n".join(rows)


def _dtype_bytes(res: list[residuals.Residual], pred: Callable) -> int:
    """Total bytes of the residuals whose dtype satisfies `pred`."""
    return sum(r.nbytes for r in res if pred(np.dtype(r.aval.dtype)))


def _is_half(dtype) -> bool:
    return dtype in tuple(models.HALF.values())


def _summary_table(results: dict[str, list[residuals.Residual]], temps: dict) -> str:
    """Residual totals per variant, and their ratios to the float32 loss."""

    def totals(res):
        everything = sum(r.nbytes for r in res)
        no_args = sum(r.nbytes for r in res if r.kind != "argument")
        acts = sum(r.nbytes for r in res if r.kind not in ("argument", "param cast"))
        return everything, no_args, acts

    ref = totals(results["float32 loss"])
    rows = [
        "| variant | residuals | all (MiB) | excl. arguments (MiB) "
        "| activations only (MiB) | in f32 (MiB) | in f16/bf16 (MiB) "
        "| all / fp32 | excl. args / fp32 | activations / fp32 | XLA temp (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        t = totals(res)
        f32 = _dtype_bytes(res, lambda d: d == np.float32)
        half = _dtype_bytes(res, _is_half)
        temp = "–" if temps[name] is None else f"{temps[name] / MiB:.2f}"
        rows.append(
            f"| {name} | {len(res)} | {t[0] / MiB:.2f} | {t[1] / MiB:.2f} "
            f"| {t[2] / MiB:.2f} | {f32 / MiB:.2f} | {half / MiB:.2f} "
            f"| **{t[0] / ref[0]:.3f}** | **{t[1] / ref[1]:.3f}** "
            f"| {t[2] / ref[2]:.3f} | {temp} |"
        )
    return "\n".join(rows)


def _kind_table(res: list[residuals.Residual], label: str) -> str:
    """Bytes of `res` by kind and dtype."""
    by_kind = collections.defaultdict(collections.Counter)
    for r in res:
        by_kind[r.kind][str(np.dtype(r.aval.dtype))] += r.nbytes
    dtypes = sorted({d for c in by_kind.values() for d in c})
    rows = [
        f"| {label} residuals | " + " | ".join(f"{d} (MiB)" for d in dtypes) + " |",
        "|---|" + "---:|" * len(dtypes),
    ]
    for kind, counter in sorted(by_kind.items()):
        cells = " | ".join(f"{counter[d] / MiB:.2f}" for d in dtypes)
        rows.append(f"| {kind} | {cells} |")
    return "\n".join(rows)


def _top_f32_table(res: list[residuals.Residual]) -> str:
    """The ten largest groups of float32 residuals of `res` (same type, producer and
    source line)."""
    groups = collections.defaultdict(list)
    for r in res:
        if np.dtype(r.aval.dtype) == np.float32:
            groups[(_compat.short_type(r.aval), r.producer, r.source)].append(r)
    top = sorted(groups.items(), key=lambda kv: -sum(r.nbytes for r in kv[1]))[:10]
    f32_total = _dtype_bytes(res, lambda d: d == np.float32)
    sources = {source for (_, _, source), _ in top}
    # Under amp every equation carries the same source line (the transform's own):
    # then print it once below the table instead of in every row.
    one_source = len(sources) == 1
    rows = [
        "| count × residual | MiB | share of f32 "
        "| produced by (primitive in jit/scan @ scope) "
        + ("|" if one_source else "| source line |"),
        "|---|---:|---:|---|" + ("" if one_source else "---|"),
    ]
    for (short, producer, source), rs in top:
        nbytes = sum(r.nbytes for r in rs)
        row = (
            f"| {len(rs)} × {short} | {nbytes / MiB:.2f} | {nbytes / f32_total:.0%} "
            f"| `{producer}` |"
        )
        rows.append(row if one_source else f"{row} `{source}` |")
    if one_source:
        rows.append(
            f"\nEvery one of these equations has the source line `{sources.pop()}`."
        )
    return "\n".join(rows)


def residual_tables(case: models.Case, xla_memory: bool = True) -> str:
    """Markdown tables of residual bytes per variant, then a breakdown of `amp`'s
    residuals under fp16. With `xla_memory`, also compile each variant's value and
    gradient to read the size of the temporary buffers XLA allocates for it."""
    variants = models.residual_variants(case)
    results, temps = residuals.measure(variants, case.model, case.batch, xla_memory)
    amp = results["amp fp16"]
    label = "`amp` under fp16"
    f32_total = _dtype_bytes(amp, lambda d: d == np.float32)
    return "\n\n".join(
        [
            _summary_table(results, temps),
            f"Residuals of {label} by kind and dtype:",
            _kind_table(amp, label),
            f"The ten largest groups of float32 residuals of {label} "
            f"({f32_total / MiB:.2f} MiB in all):",
            _top_f32_table(amp),
        ]
    )
