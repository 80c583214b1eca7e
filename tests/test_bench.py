"""`scripts/bench.py` and its `benchlib`: the hand-cast twins, the targets, the
commands besides the step benchmark (slow: `pytest -m slow`)."""

import gzip
import json
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from .test_bench_smoke import ROOT, check_row, run_bench

# The benchmark tools' own tests: slow, run with `pytest -m slow` (the default suite
# runs `tests/test_bench_smoke.py`).
pytestmark = pytest.mark.slow

# The precisions with a hand-cast twin: all but scalify_fp8 and fp8_delayed.
TWINS = (
    "fp32",
    "bf16",
    "fp16",
    "fp8",
    "unit_fp32",
    "unit_bf16",
    "unit_fp16",
    "unit_fp8",
)


def test_bench_quick_every_precision(tmp_path):
    result = run_bench(tmp_path, "--isolate", "yes")
    rows = {row["precision"]: row for row in result["rows"]}
    assert list(rows) == [
        "fp32",
        "bf16",
        "fp16",
        "fp8",
        "fp8_delayed",
        "scalify_fp8",
        "unit_fp32",
        "unit_bf16",
        "unit_fp16",
        "unit_fp8",
    ]
    for precision, row in rows.items():
        if not precision.startswith("unit"):  # unit: another model, other params
            check_row(row, precision)
        # Hand-cast twins exist for all but scalify_fp8 and fp8_delayed.
        assert (row["vs_hand"] is None) == (precision not in TWINS)


@pytest.mark.gpu
def test_bench_fp8_matmuls_are_fp8_gemms(tmp_path):
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not any(h in gpus[0].device_kind for h in ("H100", "H200")):
        pytest.skip("needs a Hopper GPU (H100/H200) for FP8 GEMMs")
    (row,) = run_bench(tmp_path, "--precisions", "fp8")["rows"]
    # Every matmul of the step, forward and backward, is an FP8 GEMM.
    # (cuBLASLt or Triton, whichever XLA's autotuner picks).
    assert row["gemms"] > 0 and row["wide_dots"] == 0
    assert sum(row["fp8_gemms"].values()) == row["gemms"]
    assert row["mfu"] is not None and row["memory_source"] == "peak_bytes_in_use"


