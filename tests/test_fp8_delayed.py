"""`precision=fp8_delayed`: the recipes' `Linear` layers in FP8 with delayed
scaling (`recipes.precisions.DelayedLinear`), the rest of the step as the `fp8`
policy has it; `amp` keeps delayed-scaling state in float32."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

import lowtrain
from lowtrain import fp8
from lowtrain.recipes import _common, _run, gpt, mnist, precisions
from lowtrain.recipes.precisions import DelayedLinear, DelayedLinears

from .helpers import gpt_batches, iter_eqns, tiny_gpt
from .test_recipes import TINY_GPT, make_config


def _fp8_cast_inputs(jaxpr) -> list[tuple[str, frozenset]]:
    """For each cast to an FP8 dtype in `jaxpr` (sub-jaxprs included): the dtype, and
    the primitives its operand was computed with."""
    return _flow(jaxpr, None)[1]


def _flow(jaxpr, deps) -> tuple[list[frozenset], list[tuple[str, frozenset]]]:
    """`(for each output, the primitives it was computed with; the FP8 casts as
    `_fp8_cast_inputs` lists them)`, given those of the inputs (`deps`). Data flow is
    followed into and out of each sub-jaxpr that takes its equation's operands in
    order (jit, custom VJP/JVP calls, remat, scan); into any other, everything flows
    to everything."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    env = dict(zip(jaxpr.invars, deps or [frozenset()] * len(jaxpr.invars)))
    read = lambda v: frozenset() if isinstance(v, Literal) else env.get(v, frozenset())
    casts = []
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        flowing = frozenset().union(*ins)
        outs = [flowing | {eqn.primitive.name}] * len(eqn.outvars)
        for sub in _subs(eqn):
            inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
            aligned = len(inner.invars) == len(ins)
            sub_outs, sub_casts = _flow(sub, ins if aligned else [flowing] * len(ins))
            casts += sub_casts
            if aligned and len(sub_outs) == len(eqn.outvars):
                outs = sub_outs
            else:
                outs = [o.union(*sub_outs) for o in outs]
        new = str(eqn.params.get("new_dtype", ""))
        if eqn.primitive.name == "convert_element_type" and "float8" in new:
            casts.append((new, flowing))
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars], casts


def _subs(eqn):
    for v in eqn.params.values():
        for s in v if isinstance(v, tuple | list) else (v,):
            if isinstance(s, ClosedJaxpr | Jaxpr):
                yield s


def test_delayed_linears_swap_every_linear_with_a_history_per_layer(getkey):
    model = tiny_gpt(getkey(), n_layer=3)
    swapped = DelayedLinears(8, 1).cast_params(model)
    for name in ("qkv", "proj", "fc", "out"):
        old, new = getattr(model.blocks, name), getattr(swapped.blocks, name)
        assert isinstance(new, DelayedLinear)
        assert new.kernel is old.kernel and new.bias is old.bias
        for scale, dtype in zip(
            (new.x_scale, new.w_scale, new.g_scale), (fp8.E4M3, fp8.E4M3, fp8.E5M2)
        ):
            assert scale.amax_history.shape == (3, 8) and scale.scale.shape == (3,)
            assert scale.dtype == dtype and scale.margin == 1
    assert eqx.tree_equal((swapped.wte, swapped.ln_f), (model.wte, model.ln_f))
    mlp = DelayedLinears(16, 0).cast_params(mnist.MLP((16,), key=getkey()))
    assert all(isinstance(layer, DelayedLinear) for layer in mlp.layers)
    assert mlp.layers[0].x_scale.amax_history.shape == (16,)


def test_delayed_linears_need_the_recipes_linear_layers(getkey):
    unit = lowtrain.unit_scaling.Linear(4, 4, key=getkey())
    with pytest.raises(ValueError, match="recipes' `Linear` layers.*got a Linear"):
        DelayedLinears(16, 0).cast_params(unit)


def test_fp8_delayed_composes_and_checks_its_fields():
    config = _run.to_config(make_config("recipe=gpt", "precision=fp8_delayed"))
    assert config.precision.name == "fp8_delayed" and config.precision.history == 16
    built = _common.trainer_options(config)["precision"]
    kinds = [type(part).__name__ for part in built.parts]
    assert kinds == ["DelayedLinears", "Amp", "DelayedFp8"]
    assert built.parts[1].policy == lowtrain.get_policy("fp8")
    with pytest.raises(Exception, match="precision.history"):
        _run.to_config(
            make_config("recipe=gpt", "precision=fp8_delayed", "precision.history=0")
        )
    with pytest.raises(Exception, match="precision.margin"):
        _run.to_config(
            make_config("recipe=mnist", "precision=fp8_delayed", "precision.margin=-1")
        )


