"""The scaling as a decision: block-scaled casts in the casts report (their element
format after each block's scale, with their rounding error), `plan(formats=...)`
choosing each matmul's format from what its casts lose in each, the policy and the
precision that run a plan's routes, and the Autopilot choosing formats while it
trains."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lowtrain
import lowtrain.fp8 as fp8
import lowtrain.numerics as numerics
from lowtrain.numerics import Plan, Report

from .test_autopilot import Two

DN = (((1,), (0,)), ((), ()))
FORMATS = ["nvfp4", "mxfp8", "fp8"]


# -- block-scaled casts in the casts report ----------------------------------------


def _block_loss(recipe):
    def loss(w, x):
        with jax.named_scope("head"):
            return jnp.sum(fp8.block_recipe_dot(x, w, DN, recipe) ** 2)

    return loss


def test_block_casts_are_reported_in_their_element_format(getkey):
    x = jax.random.normal(getkey(), (64, 128))
    w = jax.random.normal(getkey(), (128, 32))
    grad = jax.grad(_block_loss("nvfp4"))
    got, report = numerics.track(grad, casts=True)(w, x)
    # Naming the casts is metadata: the same gradient, bit for bit.
    assert jnp.array_equal(got, jax.jit(grad)(w, x))
    roles = [(r["pass"], r["site"]["role"], r["site"]["scaling"]) for r in report.rows]
    # Forward: both operands; backward: the cotangent for each GEMM and each operand
    # again, along the dimension that GEMM contracts.
    assert sorted(roles) == sorted(
        [
            ("fwd", "lhs", "nvfp4"),
            ("fwd", "rhs", "nvfp4_16x16"),
            ("bwd", "grad", "nvfp4"),
            ("bwd", "rhs", "nvfp4_16x16"),
            ("bwd", "grad", "nvfp4"),
            ("bwd", "lhs", "nvfp4"),
        ]
    )
    for r in report.rows:
        assert r["dtype"] == "float4_e2m1fn" and r["name"] == "head"
        assert r["site"]["stochastic"] == (r["site"]["role"] == "grad")
    # One call, though its gradient is cast twice (once for each backward GEMM).
    (matmul,) = numerics.plan(report).matmuls
    assert matmul.calls == 1 and matmul.flops == 2 * 64 * 32 * 128


def test_a_block_casts_flush_and_error_are_those_of_its_scaled_values(getkey):
    # The forward lhs cast of MXFP4 along rows of 32, recomputed by hand: each
    # block divided by its power-of-two scale, rounded to nearest in E2M1.
    x = jax.random.normal(getkey(), (8, 64)) * jnp.logspace(-3, 0, 64)[None, :]
    w = jax.random.normal(getkey(), (64, 16))

    def fwd(x, w):
        with jax.named_scope("mm"):
            fmt = fp8.MXFP4
            return fp8.block_dot_general(x, w, DN, fmt)

    _, report = numerics.track(fwd, casts=True)(x, w)
    (row,) = [r for r in report.rows if r["site"]["role"] == "lhs"]
    q = fp8.block_quantize(x, fp8.MXFP4, axis=1)
    scales = np.repeat(np.asarray(q.scales.astype(jnp.float32)), 32, axis=1)
    v = np.asarray(x) / scales
    rounded = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(rounded * scales, np.asarray(q.dequantize()))  # the cast
    nonzero = v != 0
    flush = np.sum((rounded == 0) & nonzero) / np.sum(nonzero)
    error = np.sqrt(np.mean((v - rounded) ** 2)) / np.sqrt(np.mean(v**2))
    assert row["underflow"]["float4_e2m1fn"] == pytest.approx(flush, abs=1e-9)
    assert row["error"] == pytest.approx(error, rel=1e-5)
    assert 0.05 < row["error"] < 0.3 and flush > 0


def test_a_per_tensor_casts_error_is_e4m3s_for_gaussian_values(getkey):
    # Three mantissa bits: a uniform rounding error of 2**-4 of each value's power
    # of two, about 3% RMS relative for Gaussian values.
    x = jax.random.normal(getkey(), (256, 64))
    w = jax.random.normal(getkey(), (64, 32))
    _, report = numerics.track(lambda x, w: fp8.fp8_dot_general(x, w, DN), casts=True)(
        x, w
    )
    errors = [r["error"] for r in report.rows]
    assert len(errors) == 2 and all(0.02 < e < 0.04 for e in errors)


# -- plan(formats=...) ----------------------------------------------------------------


def _row(
    name,
    role,
    fmt,
    *,
    flush=0.0,
    sat=0.0,
    error=0.05,
    rhs=(64, 64),
    scaling="",
    stochastic=False,
    gemm=(1, 64, 64, 64),
):
    under = dict.fromkeys(numerics._stats.FORMATS, 0.0) | {fmt: flush}
    over = dict.fromkeys(numerics._stats.FORMATS, 0.0) | {fmt: sat}
    site = {
        "format": fmt,
        "role": role,
        "gemm": list(gemm),
        "rhs": list(rhs),
        "applied": True,
        "scaling": scaling,
        "stochastic": stochastic,
    }
    return {
        "name": name,
        "primitive": "fp8_cast",
        "pass": "bwd" if role == "grad" else "fwd",
        "dtype": fmt,
        "shape": [64, 64],
        "layer": None,
        "site": site,
        "size": 4096,
        "rms": 1.0,
        "absmax": 4.0,
        "zero": 0.0,
        "underflow": under,
        "overflow": over,
        "error": error,
    }


def _matmul(name, fmt, scaling, **per_role):
    # The three casts of one matmul; `per_role`: {role: {flush=, sat=, error=}}.
    stochastic = scaling == "nvfp4"
    return [
        _row(
            name,
            role,
            fmt,
            scaling=scaling,
            stochastic=stochastic and role == "grad",
            **per_role.get(role, {}),
        )
        for role in ("lhs", "rhs", "grad")
    ]


E2M1, E4M3 = "float4_e2m1fn", "float8_e4m3fn"


def _reports(nvfp4, mxfp8, fp8_rows):
    return {
        "nvfp4": Report(nvfp4, "casts"),
        "mxfp8": Report(mxfp8, "casts"),
        "fp8": Report(fp8_rows, "casts"),
    }


def _three_matmuls():
    # a: fine in NVFP4; b: its activations lose 20% in NVFP4, 3% in MXFP8;
    # c: too much everywhere (NVFP4 and MXFP8 error, per-tensor FP8 saturates).
    nvfp4 = [
        *_matmul("a", E2M1, "nvfp4", lhs={"error": 0.1, "flush": 0.08}),
        *_matmul("b", E2M1, "nvfp4", lhs={"error": 0.2}),
        *_matmul("c", E2M1, "nvfp4", rhs={"error": 0.4}),
    ]
    mxfp8 = [
        *_matmul("a", E4M3, "mxfp8_e4m3"),
        *_matmul("b", E4M3, "mxfp8_e4m3", lhs={"error": 0.03, "sat": 0.05}),
        *_matmul("c", E4M3, "mxfp8_e4m3", rhs={"error": 0.2}),
    ]
    per_tensor = [
        *_matmul("a", E4M3, ""),
        *_matmul("b", E4M3, ""),
        *_matmul("c", E4M3, "", rhs={"sat": 0.01}),
    ]
    return _reports(nvfp4, mxfp8, per_tensor)


def test_each_matmul_takes_the_first_format_whose_casts_are_within_the_limits():
    plan = numerics.plan(
        _three_matmuls(), formats=FORMATS, max_error_fwd=0.15, max_error_bwd=0.3
    )
    decisions = {m.name: m.decision for m in plan.matmuls}
    # b's MXFP8 cast clips 5% of its values (a block's largest, by MX's power-of-two
    # scale): bounded by the scale rule and inside its 3% error, so not judged.
    assert decisions == {"a": "nvfp4", "b": "mxfp8", "c": "wide"}
    assert plan.base == "nvfp4" and plan.routes == (("b", "mxfp8"),)
    assert plan.keep == ("c",)
    assert plan.shares() == pytest.approx(
        {"nvfp4": 1 / 3, "mxfp8": 1 / 3, "wide": 1 / 3}
    )
    assert plan.fp8_share == pytest.approx(2 / 3)
    c = next(m for m in plan.matmuls if m.name == "c")
    assert "nvfp4: rhs E2M1 error 40.0% > 15.0%" in c.reason
    assert "fp8: rhs E4M3 saturates 1.00% > 0.1%" in c.reason
    assert plan.override() == (
        'precision.base=nvfp4 precision.keep=["c"] precision.routes=["b=mxfp8"]'
    )
    text = plan.table()
    assert "nvfp4 33.3%" in text and "mxfp8 err/fl/sat" in text
    assert Plan.from_json(plan.to_json()) == plan


def test_a_stochastic_casts_flush_is_no_loss_a_rounded_ones_is():
    # NVFP4's gradient flushes 10% of its values: unbiased under stochastic
    # rounding, lost under rounding to nearest.
    def reports(stochastic):
        rows = _matmul("a", E2M1, "nvfp4", grad={"flush": 0.1})
        for r in rows:
            r["site"]["stochastic"] = stochastic and r["site"]["role"] == "grad"
        mx = _matmul("a", E4M3, "mxfp8_e4m3")
        return {"nvfp4": Report(rows, "casts"), "mxfp8": Report(mx, "casts")}

    formats = ["nvfp4", "mxfp8"]
    assert numerics.plan(reports(True), formats=formats).matmuls[0].decision == "nvfp4"
    rounded = numerics.plan(reports(False), formats=formats).matmuls[0]
    assert rounded.decision == "mxfp8"
    assert "grad E2M1 flushes 10.0% > 0.5%" in rounded.reason


def test_a_4_bit_format_only_for_a_matmul_with_its_share_of_the_flops():
    big = dict(gemm=(1, 512, 512, 512), rhs=(512, 512))
    nvfp4 = [_row("big", r, E2M1, scaling="nvfp4", **big) for r in ("lhs", "rhs")]
    nvfp4 += [_row("small", r, E2M1, scaling="nvfp4") for r in ("lhs", "rhs")]
    mx = [_row("big", r, E4M3, scaling="mxfp8_e4m3", **big) for r in ("lhs", "rhs")]
    mx += [_row("small", r, E4M3, scaling="mxfp8_e4m3") for r in ("lhs", "rhs")]
    reports = {"nvfp4": Report(nvfp4, "casts"), "mxfp8": Report(mx, "casts")}
    plan = numerics.plan(reports, formats=["nvfp4", "mxfp8"], min_share=0.02)
    decisions = {m.name: m.decision for m in plan.matmuls}
    assert decisions == {"big": "nvfp4", "small": "mxfp8"}  # small: 0.2% of FLOPs
    small = next(m for m in plan.matmuls if m.name == "small")
    assert "0.2% of the FLOPs < min_share 2.0%" in small.reason


def test_a_matmul_moves_to_a_more_aggressive_format_only_well_within_the_limits():
    before = numerics.plan(
        _three_matmuls(), formats=FORMATS, max_error_fwd=0.15, max_error_bwd=0.3
    )
    # b's NVFP4 error falls to 10%: within 0.15, not within half of it.
    now = _three_matmuls()
    for r in now["nvfp4"].rows:
        if r["name"] == "b" and r["site"]["role"] == "lhs":
            r["error"] = 0.1
    limits = dict(max_error_fwd=0.15, max_error_bwd=0.3)
    after = numerics.plan(now, formats=FORMATS, previous=before, **limits)
    b = next(m for m in after.matmuls if m.name == "b")
    assert b.decision == "mxfp8" and "moving in: stricter" in b.reason
    assert numerics.plan(now, formats=FORMATS, **limits).routes == ()


def test_matmuls_a_scope_cannot_separate_take_the_more_conservative_format():
    # `blk` holds a matmul of its own and, in `inner`, one of the same weight shape:
    # no entry names the first without the second, so both run in MXFP8.
    def rows(fmt, scaling, outer_error):
        outer = _matmul("blk", fmt, scaling, lhs={"error": outer_error})
        return outer + _matmul("blk/inner", fmt, scaling)

    reports = {
        "nvfp4": Report(rows(E2M1, "nvfp4", 0.3), "casts"),
        "mxfp8": Report(rows(E4M3, "mxfp8_e4m3", 0.03), "casts"),
    }
    plan = numerics.plan(reports, formats=["nvfp4", "mxfp8"], max_error_fwd=0.15)
    decisions = {m.name: (m.decision, m.reason) for m in plan.matmuls}
    assert decisions["blk"][0] == "mxfp8" and "E2M1 error 30.0%" in decisions["blk"][1]
    assert decisions["blk/inner"] == ("mxfp8", "shares `blk@64x64`")
    assert ("blk", "mxfp8") in plan.routes and plan.keep == ()


def test_plan_formats_refuses_what_it_cannot_judge():
    reports = _three_matmuls()
    with pytest.raises(ValueError, match="one casts report .* per format"):
        numerics.plan(reports["nvfp4"], formats=FORMATS)
    with pytest.raises(ValueError, match="one casts report .* per format"):
        numerics.plan(reports, formats=["nvfp4", "mxfp8"])
    with pytest.raises(ValueError, match="other than 'wide'"):
        numerics.plan(reports | {"wide": reports["fp8"]}, formats=[*FORMATS, "wide"])
    with pytest.raises(ValueError, match="max_error_fwd"):
        numerics.plan(reports, formats=FORMATS, max_error_fwd=2.0)


# -- running a plan --------------------------------------------------------------------


def _two(x, w):
    with jax.named_scope("a"):
        a = x @ w
    with jax.named_scope("b"):
        b = x @ w
    return a, b


def test_routes_run_each_matmul_in_its_format():
    x, w = jnp.full((1, 32), 0.2).at[0, 0].set(6.0), jnp.ones((32, 1))
    plain = (x @ w)[0, 0]
    for routes, expected in [
        ([], ("nvfp4", "nvfp4")),
        (["b=mxfp8"], ("nvfp4", "mxfp8")),
        ({"a": "fp8", "b": "fp8_block"}, ("fp8", "fp8_block")),
    ]:
        a, b = lowtrain.train.block_scaled("nvfp4", routes=routes).wrap_model(_two)(
            x, w
        )
        for got, fmt in zip((a[0, 0], b[0, 0]), expected):
            # 0.2 next to 6 flushes in NVFP4's E2M1 (15 of them in its block),
            # and survives every 8-bit format.
            if fmt == "nvfp4":
                assert got == 9.1875  # 6 + 16 * 0.2, less the 15 flushed
            else:
                assert abs(got - plain) < 0.15, (fmt, got)
    base = lowtrain.train.block_scaled("nvfp4", base="mxfp8", keep=["a"])
    a, b = base.wrap_model(_two)(x, w)
    assert abs(b[0, 0] - plain) < 0.15
    assert abs(a[0, 0] - plain) < 0.1  # kept: in bfloat16
    with pytest.raises(ValueError, match="Expected a route as '<entry>=<format>'"):
        lowtrain.train.block_scaled("nvfp4", routes=["b"])
    with pytest.raises(ValueError, match="Expected a format among"):
        lowtrain.train.block_scaled("nvfp4", routes=["b=mxfp4"])


def test_a_policy_runs_a_named_recipe_its_own_parts_kept():
    policy = lowtrain.get_policy("nvfp4").with_block(
        fp8.BlockRecipe("nvfp4", fp8.NVFP4, fp8.NVFP4, fp8.NVFP4)  # no Hadamard
    )
    assert policy.recipe("nvfp4") is policy.block  # the switched recipe
    assert policy.recipe("mxfp8") == fp8.block_recipe("mxfp8")
    assert policy.recipe("block") is policy.block and policy.blocks
    assert not lowtrain.get_policy("bf16").blocks
    # Inside amp_stop the action is "keep", whatever scope surrounds it.
    routed = policy.with_scopes({"outer": "fp8"})
    assert routed.action("mul", ("outer", "lowtrain.amp_stop")) == "keep"
    assert routed.action("dot_general", ("outer",)) == "fp8"
    with pytest.raises(ValueError, match="applies to dot_general only"):
        lowtrain.Policy(rules={"conv_general_dilated": "nvfp4"})


# -- the autopilot choosing formats ---------------------------------------------------


class Fit(lowtrain.Trainer):
    def loss(self, model, batch, *, key):
        ya, yb = model(batch)
        return jnp.mean((ya - 1.0) ** 2) + jnp.mean((yb - 1.0) ** 2)


def test_the_autopilot_chooses_each_matmuls_format(tmp_path):
    # b's weight: in each row of 16, one value 1 and fifteen of 0.02. NVFP4 maps
    # the 1 to E2M1's 6 and flushes the rest (0.12 < 0.25): most of b's values
    # lost, forward. MXFP8's E4M3 holds them.
    row = jnp.full((32,), 0.02).at[::16].set(1.0)
    b = jnp.tile(row[:, None], (1, 32))
    a = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    model = Two(a, b)

    def precision(keep, routes=(), base=None):
        return lowtrain.train.block_scaled("nvfp4", keep=keep, routes=routes, base=base)

    trainer = Fit(model, optax.sgd(1e-4), precision="nvfp4")
    pilot = lowtrain.train.Autopilot(
        precision,
        every=3,
        batches=1,
        formats=["nvfp4", "mxfp8"],
        min_share=0.0,
        directory=tmp_path,
    )
    data = lambda step: jax.random.normal(jax.random.key(step), (16, 32))  # noqa: E731
    state = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        data,
        steps=4,
        callbacks=[pilot],
        progress=False,
    )
    summary = pilot.summary(4)
    assert summary["routes"] == ["b=mxfp8"] and summary["keep"] == []
    assert summary["shares"] == {"nvfp4": 0.5, "mxfp8": 0.5}
    final = pilot.at(4)
    b_plan = next(m for m in final.matmuls if m.name == "b")
    assert "rhs E2M1 flushes 93.8% > " in b_plan.reason
    # The trainer runs the plan: b's product as MXFP8's, a's as NVFP4's.
    x = data(0)
    ran = trainer.precision.wrap_model(state.model)(x)
    want = precision([], ["b=mxfp8"], "nvfp4").wrap_model(state.model)(x)
    assert all(jnp.array_equal(r, w) for r, w in zip(ran, want))
    assert (tmp_path / "plan.json").exists() and "routes" in (
        tmp_path / "plan.txt"
    ).read_text()