def test_bench_judges_the_targets(monkeypatch):
    # Rows in the shape of an H100 run (gpt_small, gpt_1b, and the char-GPT's
    # overhead): each target computed from them, met or missed.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import benchtable

    def row(
        precision,
        step_ms,
        vs_hand=None,
        mfu=None,
        mib=None,
        model="gpt_small",
        flops=1e15,
        gemms=None,
    ):
        return {
            "model": model,
            "precision": precision,
            "step_s": step_ms / 1e3,
            "vs_hand": vs_hand,
            "mfu": mfu,
            "memory_bytes": None if mib is None else mib * 2**20,
            "flops_per_step": flops,
            "fp8_gemms": None if gemms is None else {"cublaslt": gemms, "triton": 0},
            "gemms": 37,
            "wide_dots": 3,
        }

    rows = [
        row("fp32", 186.39, 1.002, 0.152, 47361),
        row("bf16", 114.70, 0.962, 0.123, 36917),
        row("fp8", 120.51, None, 0.059, 32305),
        row("fp8_delayed", 100.0),
        # Another model (more FLOPs per step): judged by FLOPs per second.
        row("unit_fp8", 110.0, flops=1.2e15, gemms=34),
        {"model": "gpt_small", "precision": "unit_bf16", "error": "exit 1: OOM"},
        row("bf16", 300.0, mfu=0.48, model="gpt_1b"),
        row("fp8", 230.0, model="gpt_1b"),
        row("unit_fp8", 250.0, model="gpt_1b", gemms=30),
        {**row("fp16", 3.56, 1.055, model="gpt"), "overhead": {"ratio": 1.187}},
        {**row("fp32", 3.61, 1.045, model="gpt"), "overhead": {"ratio": 1.299}},
    ]
    got = {
        (t["model"], t["target"]): (t["text"], t["precision"], t["verdict"])
        for t in benchtable.targets(rows, gpu=True)
    }
    small = {k[1]: v for k, v in got.items() if k[0] == "gpt_small"}
    unit_over_bf16 = (1.2e15 / 0.110) / (1e15 / 0.1147)  # 1.25x in FLOP/s
    assert small == {
        "bf16 step >= 2.0x fp32": ("1.63x", None, "missed"),
        "best FP8 step >= 1.05x bf16": ("1.25x", "unit_fp8", "met"),
        "unit_fp8 / unit_bf16 >= best other FP8 / bf16": (
            f"{unit_over_bf16 / (114.70 / 100.0):.2f}",
            None,
            "met",
        ),
        "unit_fp8: every matmul not kept wide an FP8 GEMM": ("100%", None, "met"),
        "bf16 MFU >= 40%": ("12.3%", None, "missed"),
        "peak memory of bf16 <= 0.6x fp32": ("0.78x", None, "missed"),
        "lowtrain within 1.03x of its hand-cast twin": ("1.002", "fp32", "met"),
    }
    big = {k[1]: v for k, v in got.items() if k[0] == "gpt_1b"}
    assert big == {
        "best FP8 step >= 1.25x bf16": ("1.30x", "fp8", "met"),
        "unit_fp8 / unit_bf16 >= best other FP8 / bf16": ("0.92", None, "missed"),
        "unit_fp8: every matmul not kept wide an FP8 GEMM": ("88%", None, "missed"),
        "bf16 MFU >= 50%": ("48.0%", None, "missed"),
        "lowtrain within 1.03x of its hand-cast twin": ("–", None, "not measured"),
    }
    gpt = {k[1]: v for k, v in got.items() if k[0] == "gpt"}
    assert gpt == {
        "lowtrain within 1.03x of its hand-cast twin": ("1.055", "fp16", "missed"),
        "`Trainer.fit` <= 1.05x a plain loop": ("1.299", "fp32", "missed"),
    }
    # On a CPU low precision is emulated: its speed and memory get no verdict.
    cpu = {
        (t["model"], t["target"]): t["verdict"]
        for t in benchtable.targets(rows, gpu=False)
    }
    assert cpu["gpt_small", "bf16 step >= 2.0x fp32"] == "no verdict on a CPU"
    assert cpu["gpt_small", "lowtrain within 1.03x of its hand-cast twin"] == "met"
    table = benchtable.targets_table(rows, gpu=True)
    assert "| gpt_1b | best FP8 step >= 1.25x bf16 | 1.30x (fp8) | met |" in table
    assert "| gpt | `Trainer.fit` <= 1.05x a plain loop | 1.299 (fp32) | missed |" in (
        table
    )