@pytest.mark.parametrize("delayed", [True, False])
def test_no_fp8_cast_waits_for_its_own_amax(delayed, getkey):
    # Delayed scaling's point: each cast to FP8 (E4M3 operands forward, the E5M2
    # cotangent backward) uses a scale known before its tensor is made, so XLA can
    # fuse the cast into the op that makes it. Under current scaling (`fp8`) every
    # cast depends on an amax (`reduce_max`) of its own operand.
    model = mnist.MLP((16,), key=getkey())
    precision = precisions.delayed_fp8() if delayed else precisions.amp("fp8")
    model = precision.cast_params(model)
    x = jax.random.normal(getkey(), (4, 784))

    def loss(m):  # no softmax: its own reduce_max would flow into the cotangent
        return jnp.sum(precision.wrap_model(m)(x) ** 2)

    casts = _fp8_cast_inputs(jax.make_jaxpr(eqx.filter_grad(loss))(model))
    e4m3 = [deps for dtype, deps in casts if "e4m3" in dtype]
    e5m2 = [deps for dtype, deps in casts if "e5m2" in dtype]
    assert len(e4m3) >= 2 * 2 and len(e5m2) >= 2  # 2 matmuls: 2 operands, 1 cotangent
    waits = ["reduce_max" in deps for deps in e4m3 + e5m2]
    assert not any(waits) if delayed else all(waits)


@pytest.mark.slow
def test_delayed_fp8_trains_the_gpt_with_one_history_per_layer(getkey):
    model = tiny_gpt(getkey(), n_layer=2)
    trainer = gpt.GptTrainer(
        model, optax.sgd(0.5), precision=precisions.delayed_fp8(history=4)
    )
    state = trainer.init(key=getkey())
    batches = gpt_batches(getkey(), 3)
    losses = []
    for tokens, targets in batches:
        before = state
        state, metrics = trainer.train_step(state, {"x": tokens, "y": targets})
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses))
    qkv = state.model.blocks.qkv
    for scale in (qkv.x_scale, qkv.w_scale, qkv.g_scale):
        history = np.asarray(scale.amax_history)  # (layers, history), newest first
        assert history.shape == (2, 4)
        assert (history[:, :3] > 0).all() and (history[:, 3] == 0).all()
        assert history[0, 0] != history[1, 0]  # each layer its own (not summed)
        # The scale is the history's (float32, not rounded to the compute dtype).
        expected = [fp8.compute_scale(jnp.max(h), scale.dtype) for h in history]
        np.testing.assert_allclose(scale.scale, expected, rtol=1e-6)
    # The newest weight amax is that of the kernels the last step multiplied (the
    # float32 kernels: `amp` casts an input where an op uses it, and the FP8 cast
    # takes it as it is), one per layer; the kernels themselves moved (the optimizer
    # saw them).
    used = before.model.blocks.qkv.kernel
    np.testing.assert_array_equal(
        qkv.w_scale.amax_history[:, 0], jnp.max(jnp.abs(used), axis=(1, 2))
    )
    assert not np.array_equal(qkv.kernel, before.model.blocks.qkv.kernel)


@pytest.mark.parametrize("policy", ["bf16", "fp8"])
def test_amp_leaves_delayed_scaling_state_in_float32(policy, getkey):
    # `amp` casts a model's float leaves where the ops that use them run in the
    # compute dtype; a `DelayedScale`'s are used by the FP8 op as they are: its new
    # value comes back as its cotangent, and a bf16 cast would round that too (a
    # scale of 8 significant bits, not 24).
    layer = fp8.Fp8Linear(16, 4, delayed=True, key=getkey())
    x = jax.random.normal(getkey(), (8, 16)) * 3.3
    loss = lambda m: jnp.sum(lowtrain.amp(m, policy)(x) ** 2)
    grads = eqx.filter_grad(loss)(layer)
    _, scales = fp8.pop_scales(grads, layer)
    for s in (scales.x_scale, scales.w_scale, scales.g_scale):
        assert s.scale.dtype == s.amax_history.dtype == jnp.float32
        expected = fp8.compute_scale(jnp.max(s.amax_history), s.dtype)
        np.testing.assert_allclose(s.scale, expected, rtol=1e-6)
        assert s.scale.astype(jnp.bfloat16).astype(jnp.float32) != s.scale
    # The FP8 op takes its operands as they come: x in float32.
    assert scales.x_scale.amax_history[0] == jnp.max(jnp.abs(x))


