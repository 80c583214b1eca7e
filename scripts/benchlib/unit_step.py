"""The cost of unit scaling: a unit-scaled GPT train step against the same step
without the scales, at the same size, measured as a ratio in one process.

Two pairs, each the same model and the same optimizer step (`optax.adam`, the
value and gradient of the loss with respect to every float array, jitted with
`eqx.filter_jit`), float32, 4 layers, 4 heads, width 128, context 64, vocabulary 64,
batch 32 (the recipes' GPT sizes and batch), on one fixed random batch:

1. `unit_scale`: the recipes' standard GPT (`model=gpt`: GPT-2 style, learned
   positions, GELU, layer norms, the blocks under `lax.scan`) and its mean
   cross-entropy, as written (`plain`) and under the one-line transform
   `uu.unit_scale(loss)` (`unit`).
2. `modules`: the recipes' unit-scaled GPT (`model=gpt_unit`:
   `uu.TransformerDecoder`, RMS norms, SwiGLU MLPs, no position embedding, the
   layers unrolled) with `U.cross_entropy` (`unit`), against the same network
   written in plain JAX on the same weights (`plain`: the same matmuls, norms,
   attention and SwiGLU, residuals `x + f(x)`, softmax temperature
   `1 / sqrt(head_dim)`, `jax.nn.log_softmax` cross-entropy; no `scale_fwd` /
   `scale_bwd`).

The variants of both pairs alternate in rounds of 5 steps after warmup (so a slow
spell of the shared machine hits them alike); each time is the median over
`--steps` steps, and the ratio unit / plain is the cost of unit scaling (the
target: at most 1.05). The two models differ from each other (SwiGLU has 1.5x the MLP
weights of GELU), so only the ratio within a pair is a cost of unit scaling.

    python scripts/bench.py unit              # 200 timed steps per variant
    python scripts/bench.py unit --steps 40   # a quick look
    python scripts/bench.py unit --ablation   # the modules pair, one part at a time
    python scripts/bench.py unit --hlo        # the ablation's compiled steps, counted
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U
from lowtrain.unit_scaling.internal import next_stream_scale

from . import models, report, timing

ROUND = 5
BATCH = 32  # the recipes' trainer.batch_size
C = models.GPT_CONFIG  # 4 layers, 4 heads, width 128, context 64


def _rms_norm(x: jax.Array, eps: float = 1e-5) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)


def _plain_attention(mhsa: uu.MHSA, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    qkv = (x @ mhsa.linear_qkv.weight.T).reshape(b, t, 3, mhsa.heads, -1)
    q, k, v = jnp.swapaxes(jnp.moveaxis(qkv, 2, 0), -3, -2)  # (B, H, T, hd)
    logits = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    mask = jnp.tril(jnp.ones((t, t), bool))
    attn = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.swapaxes(attn @ v, 1, 2).reshape(b, t, d)  # (B, T, D)
    return out @ mhsa.linear_o.weight.T


def _plain_mlp(mlp: uu.MLP, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x @ mlp.linear_gate.weight.T)
    return (gate * (x @ mlp.linear_1.weight.T)) @ mlp.linear_2.weight.T


def _op_by_op_mlp(mlp: uu.MLP, x: jax.Array) -> jax.Array:
    # `uu.MLP` written op by op (`MLP(fold_scales=False)`, no `swiglu_mlp`).
    a, g = (
        U.linear(x, lin.weight, constraint=None)
        for lin in (mlp.linear_1, mlp.linear_gate)
    )
    return U.linear(U.silu_glu(a, g), mlp.linear_2.weight, constraint=None)


def plain_decoder_loss(model: uu.TransformerDecoder, x, y) -> jax.Array:
    """`model`'s network in plain JAX, without a single unit-scaling scale."""
    h = model.embedding.weight[x]  # (B, T, D)
    for layer in model.layers.layers:
        h = h + _plain_attention(layer.mhsa, _rms_norm(h))
        h = h + _plain_mlp(layer.mlp, _rms_norm(h))
    logits = _rms_norm(h) @ model.projection.weight.T  # (B, T, V)
    return models.cross_entropy(logits, y)