def test_bench_cases_are_the_recipes_trainers(monkeypatch):
    # The pieces of bench.py without compiling anything: the cases are built from
    # the recipes' configs, with their precisions, FLOPs and the device's peak.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import throughput

    import lowtrain

    for precision in throughput.RECIPES:
        case = throughput.make_case("quick", precision, 4)
        assert case.config.precision.name == precision
        assert (case.batch_size, case.block_size, case.tokens) == (4, 16, 64)
        assert (case.hand_loss is None) == (precision not in TWINS)
        parts = getattr(case.trainer.precision, "parts", (case.trainer.precision,))
        if precision in ("fp32", "bf16", "fp16", "fp8"):
            assert parts[0].policy == lowtrain.get_policy(precision)
    half = throughput.make_case("quick", "bf16", 4, ["precision.residuals=half"])
    assert half.trainer.precision.policy.residuals == "half"  # `bench.py --set`
    case = throughput.make_case("quick", "bf16", 4)
    assert case.trainer.precision.policy.residuals == "all"
    n = 12 * 32**2 + 13 * 32 + 65 * 32 + 2 * 32  # 1 block, tied embedding, ln_f
    assert case.parameters() == n
    assert case.flops() == (6 * n + 12 * 32 * 16) * 64
    # The unit-scaled model's token embedding is a lookup of its own (untied).
    unit = throughput.make_case("quick", "unit_bf16", 4)
    params = eqx.filter(unit.trainer.model, eqx.is_inexact_array)
    total = sum(x.size for x in jax.tree.leaves(params))
    assert unit.parameters() == total - 65 * 32
    batch = throughput.synthetic_data(case)(3)
    assert batch["x"].shape == (4, 16) and batch["x"].dtype == "int32"
    assert (batch["x"][:, 1:] == batch["y"][:, :-1]).all()
    if jax.default_backend() == "cpu":
        assert throughput.device_name() is None
        assert throughput.peak_flops("bf16") is None
    h100 = throughput.PEAKS["H100 SXM"]
    assert h100["fp8"] == pytest.approx(2 * h100["bf16"], rel=1e-3)
    cublas = 'a = f8 custom-call(x, y), custom_call_target="__cublas$lt$matmul$f8"\n'
    wide = 'a = bf16 custom-call(x, y), custom_call_target="__cublas$lt$matmul"\n'
    assert throughput.count_fp8_gemms(cublas * 3 + wide) == (3, 0, 4)
    lowered = (
        "%1 = stablehlo.dot_general %a, %b : (tensor<4x8xf8E4M3FN>, "
        "tensor<8x2xf8E5M2>) -> tensor<4x2xf32>\n"
        "%2 = stablehlo.dot_general %a, %b : (tensor<4x8xbf16>, "
        "tensor<8x2xf8E5M2>) -> tensor<4x2xf32>\n"
    )
    assert throughput.count_dots(lowered) == (2, 1)
    # A Triton GEMM fusion counts when its dot takes two FP8 operands (as XLA prints
    # them: the fused computation, then the fusion calling it).
    fused = (
        "%gemm_{i}_computation (p0: {t}[4,8], p1: f8e4m3fn[8,2]) -> bf16[4,2] {{\n"
        "  %p0 = {t}[4,8]{{1,0}} parameter(0)\n"
        "  %p1 = f8e4m3fn[8,2]{{1,0}} parameter(1)\n"
        "  %dot.{i} = f32[4,2]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}\n"
        "  ROOT %c = bf16[4,2]{{1,0}} convert(%dot.{i})\n}}\n"
        "%fusion.{i} = bf16[4,2]{{1,0}} fusion(%a, %b), kind=kCustom, "
        'calls=%gemm_{i}_computation, backend_config={{"fusion_backend_config":'
        '{{"kind":"__triton_nested_gemm_fusion"}}}}\n'
    )
    hlo = cublas + fused.format(i=1, t="f8e5m2") + fused.format(i=2, t="bf16")
    assert throughput.count_fp8_gemms(hlo) == (1, 1, 3)


@pytest.mark.parametrize("precision", ["fp32", "unit_fp32"])
def test_float32_twins_are_the_trainers_loss(monkeypatch, precision):
    # Without casts, the twin is the loss the recipe's Trainer computes, called
    # without the Trainer: the same value and gradients (u-μP's unit-scaled
    # cross-entropy has the true mean's value but not its gradient).
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import throughput

    case = throughput.make_case("quick", precision, 4)
    batch = throughput.synthetic_data(case)(0)
    args = (batch["x"], batch["y"])
    trainers = lambda model: case.trainer_loss(model, *args, jax.random.key(0))
    twin = lambda model: case.hand_loss(model, *args)
    ours, theirs = (
        eqx.filter_value_and_grad(f)(case.trainer.model) for f in (trainers, twin)
    )
    assert ours[0] == theirs[0]
    assert all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(theirs[1]))
    )


def _value_grad_and_fp8_casts(loss, model, x, y):
    """The loss and gradients of `loss`, compiled with XLA's excess precision off (so
    each op rounds as written), and the FP8 dtypes its jaxpr casts to, one per cast."""
    from .helpers import iter_eqns

    step = eqx.filter_value_and_grad(loss)
    fn = lambda m, x, y: step(m, x, y)
    lowered = jax.jit(fn).lower(model, x, y)
    value, grads = lowered.compile({"xla_allow_excess_precision": False})(model, x, y)
    casts = [
        str(e.params["new_dtype"])
        for e in iter_eqns(jax.make_jaxpr(fn)(model, x, y))
        if e.primitive.name == "convert_element_type"
        and "float8" in str(e.params["new_dtype"])
    ]
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    return (
        value,
        jnp.concatenate([g.astype(jnp.float32).ravel() for g in leaves]),
        casts,
    )


