"""A character-level GPT in any precision: a nanoGPT-shaped decoder and its Trainer.

Token and position embeddings, pre-LayerNorm blocks (causal self-attention, GELU
MLP), a final LayerNorm and a head tied to the token embedding. The blocks' weights
are stacked and run under `lax.scan` (one block to trace and compile; `amp` reaches
inside the scan). As in `recipes/mnist.py`, the precision is the Trainer's business:
`loss` receives the model as the precision wraps it (`lowtrain.amp(model,
policy)`, ...).

    python -m lowtrain recipe=gpt_fp8
    python -m lowtrain recipe=gpt precision=fp16 data=text data.path=corpus.txt
"""

from __future__ import annotations

import hashlib
import math
import operator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jaxtyping import Array, Float, Int, PRNGKeyArray

import lowtrain
import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U
from lowtrain.train import gather_layer, logical_constraint, remat_layer

from ._config import (
    Attention,
    Config,
    CrossEntropy,
    GPTConfig,
    GPTUnitConfig,
    TextDataConfig,
)
from ._layers import LayerNorm, Linear, decay_mask
from ._task import Task, TaskData
from ._text_data import CharText, Crops, load_text

EVAL_SEED = 1234  # the same validation crops for every run, whatever its seed

# The logical axis names of the GPT's arrays (`Trainer(axis_names=...)`): with a
# mesh axis "tensor", Megatron's split: the attention's heads and the MLP's hidden
# units (the first matmul split by its columns, the second by its rows), and the
# vocabulary of the tied embedding; "embed" is split over the FSDP axis.
AXIS_NAMES = {
    r"wte$": ("vocab", "embed"),
    r"wpe$": (None, "embed"),
    r"qkv\.kernel$": ("embed", "heads"),
    r"qkv\.bias$": ("heads",),
    r"proj\.kernel$": ("heads", "embed"),
    r"fc\.kernel$": ("embed", "mlp"),
    r"fc\.bias$": ("mlp",),
    r"out\.kernel$": ("mlp", "embed"),
}


def _dropout(x: Array, rate: float, key: PRNGKeyArray | None) -> Array:
    """Inverted dropout: each entry of `x` zeroed with probability `rate`, the rest
    divided by `1 - rate`; `x` itself when `key` is None (evaluation) or `rate` is 0
    (then no op is added: the step is the one without dropout)."""
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


@jax.custom_vjp
def cross_entropy(logits: Float[Array, "*B V"], targets: Int[Array, "*B"]) -> Array:
    """The mean cross-entropy of `targets` under `logits`, without a float32 copy of
    the logits: each token's logsumexp and picked logit are reduced in float32 from
    the logits as they come (bfloat16 under `amp`), and the gradient,
    `(softmax - onehot) / n`, is computed in float32 and written in the logits'
    dtype within one elementwise pass. Only the logits (already the head's output)
    and one float32 number per token are saved for the backward pass. Equal to
    `-mean(log_softmax(logits.astype(float32))[targets])` up to float32 rounding.
    """
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    wide = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(wide, axis=-1)  # (*B,)
    picked = jnp.take_along_axis(wide, targets[..., None], -1)[..., 0]  # (*B,)
    return jnp.mean(lse - picked), (logits, lse, targets)


def _cross_entropy_bwd(res, g):
    logits, lse, targets = res
    p = jnp.exp(logits.astype(jnp.float32) - lse[..., None])  # softmax, (*B, V)
    vocab = lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    hit = vocab == targets[..., None]
    grad = jnp.where(hit, p - 1.0, p) * (g / lse.size)
    return grad.astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _split(key: PRNGKeyArray | None, n: int) -> list:
    """`n` keys from `key`, or `n` Nones."""
    return [None] * n if key is None else list(jax.random.split(key, n))


