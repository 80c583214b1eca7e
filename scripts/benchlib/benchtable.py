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
        f"{total} / {row['dot_generals']} ({kinds['cublaslt']} cuBLASLt, "
        f"{kinds['triton']} Triton)"
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
        "| lowtrain / hand | FP8 GEMMs / matmuls |",
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
            "| fit / plain |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in over:
            o = r["overhead"]
            lines.append(
                f"| {r['model']} | {r['precision']} | {o['steps']} "
                f"| {_ms(o['fit_s'])} | {_ms(o['plain_s'])} | **{o['ratio']:.3f}** |"
            )
        lines.append(
            f"\n`Trainer.fit` (log_every={over[0]['overhead']['log_every']}, no "
            "progress bar, no eval, no checkpoints) against a plain Python loop over "
            "the same `trainer.compiled_step`; chunks of "
            f"{args.overhead_steps} steps alternating, median seconds per step."
        )
    return "\n".join([*lines, "", targets_table(rows, gpu)])


def _speedup(rows: dict, slow: str, fast: str) -> float | None:
    """Step time of precision `slow` over that of `fast` (one model's rows)."""
    if slow in rows and fast in rows:
        return rows[slow]["step_s"] / rows[fast]["step_s"]
    return None


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
    """One of issue 13's targets (docs/performance.md), as one model's rows
    (`{precision: row}`) measure it: `value` returns a number, or `(number, the
    precision it comes from)`, or None when the rows needed were not measured."""

    name: str
    value: Callable[[dict], float | tuple | None]
    limit: float
    at_most: bool  # met when the value is <= limit (else >=)
    fmt: str  # of the value
    gpu_only: bool  # low precision is emulated on a CPU: no verdict there


TARGETS = (
    Target(
        "bf16 step >= 2.0x fp32",
        lambda r: _speedup(r, "fp32", "bf16"),
        limit=2.0,
        at_most=False,
        fmt="{:.2f}x",
        gpu_only=True,
    ),
    # FP8 with current scaling (`fp8`) and with delayed scaling (`fp8_delayed`).
    *(
        Target(
            f"{fp8} step >= 1.3x bf16",
            lambda r, fp8=fp8: _speedup(r, "bf16", fp8),
            limit=1.3,
            at_most=False,
            fmt="{:.2f}x",
            gpu_only=True,
        )
        for fp8 in ("fp8", "fp8_delayed")
    ),
    Target(
        "bf16 MFU >= 40%",
        lambda r: r.get("bf16", {}).get("mfu"),
        limit=0.40,
        at_most=False,
        fmt="{:.1%}",
        gpu_only=True,
    ),
    Target(
        "peak memory of bf16 <= 0.6x fp32",
        _memory,
        limit=0.6,
        at_most=True,
        fmt="{:.2f}x",
        gpu_only=True,
    ),
    Target(
        "lowtrain within 1.03x of its hand-cast twin",
        lambda r: _worst(r, lambda row: row["vs_hand"]),
        limit=1.03,
        at_most=True,
        fmt="{:.3f}",
        gpu_only=False,
    ),
    Target(
        "`Trainer.fit` <= 1.05x a plain loop",
        lambda r: _worst(r, lambda row: row.get("overhead", {}).get("ratio")),
        limit=1.05,
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
            value, precision = t.value(mine), None
            if isinstance(value, tuple):
                value, precision = value
            if value is None:
                verdict = "not measured"
            elif t.gpu_only and not gpu:
                verdict = "no verdict on a CPU"
            else:
                met = value <= t.limit if t.at_most else value >= t.limit
                verdict = "met" if met else "missed"
            found.append(
                {
                    "model": model,
                    "target": t.name,
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
        "\nIssue 13's targets are for one H100: the speed and memory of low "
        "precision get no verdict on a CPU, which emulates it. lowtrain / hand and "
        "fit / plain: the largest over the precisions measured."
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