@pytest.mark.parametrize(
    "precision, attention",
    [("bf16", "einsum"), ("fp16", "fused"), ("fp8", "einsum"), ("fp8", "fused")],
)
def test_hand_cast_twins_compute_the_trainers_loss(monkeypatch, precision, attention):
    # The hand-cast twin places every op of the forward pass as `amp` does under the
    # recipe's policy: the same loss to the last bit, the same FP8 casts, close
    # gradients (the bias gradients sum in half precision by hand, in float32 under
    # amp).
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import models, throughput

    import lowtrain

    extra = [f"model.attention={attention}", "model.dropout=0"]
    case = throughput.make_case("quick", precision, 4, extra)
    policy = case.trainer.precision.policy
    assert policy == lowtrain.get_policy(precision)
    batch = throughput.synthetic_data(case)(0)
    args = (case.trainer.model, batch["x"], batch["y"])
    # The twins mix dtypes as a jmp-style loop does (bf16 * f32 -> f32): standard
    # promotion, as scripts/bench.py runs them.
    with jax.numpy_dtype_promotion("standard"):
        amp_loss, amp_grads, amp_casts = _value_grad_and_fp8_casts(
            lowtrain.amp(models.loss, policy), *args
        )
        hand_loss, hand_grads, hand_casts = _value_grad_and_fp8_casts(
            case.hand_loss, *args
        )
    assert amp_loss == hand_loss
    # 1 layer: qkv, proj, fc, out and the tied head (and the 2 attention einsums
    # unless fused): two E4M3 operands forward, one E5M2 cotangent backward, each.
    n = 5 if attention == "fused" else 7
    expected = ["float8_e4m3fn"] * 2 * n + ["float8_e5m2"] * n
    assert sorted(amp_casts) == sorted(hand_casts) == (expected * (precision == "fp8"))
    gap = jnp.linalg.norm(amp_grads - hand_grads) / jnp.linalg.norm(amp_grads)
    assert float(gap) < 0.02


@pytest.mark.parametrize("precision", ["unit_bf16", "unit_fp16", "unit_fp8"])
def test_unit_twins_compute_the_trainers_loss(monkeypatch, precision):
    # The unit-scaled GPT placed by hand (scripts/benchlib/unit_twin.py) computes
    # the loss of the recipe's Trainer (amp; for unit_fp8 the fp8_naive rewrite,
    # then amp) to the last bit, with the same FP8 casts. The gradients differ by
    # rounding only: amp multiplies the half cotangents by unit scaling's backward
    # scales in float32, the library's `U.scale_bwd` on half arrays in half.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import throughput, unit_twin

    case = throughput.make_case("quick", precision, 4)
    trainer = case.trainer
    batch = throughput.synthetic_data(case)(0)
    args = (trainer.model, batch["x"], batch["y"])
    with jax.numpy_dtype_promotion("standard"):
        ours, our_grads, our_casts = _value_grad_and_fp8_casts(case.trainer_loss, *args)
        theirs, their_grads, their_casts = _value_grad_and_fp8_casts(
            case.hand_loss, *args
        )
        # Casting the readout too (not in `precision.keep`) is another loss.
        other = unit_twin.hand_unit_loss(jnp.bfloat16, fp8=True, keep=())
        other_loss = _value_grad_and_fp8_casts(other, *args)[0]
    assert ours == theirs and other_loss != ours
    # 1 layer: qkv, the two attention products, o, and the MLP's three (the readout
    # kept): two E4M3 operands forward, one E5M2 cotangent backward, each.
    expected = (["float8_e4m3fn"] * 14 + ["float8_e5m2"] * 7) * (
        precision == "unit_fp8"
    )
    assert sorted(our_casts) == sorted(their_casts) == sorted(expected)
    gap = jnp.linalg.norm(our_grads - their_grads) / jnp.linalg.norm(our_grads)
    assert float(gap) < 0.03
    # float16's MLP runs op by op (`fold_mlp_scales: false`), the others folded.
    assert trainer.model.layers.layers[0].mlp.fold_scales == (precision != "unit_fp16")


def test_unit_twin_follows_the_precision_config(monkeypatch):
    # `bench.py --set` overrides reach the twin: `precision.keep` (here nothing
    # kept: the readout in FP8 too, one more cast matmul); `weights_only=true`, a
    # placement the twin does not write, leaves the row without one ("–").
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import throughput

    def casts(extra):
        case = throughput.make_case("quick", "unit_fp8", 4, extra)
        batch = throughput.synthetic_data(case)(0)
        args = (case.trainer.model, batch["x"], batch["y"])
        with jax.numpy_dtype_promotion("standard"):  # as scripts/bench.py runs twins
            return _value_grad_and_fp8_casts(case.hand_loss, *args)[2]

    assert len(casts([])) == 21 and len(casts(["precision.keep=[]"])) == 24
    some = throughput.make_case("quick", "unit_fp8", 4, ["precision.weights_only=true"])
    assert some.hand_loss is None


