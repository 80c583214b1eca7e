"""The model zoo under `lowtrain.amp`: models written the way their users write them
(`scripts/benchlib/zoo_models.py`: Equinox's examples, diffrax's neural ODE, Flax
linen and NNX, einops), each under "bf16", "fp16" (loss-scaled) and "fp8".

For each model and policy, one gradient step (`benchlib.zoo.traced_step`, the step
`python scripts/bench.py zoo` tabulates):

- it runs, its loss finite;
- every matmul and convolution of its program, forward and backward, takes its
  operands in the compute dtype; under "fp8", FP8 operands (E4M3 forward, an E5M2
  cotangent backward), as FP8 arrays (a GPU) or their dequantized values (elsewhere);
- the gradients are float32, as the parameters are, and the model's state (BatchNorm
  statistics, rng counts) keeps its dtypes;
- the gradient error against float32, `|g - g32| / |g32|` over the whole gradient,
  is within `benchlib.zoo.bound` of the reference's: the hand cast (bf16, fp16) or
  the FP8 emulation (fp8) that `benchlib.zoo` writes out.

Then what single models need: an NNX model called directly writes back its BatchNorm
statistics and its dropout rng count; `eqx.nn.PReLU`'s slope (a 0-d float32
parameter made from a Python float) is not rounded to the compute dtype.

The models are user code, written for JAX's default promotion rules
(`benchlib.zoo.user_code`: standard dtype promotion, rank promotion allowed). Their
programs are compiled with most XLA optimizations off: at these sizes compiling costs
more than running (the errors agree with optimized programs' to 1e-6).
"""

import functools
import json
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

import lowtrain

pytest.importorskip("flax", reason="Flax is not installed (`pip install flax`)")
pytest.importorskip("diffrax", reason="diffrax is not installed")
pytest.importorskip("einops", reason="einops is not installed")

# `benchlib` is a folder of scripts/, not a package: imported from there, as
# scripts/bench.py imports it, and taken off the path again.
_SCRIPTS = str(pathlib.Path(__file__).resolve().parent.parent / "scripts")
sys.path.insert(0, _SCRIPTS)
try:
    from benchlib import zoo
    from benchlib.zoo_models import NNXCNN, ZOO
finally:
    sys.path.remove(_SCRIPTS)

from flax import nnx  # noqa: E402

POLICIES = ["bf16", "fp16", "fp8"]
# Models whose backward pass is their own custom rule's program (diffrax's adjoints
# recompute and differentiate the solve inside a `custom_vjp`): `amp` transforms it
# as a program, so its FP8 matmuls are E4M3 ones (docs/guides/amp.md, Limits).
CUSTOM_BACKWARD = ("neural_ode", "neural_ode_backsolve")
NAMES = [
    "mlp",
    "cnn",
    "stateful",
    "gru",
    "bert",
    "mixer",
    "unet",
    "vit",
    "dcgan",
    "neural_ode",
    "neural_ode_backsolve",
    "linen_cnn",
    "nnx_cnn",
    "einops",
]
F32 = jnp.float32
F8 = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}
MATMULS = ("dot_general", "conv_general_dilated")
# Ops between a dequantized FP8 operand and the matmul that change no value: a
# convolution's transpose reverses its kernel, a dot's batching moves axes.
LAYOUT = ("rev", "transpose", "reshape", "broadcast_in_dim", "squeeze", "copy")


@pytest.fixture(autouse=True, scope="module")
def fast_compiles():
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@functools.cache
def _float32_step(name):
    """The model, its inputs, its loss and its float32 step's outputs."""
    with zoo.user_code():
        model, inputs, loss = ZOO[name](jax.random.key(0))
        return model, inputs, loss, zoo.gradients(loss, model, inputs, "fp32")


def _sub_jaxprs(eqn):
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                yield sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def _outer_operands(eqn, sub) -> list:
    """The operands of `eqn` that `sub`'s inputs are (a loop's carry: its initial
    value), or [] where they do not line up."""
    n = len(sub.invars)
    if eqn.primitive.name == "while":  # cond consts, body consts, carry
        return list(eqn.invars[-n:])
    if eqn.primitive.name == "cond":  # the index, then the branches' operands
        return list(eqn.invars[1:])
    return list(eqn.invars) if len(eqn.invars) == n else []


