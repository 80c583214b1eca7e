"""The model zoo: small models written the way their libraries' users write them,
for the zoo tests (tests/test_zoo.py) and `python scripts/bench.py zoo`.

`ZOO` maps a name to a builder, `build(key) -> (model, inputs, loss)`:

- `model`: what is trained, all float32: an Equinox module, a tuple of them, a Flax
  linen parameter dict, an NNX `nnx.State` of parameters, a dict of arrays;
- `inputs`: a tuple: data, labels, PRNG keys, model state (BatchNorm statistics);
- `loss(model, *inputs) -> (loss, aux)`: a float32 scalar and what the step hands
  to the next one (the new model state; None where there is none).

`eqx.filter_value_and_grad(loss, has_aux=True)(model, *inputs)` is a float32 step,
and `lowtrain.amp(loss, policy)` the same step in mixed precision. The code is
user code: it assumes JAX's standard dtype promotion (under the test suite's strict
promotion, call it inside `jax.numpy_dtype_promotion("standard")`).

The Equinox models follow Equinox's examples (`examples/` of its repository) shrunk
to a few thousand parameters: the MLP, the MNIST CNN, BatchNorm with SpectralNorm
(`stateful`), the GRU of `train_rnn`, a BERT layer, the MLP-Mixer and the U-Net of
score-based diffusion, the vision transformer, DCGAN; the neural ODE is diffrax's
example. Then a Flax linen CNN (`mutable=["batch_stats"]`, a dropout rng), a Flax
NNX CNN run the NNX way (`nnx.split` / `nnx.merge`), and a functional transformer
written with einops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import diffrax
import einops
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from flax import linen, nnx
from jax import lax


def _batched(model, axis_name="batch"):
    # Equinox's way to call a stateful per-example model on a batch: the state is
    # shared (not batched) and comes back once.
    return jax.vmap(model, axis_name=axis_name, in_axes=(0, None), out_axes=(0, None))


# -- train_mlp.py: an MLP regression --------------------------------------------------


def mlp(key):
    mkey, xkey = jr.split(key)
    model = eqx.nn.MLP(16, 4, 64, 2, key=mkey)
    x = jr.normal(xkey, (256, 16))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3], -x[:, 4]], 1)

    def loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return jnp.mean((y - pred_y) ** 2), None

    return model, (x, y), loss


# -- mnist.ipynb: the CNN -------------------------------------------------------------


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jr.split(key, 4)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top (12x12 images here, 28x28 in the example).
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(3 * 8 * 8, 64, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(64, 32, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(32, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x):  # (1, 12, 12) -> (10,) log-probabilities
        for layer in self.layers:
            x = layer(x)
        return x


def _cross_entropy(y, pred_y):
    # y are the true targets, pred_y the log-softmax'd predictions (the example's).
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


def cnn(key):
    mkey, xkey, ykey = jr.split(key, 3)
    model = CNN(mkey)
    x = jr.normal(xkey, (64, 1, 12, 12))
    y = jr.randint(ykey, (64,), 0, 10)

    def loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return _cross_entropy(y, pred_y), None

    return model, (x, y), loss


# -- stateful.ipynb: BatchNorm and SpectralNorm with `eqx.nn.State` --------------------


class StatefulModel(eqx.Module):
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2, key3, key4 = jr.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch", mode="batch")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
            weight_name="weight",
            key=key2,
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch", mode="batch")
        self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
        self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


def stateful(key):
    mkey, xkey = jr.split(key)
    model, state = eqx.nn.make_with_state(StatefulModel)(mkey)
    x = jr.normal(xkey, (128, 3))
    y = jnp.sin(x) + 1

    def loss(model, state, x, y):
        pred_y, state = _batched(model)(x, state)
        return jnp.mean((y - pred_y) ** 2), state

    return model, (state, x, y), loss


# -- train_rnn.ipynb: a GRU in `lax.scan` ----------------------------------------------


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jr.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):  # (time, in_size), one sequence
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def gru(key):
    mkey, tkey, ykey = jr.split(key, 3)
    model = RNN(in_size=2, out_size=1, hidden_size=32, key=mkey)
    # The example's data: points on clockwise or anticlockwise spirals.
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jr.uniform(tkey, (64, 1), minval=0, maxval=2 * math.pi)
    y = jr.bernoulli(ykey, 0.5, (64,)).astype(jnp.float32)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    x = jnp.stack([x1, jnp.where(y[:, None] > 0.5, x2, -x2)], axis=-1)

    def loss(model, x, y):
        pred_y = jax.vmap(model)(x)[:, 0]
        # binary cross-entropy
        return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y)), None

    return model, (x, y), loss


# -- bert.ipynb: a BERT encoder layer with dropout -------------------------------------


class EmbedderBlock(eqx.Module):
    token_embedder: eqx.nn.Embedding
    position_embedder: eqx.nn.Embedding
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, vocab_size, max_length, embedding_size, dropout_rate, key):
        token_key, position_key = jr.split(key)
        self.token_embedder = eqx.nn.Embedding(
            vocab_size, embedding_size, key=token_key
        )
        self.position_embedder = eqx.nn.Embedding(
            max_length, embedding_size, key=position_key
        )
        self.layernorm = eqx.nn.LayerNorm(shape=embedding_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, token_ids, position_ids, enable_dropout=False, key=None):
        tokens = jax.vmap(self.token_embedder)(token_ids)
        positions = jax.vmap(self.position_embedder)(position_ids)
        embedded_inputs = tokens + positions
        embedded_inputs = jax.vmap(self.layernorm)(embedded_inputs)
        return self.dropout(embedded_inputs, inference=not enable_dropout, key=key)


class FeedForwardBlock(eqx.Module):
    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, hidden_size, intermediate_size, dropout_rate, key):
        mlp_key, output_key = jr.split(key)
        self.mlp = eqx.nn.Linear(hidden_size, intermediate_size, key=mlp_key)
        self.output = eqx.nn.Linear(intermediate_size, hidden_size, key=output_key)
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, inputs, enable_dropout=True, key=None):  # one token
        hidden = jax.nn.gelu(self.mlp(inputs))
        output = self.output(hidden)
        output = self.dropout(output, inference=not enable_dropout, key=key)
        return self.layernorm(output + inputs)


class AttentionBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)

    def __init__(self, hidden_size, num_heads, dropout_rate, attention_dropout, key):
        self.num_heads = num_heads
        self.attention = eqx.nn.MultiheadAttention(
            num_heads=num_heads,
            query_size=hidden_size,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            dropout_p=attention_dropout,
            key=key,
        )
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, inputs, mask=None, enable_dropout=False, key=None):
        if mask is not None:
            mask = self.make_self_attention_mask(mask)
        attention_key, dropout_key = (None, None) if key is None else jr.split(key)
        attention_output = self.attention(
            query=inputs,
            key_=inputs,
            value=inputs,
            mask=mask,
            inference=not enable_dropout,
            key=attention_key,
        )
        result = self.dropout(
            attention_output, inference=not enable_dropout, key=dropout_key
        )
        result = result + inputs
        return jax.vmap(self.layernorm)(result)

    def make_self_attention_mask(self, mask):  # (seq,) -> (seq, seq), bool
        return jnp.expand_dims(mask, axis=-1) & jnp.expand_dims(mask, axis=-2)


class TransformerLayer(eqx.Module):
    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(self, hidden_size, intermediate_size, num_heads, dropout_rate, key):
        attention_key, ff_key = jr.split(key)
        self.attention_block = AttentionBlock(
            hidden_size, num_heads, dropout_rate, dropout_rate, attention_key
        )
        self.ff_block = FeedForwardBlock(
            hidden_size, intermediate_size, dropout_rate, ff_key
        )

    def __call__(self, inputs, mask=None, *, enable_dropout=False, key=None):
        attn_key, ff_key = (None, None) if key is None else jr.split(key)
        attention_output = self.attention_block(
            inputs, mask, enable_dropout=enable_dropout, key=attn_key
        )
        seq_len = inputs.shape[0]
        ff_keys = None if ff_key is None else jr.split(ff_key, num=seq_len)
        return jax.vmap(self.ff_block, in_axes=(0, None, 0))(
            attention_output, enable_dropout, ff_keys
        )


class BertClassifier(eqx.Module):
    embedder_block: EmbedderBlock
    layers: list[TransformerLayer]
    pooler: eqx.nn.Linear
    classifier_head: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, vocab_size, max_length, hidden_size, num_classes, *, key):
        embedder_key, layer_key, pooler_key, head_key = jr.split(key, 4)
        self.embedder_block = EmbedderBlock(
            vocab_size, max_length, hidden_size, 0.1, embedder_key
        )
        self.layers = [
            TransformerLayer(hidden_size, 2 * hidden_size, 4, 0.1, layer_key)
        ]
        self.pooler = eqx.nn.Linear(hidden_size, hidden_size, key=pooler_key)
        self.classifier_head = eqx.nn.Linear(hidden_size, num_classes, key=head_key)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, token_ids, mask, *, enable_dropout=False, key=None):
        emb_key, l_key, d_key = (None,) * 3 if key is None else jr.split(key, 3)
        position_ids = jnp.arange(token_ids.shape[-1])
        x = self.embedder_block(token_ids, position_ids, enable_dropout, key=emb_key)
        layer_keys = (None,) * len(self.layers) if key is None else jr.split(l_key, 1)
        for layer, layer_key in zip(self.layers, layer_keys):
            x = layer(x, mask, enable_dropout=enable_dropout, key=layer_key)
        # The first token's state, through the pooler, as BERT's classifier reads it.
        pooled = jnp.tanh(self.pooler(x[0]))
        pooled = self.dropout(pooled, inference=not enable_dropout, key=d_key)
        return self.classifier_head(pooled)


def bert(key):
    mkey, tkey, ykey, lkey, dkey = jr.split(key, 5)
    model = BertClassifier(32, 8, 32, 2, key=mkey)
    tokens = jr.randint(tkey, (8, 8), 0, 32)
    lengths = jr.randint(lkey, (8, 1), 4, 9)
    mask = jnp.arange(8) < lengths  # (batch, seq): padding masked out
    labels = jr.randint(ykey, (8,), 0, 2)

    def loss(model, tokens, mask, labels, key):
        keys = jr.split(key, tokens.shape[0])
        forward = functools.partial(model, enable_dropout=True)
        logits = jax.vmap(lambda t, m, k: forward(t, m, key=k))(tokens, mask, keys)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, labels
        ).mean(), None

    return model, (tokens, mask, labels, dkey), loss


# -- score_based_diffusion.ipynb: the MLP-Mixer with a time input, and its loss --------


class MixerBlock(eqx.Module):
    patch_mixer: eqx.nn.MLP
    hidden_mixer: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(
        self, num_patches, hidden_size, mix_patch_size, mix_hidden_size, *, key
    ):
        tkey, ckey = jr.split(key, 2)
        self.patch_mixer = eqx.nn.MLP(
            num_patches, num_patches, mix_patch_size, depth=1, key=tkey
        )
        self.hidden_mixer = eqx.nn.MLP(
            hidden_size, hidden_size, mix_hidden_size, depth=1, key=ckey
        )
        self.norm1 = eqx.nn.LayerNorm((hidden_size, num_patches))
        self.norm2 = eqx.nn.LayerNorm((num_patches, hidden_size))

    def __call__(self, y):
        y = y + jax.vmap(self.patch_mixer)(self.norm1(y))
        y = einops.rearrange(y, "c p -> p c")
        y = y + jax.vmap(self.hidden_mixer)(self.norm2(y))
        y = einops.rearrange(y, "p c -> c p")
        return y


class Mixer2d(eqx.Module):
    conv_in: eqx.nn.Conv2d
    conv_out: eqx.nn.ConvTranspose2d
    blocks: list
    norm: eqx.nn.LayerNorm
    t1: float

    def __init__(
        self,
        img_size,
        patch_size,
        hidden_size,
        mix_patch_size,
        mix_hidden_size,
        num_blocks,
        t1,
        *,
        key,
    ):
        input_size, height, width = img_size
        assert (height % patch_size) == 0
        assert (width % patch_size) == 0
        num_patches = (height // patch_size) * (width // patch_size)
        inkey, outkey, *bkeys = jr.split(key, 2 + num_blocks)

        self.conv_in = eqx.nn.Conv2d(
            input_size + 1, hidden_size, patch_size, stride=patch_size, key=inkey
        )
        self.conv_out = eqx.nn.ConvTranspose2d(
            hidden_size, input_size, patch_size, stride=patch_size, key=outkey
        )
        self.blocks = [
            MixerBlock(
                num_patches, hidden_size, mix_patch_size, mix_hidden_size, key=bkey
            )
            for bkey in bkeys
        ]
        self.norm = eqx.nn.LayerNorm((hidden_size, num_patches))
        self.t1 = t1

    def __call__(self, t, y, *, key=None):
        t = jnp.array(t / self.t1)
        _, height, width = y.shape
        t = einops.repeat(t, "-> 1 h w", h=height, w=width).astype(y.dtype)
        y = jnp.concatenate([y, t])
        y = self.conv_in(y)
        _, patch_height, patch_width = y.shape
        y = einops.rearrange(y, "c h w -> c (h w)")
        for block in self.blocks:
            y = block(y)
        y = self.norm(y)
        y = einops.rearrange(y, "c (h w) -> c h w", h=patch_height, w=patch_width)
        return self.conv_out(y)


def _single_loss_fn(model, weight, int_beta, data, t, key):
    noise_key, model_key = jr.split(key)
    mean = data * jnp.exp(-0.5 * int_beta(t))
    var = jnp.maximum(1 - jnp.exp(-int_beta(t)), 1e-5)
    std = jnp.sqrt(var)
    noise = jr.normal(noise_key, data.shape, data.dtype)
    # The model's inputs in the data's dtype, so it runs on half-precision data too.
    y = (mean + std * noise).astype(data.dtype)
    pred = model(t.astype(data.dtype), y, key=model_key)
    return weight(t) * jnp.mean((pred + noise / std) ** 2)


def _batch_loss_fn(model, data, key, t1=10.0):
    # The example's loss: denoising score matching with a linear noise schedule.
    int_beta = lambda t: t
    weight = lambda t: 1 - jnp.exp(-int_beta(t))
    batch_size = data.shape[0]
    tkey, losskey = jr.split(key)
    losskey = jr.split(losskey, batch_size)
    # Low-discrepancy sampling over t to reduce variance
    t = jr.uniform(tkey, (batch_size,), minval=0, maxval=t1 / batch_size)
    t = t + (t1 / batch_size) * jnp.arange(batch_size)
    loss_fn = functools.partial(_single_loss_fn, model, weight, int_beta)
    loss_fn = jax.vmap(loss_fn)
    return jnp.mean(loss_fn(data, t, losskey)), None


def _images(key, batch, channels, size):
    # Smooth images in [-1, 1], as the examples' normalised MNIST digits.
    xs = jnp.linspace(-1.0, 1.0, size)
    phase = jr.uniform(key, (batch, channels, 1, 1), minval=0, maxval=2 * math.pi)
    return jnp.tanh(2 * jnp.sin(3 * xs[:, None] + phase) * jnp.cos(2 * xs[None, :]))


def mixer(key):
    mkey, dkey, lkey = jr.split(key, 3)
    model = Mixer2d((1, 8, 8), 4, 16, 16, 16, num_blocks=1, t1=10.0, key=mkey)
    return model, (_images(dkey, 8, 1, 8), lkey), _batch_loss_fn


# -- unet.py: the score model's U-Net --------------------------------------------------


class SinusoidalPosEmb(eqx.Module):
    emb: jax.Array

    def __init__(self, dim):
        half_dim = dim // 2
        emb = math.log(10000) / (half_dim - 1)
        self.emb = jnp.exp(jnp.arange(half_dim) * -emb)

    def __call__(self, x):
        emb = x * self.emb
        return jnp.concatenate((jnp.sin(emb), jnp.cos(emb)), axis=-1)


class ResnetBlock(eqx.Module):
    dim_out: int
    up: bool
    down: bool
    mlp_layers: list
    scaling: eqx.nn.ConvTranspose2d | eqx.nn.Conv2d | None
    block1_groupnorm: eqx.nn.GroupNorm
    block1_conv: eqx.nn.Conv2d
    block2_layers: list
    res_conv: eqx.nn.Conv2d

    def __init__(self, dim_in, dim_out, up, down, *, time_emb_dim, key):
        keys = jr.split(key, 6)
        self.dim_out = dim_out
        self.up = up
        self.down = down
        self.mlp_layers = [
            jax.nn.silu,
            eqx.nn.Linear(time_emb_dim, dim_out, key=keys[0]),
        ]
        self.block1_groupnorm = eqx.nn.GroupNorm(min(dim_in // 4, 32), dim_in)
        self.block1_conv = eqx.nn.Conv2d(dim_in, dim_out, 3, padding=1, key=keys[1])
        self.block2_layers = [
            eqx.nn.GroupNorm(min(dim_out // 4, 32), dim_out),
            jax.nn.silu,
            eqx.nn.Conv2d(dim_out, dim_out, 3, padding=1, key=keys[2]),
        ]
        # Learned up- and downsampling without bias: the next convolution takes
        # their output as it comes.
        if up:
            self.scaling = eqx.nn.ConvTranspose2d(
                dim_in, dim_in, 4, stride=2, padding=1, use_bias=False, key=keys[3]
            )
        elif down:
            self.scaling = eqx.nn.Conv2d(
                dim_in, dim_in, 3, stride=2, padding=1, use_bias=False, key=keys[4]
            )
        else:
            self.scaling = None
        # A 1x1 convolution (DDPM's NIN), without bias.
        self.res_conv = eqx.nn.Conv2d(
            dim_in, dim_out, kernel_size=1, use_bias=False, key=keys[5]
        )

    def __call__(self, x, t):
        C, _, _ = x.shape
        h = jax.nn.silu(self.block1_groupnorm(x))
        if self.up or self.down:
            h = self.scaling(h)
            x = self.scaling(x)
        h = self.block1_conv(h)
        for layer in self.mlp_layers:
            t = layer(t)
        h = h + t[..., None, None]
        for layer in self.block2_layers:
            h = layer(h)
        if C != self.dim_out or self.up or self.down:
            x = self.res_conv(x)
        return (h + x) / jnp.sqrt(2)


class UNet(eqx.Module):
    time_pos_emb: SinusoidalPosEmb
    mlp: eqx.nn.MLP
    first_conv: eqx.nn.Conv2d
    down_res_blocks: list[ResnetBlock]
    mid_block: ResnetBlock
    ups_res_blocks: list[ResnetBlock]
    final_conv_layers: list

    def __init__(self, data_channels, hidden_size, *, key):
        keys = jr.split(key, 8)
        self.time_pos_emb = SinusoidalPosEmb(hidden_size)
        self.mlp = eqx.nn.MLP(
            hidden_size,
            hidden_size,
            4 * hidden_size,
            1,
            activation=jax.nn.silu,
            key=keys[0],
        )
        self.first_conv = eqx.nn.Conv2d(
            data_channels, hidden_size, kernel_size=3, padding=1, key=keys[1]
        )
        h = hidden_size
        block = functools.partial(ResnetBlock, time_emb_dim=hidden_size)
        # Two levels, 8x8 and 4x4, one block each (the example's `dim_mults`,
        # `num_res_blocks`, attention and dropout left out).
        self.down_res_blocks = [block(h, h, False, True, key=keys[2])]
        self.mid_block = block(h, h, False, False, key=keys[3])
        self.ups_res_blocks = [
            block(h + h, h, False, False, key=keys[4]),
            block(h, h, True, False, key=keys[5]),
            block(h + h, h, False, False, key=keys[6]),
        ]
        self.final_conv_layers = [
            eqx.nn.GroupNorm(min(hidden_size // 4, 32), hidden_size),
            jax.nn.silu,
            eqx.nn.Conv2d(hidden_size, data_channels, 1, key=keys[7]),
        ]

    def __call__(self, t, y, *, key=None):
        t = self.time_pos_emb(t)
        t = self.mlp(t)
        h = self.first_conv(y)
        hs = [h]
        for res_block in self.down_res_blocks:
            h = res_block(h, t)
            hs.append(h)
        h = self.mid_block(h, t)
        for res_block in self.ups_res_blocks:
            if res_block.up:
                h = res_block(h, t)
            else:
                h = res_block(jnp.concatenate((h, hs.pop()), axis=0), t)
        for layer in self.final_conv_layers:
            h = layer(h)
        return h


def unet(key):
    mkey, dkey, lkey = jr.split(key, 3)
    model = UNet(1, 8, key=mkey)
    return model, (_images(dkey, 4, 1, 8), lkey), _batch_loss_fn


# -- vision_transformer.ipynb: ViT with a convolutional patch embedding ----------------


class PatchEmbedding(eqx.Module):
    conv: eqx.nn.Conv2d

    def __init__(self, input_channels, output_shape, patch_size, key):
        self.conv = eqx.nn.Conv2d(
            input_channels, output_shape, patch_size, stride=patch_size, key=key
        )

    def __call__(self, x):  # (c, h, w) -> (patches, embedding)
        return einops.rearrange(self.conv(x), "e h w -> (h w) e")


class ViTBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, input_shape, hidden_dim, num_heads, dropout_rate, key):
        key1, key2, key3 = jr.split(key, 3)
        self.layer_norm1 = eqx.nn.LayerNorm(input_shape)
        self.layer_norm2 = eqx.nn.LayerNorm(input_shape)
        self.attention = eqx.nn.MultiheadAttention(num_heads, input_shape, key=key1)
        self.linear1 = eqx.nn.Linear(input_shape, hidden_dim, key=key2)
        self.linear2 = eqx.nn.Linear(hidden_dim, input_shape, key=key3)
        self.dropout1 = eqx.nn.Dropout(dropout_rate)
        self.dropout2 = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x, enable_dropout, key):
        input_x = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(input_x, input_x, input_x)
        input_x = jax.vmap(self.layer_norm2)(x)
        input_x = jax.vmap(self.linear1)(input_x)
        input_x = jax.nn.gelu(input_x)
        key1, key2 = jr.split(key, num=2)
        input_x = self.dropout1(input_x, inference=not enable_dropout, key=key1)
        input_x = jax.vmap(self.linear2)(input_x)
        input_x = self.dropout2(input_x, inference=not enable_dropout, key=key2)
        return x + input_x


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    positional_embedding: jax.Array
    cls_token: jax.Array
    attention_blocks: list[ViTBlock]
    dropout: eqx.nn.Dropout
    mlp: eqx.nn.Sequential
    num_layers: int

    def __init__(
        self,
        embedding_dim,
        channels,
        hidden_dim,
        num_heads,
        num_layers,
        dropout_rate,
        patch_size,
        num_patches,
        num_classes,
        key,
    ):
        key1, key2, key3, key4, key5 = jr.split(key, 5)
        self.patch_embedding = PatchEmbedding(channels, embedding_dim, patch_size, key1)
        self.positional_embedding = jr.normal(key2, (num_patches + 1, embedding_dim))
        self.cls_token = jr.normal(key3, (1, embedding_dim))
        self.num_layers = num_layers
        self.attention_blocks = [
            ViTBlock(embedding_dim, hidden_dim, num_heads, dropout_rate, k)
            for k in jr.split(key4, num_layers)
        ]
        self.dropout = eqx.nn.Dropout(dropout_rate)
        self.mlp = eqx.nn.Sequential(
            [
                eqx.nn.LayerNorm(embedding_dim),
                eqx.nn.Linear(embedding_dim, num_classes, key=key5),
            ]
        )

    def __call__(self, x, enable_dropout, key):
        x = self.patch_embedding(x)
        x = jnp.concatenate((self.cls_token, x), axis=0)
        x += self.positional_embedding[: x.shape[0]]
        dropout_key, *attention_keys = jr.split(key, num=self.num_layers + 1)
        x = self.dropout(x, inference=not enable_dropout, key=dropout_key)
        for block, attention_key in zip(self.attention_blocks, attention_keys):
            x = block(x, enable_dropout, key=attention_key)
        x = x[0]  # Select the CLS token.
        return self.mlp(x)


def vit(key):
    mkey, xkey, ykey, dkey = jr.split(key, 4)
    model = VisionTransformer(
        embedding_dim=16,
        channels=3,
        hidden_dim=32,
        num_heads=2,
        num_layers=1,
        dropout_rate=0.1,
        patch_size=4,
        num_patches=4,
        num_classes=10,
        key=mkey,
    )
    images = jr.normal(xkey, (8, 3, 8, 8))
    labels = jr.randint(ykey, (8,), 0, 10)

    def loss(model, images, labels, key):
        keys = jr.split(key, images.shape[0])
        logits = jax.vmap(model, in_axes=(0, None, 0))(images, True, keys)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, labels
        ).mean(), None

    return model, (images, labels, dkey), loss


# -- deep_convolutional_gan.ipynb: DCGAN, BatchNorm and PReLU --------------------------


class Generator(eqx.Module):
    layers: list

    def __init__(self, latent_size, width, channels, key):
        keys = jr.split(key, 3)
        ConvT = functools.partial(eqx.nn.ConvTranspose2d, kernel_size=4, use_bias=False)
        self.layers = [
            ConvT(latent_size, width * 2, stride=1, padding=0, key=keys[0]),  # 4x4
            eqx.nn.BatchNorm(width * 2, axis_name="batch", mode="batch"),
            jax.nn.relu,
            ConvT(width * 2, width, stride=2, padding=1, key=keys[1]),  # 8x8
            eqx.nn.BatchNorm(width, axis_name="batch", mode="batch"),
            jax.nn.relu,
            ConvT(width, channels, stride=2, padding=1, key=keys[2]),  # 16x16
            jax.nn.tanh,
        ]

    def __call__(self, x, state):
        for layer in self.layers:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state)
            else:
                x = layer(x)
        return x, state


class Discriminator(eqx.Module):
    layers: list

    def __init__(self, width, channels, key):
        keys = jr.split(key, 3)
        Conv = functools.partial(eqx.nn.Conv2d, kernel_size=4, use_bias=False)
        self.layers = [
            Conv(channels, width, stride=2, padding=1, key=keys[0]),  # 8x8
            eqx.nn.PReLU(0.2),
            Conv(width, width * 2, stride=2, padding=1, key=keys[1]),  # 4x4
            eqx.nn.BatchNorm(width * 2, axis_name="batch", mode="batch"),
            eqx.nn.PReLU(0.2),
            Conv(width * 2, 1, stride=1, padding=0, key=keys[2]),  # 1x1
        ]

    def __call__(self, x, state):
        for layer in self.layers:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state)
            else:
                x = layer(x)
        return x, state


def dcgan(key):
    gkey, dkey, nkey, xkey = jr.split(key, 4)
    latent_size = 8
    generator, g_state = eqx.nn.make_with_state(Generator)(latent_size, 8, 1, gkey)
    discriminator, d_state = eqx.nn.make_with_state(Discriminator)(8, 1, dkey)
    noise = jr.normal(nkey, (8, latent_size, 1, 1))
    real = _images(xkey, 8, 1, 16)

    def loss(models, states, noise, real):
        # The discriminator's loss and the generator's, in one step.
        generator, discriminator = models
        g_state, d_state = states
        fake, g_state = _batched(generator)(noise, g_state)
        pred_fake, d_state = _batched(discriminator)(fake, d_state)
        pred_real, d_state = _batched(discriminator)(real, d_state)
        ones, zeros = jnp.ones_like(pred_real), jnp.zeros_like(pred_fake)
        d_loss = (
            optax.sigmoid_binary_cross_entropy(pred_real, ones).mean()
            + optax.sigmoid_binary_cross_entropy(pred_fake, zeros).mean()
        )
        g_loss = optax.sigmoid_binary_cross_entropy(pred_fake, ones).mean()
        return d_loss + g_loss, (g_state, d_state)

    return (generator, discriminator), ((g_state, d_state), noise, real), loss


# -- diffrax's neural_ode example ------------------------------------------------------


class Func(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, data_size, width_size, depth, *, key):
        self.mlp = eqx.nn.MLP(
            in_size=data_size,
            out_size=data_size,
            width_size=width_size,
            depth=depth,
            activation=jax.nn.softplus,
            key=key,
        )

    def __call__(self, t, y, args):
        return self.mlp(y)


class NeuralODE(eqx.Module):
    func: Func
    adjoint: diffrax.AbstractAdjoint

    def __init__(self, data_size, width_size, depth, adjoint, *, key):
        self.func = Func(data_size, width_size, depth, key=key)
        self.adjoint = adjoint

    def __call__(self, ts, y0):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(self.func),
            diffrax.Tsit5(),
            t0=ts[0],
            t1=ts[-1],
            dt0=ts[1] - ts[0],  # constant steps (the example adapts them)
            y0=y0,
            # The final state (the example saves the whole trajectory): the
            # smallest program, as what amp transforms is diffrax's, not the model.
            saveat=diffrax.SaveAt(t1=True),
            adjoint=self.adjoint,
            max_steps=8,
        )
        return solution.ys[-1]


def _spirals(key, ts, batch):
    # The example's data: a damped linear ODE's trajectories from random points.
    y0 = jr.uniform(key, (batch, 2), minval=-0.6, maxval=1)
    matrix = jnp.array([[-0.1, 1.3], [-1, -0.1]])
    expm = jax.vmap(lambda t: jax.scipy.linalg.expm(t * matrix))(ts)  # (time, 2, 2)
    return jnp.einsum("tij,bj->bti", expm, y0)


def _neural_ode(key, adjoint):
    mkey, dkey = jr.split(key)
    ts = jnp.linspace(0, 2, 8)
    ys = _spirals(dkey, ts, 16)  # (batch, time, 2)
    model = NeuralODE(2, 16, 1, adjoint, key=mkey)

    def loss(model, ti, yi):
        y_pred = jax.vmap(model, in_axes=(None, 0))(ti, yi[:, 0])
        return jnp.mean((yi[:, -1] - y_pred) ** 2), None

    return model, (ts, ys), loss


neural_ode = functools.partial(
    _neural_ode, adjoint=diffrax.RecursiveCheckpointAdjoint()
)
neural_ode_backsolve = functools.partial(
    _neural_ode, adjoint=diffrax.BacksolveAdjoint()
)


# -- Flax linen: Conv + BatchNorm + Dropout, `mutable=["batch_stats"]` -----------------


class LinenCNN(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool):
        x = linen.Conv(8, (3, 3))(x)
        x = linen.BatchNorm(use_running_average=not train)(x)
        x = linen.relu(x)
        x = linen.avg_pool(x, (2, 2), strides=(2, 2))
        x = linen.Dropout(0.25, deterministic=not train)(x)
        x = x.reshape((x.shape[0], -1))
        x = linen.Dense(32)(x)
        x = linen.relu(x)
        return linen.Dense(10)(x)


def linen_cnn(key):
    pkey, xkey, ykey, dkey = jr.split(key, 4)
    module = LinenCNN()
    x = jr.normal(xkey, (16, 8, 8, 1))
    y = jr.randint(ykey, (16,), 0, 10)
    variables = module.init(pkey, x, train=False)

    def loss(params, batch_stats, x, y, key):
        logits, updates = module.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    return variables["params"], (variables["batch_stats"], x, y, dkey), loss


# -- Flax NNX: BatchNorm and Dropout, run with `nnx.split` / `nnx.merge` ---------------


class NNXCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.linear1 = nnx.Linear(8 * 4 * 4, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):  # (batch, 8, 8, 1)
        x = nnx.relu(self.bn(self.conv(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = self.dropout(x.reshape(x.shape[0], -1))
        x = nnx.relu(self.linear1(x))
        return self.linear2(x)


def nnx_cnn(key):
    pkey, dkey, xkey, ykey = jr.split(key, 4)
    model = NNXCNN(rngs=nnx.Rngs(params=pkey, dropout=dkey))
    model.train()  # BatchNorm on batch statistics, dropout on
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jr.normal(xkey, (16, 8, 8, 1))
    y = jr.randint(ykey, (16,), 0, 10)

    def loss(params, rest, x, y):
        # copy=True: new Variables, made under the trace that updates them (the
        # statistics and the rng count change inside `jax.grad`).
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        _, _, rest = nnx.split(model, nnx.Param, ...)
        return loss, rest  # new BatchNorm statistics and dropout rng counts

    return params, (rest, x, y), loss


# -- einops: a functional transformer block, parameters in a dict ----------------------


HEADS = 2


def _einops_init(key, dim=16, classes=4):
    k1, k2, k3, k4 = jr.split(key, 4)
    dense = lambda k, i, o: jr.normal(k, (i, o)) / math.sqrt(i)
    return {
        "w_in": dense(k1, 8, dim),
        "w_qkv": dense(k2, dim, 3 * dim),
        "w_out": dense(k3, dim, dim),
        "w_head": dense(k4, dim, classes),
        "ln_scale": jnp.ones(dim),
    }


def einops_transformer(params, x):  # (batch, tokens, 8) -> (batch, classes)
    h = x @ params["w_in"]
    qkv = einops.rearrange(
        h @ params["w_qkv"], "b n (three h d) -> three b h n d", three=3, h=HEADS
    )
    q, k, v = qkv[0], qkv[1], qkv[2]
    scores = jnp.einsum("bhnd,bhmd->bhnm", q, k) / math.sqrt(q.shape[-1])
    attended = jnp.einsum("bhnm,bhmd->bhnd", jax.nn.softmax(scores, axis=-1), v)
    h = h + einops.rearrange(attended, "b h n d -> b n (h d)") @ params["w_out"]
    h = (
        h
        * lax.rsqrt(jnp.mean(h**2, axis=-1, keepdims=True) + 1e-6)
        * params["ln_scale"]
    )
    pooled = einops.reduce(h, "b n c -> b c", "mean")
    return pooled @ params["w_head"]


def einops_model(key):
    pkey, xkey, ykey = jr.split(key, 3)
    params = _einops_init(pkey)
    x = jr.normal(xkey, (16, 6, 8))
    y = jr.randint(ykey, (16,), 0, 4)

    def loss(params, x, y):
        logits = einops_transformer(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), None

    return params, (x, y), loss


ZOO: dict[str, Callable] = {
    "mlp": mlp,
    "cnn": cnn,
    "stateful": stateful,
    "gru": gru,
    "bert": bert,
    "mixer": mixer,
    "unet": unet,
    "vit": vit,
    "dcgan": dcgan,
    "neural_ode": neural_ode,
    "neural_ode_backsolve": neural_ode_backsolve,
    "linen_cnn": linen_cnn,
    "nnx_cnn": nnx_cnn,
    "einops": einops_model,
}
"""Name -> `build(key) -> (model, inputs, loss)`; see the module docstring."""
