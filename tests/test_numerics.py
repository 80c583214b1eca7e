import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowtrain
from lowtrain.numerics import FORMATS, Report, _stats, track
from lowtrain.numerics._stats import THRESHOLDS
from lowtrain.numerics._track import tracked_call

from .helpers import gpt_loss, higher_order_program, same_bits, tiny_gpt


def _rows(report, name):
    return [r for r in report.rows if r["name"] == name]


def _two_scopes(x, w):
    with jax.named_scope("small"):
        a = x @ (w * 1e-6)  # (8, 16), |a| ~ 1e-6: below E4M3's 2^-10 rounding to 0
    with jax.named_scope("large"):
        b = x @ (w * 1e3)  # (8, 16), |b| ~ 1e3: many above E4M3's 448
    return jnp.sum(a) + jnp.sum(b) * 1e-3


def test_acceptance_underflow_and_overflow_rows(getkey):
    x = jax.random.normal(getkey(), (8, 32))
    w = jax.random.normal(getkey(), (32, 16)) / jnp.sqrt(32.0)
    out, report = track(_two_scopes)(x, w)
    assert same_bits([np.asarray(out)], [np.asarray(jax.jit(_two_scopes)(x, w))])
    (small,) = _rows(report, "small/dot_general")
    (large,) = _rows(report, "large/dot_general")
    assert small["underflow"]["float8_e4m3fn"] > 0.9
    assert small["underflow"]["float16"] < 0.1
    assert small["overflow"]["float8_e4m3fn"] == 0.0
    assert large["overflow"]["float8_e4m3fn"] > 0.3
    assert large["overflow"]["float16"] == 0.0
    assert small["dtype"] == "float32" and small["shape"] == [8, 16]
    assert small["pass"] == "fwd" and small["primitive"] == "dot_general"
    assert 5e-7 < small["rms"] < 2e-6 and large["absmax"] > 448
    # The worst for E4M3 come first, in the table too.
    worst = report.worst(3)
    assert "small/dot_general" in [r["name"] for r in worst]
    assert worst[0]["underflow"]["float8_e4m3fn"] == 1.0
    assert report.table().splitlines()[2].split()[-2] == worst[0]["name"]


def _overflows(x: np.ndarray, fmt: str) -> np.ndarray:
    # Where a cast to `fmt` goes past its largest finite value: to infinity or NaN,
    # or, in E2M1 (no infinity, no NaN: ml_dtypes saturates), past the midpoint 7
    # between its largest value 6 and the next step, 8.
    if fmt == "float4_e2m1fn":
        return np.abs(x) > 7.0
    with np.errstate(over="ignore", invalid="ignore"):
        return ~np.isfinite(x.astype(jnp.dtype(fmt)).astype(np.float32))


def test_statistics_match_numpy(getkey):
    x = jax.random.normal(getkey(), (64,)) * 100.0
    _, report = track(lambda v: v * 3.0)(x)
    inp, row = report.rows
    assert inp["name"] == "input[1][0]" and inp["primitive"] == "input"
    assert inp["absmax"] == float(jnp.max(jnp.abs(x)))
    y = np.asarray(x) * 3.0
    np.testing.assert_allclose(row["rms"], np.sqrt(np.mean(y**2)), rtol=1e-6)
    assert row["absmax"] == np.abs(y).max() and row["size"] == 64
    for fmt in FORMATS:
        assert row["overflow"][fmt] == np.mean(_overflows(y, fmt)), fmt


@pytest.fixture(params=["grouped", "in place"])
def read(request, monkeypatch):
    # Small tensors are copied into groups, large ones (ALONE values or more) read
    # in place: both ways, each statistic.
    if request.param == "in place":
        monkeypatch.setattr(_stats, "ALONE", 1)
    return request.param