def _matmuls(jaxpr, outer=None):
    """`(eqn, fp8)` for every matmul and convolution of `jaxpr` and its sub-jaxprs,
    `fp8` the FP8 dtype each float operand holds or was dequantized from
    (`convert(data) * scale`, maybe through layout ops), None where neither. Values
    are followed into sub-jaxprs (a weight quantized outside the scan using it)."""
    outer = outer or {}
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}

    def source(var):
        if not isinstance(var, Var):
            return None
        if np.dtype(var.aval.dtype) in F8:
            return np.dtype(var.aval.dtype).name
        eqn = producers.get(var)
        if eqn is None:
            return outer[var]() if var in outer else None
        if eqn.primitive.name in LAYOUT:
            return source(eqn.invars[0])
        if eqn.primitive.name == "convert_element_type":  # dequantizing the data
            held = np.dtype(eqn.invars[0].aval.dtype)
            return source(eqn.invars[0]) if held in F8 else None
        if eqn.primitive.name == "mul":  # data * scale, the scale a scalar
            data, scale = sorted(eqn.invars, key=lambda v: v.aval.shape == ())
            return source(data) if scale.aval.shape == () else None
        return None

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMULS:
            yield eqn, tuple(source(v) for v in _floats(eqn))
        for sub in _sub_jaxprs(eqn):
            bound = zip(sub.invars, _outer_operands(eqn, sub))
            inner = {iv: functools.partial(source, ov) for iv, ov in bound}
            yield from _matmuls(sub, inner)


def _floats(eqn):
    return [v for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def _matmul_problems(jaxpr, policy, custom_backward=False) -> list[str]:
    """What is wrong with the matmuls and convolutions of `jaxpr` under `policy`.
    `custom_backward`: the backward pass is a custom rule's program (a diffrax
    adjoint), whose matmuls `amp` sees as forward ones: FP8 in E4M3, no E5M2."""
    compute = np.dtype(lowtrain.get_policy(policy).compute_dtype)
    problems, sources = [], []
    for eqn, fp8 in _matmuls(jaxpr.jaxpr):
        sources.append(fp8)
        dtypes = [np.dtype(v.aval.dtype).name for v in _floats(eqn)]
        if policy == "fp8":
            if None in fp8:
                problems.append(f"{eqn.primitive.name} on {dtypes}, not FP8")
        elif any(np.dtype(d) != compute for d in dtypes):
            problems.append(f"{eqn.primitive.name} on {dtypes}, not {compute}")
    if not sources:
        problems.append("no matmul or convolution found")
    if policy == "fp8" and not problems:
        e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
        if (e4m3, e4m3) not in sources:
            problems.append("no forward FP8 matmul (E4M3 x E4M3)")
        if not any(e5m2 in s for s in sources) and not custom_backward:
            problems.append("no backward FP8 matmul (an E5M2 cotangent)")
    return problems


def _cases():
    # In the default suite each model runs under one policy, the three rotating
    # (every policy on several models, FP8 on DCGAN's convolutions, a diffrax
    # solve), but for the five whose three compilations take longest (15-35 s each
    # on 2 cores); the whole matrix is in the slow suite.
    fast = {name: POLICIES[i % 3] for i, name in enumerate(NAMES)}
    fast.update(dcgan="fp8", neural_ode="bf16", nnx_cnn="fp16")
    for name in ("bert", "unet", "neural_ode_backsolve", "mixer", "vit"):
        fast[name] = None
    for name in NAMES:
        for policy in POLICIES:
            marks = () if fast[name] == policy else (pytest.mark.slow,)
            yield pytest.param(name, policy, marks=marks, id=f"{name}-{policy}")


@pytest.mark.parametrize("name, policy", list(_cases()))
def test_zoo(name, policy):
    model, inputs, loss, (_, aux32, g32, _) = _float32_step(name)
    reference = "emulation" if policy == "fp8" else "hand"
    with zoo.user_code():
        jaxpr, run = zoo.traced_step(loss, model, inputs, "lowtrain", policy)
        value, aux, grads, finite = run()
        ref = zoo.gradients(loss, model, inputs, reference, policy)
    problems = _matmul_problems(jaxpr, policy, name in CUSTOM_BACKWARD)
    if not (bool(finite) and bool(jnp.isfinite(value)) and value.dtype == F32):
        problems.append(f"loss {value} ({value.dtype}), gradients finite: {finite}")
    params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    grad_dtypes = [g.dtype for g in jax.tree.leaves(grads)]
    if grad_dtypes != [p.dtype for p in params]:
        problems.append(f"gradient dtypes {grad_dtypes}, not the parameters'")
    state_dtypes = [a.dtype for a in jax.tree.leaves(aux)]
    if state_dtypes != [a.dtype for a in jax.tree.leaves(aux32)]:
        problems.append(f"state dtypes {state_dtypes}, float32's differ")
    error = zoo.relative_error(grads, g32)
    ref_error = zoo.relative_error(ref[2], g32) if bool(ref[3]) else float("inf")
    if not error <= zoo.bound(policy, ref_error):
        problems.append(
            f"gradient error {error:.3g} above the bound "
            f"{zoo.bound(policy, ref_error):.3g} (the {reference}'s: {ref_error:.3g})"
        )
    assert not problems, f"{name} under {policy}: " + "; ".join(problems)


def test_zoo_names():
    assert list(ZOO) == NAMES


def test_zoo_table(tmp_path):
    # `python scripts/bench.py zoo`: one row per model and policy, in zoo.json and
    # zoo.md.
    zoo.main(["--models", "mlp", "--policies", "bf16,fp8", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "zoo.json").read_text())["rows"]
    assert [(r["model"], r["policy"], r["reference"]) for r in rows] == [
        ("mlp", "bf16", "hand cast"),
        ("mlp", "fp8", "fp8 emulation"),
    ]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["lowtrain_error"] / r["reference_error"])
        assert r["bound"] == zoo.bound(r["policy"], r["reference_error"])
        assert 0 < r["lowtrain_error"] <= r["bound"]
    table = (tmp_path / "zoo.md").read_text()
    assert "| mlp | fp8 |" in table and "fp8 emulation" in table


