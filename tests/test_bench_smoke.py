"""`scripts/bench.py`, the one benchmark command, end to end on a tiny GPT (a
subprocess, as users run it): the benchmark tools' one test in the default suite
(the others: tests/test_bench.py, slow)."""

import json
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_bench(out, *args):
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick"]
    subprocess.run(
        [*command, "--out", str(out), *args], check=True, capture_output=True
    )
    return json.loads((out / "bench.json").read_text())


def check_row(row, precision):
    assert row["model"] == "quick" and row["precision"] == precision
    assert (row["batch"], row["context"], row["timed_steps"]) == (4, 16, 20)
    # 1 layer of width 32 (12 * 32**2 + 13 * 32) and the tied 65 x 32 embedding.
    assert row["parameters"] == 12 * 32**2 + 13 * 32 + 65 * 32 + 2 * 32
    attention = 12 * 1 * 32 * 16
    assert row["flops_per_step"] == (6 * row["parameters"] + attention) * 4 * 16
    assert row["tokens_per_s"] == pytest.approx(4 * 16 / row["step_s"])
    assert row["step_s"] > 0 and row["compile_s"] > 0 and row["loss"] > 0
    assert row["memory_bytes"] > 0
    over = row["overhead"]
    assert over["ratio"] == pytest.approx(over["fit_s"] / over["plain_s"])
    assert over["log_every"] == 25 and over["steps"] == 20
    if precision in ("fp32", "bf16", "fp16", "fp8"):  # a hand-written twin
        assert over["fit_over_hand"] == pytest.approx(over["fit_s"] / over["hand_s"])


# In the default run (20 s on one core: three compiles, then 200 steps): the one
# command runs end to end on a CPU, files and targets included.
@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU columns")
def test_bench_quick_fp32_on_cpu(tmp_path):
    result = run_bench(tmp_path, "--precisions", "fp32")
    (row,) = result["rows"]
    check_row(row, "fp32")
    # The hand-written twin of fp32 is the plain float32 step.
    assert row["vs_hand"] == pytest.approx(row["step_s"] / row["hand_step_s"])
    # No peak for a CPU, XLA's analysis for memory, no cuBLASLt.
    assert row["mfu"] is None and row["memory_source"] == "XLA memory analysis"
    assert row["fp8_gemms"] is None and row["gemms"] is None
    assert row["wide_dots"] > 0  # a CPU multiplies dequantized values
    # The targets of the tiny GPT: the twin and fit ratios (speed targets are the
    # GPU sizes').
    targets = {t["target"]: t for t in result["targets"]}
    assert set(targets) == {
        "lowtrain within 1.03x of its hand-cast twin",
        "`Trainer.fit` <= 1.05x a plain loop",
    }
    twin = targets["lowtrain within 1.03x of its hand-cast twin"]
    assert (twin["value"], twin["precision"]) == (row["vs_hand"], "fp32")
    assert twin["verdict"] == ("met" if row["vs_hand"] <= 1.03 else "missed")
    table = (tmp_path / "bench.md").read_text()
    assert "| quick | fp32 | 0.01M | 4 x 16 |" in table
    assert "| unknown |" in table and "not applicable (CPU)" in table
    assert "fit / plain" in table
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
