"""`lowtrain.dot_product_attention`: jax.nn's attention as one op, run whole by amp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain
from lowtrain._attention import choose_implementation
from lowtrain.recipes import _config, gpt

from .helpers import float_in_dtypes, iter_eqns, make_jaxpr

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)


def qkv(t=16, s=16, heads=4, kv_heads=4, size=8, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(k1, (2, t, heads, size)),
        jax.random.normal(k2, (2, s, kv_heads, size)),
        jax.random.normal(k3, (2, s, kv_heads, size)),
    )


def attention_eqns(jaxpr, forward=True):
    """The jit equations of `lowtrain.dot_product_attention` in `jaxpr`: its forward
    pass (the call as written, or its part JAX's autodiff keeps for the forward, the
    residuals added to its outputs), or its backward pass (the transposed part)."""
    return [
        e
        for e in iter_eqns(jaxpr)
        if e.primitive.name == "jit"
        and e.params["name"].startswith("lowtrain_dot_product_attention_")
        and (len(e.invars) == 3) == forward
    ]


def causal(q, k, v):
    return lowtrain.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "shape, kw",
    [
        ({}, {"is_causal": True}),
        ({}, {}),
        ({"s": 24, "kv_heads": 2}, {"is_causal": True, "scale": 0.3}),  # GQA, T < S
        pytest.param(  # rows past S: fully visible
            {"t": 24, "s": 12}, {"is_causal": True}, marks=pytest.mark.slow
        ),
    ],
)
def test_matches_jax_nn_forward_and_backward(shape, kw):
    q, k, v = qkv(**shape)
    ours = lambda *a: lowtrain.dot_product_attention(*a, **kw)
    ref = lambda *a: jax.nn.dot_product_attention(*a, **kw)
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), atol=2e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    g_ours = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ours, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_half_precision_runs_on_the_cpu():
    # JAX's own XLA attention asks for the F16_F16_F32 dot algorithm, which the CPU
    # rejects; ours computes the same: float32 logits and softmax.
    q, k, v = (x.astype(F16) for x in qkv())
    y = jax.jit(causal)(q, k, v)
    assert y.dtype == F16
    ref = causal(*(x.astype(F32) for x in (q, k, v)))
    np.testing.assert_allclose(y.astype(F32), ref, atol=3e-3)
    logits = [
        e for e in iter_eqns(make_jaxpr(causal)(q, k, v)) if e.primitive.name == "exp"
    ]
    assert logits and all(float_in_dtypes(e) == {F32} for e in logits)


def test_choose_implementation():
    assert choose_implementation(BF16, 64, None, cuda=True) == "cudnn"
    assert choose_implementation(F16, 128, None, cuda=True) == "cudnn"
    assert choose_implementation(F32, 64, None, cuda=True) == "xla"  # cuDNN: 16-bit
    assert choose_implementation(BF16, 12, None, cuda=True) == "xla"  # not 8k
    assert choose_implementation(BF16, 256, None, cuda=True) == "xla"  # > 128
    assert choose_implementation(BF16, 64, None, cuda=False) == "xla"
    assert choose_implementation(F32, 64, "cudnn", cuda=False) == "cudnn"  # asked
    assert choose_implementation(BF16, 64, None) == "xla"  # this CPU


def test_rejects_bad_arguments():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="Expected `implementation` None, 'xla'"):
        lowtrain.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match=r"Expected `key` of shape \(\.\.\., seq"):
        lowtrain.dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"Expected `query` of shape \(\.\.\., seq"):
        lowtrain.dot_product_attention(q[0, 0], k[0, 0], v[0, 0])


def test_any_leading_axes_and_vmap():
    q, k, v = qkv()
    batched = causal(q, k, v)
    # One sequence (what a per-example Equinox model passes), under `jax.vmap`.
    np.testing.assert_allclose(jax.vmap(causal)(q, k, v), batched, atol=1e-6)
    np.testing.assert_allclose(causal(q[1], k[1], v[1]), batched[1], atol=1e-6)
    # Two leading axes; and `amp` of a vmapped call (the op's jit batched by vmap).
    two = causal(*(x.reshape(1, *x.shape) for x in (q, k, v)))
    np.testing.assert_allclose(two[0], batched, atol=1e-6)
    half = lowtrain.amp(jax.vmap(causal), "bf16")(q, k, v)
    np.testing.assert_allclose(half, batched, atol=0.05)
    (call,) = attention_eqns(
        make_jaxpr(lowtrain.amp(jax.vmap(causal), "bf16"))(q, k, v)
    )
    assert float_in_dtypes(call) == {BF16}


@pytest.mark.parametrize("policy, half", [("bf16", BF16), ("fp16", F16), ("fp8", BF16)])
def test_amp_runs_it_whole_in_the_compute_dtype(policy, half):
    q, k, v = qkv()
    fn = lowtrain.amp(causal, policy)
    jaxpr = make_jaxpr(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), (0, 1, 2)))(
        q, k, v
    )
    (call,) = attention_eqns(jaxpr)
    assert float_in_dtypes(call) == {half}  # operands cast once, on entry
    inner = list(iter_eqns(call.params["jaxpr"]))
    # Placed as JAX's attention places it, not by the policy: float32 logits and
    # softmax, the probabilities in the compute dtype for the product with `value`.
    dots = [e for e in inner if e.primitive.name == "dot_general"]
    assert [e.outvars[0].aval.dtype for e in dots] == [F32, half]
    assert all(float_in_dtypes(e) == {F32} for e in inner if e.primitive.name == "exp")
    # The backward pass: JAX's derivative of that call, untouched (under "fp8" too:
    # no FP8 anywhere, attention stays in bfloat16 as in Transformer Engine).
    (split,) = attention_eqns(jaxpr, forward=False)
    dtypes = {v.aval.dtype for e in iter_eqns(jaxpr) for v in (*e.invars, *e.outvars)}
    assert not dtypes & {E4M3, E5M2}
    assert half in {v.aval.dtype for v in split.invars}


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_amp_numerics_against_float32(policy):
    q, k, v = qkv()
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    y, g = jax.value_and_grad(loss(lowtrain.amp(causal, policy)), (0, 1, 2))(q, k, v)
    y_ref, g_ref = jax.value_and_grad(loss(causal), (0, 1, 2))(q, k, v)
    tol = {"bf16": 0.05, "fp16": 0.006}[policy]  # bf16 has 8 bits, fp16 11
    np.testing.assert_allclose(y, y_ref, rtol=tol)
    for a, b in zip(g, g_ref):
        assert a.dtype == F32
        assert jnp.linalg.norm(a - b) / jnp.linalg.norm(b) < tol


def test_fp8_policy_backward_equals_bf16s():
    # Attention alone: the fp8 preset runs it as the bf16 one does, forward and
    # backward, bit for bit (its backward matmuls are not rewritten to FP8).
    q, k, v = qkv()
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    grads = {
        p: jax.grad(loss(lowtrain.amp(causal, p)), (0, 1, 2))(q, k, v)
        for p in ("bf16", "fp8")
    }
    for a, b in zip(grads["bf16"], grads["fp8"]):
        np.testing.assert_array_equal(a, b)


def test_policy_rules_and_amp_stop_place_it():
    q, k, v = qkv()
    f32 = lowtrain.get_policy("bf16").with_rules(dot_product_attention="float32")
    (call,) = attention_eqns(make_jaxpr(lowtrain.amp(causal, f32))(q, k, v))
    assert float_in_dtypes(call) == {F32}
    stopped = lowtrain.amp(lowtrain.amp_stop(causal), "fp16")
    (call,) = attention_eqns(make_jaxpr(stopped)(q, k, v))
    assert float_in_dtypes(call) == {F32}
    # float32 on the inputs as they came (`amp` casts where ops use them)
    np.testing.assert_allclose(stopped(q, k, v), causal(q, k, v), atol=1e-6)
    with pytest.raises(ValueError, match="The 'fp8' action applies to"):
        lowtrain.Policy(rules={"dot_product_attention": "fp8"})


def test_half_residuals():
    q, k, v = qkv()
    policy = lowtrain.get_policy("bf16").with_residuals("half")
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    g = jax.grad(loss(lowtrain.amp(causal, policy)), (0, 1, 2))(q, k, v)
    g_all = jax.grad(loss(lowtrain.amp(causal, "bf16")), (0, 1, 2))(q, k, v)
    for a, b in zip(g, g_all):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_recipe_gpt_fused_attention():
    config = _config.GPTConfig(2, 2, 16, 8, attention="fused")
    assert config.attention is _config.Attention.fused
    key = jax.random.key(0)
    fused = gpt.GPT(config, 16, key=key)
    plain = gpt.GPT(_config.GPTConfig(2, 2, 16, 8), 16, key=key)
    tokens = jax.random.randint(key, (3, 8), 0, 16)
    np.testing.assert_allclose(fused(tokens), plain(tokens), atol=1e-5)
    jaxpr = make_jaxpr(lowtrain.amp(fused, "bf16"))(tokens)
    assert len(attention_eqns(jaxpr)) == 1  # the one in the blocks' scan body
    with pytest.raises(ValueError, match="Expected `model.dropout` 0 with"):
        _config.GPTConfig(attention="fused", dropout=0.1)
    with pytest.raises(ValueError, match="Expected `model.attention` in"):
        _config.GPTConfig(attention="flash")


@pytest.mark.gpu
def test_cudnn_attention_under_amp():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("needs an NVIDIA GPU")
    q, k, v = qkv(t=128, s=128, size=64)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    step = jax.jit(jax.value_and_grad(loss(lowtrain.amp(causal, "bf16")), (0, 1, 2)))
    hlo = step.lower(q, k, v).compile().as_text()
    # cuDNN's fused attention, forward and backward (JAX's custom call targets)
    assert "__cudnn$fmhaSoftmax" in hlo and "__cudnn$fmhaSoftmaxBackward" in hlo
    y, g = step(q, k, v)
    y_ref, g_ref = jax.value_and_grad(loss(causal), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(y, y_ref, rtol=0.05)
    for a, b in zip(g, g_ref):
        assert jnp.linalg.norm(a - b) / jnp.linalg.norm(b) < 0.05


def test_scalify_traces_xla_attention_where_cudnn_would_run(monkeypatch):
    # As on an NVIDIA GPU: float16 operands would pick cuDNN's kernel, which scalify
    # has no scale rules for (nor the CPU a kernel). Under scalify the call traces
    # XLA's ops instead, forward and backward, and computes the float32 result.
    import lowtrain._attention as attention
    import lowtrain.scalify as sc

    monkeypatch.setattr(attention, "_on_cuda", lambda: True)
    assert choose_implementation(F16, 8, None) == "cudnn"
    q, k, v = qkv()
    loss = lambda q, k, v: jnp.sum(jnp.sin(causal(q, k, v).astype(F32)))
    step = jax.value_and_grad(loss, (0, 1, 2))
    half = [sc.as_scaled_array(x.astype(F16)) for x in (q, k, v)]
    y, g = sc.scalify(step)(*half)
    y_ref, g_ref = step(q, k, v)
    np.testing.assert_allclose(sc.asarray(y, F32), y_ref, rtol=2e-3)
    for a, b in zip(g, g_ref):
        assert sc.asarray(a, F16).dtype == F16
        a = sc.asarray(a, F32)
        assert jnp.linalg.norm(a - b) / jnp.linalg.norm(b) < 5e-3
    jaxpr = make_jaxpr(sc.scalify(step))(*half)
    prims = {e.primitive.name for e in iter_eqns(jaxpr)}
    assert "dot_general" in prims and not any("attention" in p for p in prims)
    with attention.xla_only():
        jaxpr = make_jaxpr(lambda *a: lowtrain.dot_product_attention(*a))(q, k, v)
    names = {e.params["name"] for e in attention_eqns(jaxpr)}
    assert {attention._CONFIGS[n].implementation for n in names} == {"xla"}
