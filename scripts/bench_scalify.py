"""Step time of a scalified training step against the plain step of the same dtype.

Both steps are the same Python function (forward, `jax.grad`, an optax update) jitted
with `eqx.filter_jit`; the scalified one runs under `lowtrain.scalify.scalify` on
float16 `ScaledArray` weights (float32 Adam moments), the plain one on float16 arrays.
Medians of interleaved rounds, in one process; the ratio is what we report.

    python scripts/bench_scalify.py            # ~2 minutes on 2 CPU cores
    python scripts/bench_scalify.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax

import lowtrain.scalify as sc

F16 = jnp.float16


def mlp(key):
    """784-512-512-10 weights, as a dict."""
    k1, k2, k3 = jax.random.split(key, 3)
    init = lambda k, n, m: jax.random.normal(k, (n, m)) / n**0.5
    return {"w1": init(k1, 784, 512), "w2": init(k2, 512, 512), "w3": init(k3, 512, 10)}


def mlp_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"])
    h = jax.nn.relu(h @ p["w2"])
    logp = jax.nn.log_softmax(h @ p["w3"])
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))


def gpt(key, vocab=65, d=128, layers=4, block=64):
    """A small decoder's weights: embeddings, stacked layers (run by `lax.scan`)."""
    ks = jax.random.split(key, 7)
    init = lambda k, *s: jax.random.normal(k, s) * 0.02
    return {
        "wte": init(ks[0], vocab, d),
        "wpe": init(ks[1], block, d),
        "layers": {
            "ln1": jnp.ones((layers, d)),
            "qkv": init(ks[2], layers, d, 3 * d),
            "proj": init(ks[3], layers, d, d),
            "ln2": jnp.ones((layers, d)),
            "fc": init(ks[4], layers, d, 4 * d),
            "out": init(ks[5], layers, 4 * d, d),
        },
        "head": init(ks[6], d, vocab),
    }


def _ln(x, g):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g


def gpt_loss(p, tokens, targets, heads=4):
    B, T = tokens.shape
    x = p["wte"][tokens] + p["wpe"][None, :T]  # (B, T, d)

    def block(x, w):
        d = x.shape[-1]
        q, k, v = jnp.split(_ln(x, w["ln1"]) @ w["qkv"], 3, axis=-1)
        q, k, v = (t.reshape(B, T, heads, d // heads) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
        mask = jnp.tril(jnp.ones((T, T), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, d)
        x = x + y @ w["proj"]
        return x + jax.nn.gelu(_ln(x, w["ln2"]) @ w["fc"]) @ w["out"], None

    x, _ = lax.scan(block, x, p["layers"])
    logp = jax.nn.log_softmax(x @ p["head"], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def make_step(loss_fn, opt):
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


def compare(name, params, loss_fn, batch, steps, rounds):
    """Median step times (plain float16, scalified float16) and their ratio."""
    opt = optax.adam(1e-3)
    step = make_step(loss_fn, opt)
    plain = jax.tree.map(lambda a: a.astype(F16), params)
    states = {
        "plain": (eqx.filter_jit(step), plain, opt.init(params)),
        "scalify": (
            eqx.filter_jit(sc.scalify(step)),
            sc.as_scaled_array(params, dtype=F16),
            sc.as_scaled_array(opt.init(params)),
        ),
    }
    times = {k: [] for k in states}
    for rnd in range(rounds + 1):
        for key, (fn, p, s) in states.items():
            for _ in range(steps):
                start = time.perf_counter()
                loss, p, s = fn(p, s, *batch)
                jax.block_until_ready((loss, p, s))
                if rnd:  # round 0 warms up (compiles)
                    times[key].append(time.perf_counter() - start)
            states[key] = (fn, p, s)
    plain_t, scal_t = (statistics.median(times[k]) for k in ("plain", "scalify"))
    return (
        f"| {name} | {len(times['plain'])} | {1e3 * plain_t:.2f} "
        f"| {1e3 * scal_t:.2f} | **{scal_t / plain_t:.2f}** |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    args = parser.parse_args()
    steps, rounds = (5, 2) if args.quick else (10, 4)
    key = jax.random.key(0)
    x = jax.random.normal(key, (128, 784)).astype(F16)
    y = jax.random.randint(key, (128,), 0, 10)
    tokens = jax.random.randint(key, (16, 65), 0, 65)
    rows = [
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind}",
        "",
        "| step | timed steps | plain f16 (ms) | scalify f16 (ms) | scalify / plain |",
        "|---|---:|---:|---:|---:|",
    ]
    with jax.numpy_dtype_promotion("standard"):
        rows.append(
            compare(
                "MLP 784-512-512-10, batch 128",
                mlp(key),
                mlp_loss,
                (x, y),
                steps,
                rounds,
            )
        )
        batch = (tokens[:, :-1], tokens[:, 1:])
        rows.append(
            compare(
                "GPT 4L d128, seq 64, batch 16",
                gpt(key),
                gpt_loss,
                batch,
                steps,
                rounds,
            )
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