@pytest.mark.parametrize(
    "scale", [1.0, 1e30, 1e-25, 1e-36, "mixed", "extremes", "inf", "nan"]
)
def test_rms_and_counts_at_any_magnitude(scale, read):
    # The sums of squares change scale with the values (three ranges): RMS to
    # float32 rounding from float32's smallest normals to its largest values.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(5000)
    if scale == "mixed":  # chunks of 1e25 and of 1
        x[:3000] *= 1e25
    elif scale == "extremes":  # one chunk with float32's largest values
        x = np.concatenate([x, [3e38, -3e38]])
    elif scale in ("inf", "nan"):
        x[7] = -np.inf if scale == "inf" else np.nan
    else:
        x = x * scale
    x = x.astype(np.float32)
    _, report = track(lambda v: v)(jnp.asarray(x))
    (row,) = report.rows  # the input
    rms = np.sqrt(np.mean(np.square(x.astype(np.float64))))
    if scale == "inf":
        assert row["rms"] == np.inf and row["absmax"] == np.inf
    elif scale == "nan":
        assert np.isnan(row["rms"]) and np.isnan(row["absmax"])
    else:
        np.testing.assert_allclose(row["rms"], rms, rtol=1e-6)
        assert row["absmax"] == np.abs(x).max()
    finite = x[np.isfinite(x) | np.isinf(x)]  # NaN is in no count
    for fmt in FORMATS:
        with np.errstate(over="ignore", invalid="ignore"):
            cast = finite.astype(jnp.dtype(fmt)).astype(np.float32)
        nonzero = np.count_nonzero(finite)
        assert row["underflow"][fmt] == np.sum((cast == 0) & (finite != 0)) / nonzero
        # An infinity is kept by the cast: not an overflow.
        overflow = np.isfinite(finite) & _overflows(finite, fmt)
        assert row["overflow"][fmt] == np.sum(overflow) / nonzero


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_boundaries_are_exact(fmt, read):
    # The midpoints, and the float32 neighbours on either side of them: counted as
    # lost exactly when ml_dtypes' round-to-nearest-even cast loses them.
    under, _, over, _ = THRESHOLDS[fmt]
    points = []
    for p in (under, over):
        p = np.float32(p)
        points += [np.nextafter(p, np.float32(0)), p, np.nextafter(p, np.float32(1e30))]
    x = np.array(points, np.float32)  # for bfloat16: float32 subnormals
    with np.errstate(over="ignore"):
        cast = x.astype(jnp.dtype(fmt)).astype(np.float32)
    # The input's row: the values as stored (XLA's CPU backend would flush the
    # subnormals in arithmetic; the counts read bit patterns).
    _, report = track(lambda v: -v)(jnp.asarray(x))
    (row,) = [r for r in report.rows if r["primitive"] == "input"]
    with np.errstate(invalid="ignore"):
        lost_under = np.sum(cast == 0) / 6
        lost_over = np.sum(~np.isfinite(cast)) / 6
    assert row["underflow"][fmt] == lost_under and row["overflow"][fmt] == lost_over
    assert 0 < lost_under < 1 / 2 and 0 < lost_over < 1 / 2  # the boundary is inside


def _mixed_sizes():
    def fn(v):  # tensors above and below a patched ALONE of 2048, interleaved
        a = v * 1e-30
        b = jnp.tile(v, 3) * 1e20
        c = v[:7] + 1.0
        d = jnp.exp(jnp.tile(v, 2))
        e = v[:0] * 2.0  # no values
        return jnp.sum(a) + jnp.sum(b) + jnp.sum(c) + jnp.sum(d) + jnp.sum(e)

    return fn


def test_in_place_and_grouped_reads_agree(getkey, monkeypatch):
    x = jax.random.normal(getkey(), (1500,))
    _, grouped = track(_mixed_sizes())(x)
    monkeypatch.setattr(_stats, "ALONE", 2048)
    _, in_place = track(_mixed_sizes())(x)
    assert len(grouped.rows) == len(in_place.rows) > 8
    assert grouped.rows == in_place.rows


def test_statistics_read_tensors_from_memory(getkey, monkeypatch):
    # `_read_materialised`'s `cond` (always true, not known to XLA) must survive
    # compilation: without it, XLA recomputes each tensor's producer inside the
    # statistics' reductions (1.6x the time of a GPT step). Fails if XLA learns to
    # fold the predicate.
    x = jax.random.normal(getkey(), (4096,))

    def conditionals():
        fn = lambda v: jnp.tanh(jnp.exp(v) * 2.0)  # noqa: E731
        compiled = tracked_call.lower(fn, (x,), {}).compile()
        return getattr(compiled, "compiled", compiled).as_text().count(" conditional(")

    with_cond = conditionals()
    monkeypatch.setattr(_stats, "_read_materialised", lambda fn, never, xs: fn(xs))
    assert with_cond == conditionals() + 1


def test_outputs_equal_to_float_rounding(getkey):
    # Reading every intermediate changes XLA's fusions: a matmul's gradient may add
    # in another order. A few units in the last place, no more.
    x = jax.random.normal(getkey(), (16, 64, 128))
    w = jax.random.normal(getkey(), (128, 512)) * 0.05
    fn = jax.grad(lambda w: jnp.sum(jax.nn.gelu(x @ w, approximate=False)))
    out, _ = track(fn)(w)
    ref = np.asarray(jax.jit(fn)(w))
    assert np.abs(np.asarray(out) - ref).max() <= 1e-5 * np.abs(ref).max()


def test_value_and_grad_has_both_passes_and_same_outputs(getkey):
    x = jax.random.normal(getkey(), (8, 32))
    w = jax.random.normal(getkey(), (32, 16))
    fn = jax.value_and_grad(_two_scopes, argnums=1)
    out, report = track(fn)(x, w)
    # The outputs of the program as written, to float32 rounding (the tracked
    # program is not fused as the jitted one is: a multiply-add may round apart).
    for ours, theirs in zip(jax.tree.leaves(out), jax.tree.leaves(jax.jit(fn)(x, w))):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
    passes = {r["pass"] for r in report.rows}
    assert passes == {"fwd", "bwd"}
    bwd_dots = [r for r in report.rows if r["pass"] == "bwd"]
    assert any(r["name"] == "small/dot_general" for r in bwd_dots)
    # Forward rows come first in program order.
    first_bwd = [r["pass"] for r in report.rows].index("bwd")
    assert all(r["pass"] == "bwd" for r in report.rows[first_bwd:])