def ablation_loss(part: str):
    """`plain_decoder_loss` with one part of the unit-scaled model put back (`part`):
    `residual` (`U.residual_apply` with the model's `tau`s, each add normalised),
    `residual_jax` (the same forward `tau * f(x) / d + x / d` written in plain JAX,
    no `scale_fwd`/`scale_bwd`: its gradients are the true ones), `residual_stream`
    (`U.residual_apply(..., stream_scale=c)`, as `uu.TransformerDecoder` runs it:
    no factor on the stream), `norm` (`U.rms_norm`), `mhsa` and `mlp` (the `uu`
    modules), `mlp_ops` (the same MLP op by op: `U.linear`, `U.silu_glu`), `head`
    (`U.embedding`, the `LinearReadout`, `U.cross_entropy`)."""
    norm = U.rms_norm if part == "norm" else _rms_norm

    def residual(f, h, tau, c):
        if part == "residual":
            return U.residual_apply(f, h, tau)
        if part == "residual_stream":
            return U.residual_apply(f, h, tau, stream_scale=c)
        if part == "residual_jax":
            d = (1 + tau**2) ** 0.5
            return tau / d * f(h) + h / d
        return h + f(h)

    def layer_fn(layer, h, c):
        mhsa, mlp = layer.mhsa, layer.mlp
        attn = mhsa if part == "mhsa" else lambda z: _plain_attention(mhsa, z)
        ffn = {"mlp": mlp, "mlp_ops": lambda z: _op_by_op_mlp(mlp, z)}.get(
            part, lambda z: _plain_mlp(mlp, z)
        )
        h = residual(lambda z: attn(norm(z)), h, layer.mhsa_tau, c)
        c = next_stream_scale(c, layer.mhsa_tau)
        h = residual(lambda z: ffn(norm(z)), h, layer.mlp_tau, c)
        return h, next_stream_scale(c, layer.mlp_tau)

    def loss(model, x, y):
        table = model.embedding.weight
        h = U.embedding(x, table) if part == "head" else table[x]
        c = 1.0  # the stream's factor (`residual_stream` only)
        for layer in model.layers.layers:
            h, c = layer_fn(layer, h, c)
        if part == "head":
            return U.cross_entropy(model.projection(norm(h)), y)
        return models.cross_entropy(norm(h) @ model.projection.weight.T, y)

    return loss


ABLATION = (
    "residual",
    "residual_jax",
    "residual_stream",
    "norm",
    "mhsa",
    "mlp",
    "mlp_ops",
    "head",
)


def unit_decoder_loss(model: uu.TransformerDecoder, x, y) -> jax.Array:
    """The recipes' loss of `model=gpt_unit` (`UnitGptTrainer`)."""
    return U.cross_entropy(model(x), y)


def pairs(key: jax.Array) -> dict[str, tuple[eqx.Module, dict]]:
    """`{pair: (model, {"plain": loss, "unit": loss})}`."""
    k_std, k_unit, _ = jax.random.split(key, 3)
    standard = models.GPT(C, models.GPT_VOCAB, key=k_std)
    unit = uu.TransformerDecoder(
        C.n_embd, models.GPT_VOCAB, layers=C.n_layer, heads=C.n_head, key=k_unit
    )
    return {
        "unit_scale": (
            standard,
            {"plain": models.loss, "unit": uu.unit_scale(models.loss)},
        ),
        "modules": (unit, {"plain": plain_decoder_loss, "unit": unit_decoder_loss}),
    }


def _ablation_steps():
    """`(jitted steps of the plain twin, each ablation part and the unit-scaled
    decoder, their shared state)`."""
    unit, _ = pairs(jax.random.key(0))["modules"]
    losses = {"plain": plain_decoder_loss}
    losses.update({part: ablation_loss(part) for part in ABLATION})
    losses["unit"] = unit_decoder_loss
    optimizer = optax.adam(1e-3)
    state = (unit, optimizer.init(eqx.filter(unit, eqx.is_inexact_array)))
    fns = {k: eqx.filter_jit(timing.make_step(f, optimizer)) for k, f in losses.items()}
    return fns, state


