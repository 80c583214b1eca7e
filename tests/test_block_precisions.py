"""The block-scaled precisions `mxfp8`, `fp8_block` and `nvfp4`: the "block" action of
`lowtrain.amp` (which operand is the weight, the formats each gets), its values and
gradients against `lowtrain.fp8.block_dot_general` and a hand-written VJP, NVFP4's
switches, and the Trainer and the CLI building the same precision."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowtrain
import lowtrain.fp8 as fp8
from lowtrain.fp8._block_dot import _rht

from .helpers import SGD, iter_eqns

NAMES = ["mxfp8", "fp8_block", "nvfp4"]
DN = (((1,), (0,)), ((), ()))
F32, BF16 = jnp.float32, jnp.bfloat16


class Dense(eqx.Module):
    kernel: jax.Array  # (in, out): the right operand, a parameter

    def __call__(self, x):  # (M, in) -> (M, out)
        return x @ self.kernel


class Net(eqx.Module):
    dense: Dense
    v: jax.Array  # (out,)

    def __call__(self, x):
        h = self.dense(x)  # weight matmul: (M, 256) @ (256, 128)
        scores = h @ h.T  # a product of two activations: no weight
        with jax.named_scope("head"):
            out = scores @ h  # (M, M) @ (M, 128): activations too
        return out @ self.v  # a matrix-vector product: not block-scaled


def _dense(key, k=256, n=128):
    return Dense(jax.random.normal(key, (k, n)) * 0.1)


def _quantized(jaxpr):
    # (input shape, scales shape) of every block quantization: a fake quantization
    # (the rounded values times their scales), whose blocks' shape is that of its
    # per-block finiteness check.
    found = []
    for e in iter_eqns(jaxpr):
        if e.primitive.name in ("pjit", "jit") and e.params["name"] == "_fake_quantize":
            inner = e.params["jaxpr"]
            (blocks,) = [
                q for q in iter_eqns(inner) if q.primitive.name == "reduce_and"
            ]
            found.append((e.invars[0].aval.shape, blocks.outvars[0].aval.shape))
    return found


def _scales(shape, fmt, axis):
    # The scales' shape of `shape` blocked along `axis` (a tile along the other).
    t, k = fmt.block
    out = list(shape)
    out[axis] = -(-shape[axis] // k)
    out[1 - axis] = -(-shape[1 - axis] // t)
    return tuple(out)


@pytest.mark.parametrize("name", NAMES)
def test_jaxpr_quantizes_each_matmul_by_its_role_and_nothing_else(name, getkey):
    recipe = fp8.block_recipe(name)
    net = Net(_dense(getkey()), jnp.ones(128))
    x = jax.random.normal(getkey(), (8, 256))
    found = _quantized(jax.make_jaxpr(lowtrain.amp(net, name))(x))
    act, w = recipe.activations, recipe.weights
    expected = [
        ((8, 256), _scales((8, 256), act, 1)),  # x: an activation
        ((256, 128), _scales((256, 128), w, 0)),  # the kernel: a weight
        ((8, 128), _scales((8, 128), act, 1)),  # h @ h.T: both activations
        ((128, 8), _scales((128, 8), act, 0)),
        ((8, 8), _scales((8, 8), act, 1)),  # scores @ h
        ((8, 128), _scales((8, 128), act, 0)),
    ]
    assert found == expected  # and none for the matrix-vector product
    assert _quantized(jax.make_jaxpr(lowtrain.amp(net, "bf16"))(x)) == []


def test_the_weight_of_an_equinox_linear_is_its_left_operand(getkey):
    # `eqx.nn.Linear` computes `weight @ x`: under `jax.vmap` the weight is the
    # left operand of the batched matmul, and gets the weights' 128x128 tiles.
    linear = eqx.nn.Linear(256, 128, use_bias=False, key=getkey())
    x = jax.random.normal(getkey(), (8, 256))
    y = jax.vmap(lowtrain.amp(linear, "fp8_block"))(x)
    dn = (((1,), (1,)), ((), ()))
    ref = jax.jit(
        fp8.block_dot_general,
        static_argnums=(2, 3),
        static_argnames=("rhs_format", "out_dtype"),
    )(linear.weight, x, dn, fp8.FP8_128X128, rhs_format=fp8.FP8_1X128, out_dtype=BF16)
    assert jnp.array_equal(y, ref.T.astype(F32))


@jax.jit
def _run(precision, dense, x, c):
    # The output and the VJP with cotangent `c` (kernel, x) of the model wrapped as
    # `precision` wraps it.
    y, pullback = jax.vjp(lambda d, x: precision.wrap_model(d)(x), dense, x)
    return y, *pullback(c)


def _by_hand(recipe, w, x, c):
    # The VJP of `x @ w` as the recipe's three GEMMs compute it: the cotangent `g`
    # (the float32 `c` through the bfloat16 product's cast) and the saved operands
    # quantized along each backward GEMM's contracting axis.
    g = c.astype(BF16).astype(F32)
    rounding = "stochastic" if recipe.stochastic else "nearest"
    fq = fp8.block_fake_quantize
    hp = jax.lax.Precision.HIGHEST
    dx = jnp.matmul(
        fq(g, recipe.grads, axis=1, rounding=rounding),
        fq(w, recipe.weights, axis=1, tile_axis=0).T,
        precision=hp,
    )
    if recipe.hadamard:  # rotated alike along M, the axis the wgrad GEMM contracts
        x, g = _rht(x, 0), _rht(g, 0)
    dw = jnp.matmul(
        fq(x, recipe.activations, axis=0, tile_axis=1).T,
        fq(g, recipe.grads, axis=0, rounding=rounding),
        precision=hp,
    )
    return dw, dx


@pytest.mark.parametrize("name", NAMES)
def test_value_is_block_dot_general_and_gradients_the_hand_written_vjp(name, getkey):
    recipe = fp8.block_recipe(name)
    dense, x = _dense(getkey()), jax.random.normal(getkey(), (32, 256))
    c = jax.random.normal(getkey(), (32, 128))
    y, g_dense, dx = _run(lowtrain.train.block_scaled(name), dense, x, c)

    @jax.jit
    def reference(w, x, c):
        r = recipe
        y = fp8.block_dot_general(
            x, w, DN, r.activations, rhs_format=r.weights, out_dtype=BF16
        )
        return y.astype(F32), *_by_hand(recipe, w, x, c)

    want_y, want_dw, want_dx = reference(dense.kernel, x, c)
    assert y.dtype == F32 and jnp.array_equal(y, want_y)  # bit for bit
    np.testing.assert_allclose(g_dense.kernel, want_dw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)


def _rotations(jaxpr):
    # The Hadamard transform: matmuls by a 16x16 matrix.
    return [
        e
        for e in iter_eqns(jaxpr)
        if e.primitive.name == "dot_general"
        and any(v.aval.shape[-2:] == (16, 16) for v in e.invars)
    ]


def _hashes(jaxpr):
    # Stochastic rounding without a key: the hash's shifts.
    return [e for e in iter_eqns(jaxpr) if e.primitive.name == "shift_right_logical"]


def test_each_nvfp4_switch_changes_what_it_names(getkey):
    dense, x = _dense(getkey()), jax.random.normal(getkey(), (32, 256))
    c = jax.random.normal(getkey(), (32, 128))
    full = lowtrain.train.block_scaled("nvfp4")
    base = fp8.block_recipe("nvfp4")
    _, dw, dx = _run(full, dense, x, c)

    def grad_jaxpr(precision):
        loss = lambda d, x: jnp.sum(precision.wrap_model(d)(x) * c)  # noqa: E731
        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(dense, x)

    assert len(_rotations(grad_jaxpr(full))) == 2 and _hashes(grad_jaxpr(full))

    # Hadamard off: the wgrad GEMM's inputs unrotated; the input gradient unchanged.
    off = lowtrain.train.block_scaled("nvfp4", hadamard=False)
    _, dw_off, dx_off = _run(off, dense, x, c)
    assert not _rotations(grad_jaxpr(off))
    assert jnp.array_equal(dx_off, dx) and not jnp.array_equal(dw_off.kernel, dw.kernel)
    want, _ = _by_hand(dataclasses.replace(base, hadamard=False), dense.kernel, x, c)
    np.testing.assert_allclose(dw_off.kernel, want, rtol=1e-5, atol=1e-5)

    # Stochastic rounding off: the cotangent to nearest (no hash), both gradients
    # the nearest-rounded VJP.
    sr_off = lowtrain.train.block_scaled("nvfp4", stochastic=False)
    _, dw_n, dx_n = _run(sr_off, dense, x, c)
    assert not _hashes(grad_jaxpr(sr_off))
    assert not jnp.array_equal(dx_n, dx)
    want_dw, want_dx = _by_hand(
        dataclasses.replace(base, stochastic=False), dense.kernel, x, c
    )
    np.testing.assert_allclose(dx_n, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw_n.kernel, want_dw, rtol=1e-5, atol=1e-5)

    # 2-D weight tiles off: the kernel in 1x16 blocks, the input as it was.
    fwd = lambda p: _quantized(jax.make_jaxpr(p.wrap_model(dense))(x))  # noqa: E731
    one_d = lowtrain.train.block_scaled("nvfp4", weight_2d=False)
    assert fwd(full)[1][1] == (16, 8) and fwd(one_d)[1][1] == (16, 128)
    assert fwd(full)[0] == fwd(one_d)[0]

    # `keep`: the matmuls in scope "head" in bfloat16, the others block-scaled.
    net = Net(dense, jnp.ones(128))
    xs = x[:8]
    kept = lowtrain.train.block_scaled("nvfp4", keep=["head"])
    assert len(_quantized(jax.make_jaxpr(kept.wrap_model(net))(xs))) == 4
    assert len(_quantized(jax.make_jaxpr(full.wrap_model(net))(xs))) == 6


@pytest.mark.parametrize("name", NAMES)
def test_an_equinox_mlp_trains_by_name_with_the_cli_precision(name, getkey):
    # `Trainer(precision=name)` builds what `python -m lowtrain precision=<name>`
    # builds (field for field), and a small MLP's loss goes down under it.
    from lowtrain.recipes import _common, _run

    from .test_recipes import make_config

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    mlp = eqx.nn.MLP(32, 2, 32, 1, key=getkey())
    x = jax.random.normal(getkey(), (32, 32))
    data = {"x": x, "y": x[:, :2] * 2.0}
    trainer = Fit(mlp, SGD(0.02), precision=name)
    config = _run.to_config(make_config("recipe=mnist", f"precision={name}"))
    assert eqx.tree_equal(
        _common.trainer_options(config)["precision"], trainer.precision
    )
    state = trainer.init(key=jax.random.key(0))
    losses = []
    for _ in range(6):
        state, metrics = trainer.compiled_step(trainer.shard_batch(data), state)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.8 * losses[0], losses
