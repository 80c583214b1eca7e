"""FP8 with a static scale (unit scaling's FP8): `fp8_dot_general(..., scale=)`, the
FP8 GEMMs of `uu.simulate_fp8` and `precision=unit_fp8`, the shape filter
(`fp8_min_dim`, `min_dim`), and the weights' casts under gradient accumulation."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain
import lowtrain.fp8 as fp8
import lowtrain.unit_scaling as uu
from lowtrain.fp8 import _dot
from lowtrain.recipes import _common, _run, gpt
from lowtrain.recipes._layers import decay_mask

from .helpers import iter_eqns
from .test_recipes import make_config

F8 = {np.dtype(fp8.E4M3), np.dtype(fp8.E5M2)}
DN = (((1,), (0,)), ((), ()))
BF16 = jnp.bfloat16


def _plain_cast(x, dtype):
    # The reference: a cast to FP8 with scale 1 (saturating) and back.
    return fp8.dequantize(fp8.quantize(x, dtype, 1.0), 1.0, jnp.float32)


def _operands(getkey):
    # Values near unit scale, some beyond E4M3's 448 and some below its subnormals.
    x = jax.random.normal(getkey(), (16, 32)) * 3.0
    x = x.at[0, 0].set(900.0).at[1, 1].set(1e-4)
    w = jax.random.normal(getkey(), (32, 8))
    return x, w


@pytest.mark.parametrize("gpu_lowering", [False, True], ids=["dequantized", "f8_dot"])
def test_static_scale_is_the_plain_cast(gpu_lowering, getkey, monkeypatch):
    # Forward: the product of the E4M3-cast operands; backward: both gradients from
    # the E5M2-cast cotangent, accumulated in float32 -- whichever lowering.
    monkeypatch.setattr(_dot, "f8_dot_lowering", lambda: gpu_lowering)
    x, w = _operands(getkey)
    g = jax.random.normal(getkey(), (16, 8)) * 1e-3
    out, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DN, scale=1.0), x, w)
    xq, wq = _plain_cast(x, fp8.E4M3), _plain_cast(w, fp8.E4M3)
    gq = _plain_cast(g, fp8.E5M2)
    np.testing.assert_allclose(out, xq @ wq, rtol=1e-6)
    assert float(jnp.max(xq)) == 448.0 and float(xq[1, 1]) == 0.0  # saturated, flushed
    dx, dw = vjp(g)
    np.testing.assert_allclose(dx, gq @ wq.T, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dw, xq.T @ gq, rtol=1e-6, atol=1e-9)


def test_power_of_two_scales_are_exact(getkey):
    x, w = _operands(getkey)
    x = x * 2.0**-6
    out = fp8.fp8_dot_general(x, w, DN, scale=(2.0**-6, 1.0, 1.0))
    ref = _plain_cast(x * 2.0**6, fp8.E4M3) * 2.0**-6 @ _plain_cast(w, fp8.E4M3)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_static_scale_has_no_amax_pass_and_dots_of_fp8(getkey, monkeypatch):
    # On a GPU the three products are dots of FP8 arrays (what XLA makes FP8 GEMMs of),
    # and no op reads a tensor for its amax (no reduction at all).
    monkeypatch.setattr(_dot, "f8_dot_lowering", lambda: True)
    x, w = (a.astype(BF16) for a in _operands(getkey))
    loss = lambda x, w: jnp.sum(jnp.tanh(fp8.fp8_dot_general(x, w, DN, scale=1.0)))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    dots = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    for e in dots:
        assert {np.dtype(v.aval.dtype) for v in e.invars} <= F8
    static = jax.make_jaxpr(lambda x, w: fp8.fp8_dot_general(x, w, DN, scale=1.0))
    names = {e.primitive.name for e in iter_eqns(static(x, w).jaxpr)}
    # (An elementwise `abs` remains: `isinf`, which keeps infinities non-finite.)
    assert not names & {"reduce_max", "reduce_min"}
    # Current scaling reads each operand for its amax.
    current = jax.make_jaxpr(lambda x, w: fp8.fp8_dot_general(x, w, DN))(x, w)
    assert "reduce_max" in {e.primitive.name for e in iter_eqns(current.jaxpr)}
    # The lowered program feeds the FP8 arrays to the dot.
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    f8_dots = [d for d in re.findall(r"stablehlo\.dot_general.*", text) if "f8E" in d]
    assert len(f8_dots) == 3


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), (1.0, 1.0), "1"])
def test_bad_static_scales_say_what_was_expected(scale):
    x = jnp.ones((2, 2))
    with pytest.raises(ValueError, match="Expected `scale` as a positive number"):
        fp8.fp8_dot_general(x, x, DN, scale=scale)


def test_amp_returns_the_compute_dtype_from_a_static_fp8_matmul(getkey):
    x, w = _operands(getkey)
    f = lambda x, w: fp8.fp8_dot_general(x, w, DN, scale=1.0)
    assert f(x, w).dtype == jnp.float32
    jaxpr = jax.make_jaxpr(lowtrain.amp(f, lowtrain.Policy("float32", "bfloat16")))
    # Inside amp the product is written in bfloat16 (the policy's output is float32).
    outs = [
        e.outvars[0].aval.dtype
        for e in iter_eqns(jaxpr(x, w).jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert outs and set(outs) == {jnp.dtype(BF16)}
    # Under a "keep" scope it runs as written, in float32.
    kept = lowtrain.amp(lowtrain.amp_stop(f), "bf16")
    outs = [
        e.outvars[0].aval.dtype
        for e in iter_eqns(jax.make_jaxpr(kept)(x, w).jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert set(outs) == {jnp.dtype(jnp.float32)}


def _unit_gpt(getkey):
    model = uu.TransformerDecoder(32, 65, layers=1, heads=2, key=getkey())
    tokens = jax.random.randint(getkey(), (2, 16), 0, 65)
    return model, tokens


def test_simulate_fp8_under_amp_is_the_plain_cast_program(getkey):
    # `uu.simulate_fp8` writes each matmul as a static-scale FP8 matmul now; its loss
    # and gradients are those of the plain cast of every operand (the rule given a
    # plain function, which knows no dimension numbers), to the last bit.
    model, tokens = _unit_gpt(getkey)

    def as_function(op, lhs, rhs):  # hides `op.params`: the dequantized path
        return uu.fp8_cast_op(lambda a, b: op(a, b), lhs, rhs)

    plain = lowtrain.rewrite(model, dict.fromkeys(uu.MATMULS, as_function))
    new = uu.simulate_fp8(model)
    losses = {}
    for name, m in [("plain", plain), ("new", new)]:
        loss = lambda m: jnp.mean(lowtrain.amp(m, "bf16")(tokens).astype(jnp.float32))
        value, grads = eqx.filter_value_and_grad(loss)(m)
        losses[name] = (value, jax.tree.leaves(grads))
    assert losses["plain"][0] == losses["new"][0]
    for a, b in zip(losses["plain"][1], losses["new"][1]):
        np.testing.assert_array_equal(a, b)


def test_simulate_fp8_on_a_gpu_runs_every_matmul_but_the_kept_as_fp8(
    getkey, monkeypatch
):
    monkeypatch.setattr(_dot, "f8_dot_lowering", lambda: True)
    model, tokens = _unit_gpt(getkey)
    f = lowtrain.amp(uu.simulate_fp8(model, keep=["projection"]), "bf16")
    loss = lambda m: jnp.mean(jnp.tanh(m(tokens).astype(jnp.float32)))
    text = eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(f).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    wide = [d for d in dots if "f8E" not in d.split(" -> ")[0]]
    # The readout (forward, and its two gradients) stays bfloat16.
    assert len(wide) == 3 and all("bf16" in d for d in wide)


def test_fp8_min_dim_leaves_small_matmuls_in_the_compute_dtype(getkey):
    x = jax.random.normal(getkey(), (64, 256))
    small = jax.random.normal(getkey(), (256, 8))
    big = jax.random.normal(getkey(), (256, 256))
    f = lambda x, a, b: (x @ a, x @ b)
    policy = lowtrain.get_policy("fp8").with_fp8_min_dim(64)
    jaxpr = jax.make_jaxpr(lowtrain.amp(f, policy))(x, small, big)
    dots = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    fp8_dots = [e for e in dots if {np.dtype(v.aval.dtype) for v in e.invars} <= F8]
    wide = [e for e in dots if e not in fp8_dots]
    # N = 8 < 64: bfloat16 (in the CPU lowering, the FP8 products are of dequantized
    # values, so look for the quantize casts instead).
    casts = [
        e
        for e in iter_eqns(jaxpr.jaxpr)
        if e.primitive.name == "convert_element_type"
        and np.dtype(e.params["new_dtype"]) in F8
    ]
    shapes = {tuple(e.outvars[0].aval.shape) for e in casts}
    assert (256, 256) in shapes and (256, 8) not in shapes
    assert any(
        tuple(e.outvars[0].aval.shape) == (64, 8) and e.outvars[0].aval.dtype == BF16
        for e in wide
    )


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_fp8_min_dim_is_checked(bad):
    with pytest.raises((TypeError, ValueError), match="fp8_min_dim"):
        lowtrain.get_policy("fp8").with_fp8_min_dim(bad)
    with pytest.raises(ValueError, match="min_dim"):
        uu.fp8_cast_rules(min_dim=bad)


def test_simulate_fp8_min_dim(getkey):
    x = jax.random.normal(getkey(), (8, 64)) * 1e-4  # 1e-4: 0 in E4M3
    w_small, w_big = jnp.ones((64, 4)), jnp.ones((64, 64))
    f = uu.simulate_fp8(lambda x, a, b: (x @ a, x @ b), min_dim=8)
    small, big = f(x, w_small, w_big)
    np.testing.assert_allclose(small, x @ w_small, rtol=1e-6)  # N = 4: as written
    assert float(jnp.abs(big).max()) == 0.0  # cast: flushed to zero
    assert uu.fp8_cast_rules(min_dim=8) == uu.fp8_cast_rules(min_dim=8)  # hashable


def _recipe(*overrides):
    return _run.to_config(make_config(*overrides))


def test_precision_min_dim_in_the_recipes():
    from lowtrain.recipes import precisions

    fp8_amp = precisions.amp("fp8", min_dim=512)
    assert fp8_amp.policy.fp8_min_dim == 512
    with pytest.raises(ValueError, match="only with an FP8 policy"):
        precisions.amp("bf16", min_dim=512)
    chain = precisions.delayed_fp8(min_dim=512)
    assert chain.parts[0].min_dim == 512
    assert chain.parts[1].policy.fp8_min_dim == 512
    config = _recipe("recipe=gpt_unit_fp8", "precision.min_dim=64")
    assert config.precision.min_dim == 64
    with pytest.raises(ValueError, match="precision.min_dim"):
        _recipe("recipe=gpt_fp8", "precision.min_dim=-1")


def test_delayed_linears_leave_small_layers(getkey):
    from lowtrain.recipes._layers import Linear
    from lowtrain.recipes.precisions import DelayedLinear, DelayedLinears

    model = [Linear(8, 512, key=getkey()), Linear(512, 512, key=getkey())]
    swapped = DelayedLinears(16, 0, 256).cast_params(model)
    assert type(swapped[0]) is Linear and type(swapped[1]) is DelayedLinear


def _weight_casts_in_loop(hlo: str, weight_shapes) -> tuple[int, int]:
    """Fusions casting a weight-shaped array to FP8: `(in a while loop, outside)`."""
    comps, current = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if m:
            current = comps.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    calls = {
        name: {
            c.lstrip("%")
            for line in lines
            for m in re.finditer(
                r"(?:calls|body|condition|to_apply)=(%?[\w.\-]+)", line
            )
            for c in [m.group(1)]
        }
        for name, lines in comps.items()
    }
    inside, todo = (
        set(),
        [
            m.group(1)
            for lines in comps.values()
            for line in lines
            if (m := re.search(r" while\(.*body=%?([\w.\-]+)", line))
        ],
    )
    while todo:
        c = todo.pop()
        if c not in inside and c in comps:
            inside.add(c)
            todo.extend(calls[c])
    shapes = "|".join(re.escape(s) for s in weight_shapes)
    pattern = rf"f8e4m3fn\[(?:1,)?(?:{shapes})\]"  # a layer's slice: (1, in, out)
    casting = {
        name
        for name, lines in comps.items()
        if any(re.search(pattern, line) and " convert(" in line for line in lines)
    }
    return len(casting & inside), len(casting - inside)


@pytest.mark.parametrize(
    "recipe", ["gpt_fp8", pytest.param("gpt_unit_fp8", marks=pytest.mark.slow)]
)
def test_weights_are_cast_to_fp8_once_per_step_under_grad_accum(recipe):
    # With 4 micro-batches the FP8 casts of the weights are computed once per step,
    # outside the accumulation loop (XLA hoists them: they depend on the weights
    # only), and reused by every micro-batch. Layers unrolled: a scanned stack's
    # casts sit in the layer loop's body.
    overrides = [
        f"recipe={recipe}",
        "model.n_layer=2",
        "model.n_embd=64",
        "model.n_head=4",
        "model.block_size=16",
        "trainer.batch_size=8",
        "trainer.grad_accum=4",
    ]
    if recipe == "gpt_fp8":
        overrides.append("model.scan_layers=false")
    cfg = make_config(*overrides)
    config = _run.to_config(cfg)
    model, trainer_class = gpt.build_model(config.model, 65, key=jax.random.key(0))
    trainer = trainer_class(
        model,
        _common.optimizer(cfg, 1000, decay_mask, model),
        **_common.trainer_options(config),
    )
    state = trainer.init(key=jax.random.key(1))
    tokens = np.random.default_rng(0).integers(0, 65, (8, 17), dtype=np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    hlo = jax.jit(trainer.train_step).lower(state, batch).compile().as_text()
    shapes = ["64,192", "64,64", "64,256", "256,64"]  # the blocks' weights
    if recipe == "gpt_unit_fp8":
        shapes = ["64,64", "64,256", "256,64", "64,128", "128,64"]
    inside, outside = _weight_casts_in_loop(hlo, shapes)
    assert outside > 0 and inside == 0