def test_unit_twin_says_which_model_it_writes(monkeypatch):
    # A unit GPT the twin does not write (here a GELU MLP) is refused, not placed
    # some other way.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import unit_twin

    import lowtrain.unit_scaling as uu

    gpt = uu.TransformerDecoder(32, 16, layers=1, heads=2, key=jax.random.key(0))
    gelu = uu.MLP(32, activation="gelu", key=jax.random.key(1))
    gpt = eqx.tree_at(lambda m: m.layers.layers[0].mlp, gpt, gelu)
    tokens = jnp.zeros((2, 8), jnp.int32)
    with (
        pytest.raises(ValueError, match="SwiGLU MLPs, got activation='gelu'"),
        jax.numpy_dtype_promotion("standard"),
    ):
        unit_twin.hand_unit_loss(jnp.bfloat16)(gpt, tokens, tokens)


def test_profile_step_sums_the_device_ops(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import profile_step

    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    events = [
        {
            "ph": "M",
            "pid": 1,
            "name": "process_name",
            "args": {"name": "/device:GPU:0"},
        },
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "gemm_fusion_dot", "dur": 3.0},
        {"ph": "X", "pid": 1, "name": "gemm_fusion_dot", "dur": 2.0},
        {"ph": "X", "pid": 1, "name": "loop_convert_fusion", "dur": 1.5},
        {"ph": "X", "pid": 2, "name": "host work", "dur": 100.0},
    ]
    trace = json.dumps({"traceEvents": events}).encode()
    (folder / "perfetto_trace.json.gz").write_bytes(gzip.compress(trace))
    totals = profile_step.device_ops(tmp_path)
    assert totals == {"gemm_fusion_dot": 5.0, "loop_convert_fusion": 1.5}
    with pytest.raises(FileNotFoundError, match="Expected a perfetto_trace.json.gz"):
        profile_step.device_ops(tmp_path / "no trace here")


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--batch-size", "-1"], "Expected `trainer.batch_size` > 0, got -1"),
        # `--set` overrides reach the case's own process.
        (["--set", "precision.residuals=some"], "Expected `residuals` in ('all'"),
    ],
)
def test_a_failing_case_is_a_row_and_a_nonzero_exit(tmp_path, bad, message):
    # Each case in its own process: one that fails (here at its config) becomes a
    # row saying why, the script still writes its files and exits non-zero.
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick"]
    args = ["--precisions", "fp32", *bad, "--isolate", "yes"]
    done = subprocess.run(
        [*command, *args, "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "1 case(s) failed: quick/fp32" in done.stderr
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert message in row["error"]
    table = (tmp_path / "bench.md").read_text()
    assert "| quick | fp32 | failed: exit 1: ValueError" in table
    assert ("Overrides of every case: precision.residuals=some" in table) == (
        "--set" in bad
    )


def test_saved_bytes_counts_the_backward_residuals_by_dtype(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import saved_bytes

    rows = ["fp32", "bf16", "bf16:precision.residuals=half", "fp8"]
    got = {row: saved_bytes.saved_bytes("quick", row) for row in rows}
    # The FP8 operands, saved as their bits: one byte each, in the FP8 column.
    assert got["fp8"]["uint8"] > 0 and "bfloat16" not in got["fp8"]
    assert set(got["fp32"]) <= {"float32", "int32", "bool"}
    assert got["bf16"]["bfloat16"] > 0
    # residuals=half: float32 values are recomputed, not saved; about 0.4 of fp32.
    total = {row: sum(v.values()) for row, v in got.items()}
    assert total["bf16:precision.residuals=half"] < 0.5 * total["fp32"] < total["bf16"]
    assert got["bf16:precision.residuals=half"]["float32"] < got["bf16"]["float32"] / 5
    saved_bytes.main(["--model", "quick", "--rows", *rows])
    table = capsys.readouterr().out
    assert "| fp32 |" in table and "| 1.000 |" in table
    fp8_row = next(line for line in table.splitlines() if line.startswith("| fp8 |"))
    assert fp8_row.split("|")[5].strip() == f"{got['fp8']['uint8'] / 2**20:.1f}"
    ratio = total["bf16:precision.residuals=half"] / total["fp32"]
    assert "| bf16:precision.residuals=half |" in table and f"| {ratio:.3f} |" in table


def test_twin_hlo_finds_what_the_compiled_steps_do_differently(monkeypatch, capsys):
    # `bench.py twin-hlo`: fp32's twin is the Trainer's own loss, so the two compiled
    # steps are the same; unit_fp8's lowtrain step compiles to its hand-cast twin's
    # fusions and bytes too (casts where ops use the inputs: what a hand-written
    # mixed-precision model does).
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import twin_hlo

    with jax.numpy_dtype_promotion("standard"):  # as the scripts run twins
        same = twin_hlo.compare("quick", "fp32")
        unit = twin_hlo.compare("quick", "unit_fp8")
    assert same["lowtrain"]["fusions"] == same["hand"]["fusions"]
    assert same["lowtrain"]["bytes"] == same["hand"]["bytes"] > 0
    assert not unit["more_in_lowtrain"] and not unit["more_in_hand"]
    assert unit["lowtrain"]["bytes"] == unit["hand"]["bytes"] > 0
    with pytest.raises(
        ValueError, match=r"which has none \(scalify_fp8\): leave it out"
    ):
        twin_hlo.compare("quick", "scalify_fp8")
    twin_hlo.main(["--model", "quick", "--precisions", "fp32"])
    n = sum(same["hand"]["fusions"].values())
    assert f"| fp32 | {n} / {n} | 1.000 | – | – |" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_unit_fp8_matmuls_are_fp8_gemms(tmp_path):
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not any(h in gpus[0].device_kind for h in ("H100", "H200")):
        pytest.skip("needs a Hopper GPU (H100/H200) for FP8 GEMMs")
    (row,) = run_bench(tmp_path, "--precisions", "unit_fp8")["rows"]
    # Every matmul but the readout's (forward and two backward, kept in bf16) is a
    # dot of FP8 arrays with static scale 1, and each compiles to an FP8 GEMM.
    assert row["wide_dots"] == 3
    assert sum(row["fp8_gemms"].values()) == row["gemms"] - 3


def test_gemm_table_and_break_even(monkeypatch):
    # `bench.py --gemm`'s rows measured on tiny widths, and the break-even rule:
    # the smallest width from which FP8 is faster at every larger width.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from benchlib import gemm

    rows = gemm.measure(16, widths=(16, 32), reps=1, rounds=1)
    assert [r["width"] for r in rows] == [16, 32]
    assert all(r[f"{k}_s"] > 0 for r in rows for k in gemm.KINDS)
    fake = [
        {"width": w, "bf16_s": 1.0, "fp8 current_s": c, "fp8 static_s": 0.5}
        for w, c in [(256, 2.0), (512, 0.9), (1024, 1.1), (2048, 0.8), (4096, 0.7)]
    ]
    assert gemm.break_even(fake, "fp8 current") == 2048
    assert gemm.break_even(fake, "fp8 static") == 256
    fake[-1]["fp8 current_s"] = 1.5
    assert gemm.break_even(fake, "fp8 current") is None
    table = gemm.markdown([{**r, "tokens": 8, "tflops_bf16": 1.0} for r in fake])
    assert "FP8 pays (fp8 static): d >= 256" in table
    assert "FP8 pays (fp8 current): not reached" in table


def test_bench_commands_dispatch(monkeypatch, capsys, tmp_path):
    # `bench.py COMMAND ...` runs that command's `main`; without one, the step
    # benchmark. `vmap --quick`: the per-example form costs what the batched does.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench
    from benchlib import vmap_cost

    assert set(bench.COMMANDS) >= {"gemm", "vmap", "amp", "twin-hlo", "saved-bytes"}
    bench.main(["gemm", "--quick", "--out", str(tmp_path)])
    assert "FP8 pays (fp8 static)" in (tmp_path / "gemm.md").read_text()
    rows = vmap_cost.measure(16, ("bf16",), reps=1, rounds=1)
    by = {r["form"]: r for r in rows}
    assert set(by) == {
        "float32",
        "vmap(amp(m))",
        "amp(vmap(m))",
        "Trainer, per-example loss",
        "Trainer, batched model",
    }
    # The same program: the same temporary buffers.
    assert by["vmap(amp(m))"]["temp_bytes"] == by["amp(vmap(m))"]["temp_bytes"]
    table = vmap_cost.markdown(rows)
    assert "| bf16 | vmap(amp(m)) | 16 |" in table
