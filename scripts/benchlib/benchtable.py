"""The markdown tables and the bar chart of `scripts/bench.py`."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

MiB = 2**20


def _ms(seconds) -> str:
    return "–" if seconds is None else f"{1e3 * seconds:.2f}"


def _ratio(value) -> str:
    return "–" if value is None else f"**{value:.3f}**"


def row_line(row: dict) -> str:
    """A progress line for one measured row."""
    if "error" in row:
        return f"  {row['model']} / {row['precision']}: failed ({row['error']})"
    text = (
        f"  {row['model']} / {row['precision']}: {_ms(row['step_s'])} ms/step, "
        f"{row['tokens_per_s']:.0f} tokens/s, lowtrain/hand {_ratio(row['vs_hand'])}"
    )
    if "overhead" in row:
        text += f", fit/plain loop {row['overhead']['ratio']:.3f}"
    return text


def _mfu(row: dict) -> str:
    return "unknown" if row["mfu"] is None else f"{row['mfu']:.1%}"


def _fp8(row: dict) -> str:
    if row["fp8_gemms"] is None:
        return "not applicable (CPU)"
    kinds = row["fp8_gemms"]
    total = kinds["cublaslt"] + kinds["triton"]
    return (
        f"{total} / {row['gemms']} ({row['wide_dots']} kept wide; "
        f"{kinds['cublaslt']} cuBLASLt, {kinds['triton']} Triton)"
    )


def markdown(rows: list[dict], machine: str, device: str, args, gpu: bool) -> str:
    """The step table, the Trainer-overhead table when there are such rows, and the
    targets table (`gpu`: measured on a GPU)."""
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    memory = rows[0]["memory_source"] if rows else ""
    lines = [
        f"Machine: {machine}",
        f"Device: {device}",
        *([f"Overrides of every case: {' '.join(args.set)}"] if args.set else []),
        "",
        "| model | precision | params | batch x context | step (ms) | tokens/s "
        f"| MFU | memory (MiB, {memory}) | compile (s) | hand step (ms) "
        "| lowtrain / hand | FP8 GEMMs / GEMMs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        memory = "–" if r["memory_bytes"] is None else f"{r['memory_bytes'] / MiB:.1f}"
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['parameters'] / 1e6:.2f}M "
            f"| {r['batch']} x {r['context']} "
            f"| {_ms(r['step_s'])} ± {_ms(r['step_iqr_s'] / 2)} "
            f"| {r['tokens_per_s']:.0f} | {_mfu(r)} | {memory} "
            f"| {r['compile_s']:.1f} | {_ms(r['hand_step_s'])} "
            f"| {_ratio(r['vs_hand'])} | {_fp8(r)} |"
        )
    lines += [
        f"| {r['model']} | {r['precision']} | failed: {r['error']} |" for r in failed
    ]
    lines.append(
        f"\n{rows[0]['timed_steps'] if rows else 0} timed steps, interleaved with the "
        "hand-cast twin in rounds of 5 after 2 warm-up steps; each round's steps "
        "queued back to back and timed together: the median time per step over rounds "
        "(± half the IQR)."
    )
    over = [r for r in rows if "overhead" in r]
    if over:
        lines += [
            "",
            "| model | precision | steps each | fit (ms/step) | plain loop (ms/step) "
            "| fit / plain | hand loop (ms/step) | fit / hand |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in over:
            o = r["overhead"]
            hand = (
                f"| {_ms(o['hand_s'])} | **{o['fit_over_hand']:.3f}** |"
                if "hand_s" in o
                else "| – | – |"
            )
            lines.append(
                f"| {r['model']} | {r['precision']} | {o['steps']} "
                f"| {_ms(o['fit_s'])} | {_ms(o['plain_s'])} | **{o['ratio']:.3f}** "
                + hand
            )
        lines.append(
            f"\n`Trainer.fit` (log_every={over[0]['overhead']['log_every']}, no "
            "progress bar, no eval, no checkpoints) against a plain Python loop over "
            "the same `trainer.compiled_step`, and against a plain loop of the "
            "hand-written step of the same model and optimizer (the hand-cast loss "
            f"under one jit); chunks of {args.overhead_steps} steps alternating, "
            "median seconds per step."
        )
    return "\n".join([*lines, "", targets_table(rows, gpu)])


def _speedup(rows: dict, slow: str, fast: str) -> float | None:
    """Step time of precision `slow` over that of `fast` (one model's rows)."""
    if slow in rows and fast in rows:
        return rows[slow]["step_s"] / rows[fast]["step_s"]
    return None


FP8 = ("fp8", "fp8_delayed", "scalify_fp8", "unit_fp8")


def _over_bf16(rows: dict, precision: str) -> float | None:
    """`precision`'s speed-up over bf16: model FLOPs per second over those of the
    bf16 row of the same model (unit_bf16 for a unit-scaled precision where it was
    measured, else bf16), which for the same model is the ratio of step times; the
    unit-scaled GPT (SwiGLU MLPs) has more FLOPs per token than the GPT."""
    base = "unit_bf16" if precision.startswith("unit") else "bf16"
    if base not in rows:
        base = "bf16"
    if precision not in rows or base not in rows:
        return None
    rate = lambda r: r["flops_per_step"] / r["step_s"]
    return rate(rows[precision]) / rate(rows[base])


def _best_fp8(rows: dict, exclude: tuple = ()) -> tuple | None:
    found = [(v, p) for p in FP8 if p not in exclude and (v := _over_bf16(rows, p))]
    return max(found) if found else None


def _unit_vs_best(rows: dict) -> float | None:
    """unit_fp8's speed-up over unit_bf16 against the best other FP8 precision's
    over bf16 (>= 1: unit_fp8 at least as fast, relative to its own bf16)."""
    unit, other = _over_bf16(rows, "unit_fp8"), _best_fp8(rows, ("unit_fp8",))
    return None if unit is None or other is None else unit / other[0]


def _fp8_gemm_share(rows: dict, precision: str) -> float | None:
    """FP8 GEMMs in the compiled step over its GEMMs less the matmuls the precision
    keeps wide (1: every other one is an FP8 GEMM); None off a GPU."""
    row = rows.get(precision)
    if row is None or row.get("fp8_gemms") is None or not row.get("gemms"):
        return None
    return sum(row["fp8_gemms"].values()) / (row["gemms"] - row["wide_dots"])


def _memory(rows: dict) -> float | None:
    """Peak memory of bf16 over that of fp32."""
    if "bf16" in rows and "fp32" in rows and rows["fp32"]["memory_bytes"]:
        return rows["bf16"]["memory_bytes"] / rows["fp32"]["memory_bytes"]
    return None


def _worst(rows: dict, value: Callable[[dict], float | None]) -> tuple | None:
    """`(largest value, its precision)` over the rows that have one."""
    found = [(v, p) for p, r in rows.items() if (v := value(r)) is not None]
    return max(found) if found else None


@dataclass(frozen=True)
class Target:
    """One of the targets of docs/performance.md, as one model's rows
    (`{precision: row}`) measure it: `value` returns a number, or `(number, the
    precision it comes from)`, or None when the rows needed were not measured.
    `limits` maps a model to its limit (`name` formats it as `{limit}`); a model
    without one has no such target."""

    name: str
    value: Callable[[dict], float | tuple | None]
    limits: dict[str, float]
    at_most: bool  # met when the value is <= limit (else >=)
    fmt: str  # of the value
    gpu_only: bool  # low precision is emulated on a CPU: no verdict there


GPU_SIZES = ("gpt_small", "gpt_1b", "gpt_4k")
EVERY = ("gpt", "gpt_small", "gpt_1b", "gpt_4k", "quick")
TARGETS = (
    Target(
        "bf16 step >= {limit}x fp32",
        lambda r: _speedup(r, "fp32", "bf16"),
        limits={"gpt_small": 2.0},
        at_most=False,
        fmt="{:.2f}x",
        gpu_only=True,
    ),
    Target(
        "best FP8 step >= {limit}x bf16",
        _best_fp8,
        limits={"gpt_small": 1.05, "gpt_1b": 1.25, "gpt_4k": 1.35},
        at_most=False,
        fmt="{:.2f}x",
        gpu_only=True,
    ),
    Target(
        "unit_fp8 / unit_bf16 >= best other FP8 / bf16",
        _unit_vs_best,
        limits=dict.fromkeys(GPU_SIZES, 1.0),
        at_most=False,
        fmt="{:.2f}",
        gpu_only=True,
    ),
    Target(
        "unit_fp8: every matmul not kept wide an FP8 GEMM",
        lambda r: _fp8_gemm_share(r, "unit_fp8"),
        limits=dict.fromkeys(GPU_SIZES, 1.0),
        at_most=False,
        fmt="{:.0%}",
        gpu_only=True,
    ),
    Target(
        "bf16 MFU >= {limit:.0%}",
        lambda r: r.get("bf16", {}).get("mfu"),
        limits={"gpt_small": 0.40, "gpt_1b": 0.50},  # llm.c-class, llm-foundry
        at_most=False,
        fmt="{:.1%}",
        gpu_only=True,
    ),
    Target(
        "peak memory of bf16 <= {limit}x fp32",
        _memory,
        limits={"gpt_small": 0.6},
        at_most=True,
        fmt="{:.2f}x",
        gpu_only=True,
    ),
    Target(
        "lowtrain within {limit}x of its hand-cast twin",
        lambda r: _worst(r, lambda row: row["vs_hand"]),
        limits=dict.fromkeys(EVERY, 1.03),
        at_most=True,
        fmt="{:.3f}",
        gpu_only=False,
    ),
    Target(
        "`Trainer.fit` <= {limit}x a plain loop",
        lambda r: _worst(r, lambda row: row.get("overhead", {}).get("ratio")),
        limits={"gpt": 1.05, "quick": 1.05},
        at_most=True,
        fmt="{:.3f}",
        gpu_only=False,
    ),
)


def targets(rows: list[dict], gpu: bool) -> list[dict]:
    """For each model of `rows` and each of `TARGETS`: the measured value, the
    precision it comes from (for the worst-case ones) and the verdict: "met",
    "missed", "not measured" (rows missing) or "no verdict on a CPU"."""
    by_model: dict[str, dict] = {}
    for r in rows:
        if "error" not in r:
            by_model.setdefault(r["model"], {})[r["precision"]] = r
    found = []
    for model, mine in by_model.items():
        for t in TARGETS:
            if model not in t.limits:
                continue
            limit = t.limits[model]
            value, precision = t.value(mine), None
            if isinstance(value, tuple):
                value, precision = value
            if value is None:
                verdict = "not measured"
            elif t.gpu_only and not gpu:
                verdict = "no verdict on a CPU"
            else:
                met = value <= limit if t.at_most else value >= limit
                verdict = "met" if met else "missed"
            found.append(
                {
                    "model": model,
                    "target": t.name.format(limit=limit),
                    "value": value,
                    "precision": precision,
                    "verdict": verdict,
                    "text": "–" if value is None else t.fmt.format(value),
                }
            )
    return found


def targets_table(rows: list[dict], gpu: bool) -> str:
    """`targets` as markdown."""
    lines = ["| model | target | measured | |", "|---|---|---:|---|"]
    for t in targets(rows, gpu):
        where = f" ({t['precision']})" if t["precision"] else ""
        lines.append(
            f"| {t['model']} | {t['target']} | {t['text']}{where} | {t['verdict']} |"
        )
    lines.append(
        "\nThe targets are for one H100: the speed and memory of low precision get "
        "no verdict on a CPU, which emulates it. FP8 against bf16: model FLOPs per "
        "second over bf16's on the same model (unit_bf16's for a unit-scaled "
        "precision where measured), the ratio of step times for the same model. "
        "lowtrain / hand and fit / plain: the largest over the precisions measured."
    )
    return "\n".join(lines)


def bar_chart(rows: list[dict], path: pathlib.Path, device: str) -> None:
    """Tokens/s per model and precision, lowtrain and its hand-cast twin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    if not rows:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(
        1, len(models), figsize=(5 * len(models), 4), squeeze=False
    )
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        xs = range(len(mine))
        ax.bar(
            [x - 0.2 for x in xs],
            [r["tokens_per_s"] for r in mine],
            0.4,
            label="lowtrain",
        )
        hand = [r["tokens_per_s"] * r["vs_hand"] if r["vs_hand"] else 0 for r in mine]
        ax.bar([x + 0.2 for x in xs], hand, 0.4, label="by hand (jmp style)")
        ax.set_xticks(list(xs), [r["precision"] for r in mine], rotation=30)
        ax.set_title(f"{model}")
        ax.set_ylabel("tokens/s")
        ax.legend()
    fig.suptitle(device, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