class Block(eqx.Module):
    """`x + attn(ln1(x))`, then `x + mlp(ln2(x))`: `(B, T, C) -> (B, T, C)`.

    With `dropout` > 0 and a `key`, nanoGPT's three dropouts: on the attention
    weights, and on the attention's and the MLP's outputs before the residual add.
    `model.attention=fused`: the attention is one `lowtrain.dot_product_attention`
    (cuDNN's kernel on a GPU in 16-bit; no dropout).
    """

    ln1: LayerNorm
    qkv: Linear
    proj: Linear
    ln2: LayerNorm
    fc: Linear
    out: Linear
    n_head: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    fused: bool = eqx.field(static=True)  # `lowtrain.dot_product_attention`

    def __init__(self, c: GPTConfig, *, key: PRNGKeyArray):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        d = c.n_embd
        # GPT-2's init: N(0, 0.02), and the projections into the residual stream
        # scaled by 1/sqrt(2 * n_layer) so the stream's variance does not grow.
        res = 0.02 / math.sqrt(2 * c.n_layer)
        self.ln1, self.ln2 = LayerNorm(d), LayerNorm(d)
        self.qkv = Linear(d, 3 * d, std=0.02, key=k1)
        self.proj = Linear(d, d, std=res, key=k2)
        self.fc = Linear(d, 4 * d, std=0.02, key=k3)
        self.out = Linear(4 * d, d, std=res, key=k4)
        self.n_head, self.dropout = c.n_head, c.dropout
        self.fused = c.attention is Attention.fused

    def attention(
        self, x: Float[Array, "B T C"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "B T C"]:
        b, t, c = x.shape
        hs = c // self.n_head
        heads = ("batch", None, "heads", None)  # each device its heads under TP
        q, k, v = (
            logical_constraint(a.reshape(b, t, self.n_head, hs), heads)  # (B,T,nh,hs)
            for a in jnp.split(self.qkv(x), 3, axis=-1)
        )
        if self.fused:  # one op; no dropout (checked by `GPTConfig`)
            y = lowtrain.dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.reshape(b, t, c))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hs)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), att.shape)
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)  # (B,nh,T,T)
        att = _dropout(att, self.dropout, key)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v)  # (B, T, nh, hs)
        y = logical_constraint(y, heads)
        return self.proj(y.reshape(b, t, c))

    def __call__(
        self, x: Float[Array, "B T C"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "B T C"]:
        k_att, k_res1, k_res2 = _split(key if self.dropout else None, 3)
        x = x + _dropout(self.attention(self.ln1(x), k_att), self.dropout, k_res1)
        h = logical_constraint(self.fc(self.ln2(x)), ("batch", None, "mlp"))
        h = self.out(jax.nn.gelu(h, approximate=False))
        return x + _dropout(h, self.dropout, k_res2)


class GPT(eqx.Module):
    """Next-character logits: `(B, T)` int tokens -> `(B, T, vocab)` float logits."""

    wte: Float[Array, "V C"]  # token embedding, also the output head (tied)
    wpe: Float[Array, "T C"]  # learned position embedding
    blocks: Block  # n_layer blocks, each array stacked on a leading axis
    ln_f: LayerNorm
    scan_layers: bool = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(self, c: GPTConfig, vocab: int, *, key: PRNGKeyArray):
        # `c` is checked when it is built (`GPTConfig.__post_init__`).
        k_tok, k_pos, k_blocks = jax.random.split(key, 3)
        self.wte = 0.02 * jax.random.normal(k_tok, (vocab, c.n_embd))
        self.wpe = 0.02 * jax.random.normal(k_pos, (c.block_size, c.n_embd))
        keys = jax.random.split(k_blocks, c.n_layer)
        self.blocks = eqx.filter_vmap(lambda k: Block(c, key=k))(keys)
        self.ln_f = LayerNorm(c.n_embd)
        self.scan_layers, self.dropout = c.scan_layers, c.dropout

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        *,
        key: PRNGKeyArray | None = None,
        targets: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T V"] | Float[Array, ""]:
        """The logits; `key` draws the dropout masks (None, or `dropout` 0: none).
        With `targets`, the mean cross-entropy of predicting them instead, computed
        inside the model (`cross_entropy`: under `amp` the logits stay in the
        compute dtype), as `model.cross_entropy=lean`'s Trainer calls it."""
        b, t = tokens.shape
        # Under FSDP, the arrays outside the blocks gathered here, each block's
        # where it runs (`gather_layer`): one block whole at a time.
        outer = gather_layer({"wte": self.wte, "wpe": self.wpe, "ln_f": self.ln_f})
        wte, wpe, ln_f = outer["wte"], outer["wpe"], outer["ln_f"]
        x = wte[tokens] + jnp.broadcast_to(wpe[:t], (b, t, wpe.shape[1]))
        params, static = eqx.partition(self.blocks, eqx.is_array)
        n_layer = jax.tree.leaves(params)[0].shape[0]
        if key is None or self.dropout == 0:  # no keys traced: the step without it
            layer_keys = None
        else:
            key, k_emb = jax.random.split(key)
            x = _dropout(x, self.dropout, k_emb)
            layer_keys = jax.random.split(key, n_layer)
        if self.scan_layers:
            x, _ = lax.scan(
                remat_layer(
                    lambda x, pk: (
                        eqx.combine(gather_layer(pk[0]), static)(x, key=pk[1]),
                        None,
                    )
                ),
                x,
                (params, layer_keys),
            )
        else:  # unrolled: each block traced and compiled on its own
            block = remat_layer(
                lambda p, x, k: eqx.combine(gather_layer(p), static)(x, key=k)
            )
            for i in range(n_layer):
                layer = jax.tree.map(operator.itemgetter(i), params)
                x = block(layer, x, None if layer_keys is None else layer_keys[i])
        logits = jnp.einsum("btc,vc->btv", ln_f(x), wte)  # (B, T, V)
        return logits if targets is None else cross_entropy(logits, targets)


class GptTrainer(lowtrain.Trainer):
    """Mean next-character cross-entropy (nats/char) over the batch and positions."""

    def loss(self, model, batch, *, key):
        logits = model(batch["x"], key=key).astype(jnp.float32)  # (B, T, V)
        logp = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(logp, batch["y"][..., None], -1)  # (B, T, 1)
        return -jnp.mean(picked)


class LeanGptTrainer(lowtrain.Trainer):
    """The same loss computed inside the model (`model.cross_entropy=lean`): no
    float32 logits for a large vocabulary (see `cross_entropy`)."""

    def loss(self, model, batch, *, key):
        return model(batch["x"], key=key, targets=batch["y"])


class UnitGptTrainer(lowtrain.Trainer):
    """The same loss for the unit-scaled GPT (`model=gpt_unit`): `U.cross_entropy`,
    the true mean value with a unit-scaled gradient."""

    def loss(self, model, batch, *, key):
        return U.cross_entropy(model(batch["x"]), batch["y"])


def build_model(m: GPTConfig | GPTUnitConfig, vocab: int, *, key):
    """The GPT `model=gpt` or `model=gpt_unit` describes, and its Trainer class.
    `vocab` is the data's vocabulary size; `model.vocab_size` pads it."""
    if isinstance(m, GPTConfig) and m.vocab_size is not None:
        if m.vocab_size < vocab:
            raise ValueError(
                f"Expected `model.vocab_size` >= the data's {vocab} tokens, got "
                f"{m.vocab_size} instead. Pass `model.vocab_size=null` to use the "
                "data's vocabulary."
            )
        vocab = m.vocab_size
    if isinstance(m, GPTUnitConfig):
        model = uu.TransformerDecoder(
            m.n_embd,
            vocab,
            layers=m.n_layer,
            heads=m.n_head,
            fold_mlp_scales=m.fold_mlp_scales,
            key=key,
        )
        return model, UnitGptTrainer
    lean = m.cross_entropy is CrossEntropy.lean
    return GPT(m, vocab, key=key), LeanGptTrainer if lean else GptTrainer


def generate(model, prompt: np.ndarray, length: int, *, key, temperature=0.8):
    """`length` characters sampled after `prompt` at `temperature` (the last
    `len(prompt)` characters are the context; one compiled forward per character)."""

    @eqx.filter_jit
    def step(model, ctx, key):
        logits = model(ctx[None])[0, -1].astype(jnp.float32)  # (V,)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

    ctx, out = jnp.asarray(prompt, jnp.int32), []
    for k in jax.random.split(key, length):
        nxt = step(model, ctx, k)
        out.append(int(nxt))
        ctx = jnp.concatenate([ctx[1:], nxt[None]])
    return np.array(out)


def _whole_on_one_device(x):
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_replicated:
        return x.addressable_data(0)
    whole = multihost_utils.process_allgather(x, tiled=True)  # a NumPy array
    return jax.device_put(whole, jax.local_devices()[0])


class GptTask(Task):
    """`task=gpt`: next-character prediction on a text (`data=shakespeare` or
    `data=text`), the GPT `model=gpt` or `model=gpt_unit` describes; the headline is
    the validation loss (nats/char); `sample.txt` is written at the end, and
    `mode=sample` samples a trained checkpoint."""

    def _chars(self, config: Config) -> tuple[str, CharText]:
        if not isinstance(config.data, TextDataConfig) or not isinstance(
            config.model, GPTConfig | GPTUnitConfig
        ):
            raise ValueError(
                "Expected model=gpt or model=gpt_unit and data=shakespeare or "
                f"data=text for the GPT task, got {type(config.model).__name__} and "
                f"{type(config.data).__name__} instead."
            )
        d = config.data
        text = load_text(d.path, d.cache_dir)
        return text, CharText(text, d.val_fraction)

    def data(self, config: Config) -> TaskData:
        d, t, m = config.data, config.trainer, config.model
        text, chars = self._chars(config)
        self.chars = chars
        fingerprint = {
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "vocabulary": chars.vocab,
        }
        share = (jax.process_index(), jax.process_count())  # each loads its share
        train_data = Crops(chars.train, t.batch_size, m.block_size, t.seed, share)
        val = Crops(chars.val, t.eval_batch_size, m.block_size, EVAL_SEED, share)
        eval_data = [val(i) for i in range(d.eval_batches)]
        return TaskData(train_data, eval_data, fingerprint)

    def model(self, config: Config, *, key: PRNGKeyArray):
        if not hasattr(self, "chars"):
            self.chars = self._chars(config)[1]
        model, self._trainer_class = build_model(
            config.model, len(self.chars.vocab), key=key
        )
        return model

    def trainer_class(self, config: Config, model) -> type[lowtrain.Trainer]:
        return self.trainer or self._trainer_class

    def decay_mask(self, params):
        return decay_mask(params)

    def axis_names(self, config: Config, model) -> dict | None:
        return AXIS_NAMES if isinstance(model, GPT) else None

    def results(self, trainer, state, data: TaskData, config: Config, out) -> dict:
        d, t, m = config.data, config.trainer, config.model
        val_loss = trainer.run_evaluation(state, data.eval)["loss"]
        # Gathered on every process (a split model's gather is collective),
        # sampled on the first.
        whole = self._whole_model(trainer, state.model)
        if jax.process_index() == 0:
            prompt = self.chars.val[: m.block_size]
            sample = self._generate(whole, prompt, 300, 0.8, t.seed)
            (out / "sample.txt").write_text(sample)
        return {
            "final": {"val_loss": val_loss},
            "steps": int(state.step),
            "vocab_size": len(self.chars.vocab),
            "train_characters": len(self.chars.train),
            "val_characters": len(self.chars.val),
            "val_tokens_evaluated": d.eval_batches * t.eval_batch_size * m.block_size,
        }

    def _whole_model(self, trainer, model):
        # The model as the precision exports it (plain values: under Scalify the
        # weights are ScaledArrays, which only `scalify` runs), whole on this
        # process's first device (a split array, FSDP's or tensor parallelism's,
        # gathered from every process: each process must call this).
        exported = trainer.precision.export(model)
        return jax.tree.map(_whole_on_one_device, exported)

    def _generate(self, whole, prompt, length, temperature, seed) -> str:
        sample = generate(
            whole, prompt, length, key=jax.random.key(seed), temperature=temperature
        )
        return self.chars.decode(prompt) + self.chars.decode(sample)

    def sample(self, trainer, model, config: Config, out) -> str:
        """`length` characters after `sample.prompt` (default: the first
        `block_size` characters of the validation text), at `sample.temperature`,
        seeded by `trainer.seed`."""
        s, m = config.sample, config.model
        if s.prompt is None:
            prompt = self.chars.val[: m.block_size]
        else:
            unknown = sorted(set(s.prompt) - set(self.chars.vocab))
            if unknown:
                raise ValueError(
                    f"Expected `sample.prompt` in the text's characters, got "
                    f"{''.join(unknown)!r}, which the model never saw. Remove them."
                )
            prompt = self.chars.encode(s.prompt)[-m.block_size :]
        shown = self.chars.decode(prompt)
        if len(prompt) < m.block_size:  # the context is a full block: pad it
            pad = self.chars.val[: m.block_size - len(prompt)]
            prompt = np.concatenate([pad, prompt])
        whole = self._whole_model(trainer, model)
        seed = config.trainer.seed
        text = self._generate(whole, prompt, s.length, s.temperature, seed)
        return shown + text[m.block_size :]