def test_scan_rows_aggregate_over_iterations():
    def fn(x):
        def body(c, s):
            with jax.named_scope("step"):
                y = c * s
            return c, y

        return lax.scan(body, x, jnp.array([1.0, 10.0, 1000.0]))[1]

    x = jnp.ones(4)
    out, report = track(jax.jit(fn))(x)
    with pytest.raises(TypeError, match="outside `jax.jit`"):
        jax.jit(lambda v: track(fn)(v)[0])(x)
    assert same_bits([np.asarray(out)], [np.asarray(jax.jit(fn)(x))])
    (row,) = _rows(report, "step/mul")
    assert row["size"] == 12 and row["absmax"] == 1000.0
    np.testing.assert_allclose(row["rms"], np.sqrt((1 + 100 + 1e6) / 3), rtol=1e-6)
    assert row["overflow"]["float8_e4m3fn"] == pytest.approx(1 / 3)


def test_cond_while_remat_custom_rules():
    x = jnp.linspace(-1.0, 2.0, 6)
    out, report = track(higher_order_program)(x)
    assert same_bits([np.asarray(out)], [np.asarray(jax.jit(higher_order_program)(x))])
    prims = [r["primitive"] for r in report.rows]
    # jit's sin, the custom rules' max and sin, the scan's and the while's mul (once
    # each: aggregated), one cond branch (the other is not taken), remat's exp.
    assert prims.count("mul") == 2 and "exp" in prims and "max" in prims
    (loop,) = [r for r in report.rows if r["primitive"] == "mul" and r["size"] == 18]
    assert (
        loop["absmax"]
        == pytest.approx(float(jnp.max(jnp.abs(out))) / 1.5 / 1.0, rel=0.1)
        or loop
    )
    taken = [r for r in report.rows if r["primitive"] == "neg"]
    assert len(taken) <= 1


def test_amp(getkey):
    model = eqx.nn.MLP(8, 4, 16, 2, key=getkey())
    x = jax.random.normal(getkey(), (16, 8))
    loss = lambda m: jnp.mean(jax.vmap(lowtrain.amp(m, "bf16"))(x) ** 2)
    fn = eqx.filter_value_and_grad(loss)
    out, report = track(fn)(model)
    # Not bitwise: XLA's CPU backend may keep bfloat16 intermediates in float32
    # inside a fusion (xla_allow_excess_precision), and reading them for statistics
    # changes the fusions. Equal to the rounding of one bfloat16 intermediate.
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(eqx.filter_jit(fn)(model))):
        np.testing.assert_allclose(
            a, b, rtol=2**-7, atol=2**-7 * float(jnp.abs(b).max())
        )
    dots = [r for r in report.rows if r["primitive"] == "dot_general"]
    # 3 layers forward; backward, each layer's weight gradient and the input
    # gradients of the upper two (the batch `x` is not differentiated: no gradient
    # is computed for it, as JAX computes none).
    assert len(dots) == 3 + 5
    assert [r["pass"] for r in dots].count("bwd") == 5
    assert {r["dtype"] for r in dots} == {"bfloat16"}
    assert all("eqx.nn.Linear" in r["name"] for r in dots)


@pytest.mark.slow
def test_amp_and_a_gpt(getkey):
    model = tiny_gpt(getkey())
    tokens = jnp.zeros((2, 8), jnp.int32)
    loss = lambda m: gpt_loss(lowtrain.amp(m, "bf16"), tokens, tokens)
    fn = eqx.filter_value_and_grad(loss)
    out, report = track(fn)(model)
    np.testing.assert_allclose(out[0], eqx.filter_jit(fn)(model)[0], rtol=1e-2)
    dots = [r for r in report.rows if r["primitive"] == "dot_general"]
    assert {r["pass"] for r in dots} == {"fwd", "bwd"}
    assert {r["dtype"] for r in dots} == {"bfloat16"}
    # The recipes' layers name their einsums: the tied readout, forward and backward.
    head = [r["pass"] for r in dots if r["name"] == "btc,vc->btv/dot_general"]
    assert sorted(head) == ["bwd", "bwd", "fwd"]


def test_plot_and_json(tmp_path, getkey):
    x = jax.random.normal(getkey(), (8, 32))
    w = jax.random.normal(getkey(), (32, 16))
    _, report = track(jax.grad(_two_scopes, argnums=1))(x, w)
    report.plot(tmp_path / "n.png", fmt="float8_e5m2")
    assert (tmp_path / "n.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Report(report.to_json()).rows[0]["name"] == report.rows[0]["name"]
    with pytest.raises(ValueError, match="Expected a format"):
        report.table("float8")
