"""The casts report (`track(fn, casts=True)`: each FP8 cast after its scale, only
what a precision casts, per layer), `lowtrain.numerics.plan` (which matmuls run in
FP8, named so `keep` applies it), `worst_casts`, and the one read per tensor of the
statistics."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowtrain
import lowtrain.fp8 as fp8
import lowtrain.numerics as numerics
import lowtrain.unit_scaling as uu
from lowtrain.numerics import _stats

from .helpers import iter_eqns

DN = (((1,), (0,)), ((), ()))


def _two_heads(w1, w2, x):
    # Two matmuls side by side: `left`'s gradient is fine, `right`'s is 1e-9 per
    # value, far below E5M2's smallest subnormal (2**-16).
    with jax.named_scope("left"):
        a = jnp.sum(x @ w1)
    with jax.named_scope("right"):
        b = jnp.sum(x @ w2)
    return a + 1e-9 * b


def _operands(getkey):
    x = jax.random.normal(getkey(), (16, 8))
    w1 = jax.random.normal(getkey(), (8, 4))
    w2 = jax.random.normal(getkey(), (8, 4))
    return w1, w2, x


def _casts(fn, *args):
    grad = jax.grad(fn, argnums=tuple(range(len(args) - 1)))
    return numerics.track(grad, casts=True)(*args)[1]


# -- the casts report -----------------------------------------------------------------


def test_casts_report_holds_only_the_casts_each_in_its_format(getkey):
    w1, w2, x = _operands(getkey)
    report = _casts(uu.simulate_fp8(_two_heads), w1, w2, x)
    assert report.kind == "casts"
    # Two matmuls, three casts each: no inputs, no other tensor.
    assert len(report.rows) == 6
    roles = {(r["name"], r["site"]["role"]): r for r in report.rows}
    assert set(roles) == {
        (n, k) for n in ("left", "right") for k in ("lhs", "rhs", "grad")
    }
    for (_, role), r in roles.items():
        assert r["dtype"] == ("float8_e5m2" if role == "grad" else "float8_e4m3fn")
        assert r["pass"] == ("bwd" if role == "grad" else "fwd")
        assert r["site"]["gemm"] == [1, 16, 4, 8] and r["site"]["rhs"] == [8, 4]
        assert r["site"]["applied"]
    assert roles["right", "grad"]["underflow"]["float8_e5m2"] == 1.0
    assert roles["left", "grad"]["underflow"]["float8_e5m2"] == 0.0
    # The value the cast rounds: the gradient of a sum is ones (times 1e-9).
    assert roles["left", "grad"]["rms"] == 1.0
    np.testing.assert_allclose(roles["right", "grad"]["rms"], 1e-9, rtol=1e-6)


def test_a_scaled_cast_is_judged_after_its_scale(getkey):
    # Current scaling lifts 1e-6 to E4M3's top: nothing flushed, where the same
    # values cast unscaled would all be.
    x = jnp.full((4, 8), 1e-6)
    w = jax.random.normal(getkey(), (8, 3))
    f = lambda x, w: jnp.sum(fp8.fp8_dot_general(x, w, DN))  # noqa: E731
    report = numerics.track(jax.grad(f, argnums=(0, 1)), casts=True)(x, w)[1]
    lhs = next(r for r in report.rows if r["site"]["role"] == "lhs")
    assert lhs["underflow"]["float8_e4m3fn"] == 0.0
    np.testing.assert_allclose(lhs["absmax"], fp8.E4M3_MAX, rtol=1e-6)
    full = numerics.track(jax.grad(f, argnums=(0, 1)))(x, w)[1]
    (raw,) = [r for r in full.rows if r["name"] == "input[1][0]"]
    assert raw["underflow"]["float8_e4m3fn"] == 1.0  # what the old report judged


def test_plain_half_casts_are_judged_in_their_format_constants_left_out():
    def f(x):
        constant = jnp.full((8, 2), 3.0)  # its cast is not read
        return jnp.sum(x @ constant)

    x = jnp.full((4, 8), 1e-8)  # 1e-8: 0 in float16
    report = numerics.track(lowtrain.amp(f, "fp16"), casts=True)(x)[1]
    (row,) = report.rows  # x's cast to float16, not the constant's
    assert row["dtype"] == "float16" and row["site"] is None
    assert row["shape"] == [4, 8] and row["underflow"]["float16"] == 1.0


def test_scanned_layers_get_a_row_each():
    def stack(ws, x):
        def layer(h, w):
            with jax.named_scope("dense"):
                return uu.simulate_fp8(lambda a, b: a @ b)(h, w), None

        return jnp.sum(lax.scan(layer, x, ws)[0])

    # Layer i's weight is 4**-i: from layer 2 on, E4M3 flushes part of it.
    ws = jnp.stack([jnp.eye(8) * 4.0**-i for i in range(4)]) + 1e-3
    report = _casts(stack, ws, jnp.ones((2, 8)))
    rhs = sorted(
        (r for r in report.rows if r["site"]["role"] == "rhs"), key=lambda r: r["layer"]
    )
    assert [r["layer"] for r in rhs] == [0, 1, 2, 3]
    assert [r["name"] for r in rhs] == ["dense"] * 4
    np.testing.assert_allclose([r["absmax"] for r in rhs], 4.0 ** -np.arange(4) + 1e-3)
    plan = numerics.plan(report)
    (m,) = plan.matmuls
    assert m.calls == 4 and m.flops == 4 * 2 * 2 * 8 * 8


def test_keep_op_is_the_matmul_as_written_with_shadow_casts(getkey):
    w1, w2, x = _operands(getkey)
    kept = uu.simulate_fp8(_two_heads, keep=["right"])
    plain = jax.grad(_two_heads, argnums=(0, 1))(w1, w2, x)
    grads = jax.grad(kept, argnums=(0, 1))(w1, w2, x)
    # `right` as written: its gradient is the plain one's to float32 rounding (XLA
    # may contract a multiply-add differently in the two programs on some CPUs),
    # where FP8 would be off by percents.
    np.testing.assert_allclose(grads[1], plain[1], rtol=1e-6, atol=0)
    assert not np.array_equal(grads[0], plain[0])  # `left` in FP8
    report = _casts(kept, w1, w2, x)
    applied = {
        (r["name"], r["site"]["role"]): r["site"]["applied"] for r in report.rows
    }
    assert applied == {
        **{("left", k): True for k in ("lhs", "rhs", "grad")},
        **{("right", k): False for k in ("lhs", "rhs", "grad")},
    }
    shadow = next(
        r for r in report.rows if r["name"] == "right" and r["site"]["role"] == "grad"
    )
    assert shadow["underflow"]["float8_e5m2"] == 1.0  # what FP8 would do to it


def test_the_shadows_cost_nothing_outside_a_tracked_program(getkey):
    # A kept matmul's shadows are multiplications by 1: XLA removes them, so the
    # compiled gradient is the plain one's.
    w1, w2, x = _operands(getkey)
    kept = jax.grad(uu.simulate_fp8(_two_heads, keep=["left", "right"]), argnums=(0, 1))
    plain = jax.grad(_two_heads, argnums=(0, 1))

    def count(f, op):
        text = jax.jit(f).lower(w1, w2, x).compile().as_text()
        return sum(f" {op}(" in line for line in text.splitlines())

    for op in ("dot", "multiply", "divide"):
        assert count(kept, op) == count(plain, op), op


def test_amax_shadow_is_judged_after_current_scaling(getkey):
    x = jnp.full((4, 8), 1e-6)
    w = jax.random.normal(getkey(), (8, 3))
    keep = lambda op, a, b: fp8.keep_op(op, a, b, amax=True)  # noqa: E731
    f = lowtrain.rewrite(lambda x, w: jnp.sum(x @ w), {"dot_general": keep})
    report = numerics.track(jax.grad(f, argnums=(0, 1)), casts=True)(x, w)[1]
    lhs = next(r for r in report.rows if r["site"]["role"] == "lhs")
    assert not lhs["site"]["applied"]
    np.testing.assert_allclose(lhs["absmax"], fp8.E4M3_MAX, rtol=1e-6)


def test_statistics_read_each_tensor_once():
    # Every count (nonzero, underflow and overflow per format, NaN) comes from one
    # variadic reduction per group of tensors; a second read only for an RMS at an
    # extreme magnitude (values of 2**19 or more, or all below 2**-60).
    xs = [jnp.linspace(-600.0, 600.0, n) for n in (100, 3000, 2**17 + 5)]
    closed = jax.make_jaxpr(_stats.batch_stats)(xs)
    outer = [e for e in iter_eqns(closed.jaxpr) if e.primitive.name == "cond"]
    reduces = [e for e in iter_eqns(closed.jaxpr) if e.primitive.name == "reduce"]
    rare = {
        id(sub)
        for e in outer
        for branch in e.params["branches"]
        for sub in iter_eqns(branch.jaxpr)
        if sub.primitive.name in ("reduce", "reduce_sum")
    }
    variadic = [e for e in reduces if len(e.invars) > 2]
    # Two groups: the two small tensors together, the large one alone.
    assert len(variadic) == 2
    for e in variadic:
        assert len(e.outvars) == 2 + -(-len(_stats._LOWEST) // 2)  # max, sum, counts
    assert rare  # the rare second reads sit inside a `cond`
    moments, counts = _stats.batch_stats(xs)
    rows = _stats.finish(moments, counts)
    for x, row in zip(xs, rows):
        big = np.abs(np.asarray(x))
        assert row["overflow"]["float8_e4m3fn"] == (big > 464).sum() / (big > 0).sum()


# -- plan ---------------------------------------------------------------------------


def test_plan_keeps_exactly_the_matmul_whose_gradient_underflows(getkey):
    w1, w2, x = _operands(getkey)
    report = _casts(uu.simulate_fp8(_two_heads), w1, w2, x)
    plan = numerics.plan(report)
    decisions = {m.name: m.decision for m in plan.matmuls}
    assert decisions == {"left": "fp8", "right": "wide"}
    assert plan.keep == ("right",)
    (wide,) = plan.wide
    assert "grad E5M2 flushes 100.0%" in wide.reason
    assert plan.fp8_share == 0.5
    # Applied, the plan holds: `right`'s shadows still fail, `left` still passes.
    again = numerics.plan(
        _casts(uu.simulate_fp8(_two_heads, keep=plan.keep), w1, w2, x)
    )
    assert again.keep == plan.keep


def test_plan_keeps_a_saturating_matmul_and_the_thresholds_are_arguments(getkey):
    x = jax.random.normal(getkey(), (16, 8))

    def f(w, v, x):
        with jax.named_scope("big"):
            a = jnp.sum(x @ w)
        with jax.named_scope("small"):
            b = jnp.sum(x @ v)
        return a + b

    w = jnp.full((8, 4), 1.0).at[0, 0].set(1000.0)  # 1 of 32 values past 448
    report = _casts(uu.simulate_fp8(f), w, jnp.ones((8, 4)), x)
    plan = numerics.plan(report)
    assert plan.keep == ("big",)
    assert "rhs E4M3 saturates 3.12%" in plan.wide[0].reason
    assert numerics.plan(report, max_saturate=0.05).keep == ()
    assert numerics.plan(report, min_dim=16).keep == ("big", "small")  # K = 8 < 16
    assert "below min_dim 16" in numerics.plan(report, min_dim=16).matmuls[0].reason
    with pytest.raises(ValueError, match="max_flush_bwd"):
        numerics.plan(report, max_flush_bwd=5)
    with pytest.raises(ValueError, match="casts report"):
        numerics.plan(numerics.track(jax.grad(f))(w, jnp.ones((8, 4)), x)[1])


def test_plan_names_one_of_several_matmuls_in_a_scope_by_its_shape(getkey):
    def f(w1, w2, x):
        with jax.named_scope("mlp"):
            h = x @ w1  # its output's gradient is about 1: fine in E5M2
            return 1e-9 * jnp.sum(h @ w2) + jnp.sum(h)  # this one's is 1e-9

    w1, w2 = jax.random.normal(getkey(), (8, 32)), jax.random.normal(getkey(), (32, 8))
    x = jax.random.normal(getkey(), (16, 8))
    plan = numerics.plan(_casts(uu.simulate_fp8(f), w1, w2, x))
    assert plan.keep == ("mlp@32x8",)
    assert [m.decision for m in plan.matmuls] == ["fp8", "wide"]
    report = _casts(uu.simulate_fp8(f, keep=plan.keep), w1, w2, x)
    applied = {tuple(r["site"]["rhs"]): r["site"]["applied"] for r in report.rows}
    assert applied == {(8, 32): True, (32, 8): False}


def test_selectors_separate_same_scope_matmuls_by_shape():
    report = numerics.Report(
        [
            _row("blk", [8, 16], flush=0.9),  # wide
            _row("blk", [16, 8], flush=0.0),  # fp8, same scope
            _row("head", [8, 4], flush=0.0),
        ],
        "casts",
    )
    plan = numerics.plan(report)
    assert plan.keep == ("blk@8x16",)
    assert [m.decision for m in plan.matmuls] == ["wide", "fp8", "fp8"]
    # Two matmuls no entry separates (same scope, same shape): both stay wide.
    twin = numerics.Report(
        [
            _row("blk", [8, 8], flush=0.9),
            _row("blk", [8, 8], flush=0.0, layer_name="other"),
        ],
        "casts",
    )
    both = numerics.plan(twin)
    assert both.keep == ("blk",)
    assert [m.decision for m in both.matmuls] == ["wide", "wide"]
    assert "shares" in both.matmuls[1].reason


def _row(name, rhs, *, flush, layer_name=None, role="grad", layer=None):
    # A casts-report row of the E5M2 gradient cast of a matmul `name` (rhs shape).
    fmt = "float8_e5m2" if role == "grad" else "float8_e4m3fn"
    zeros = dict.fromkeys(numerics.FORMATS, 0.0)
    return {
        "name": name if layer_name is None else f"{layer_name}/{name}",
        "primitive": "fp8_cast",
        "pass": "bwd" if role == "grad" else "fwd",
        "dtype": fmt,
        "shape": [4, rhs[1]],
        "size": 4 * rhs[1],
        "rms": 1.0,
        "absmax": 1.0,
        "zero": 0.0,
        "underflow": zeros | {fmt: flush},
        "overflow": dict(zeros),
        "layer": layer,
        "site": {
            "format": fmt,
            "role": role,
            "gemm": [1, 4, rhs[1], rhs[0]],
            "rhs": list(rhs),
            "applied": True,
        },
    }


def test_hysteresis_moves_a_wide_matmul_in_only_well_under_the_limits():
    before = numerics.plan(numerics.Report([_row("a", [4, 4], flush=0.9)], "casts"))
    assert before.keep == ("a",)
    middle = numerics.Report([_row("a", [4, 4], flush=0.004)], "casts")  # limit .005
    assert numerics.plan(middle).keep == ()
    stays = numerics.plan(middle, previous=before)
    assert stays.keep == ("a",) and "stays wide" in stays.matmuls[0].reason
    low = numerics.Report([_row("a", [4, 4], flush=0.001)], "casts")
    moved = numerics.plan(low, previous=stays)
    assert moved.keep == () and moved.changes(stays) == ["a@4x4: wide -> fp8 (fits)"]


def test_plan_table_json_and_override(getkey):
    w1, w2, x = _operands(getkey)
    plan = numerics.plan(_casts(uu.simulate_fp8(_two_heads), w1, w2, x))
    text = str(plan)
    assert "FP8 on 50.0% of matmul FLOPs" in text and "right@8x4" in text
    assert "grad E5M2 flushes" in text
    back = numerics.Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back == plan
    assert plan.override() == 'precision.keep=["right"]'


def test_plan_over_several_reports_takes_each_casts_worst():
    a = numerics.Report([_row("m", [4, 4], flush=0.001)], "casts")
    b = numerics.Report([_row("m", [4, 4], flush=0.2)], "casts")
    assert numerics.plan([a, b]).keep == ("m",)
    assert numerics.plan([a]).keep == ()


def test_break_even():
    rows = [
        {"width": 256, "bf16_s": 1.0, "fp8 static_s": 1.5, "fp8 current_s": 2.0},
        {"width": 512, "bf16_s": 1.0, "fp8 static_s": 0.9, "fp8 current_s": 1.5},
        {"width": 1024, "bf16_s": 2.0, "fp8 static_s": 1.5, "fp8 current_s": 1.8},
    ]
    assert numerics.break_even({"rows": rows}) == 512
    assert numerics.break_even({"rows": rows}, "fp8 current") == 1024
    rows[2]["fp8 current_s"] = 3.0
    assert numerics.break_even({"rows": rows}, "fp8 current") == 0
    with pytest.raises(ValueError, match="gemm.json"):
        numerics.break_even({"rows": []})


def test_worst_casts_ranks_casts_and_advises(getkey, tmp_path):
    w1, w2, x = _operands(getkey)
    report = _casts(uu.simulate_fp8(_two_heads), w1, w2, x)
    worst = numerics.worst_casts(report, 3)
    assert worst[0]["name"] == "right" and worst[0]["role"] == "grad"
    assert worst[0]["underflow"] == 1.0
    assert "precision.keep=[right@8x4]" in worst[0]["advice"]
    assert all(w["underflow"] + w["overflow"] > 0 for w in worst)
    full = numerics.track(jax.grad(_two_heads))(w1, w2, x)[1]
    assert numerics.worst_casts(full) == []  # no casts to rank
    plan = numerics.plan(report)
    report.plot(tmp_path / "casts.png", plan=plan)
    assert (tmp_path / "casts.png").stat().st_size > 1000
    # A cast losing under 0.1% is ranked, with nothing to fix.
    tiny = dict(report.rows[0])
    tiny["underflow"] = {**tiny["underflow"], tiny["dtype"]: 5e-4}
    tiny["overflow"] = {**tiny["overflow"], tiny["dtype"]: 0.0}
    (only,) = numerics.worst_casts(numerics.Report([tiny], kind="casts"))
    assert only["advice"] == "loses under 0.1%: nothing to fix"


def test_plan_on_an_equinox_model_applied_with_keep(getkey):
    class Two(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x):
            with jax.named_scope("a"):
                h = self.a(x)
            with jax.named_scope("b"):
                return self.b(h)

    model = Two(eqx.nn.Linear(8, 8, key=getkey()), eqx.nn.Linear(8, 2, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))

    def loss(m):
        return 1e-9 * jnp.sum(jax.vmap(uu.simulate_fp8(m))(x))

    report = numerics.track(eqx.filter_grad(loss), casts=True)(model)[1]
    plan = numerics.plan(report)
    assert "b" in plan.keep