@pytest.mark.slow  # three short runs through the app: 30-50 s on 2 cores
def test_gpt_fp8_delayed_run_resumes_its_scaling_state_exactly(tmp_path):
    # Through the Hydra app: the swapped model is what the Trainer's state, its
    # checkpoints and the sampling use; a resumed run goes on with the saved amax
    # histories (a fresh history would quantize step 7 with scale 1) and logs what a
    # straight run logs.
    text = tmp_path / "tiny.txt"
    rng = np.random.default_rng(0)
    words = np.array(["to", "be", "or", "not", "that", "is", "the", "question"])
    text.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(200)))
    common = [
        "recipe=gpt_fp8_delayed",
        f"data.path={text}",
        *TINY_GPT,
        "optimizer.schedule=constant",
        "trainer.checkpoint_every=6",
    ]
    summary = _run.run(make_config(*common, "trainer.steps=6"), tmp_path / "run")
    assert summary["precision"] == "fp8_delayed" and summary["steps"] == 6
    resumed = make_config(
        *common, "trainer.resume=true", "trainer.resume_allow=[trainer.steps]"
    )
    assert _run.run(resumed, tmp_path / "run")["steps"] == 12
    _run.run(make_config(*common), tmp_path / "straight")
    last = [
        json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])
        for d in ("run", "straight")
    ]
    assert last[0]["step"] == last[1]["step"] == 12
    assert last[0]["loss"] == last[1]["loss"]
    assert (tmp_path / "run" / "sample.txt").read_text()


def test_fp8_delayed_places_dtypes_as_fp8_does(getkey):
    # Only the scaling differs: every FP8 matmul (a custom-VJP call) returns the same
    # dtype and shape under both, bf16 (the compute dtype), so what runs between
    # them does too (a float32 product would double the activations' traffic).
    model = tiny_gpt(getkey(), n_layer=1)
    tokens = jnp.zeros((2, 8), jnp.int32)

    def products(precision):
        m = precision.cast_params(model)
        jaxpr = jax.make_jaxpr(lambda m: precision.wrap_model(m)(tokens))(m)
        calls = [e for e in iter_eqns(jaxpr) if e.primitive.name == "custom_vjp_call"]
        return [str(e.outvars[0].aval) for e in calls]

    current, delayed = (
        products(precisions.amp("fp8")),
        products(precisions.delayed_fp8()),
    )
    # amp's own call (the float32 logits), then 4 projections, 2 einsums, the head.
    assert delayed == current and len(current) == 8
    assert current[0] == "float32[2,8,16]"
    assert all(p.startswith("bfloat16") for p in current[1:])


def test_amp_gives_delayed_fp8_products_the_compute_dtype(getkey):
    # `amp` recognises `fp8.fp8_dot_general_delayed` (a jit of its own name) and
    # returns its product in the policy's compute dtype, as its "fp8" policy does for
    # current scaling; inside `amp_stop`, as written (the input's dtype).
    layer = fp8.Fp8Linear(16, 4, delayed=True, key=getkey())
    x = jax.random.normal(getkey(), (8, 16))

    def product_dtypes(fn, policy):
        jaxpr = jax.make_jaxpr(lowtrain.amp(fn, policy))(layer, x)
        names = [
            (e.params["name"], str(e.outvars[0].aval.dtype))
            for e in iter_eqns(jaxpr)
            if e.primitive.name == "jit"
        ]
        return [d for n, d in names if n.startswith("lowtrain_fp8_dot_general_delayed")]

    assert product_dtypes(lambda m, x: m(x), "bf16") == ["bfloat16"]
    assert product_dtypes(lambda m, x: m(x), "fp16") == ["float16"]
    assert product_dtypes(lowtrain.amp_stop(lambda m, x: m(x)), "bf16") == ["float32"]
    assert layer(x).dtype == jnp.float32  # outside amp: the input's dtype