def hlo_counts(batch) -> None:
    """What XLA compiled for each step of the ablation: the fusions of the optimized
    HLO's entry computation, and the multiplies of the whole module (inside fusions
    included), those on `(batch x context, MLP width)` activations apart."""
    fns, state = _ablation_steps()
    hidden = f"f32[{BATCH * C.block_size},{4 * C.n_embd}]"
    print("| step | fusions | multiplies | on " + hidden + " |")
    print("|---|---:|---:|---:|")
    for name, fn in fns.items():
        text = fn.lower(*state, *batch).compile().compiled.as_text()
        entry = text[text.index("\nENTRY") :]
        fusions = sum(" fusion(" in line for line in entry.splitlines())
        muls = [line for line in text.splitlines() if " multiply(" in line]
        on_hidden = sum(f"= {hidden}" in line for line in muls)
        print(f"| {name} | {fusions} | {len(muls)} | {on_hidden} |")


def ablation(steps: int, warmup: int, batch) -> None:
    """The `modules` pair taken apart: the plain twin with one unit-scaled part at a
    time, each against the plain twin, interleaved in one process."""
    fns, state = _ablation_steps()
    states = dict.fromkeys(fns, state)
    times, _ = timing.interleaved(
        fns, states, batch, steps=steps, round_len=ROUND, warmup=warmup
    )
    plain = timing.median_iqr(times["plain"])[0]
    print("| plain twin with | step (ms) | / plain twin |")
    print("|---|---:|---:|")
    for name, t in times.items():
        median, iqr = timing.median_iqr(t)
        ratio = median / plain
        print(f"| {name} | {1e3 * median:.2f} ± {5e2 * iqr:.2f} | **{ratio:.3f}** |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py unit", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="time the plain twin with one unit-scaled part at a time instead",
    )
    parser.add_argument(
        "--hlo",
        action="store_true",
        help="count the fusions and multiplies XLA compiles for each --ablation step",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"Machine: {report.machine()}", flush=True)
    stream = jax.random.randint(
        jax.random.key(1), (BATCH, C.block_size + 1), 0, models.GPT_VOCAB
    )
    batch = (stream[:, :-1], stream[:, 1:])
    if args.hlo:
        hlo_counts(batch)
        return
    if args.ablation:
        ablation(args.steps, args.warmup, batch)
        print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")
        return
    optimizer = optax.adam(1e-3)
    fns, states = {}, {}
    for pair, (model, losses) in pairs(jax.random.key(0)).items():
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        for variant, loss_fn in losses.items():
            step = timing.make_step(loss_fn, optimizer)
            fns[pair, variant] = eqx.filter_jit(step)
            states[pair, variant] = (model, opt_state)
    times, losses = timing.interleaved(
        fns, states, batch, steps=args.steps, round_len=ROUND, warmup=args.warmup
    )
    print(
        f"\n{args.steps} timed steps per variant in rounds of {ROUND} after "
        f"{args.warmup} warmup steps; float32, batch {BATCH}, "
        f"{C.n_layer} layers, width {C.n_embd}, {C.n_head} heads, context "
        f"{C.block_size}, vocabulary {models.GPT_VOCAB}.\n"
    )
    print(
        "| pair | plain step (ms) | unit-scaled step (ms) | unit / plain "
        "| per-round unit / plain (median, IQR) |"
    )
    print("|---|---:|---:|---:|---:|")
    for pair in ("unit_scale", "modules"):
        (p, p_iqr), (u, u_iqr) = (
            timing.median_iqr(times[pair, v]) for v in ("plain", "unit")
        )
        # Each round's unit time over the plain round just before it: a slow spell
        # of the machine that spans both cancels out.
        rounds = [
            sum(times[pair, "unit"][i : i + ROUND])
            / sum(times[pair, "plain"][i : i + ROUND])
            for i in range(0, len(times[pair, "unit"]), ROUND)
        ]
        r, r_iqr = timing.median_iqr(rounds)
        print(
            f"| {pair} | {1e3 * p:.2f} ± {5e2 * p_iqr:.2f} "
            f"| {1e3 * u:.2f} ± {5e2 * u_iqr:.2f} | **{u / p:.3f}** "
            f"| **{r:.3f}** ({r_iqr:.3f}) |"
        )
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")
