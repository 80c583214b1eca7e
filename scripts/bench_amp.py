"""Benchmark `lowtrain.amp` against the same mixed precision written by hand.

Everything runs in one process and is printed as markdown tables, which are the source
of truth for `docs/performance.md`:

1. Train-step time. A training step (`eqx.filter_value_and_grad` and an `optax.adam`
   update, jitted with `eqx.filter_jit`) whose loss is `lowtrain.amp(loss, policy)`,
   against the same step written by hand in the style of `jmp`: parameters and inputs
   cast to the compute dtype, matmuls in half precision, and layer norm, softmax,
   GELU and the cross-entropy upcast to float32 by hand and cast back before the next
   matmul, i.e. the placement the default AMP policy gives. Both compute the same
   loss (the table checks it), so the ratio measures what the transform costs. Models:
   an MLP (784-512-512-10, batch 128) and a 4-layer pre-LayerNorm transformer (d=128,
   4 heads, sequence 64, batch 16, vocabulary 64). Each time is the median over
   `--steps` steps after warmup; the two variants alternate in rounds of 5 steps
   (A, B, A, B, ...).
2. Trace and compile time of the same two steps: `eqx.filter_jit(step).lower(...)`
   (tracing, which includes the AMP re-interpretation, and lowering), then
   `.compile()`, from cold caches (`jax.clear_caches()` and fresh functions before
   each measurement); the median over 5 repetitions (1 with `--quick`).
3. Bytes of the residuals that reverse-mode differentiation saves for the backward pass
   of the transformer loss, for the float32 loss, `amp` under "fp16" and "bf16", and
   the hand-written half-precision losses. The residual set is that of
   `jax.ad_checkpoint.print_saved_residuals` (the totals are checked against its
   printed output), followed into jitted functions so that each residual is
   attributed to the primitive and `jax.named_scope` that produce it; then a breakdown
   of what stays in float32 under "fp16". Residuals are counted in the jaxpr, before
   XLA fuses or rematerialises anything; for comparison, the table also gives the
   temporary buffer size XLA reports for the compiled value and gradient
   (`memory_analysis()`; skipped with `--quick`).

Run it from the repository root:

    python scripts/bench_amp.py              # 200 timed steps per variant, ~3 minutes
    python scripts/bench_amp.py --quick      # 20 timed steps, under a minute
    python scripts/bench_amp.py --steps 500  # more steps for steadier medians
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from jax import ad_checkpoint
from jax.extend.core import Literal

import lowtrain

F32 = jnp.float32
HALF = {"fp16": jnp.dtype(jnp.float16), "bf16": jnp.dtype(jnp.bfloat16)}
MiB = 2**20
ROUND = 5  # steps per variant in each round of the interleaved timing


# --------------------------------------------------------------------------------------
# Models and losses
# --------------------------------------------------------------------------------------


# The label pick of the cross-entropy and the embedding lookup are written as one-hot
# products rather than gathers, so that no `scatter-add` (a gather's gradient) is
# involved: `lowtrain.amp` up to commit 978cde3 could not transform it (it took its
# `update_jaxpr` parameter for a sub-program), and the policy runs it in float32 where
# plain autodiff of the hand-written loss would run it in half precision.


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of `logits` (..., classes) against integer labels."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1])
    return -jnp.mean(jnp.sum(onehot * logp, axis=-1))


def mlp_loss(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """Cross-entropy of an MLP classifier on a batch, written in float32."""
    return cross_entropy(jax.vmap(model)(x), y)


class Block(eqx.Module):
    """A pre-LayerNorm transformer block: attention and a GELU MLP, both residual."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, d: int, heads: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.ln2 = eqx.nn.LayerNorm(d)
        self.mlp = eqx.nn.MLP(d, d, 4 * d, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the block to one sequence `x` of shape (seq, d)."""
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class Transformer(eqx.Module):
    """Token and position embeddings, pre-LN blocks, a final LN and a linear head."""

    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: tuple[Block, ...]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, d: int, heads: int, layers: int, seq: int, key: jax.Array
    ):
        keys = jax.random.split(key, layers + 3)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.pos = 0.02 * jax.random.normal(keys[1], (seq, d))
        self.blocks = tuple(Block(d, heads, k) for k in keys[3:])
        self.ln_f = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, vocab, key=keys[2])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (seq, vocab) for one sequence of token ids (seq,)."""
        vocab = self.embed.num_embeddings
        x = jax.nn.one_hot(tokens, vocab) @ self.embed.weight + self.pos
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def transformer_loss(model: Transformer, tokens: jax.Array, targets: jax.Array):
    """Next-token cross-entropy over a batch of sequences, written in float32."""
    return cross_entropy(jax.vmap(model)(tokens), targets)


# --------------------------------------------------------------------------------------
# The same losses with mixed precision written by hand (jmp style)
# --------------------------------------------------------------------------------------


def cast_floats(tree: Any, dtype) -> Any:
    """Cast every floating-point array of `tree` to `dtype`."""

    def cast(x):
        if eqx.is_inexact_array(x):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def hand_mlp_loss(half) -> Callable:
    """The MLP loss in mixed precision: Linear and ReLU in `half`, the loss in f32."""

    def loss(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
        model = cast_floats(model, half)
        logits = jax.vmap(model)(x.astype(half))
        return cross_entropy(logits.astype(F32), y)

    return loss


def _layer_norm_f32(ln: eqx.nn.LayerNorm, x: jax.Array) -> jax.Array:
    """`eqx.nn.LayerNorm` computed in float32 on a half-precision vector."""
    x = x.astype(F32)
    mean = jnp.mean(x, keepdims=True)
    var = jnp.maximum(0.0, jnp.var(x, keepdims=True))
    out = (x - mean) * jax.lax.rsqrt(var + ln.eps)
    return ln.weight.astype(F32) * out + ln.bias.astype(F32)


def _attention(attn: eqx.nn.MultiheadAttention, x: jax.Array, half) -> jax.Array:
    """Self-attention: projections in half, query scaling and softmax in float32."""
    seq = x.shape[0]

    def project(linear):
        return jax.vmap(linear)(x).reshape(seq, attn.num_heads, -1)

    def one_head(q, k, v):
        # `q / sqrt(d)` is a division, which the AMP policy runs in float32.
        q = (q.astype(F32) / math.sqrt(q.shape[-1])).astype(half)
        logits = jnp.einsum("sd,Sd->sS", q, k)
        weights = jax.nn.softmax(logits.astype(F32)).astype(half)
        return jnp.einsum("sS,Sd->sd", weights, v)

    q, k, v = project(attn.query_proj), project(attn.key_proj), project(attn.value_proj)
    out = jax.vmap(one_head, in_axes=1, out_axes=1)(q, k, v).reshape(seq, -1)
    return jax.vmap(attn.output_proj)(out)


def _mlp(mlp: eqx.nn.MLP, x: jax.Array, half) -> jax.Array:
    """The block's MLP on one vector: matmuls in half, GELU (tanh form) in float32."""
    (first, second) = mlp.layers
    h = jax.nn.gelu(first(x).astype(F32)).astype(half)
    return second(h)


def _hand_transformer(model: Transformer, tokens: jax.Array, half) -> jax.Array:
    """Float32 logits of one sequence; `model` holds half-precision parameters."""
    onehot = jax.nn.one_hot(tokens, model.embed.num_embeddings).astype(half)
    x = onehot @ model.embed.weight + model.pos
    for b in model.blocks:
        h = jax.vmap(_layer_norm_f32, in_axes=(None, 0))(b.ln1, x).astype(half)
        x = x + _attention(b.attn, h, half)
        h = jax.vmap(_layer_norm_f32, in_axes=(None, 0))(b.ln2, x).astype(half)
        x = x + jax.vmap(lambda v, b=b: _mlp(b.mlp, v, half))(h)
    h = jax.vmap(_layer_norm_f32, in_axes=(None, 0))(model.ln_f, x).astype(half)
    return jax.vmap(model.head)(h).astype(F32)


def hand_transformer_loss(half) -> Callable:
    """The transformer loss with mixed precision placed by hand."""

    def loss(model: Transformer, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        model = cast_floats(model, half)
        logits = jax.vmap(lambda t: _hand_transformer(model, t, half))(tokens)
        return cross_entropy(logits, targets)

    return loss


# --------------------------------------------------------------------------------------
# Benchmark cases and train steps
# --------------------------------------------------------------------------------------


@dataclass
class Case:
    """A model, its float32 loss, a hand-written mixed-precision loss, and a batch."""

    name: str
    model: eqx.Module
    loss: Callable
    hand_loss: Callable[[Any], Callable]
    batch: tuple[jax.Array, jax.Array]
    step_factor: int = 1  # times `--steps` timed steps (for cheap, noisy steps)


def make_cases() -> list[Case]:
    """The MLP and transformer benchmark cases, with their inputs on the device."""
    key_m, key_x, key_y, key_t, key_s = jax.random.split(jax.random.key(0), 5)
    mlp = eqx.nn.MLP(784, 10, 512, 2, activation=jax.nn.relu, key=key_m)
    x = jax.random.normal(key_x, (128, 784))
    y = jax.random.randint(key_y, (128,), 0, 10)
    vocab, seq = 64, 64
    tf = Transformer(vocab, d=128, heads=4, layers=4, seq=seq, key=key_t)
    stream = jax.random.randint(key_s, (16, seq + 1), 0, vocab)
    tokens, targets = stream[:, :-1], stream[:, 1:]
    return [
        Case(
            "MLP 784-512-512-10, batch 128",
            mlp,
            mlp_loss,
            hand_mlp_loss,
            (x, y),
            step_factor=5,
        ),
        Case(
            "Transformer 4L d128 h4, seq 64, batch 16",
            tf,
            transformer_loss,
            hand_transformer_loss,
            (tokens, targets),
        ),
    ]


def make_step(loss_fn: Callable, optimizer: optax.GradientTransformation):
    """A jitted train step: value and gradient of `loss_fn`, then an optimizer step."""

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def half_residuals(policy: str) -> lowtrain.Policy:
    """`policy` with `residuals="half"`: only compute-dtype values are saved."""
    p = lowtrain.get_policy(policy)
    return lowtrain.Policy(
        p.param_dtype, p.compute_dtype, p.output_dtype, residuals="half"
    )


def variant_losses(case: Case, policy: str) -> dict[str, Callable]:
    """The losses compared for `case` under `policy`: amp (saving all residuals, and
    saving only half-precision ones) and by hand."""
    return {
        "amp": lowtrain.amp(case.loss, policy),
        "amp_half": lowtrain.amp(case.loss, half_residuals(policy)),
        "hand": case.hand_loss(HALF[policy]),
    }


# --------------------------------------------------------------------------------------
# 1. Train-step time
# --------------------------------------------------------------------------------------


def time_steps(case: Case, policy: str, steps: int, round_len: int, warmup: int):
    """Median step time (seconds) and IQR of amp and hand, interleaved in rounds.

    Returns `{variant: (median, iqr)}` and the absolute difference of the two losses
    at the initial parameters (a check that both compute the same function).
    """
    optimizer = optax.adam(1e-3)
    losses = variant_losses(case, policy)
    states, fns = {}, {}
    for name, loss_fn in losses.items():
        fns[name] = make_step(loss_fn, optimizer)
        opt_state = optimizer.init(eqx.filter(case.model, eqx.is_inexact_array))
        states[name] = (case.model, opt_state)
    first = {}
    for name, fn in fns.items():
        for i in range(warmup):
            model, opt_state, loss = fn(*states[name], *case.batch)
            jax.block_until_ready((model, opt_state, loss))
            if i == 0:
                first[name] = float(loss)
            states[name] = (model, opt_state)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(math.ceil(steps / round_len)):
        for name, fn in fns.items():
            model, opt_state = states[name]
            for _ in range(round_len):
                start = time.perf_counter()
                out = fn(model, opt_state, *case.batch)
                jax.block_until_ready(out)
                times[name].append(time.perf_counter() - start)
                model, opt_state, _ = out
            states[name] = (model, opt_state)
    result = {}
    for name, ts in times.items():
        q1, _, q3 = statistics.quantiles(ts, n=4)
        result[name] = (statistics.median(ts), q3 - q1)
    return result, abs(first["amp"] - first["hand"])


def step_time_table(cases: list[Case], args) -> str:
    """Markdown table of train-step times, amp against hand, per model and dtype."""
    rows = [
        "| model | policy | timed steps | amp step (ms) | hand step (ms) | amp / hand "
        "| amp, residuals=half (ms) | half / hand "
        "| \\|loss(amp) − loss(hand)\\| |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        for policy in ("fp16", "bf16"):
            steps = args.steps * case.step_factor
            res, diff = time_steps(case, policy, steps, args.round, args.warmup)
            (a, a_iqr), (h, h_iqr) = res["amp"], res["hand"]
            r, r_iqr = res["amp_half"]
            rows.append(
                f"| {case.name} | {policy} | {steps} "
                f"| {1e3 * a:.2f} ± {5e2 * a_iqr:.2f} "
                f"| {1e3 * h:.2f} ± {5e2 * h_iqr:.2f} | **{a / h:.3f}** "
                f"| {1e3 * r:.2f} ± {5e2 * r_iqr:.2f} | **{r / h:.3f}** | {diff:.1e} |"
            )
            print(f"  timed {case.name} / {policy}: amp/hand = {a / h:.3f}", flush=True)
    return "\n".join(rows)


# --------------------------------------------------------------------------------------
# 2. Trace and compile time
# --------------------------------------------------------------------------------------


def time_compile(case: Case, policy: str, reps: int) -> dict[str, tuple[float, float]]:
    """Median (trace + lower, compile) seconds of the amp and hand steps, from cold."""
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(case.model, eqx.is_inexact_array))
    times: dict[str, list[tuple[float, float]]] = {"amp": [], "hand": []}
    for rep in range(reps):
        order = (
            ["amp", "hand"] if rep % 2 == 0 else ["hand", "amp"]
        )  # amp: residuals=all
        for name in order:
            jax.clear_caches()
            # Fresh functions too, so no tracing cache keyed on them can hit.
            loss_fn = variant_losses(case, policy)[name]
            step = make_step(loss_fn, optimizer)
            start = time.perf_counter()
            lowered = step.lower(case.model, opt_state, *case.batch)
            mid = time.perf_counter()
            lowered.compile()
            end = time.perf_counter()
            times[name].append((mid - start, end - mid))
    return {
        name: (
            statistics.median(t[0] for t in ts),
            statistics.median(t[1] for t in ts),
        )
        for name, ts in times.items()
    }


def compile_time_table(cases: list[Case], args) -> str:
    """Markdown table of trace+lower and compile times, amp against hand."""
    rows = [
        "| model | policy | amp trace+lower (s) | hand trace+lower (s) "
        "| amp compile (s) | hand compile (s) | trace+lower ratio | total ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        for policy in ("fp16", "bf16"):
            res = time_compile(case, policy, args.compile_reps)
            (al, ac), (hl, hc) = res["amp"], res["hand"]
            rows.append(
                f"| {case.name} | {policy} | {al:.2f} | {hl:.2f} | {ac:.2f} "
                f"| {hc:.2f} | {al / hl:.2f} | **{(al + ac) / (hl + hc):.2f}** |"
            )
            print(f"  compiled {case.name} / {policy}", flush=True)
    return "\n".join(rows)


# --------------------------------------------------------------------------------------
# 3. Residuals saved for the backward pass
# --------------------------------------------------------------------------------------


@dataclass
class Residual:
    """One residual: its type, what kind of value it is, and what produced it."""

    aval: Any
    kind: str  # "argument", "param cast", "activation", "literal" or "constant"
    producer: str  # primitive and `jax.named_scope` path, or the argument's name
    source: str  # source line of the producing equation

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.aval.shape) * np.dtype(self.aval.dtype).itemsize


def _summarize(source_info) -> str:
    """`file:line (function)` of an equation, as `print_saved_residuals` writes it."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover - private module moved
        return "?"
    text = source_info_util.summarize(source_info)
    return re.sub(r"^.*/(site-packages|lowtrain|scripts)/", r"\1/", text)


def _producers(jaxpr) -> dict:
    """Map each variable of `jaxpr` to `(equation, output index)` that defines it."""
    return {v: (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}


def _origin(atom, path: list) -> tuple:
    """Follow `atom` through `jit` boundaries to what defines it.

    `path` is a list of `(jaxpr, calling equation)` from the outermost jaxpr in.
    Returns `("eqn", eqn, path)`, `("argument", index, path)`, `("literal", ...)` or
    `("constant", ...)`.
    """
    jaxpr, call = path[-1]
    if isinstance(atom, Literal):
        return ("literal", None, path)
    found = _producers(jaxpr).get(atom)
    if found is not None:
        eqn, i = found
        if eqn.primitive.name == "jit":
            inner = eqn.params["jaxpr"].jaxpr
            return _origin(inner.outvars[i], [*path, (inner, eqn)])
        if eqn.primitive.name == "reduce_precision":  # as print_saved_residuals does
            return _origin(eqn.invars[0], path)
        return ("eqn", eqn, path)
    if atom in jaxpr.invars:
        index = jaxpr.invars.index(atom)
        if call is None:
            return ("argument", index, path)
        return _origin(call.invars[index], path[:-1])
    return ("constant", None, path)


def saved_residuals(f: Callable, *args) -> list[Residual]:
    """The residuals `jax.vjp(f, *args)` saves, attributed through jit boundaries.

    The residual set and order are those of `jax.ad_checkpoint.print_saved_residuals`,
    but a residual computed inside a jitted function (as all of `lowtrain.amp`'s are)
    is traced to the equation that computes it rather than reported as an "output of
    jitted function".
    """
    leaves, in_tree = jax.tree_util.tree_flatten_with_path(args)
    names = [jax.tree_util.keystr(p) for p, _ in leaves]

    def flat(*xs):
        return f(*jax.tree.unflatten(in_tree, xs))

    vjp = jax.make_jaxpr(lambda *xs: jax.vjp(flat, *xs), return_shape=True)
    closed, shapes = vjp(*[x for _, x in leaves])
    num_res = len(jax.tree.leaves(shapes[1]))
    top = closed.jaxpr
    residuals = []
    for var in top.outvars[len(top.outvars) - num_res :]:
        kind, eqn, path = _origin(var, [(top, None)])
        if kind == "argument":
            residuals.append(Residual(var.aval, kind, names[eqn], ""))
            continue
        if kind != "eqn":
            residuals.append(Residual(var.aval, kind, kind, ""))
            continue
        is_cast = eqn.primitive.name == "convert_element_type"
        if is_cast and _origin(eqn.invars[0], path)[0] == "argument":
            kind = "param cast"
        else:
            kind = "activation"
        producer = eqn.primitive.name
        jits = [call.params["name"] for _, call in path[1:]]
        if jits:
            producer += f" in {'/'.join(jits)}"
        scope = str(eqn.source_info.name_stack)
        if scope:
            producer += f" @ {scope}"
        residuals.append(
            Residual(var.aval, kind, producer, _summarize(eqn.source_info))
        )
    return residuals


def printed_residual_bytes(f: Callable, *args) -> int:
    """Total bytes of the residuals `jax.ad_checkpoint.print_saved_residuals` prints."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        ad_checkpoint.print_saved_residuals(f, *args)
    sizes = {"f64": 8, "f32": 4, "i32": 4, "u32": 4, "f16": 2, "bf16": 2, "bool": 1}
    total = 0
    for line in buffer.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\]", line)
        if m:
            shape = [int(d) for d in m.group(2).split(",") if d]
            total += math.prod(shape) * sizes.get(m.group(1), 4)
    return total


def _residual_fn(loss_fn: Callable, model: eqx.Module, batch) -> tuple[Callable, Any]:
    """`loss_fn` as a function of the model's float arrays only, and those arrays."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p: loss_fn(eqx.combine(p, static), *batch)), params


def _dtype_bytes(res: list[Residual], pred: Callable) -> int:
    """Total bytes of the residuals whose dtype satisfies `pred`."""
    return sum(r.nbytes for r in res if pred(np.dtype(r.aval.dtype)))


def _xla_temp_bytes(f: Callable, params: Any) -> int | None:
    """Bytes of temporary buffers XLA allocates for `jax.value_and_grad(f)(params)`."""
    compiled = jax.jit(jax.value_and_grad(f)).lower(params).compile()
    analysis = compiled.memory_analysis()
    return None if analysis is None else analysis.temp_size_in_bytes


def _summary_table(results: dict[str, list[Residual]], temps: dict) -> str:
    """Residual totals per variant, and their ratios to the float32 loss."""

    def totals(res):
        everything = sum(r.nbytes for r in res)
        no_args = sum(r.nbytes for r in res if r.kind != "argument")
        acts = sum(r.nbytes for r in res if r.kind not in ("argument", "param cast"))
        return everything, no_args, acts

    ref = totals(results["float32 loss"])
    rows = [
        "| variant | residuals | all (MiB) | excl. arguments (MiB) "
        "| activations only (MiB) | in f32 (MiB) | in f16/bf16 (MiB) "
        "| all / fp32 | excl. args / fp32 | activations / fp32 | XLA temp (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        t = totals(res)
        f32 = _dtype_bytes(res, lambda d: d == np.float32)
        half = _dtype_bytes(res, lambda d: d in (np.float16, jnp.bfloat16))
        temp = "–" if temps[name] is None else f"{temps[name] / MiB:.2f}"
        rows.append(
            f"| {name} | {len(res)} | {t[0] / MiB:.2f} | {t[1] / MiB:.2f} "
            f"| {t[2] / MiB:.2f} | {f32 / MiB:.2f} | {half / MiB:.2f} "
            f"| **{t[0] / ref[0]:.3f}** | **{t[1] / ref[1]:.3f}** "
            f"| {t[2] / ref[2]:.3f} | {temp} |"
        )
    return "\n".join(rows)


def _breakdown_tables(res: list[Residual], label: str) -> str:
    """Bytes of `res` by kind and dtype, and its ten largest float32 groups."""
    by_kind = collections.defaultdict(collections.Counter)
    for r in res:
        by_kind[r.kind][str(np.dtype(r.aval.dtype))] += r.nbytes
    dtypes = sorted({d for c in by_kind.values() for d in c})
    kind_rows = [
        f"| {label} residuals | " + " | ".join(f"{d} (MiB)" for d in dtypes) + " |",
        "|---|" + "---:|" * len(dtypes),
    ]
    for kind, counter in sorted(by_kind.items()):
        cells = " | ".join(f"{counter[d] / MiB:.2f}" for d in dtypes)
        kind_rows.append(f"| {kind} | {cells} |")

    groups = collections.defaultdict(list)
    for r in res:
        if np.dtype(r.aval.dtype) == np.float32:
            short = r.aval.str_short(short_dtypes=True)
            groups[(short, r.producer, r.source)].append(r)
    top = sorted(groups.items(), key=lambda kv: -sum(r.nbytes for r in kv[1]))[:10]
    f32_total = _dtype_bytes(res, lambda d: d == np.float32)
    sources = {source for (_, _, source), _ in top}
    # Under amp every equation carries the same source line (the transform's own):
    # then print it once below the table instead of in every row.
    one_source = len(sources) == 1
    top_rows = [
        "| count × residual | MiB | share of f32 "
        "| produced by (primitive in jit @ scope) "
        + ("|" if one_source else "| source line |"),
        "|---|---:|---:|---|" + ("" if one_source else "---|"),
    ]
    for (short, producer, source), rs in top:
        nbytes = sum(r.nbytes for r in rs)
        row = (
            f"| {len(rs)} × {short} | {nbytes / MiB:.2f} | {nbytes / f32_total:.0%} "
            f"| `{producer}` |"
        )
        top_rows.append(row if one_source else f"{row} `{source}` |")
    if one_source:
        top_rows.append(
            f"\nEvery one of these equations has the source line `{sources.pop()}`."
        )
    return "\n\n".join(
        [
            f"Residuals of {label} by kind and dtype:",
            "\n".join(kind_rows),
            f"The ten largest groups of float32 residuals of {label} "
            f"({f32_total / MiB:.2f} MiB in all):",
            "\n".join(top_rows),
        ]
    )


def residual_tables(case: Case, xla_memory: bool = True) -> str:
    """Markdown tables of residual bytes and of the float32 residuals under fp16.

    With `xla_memory`, also compile each variant's value-and-gradient to read the
    size of the temporary buffers XLA allocates for it.
    """
    variants = {
        "float32 loss": case.loss,
        "amp fp16": lowtrain.amp(case.loss, "fp16"),
        "amp bf16": lowtrain.amp(case.loss, "bf16"),
        "amp fp16, residuals=half": lowtrain.amp(case.loss, half_residuals("fp16")),
        "amp bf16, residuals=half": lowtrain.amp(case.loss, half_residuals("bf16")),
        "hand fp16": case.hand_loss(HALF["fp16"]),
        "hand bf16": case.hand_loss(HALF["bf16"]),
    }
    results, temps = {}, {}
    for name, loss_fn in variants.items():
        f, params = _residual_fn(loss_fn, case.model, case.batch)
        res = saved_residuals(f, params)
        total = sum(r.nbytes for r in res)
        printed = printed_residual_bytes(f, params)
        if printed != total:
            raise RuntimeError(
                f"{name}: {total} residual bytes, but print_saved_residuals lists "
                f"{printed}."
            )
        results[name] = res
        temps[name] = _xla_temp_bytes(f, params) if xla_memory else None
    return "\n\n".join(
        [
            _summary_table(results, temps),
            _breakdown_tables(results["amp fp16"], "`amp` under fp16"),
        ]
    )


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def machine() -> str:
    """A one-line description of the backend, CPU and library versions."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count()
    return (
        f"JAX backend {jax.default_backend()} ({jax.device_count()} device), "
        f"CPU {cpu} with {cores} cores; jax {jax.__version__}, "
        f"jaxlib {jaxlib.__version__}, equinox {eqx.__version__}, "
        f"optax {optax.__version__}, lowtrain {lowtrain.__version__}{_git()}, "
        f"Python {platform.python_version()}"
    )


def _git() -> str:
    """` (git <commit>[, modified])` of the lowtrain checkout, or "" outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(lowtrain.__file__)))
    try:
        run = functools.partial(
            subprocess.run, cwd=root, capture_output=True, text=True, check=True
        )
        commit = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--", "lowtrain"]).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f" (git {commit}{', lowtrain/ modified' if dirty.strip() else ''})"


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per variant, at least 20 (default 200; 20 with --quick); "
        "the MLP, whose steps are short and noisy, runs 5 times as many",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="20 timed steps and one cold compile per variant, no XLA memory "
        "analysis (under a minute)",
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 20 if args.quick else 200
    if args.steps < 20:
        parser.error("--steps must be at least 20")
    args.round = ROUND
    args.warmup = 2 if args.quick else 3
    args.compile_reps = 1 if args.quick else 5
    return args


def main() -> None:
    """Run the three measurements and print them as markdown."""
    args = parse_args()
    start = time.perf_counter()
    print(f"Machine: {machine()}", flush=True)
    print(
        f"Settings: {args.steps} timed steps per variant in rounds of {args.round} "
        f"(A, B, A, B, ...) after {args.warmup} warmup steps; "
        f"{args.compile_reps} cold compile(s) per variant.\n",
        flush=True,
    )
    cases = make_cases()
    step_table = step_time_table(cases, args)
    compile_table = compile_time_table(cases, args)
    residuals = residual_tables(cases[1], xla_memory=not args.quick)
    print("\n## Train-step time (median ± half IQR)\n")
    print(step_table)
    print("\n## Trace + compile time (cold caches, median)\n")
    print(compile_table)
    print(f"\n## Residuals saved for the backward pass: {cases[1].name}\n")
    print(residuals)
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