# -- NNX: state written back by a direct call ------------------------------------------


def _nnx_model():
    model = NNXCNN(rngs=nnx.Rngs(params=0, dropout=1))
    model.train()  # batch statistics, dropout on
    x = jax.random.normal(jax.random.key(2), (16, 8, 8, 1))
    return model, x


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_batchnorm_statistics_are_written_back(policy):
    # A training-mode call updates the running statistics, under amp as without:
    # in place, in their own dtype, to about float32's values.
    model, x = _nnx_model()
    plain = nnx.clone(model)
    with zoo.user_code():
        plain(x)
        lowtrain.amp(model, policy)(x)
    for stat in ("mean", "var"):
        ours, theirs = getattr(model.bn, stat)[...], getattr(plain.bn, stat)[...]
        assert ours.dtype == F32
        assert not np.allclose(ours, {"mean": 0.0, "var": 1.0}[stat]), stat
        np.testing.assert_allclose(ours, theirs, rtol=0.05, atol=0.01)


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_dropout_draws_a_new_mask_each_call(policy):
    # nnx.Dropout draws from its rng stream and counts the draw: two calls, two
    # masks, under amp as without.
    model, x = _nnx_model()
    with zoo.user_code():
        plain = nnx.clone(model)
        assert not np.allclose(plain(x), plain(x))
        first = lowtrain.amp(model, policy)(x)
        second = lowtrain.amp(model, policy)(x)
    assert int(model.dropout.rngs.count[...]) == 2
    assert not np.allclose(first, second)


# -- PReLU: a float32 parameter made from a Python float -----------------------------


class _ConvPReLU(eqx.Module):
    conv: eqx.nn.Conv2d
    prelu: eqx.nn.PReLU

    def __call__(self, x):
        return self.prelu(self.conv(x))


@pytest.mark.parametrize("policy", POLICIES)
def test_prelu_slope_stays_float32(policy):
    # DCGAN's discriminator: a bias-free convolution (its output in the compute
    # dtype), then eqx.nn.PReLU, whose slope `jnp.asarray(0.2)` is a weakly typed
    # float32 parameter. The product runs in float32, the widest of its inputs: a
    # slope below the compute dtype's resolution survives (fp16 keeps 1 + 2**-10).
    slope = 1 + 2.0 ** (-12 if policy == "fp16" else -10)
    conv = eqx.nn.Conv2d(1, 1, 1, use_bias=False, key=jax.random.key(0))
    conv = eqx.tree_at(lambda c: c.weight, conv, jnp.ones((1, 1, 1, 1)))
    model = _ConvPReLU(conv, eqx.nn.PReLU(slope))
    x = -jnp.ones((1, 2, 2))  # the convolution's output: exactly -1
    assert model.prelu.negative_slope.dtype == F32
    out = lowtrain.amp(model, policy)(x)
    assert out.dtype == F32
    np.testing.assert_array_equal(out, jnp.full((1, 2, 2), -slope))
    grads = eqx.filter_grad(lambda m: jnp.sum(lowtrain.amp(m, policy)(x)))(model)
    assert grads.prelu.negative_slope.dtype == F32
    assert float(grads.prelu.negative_slope) == -4.0
