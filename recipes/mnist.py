"""MNIST in any precision: an MLP 784-512-512-10 (or a small CNN) and its Trainer.

The worked example of subclassing `lowtrain.Trainer`: `MnistTrainer.loss` is the
whole of the training logic. The precision is not written anywhere here: the Trainer
runs `loss` on `lowtrain.amp(model, policy)`, so the model below computes in FP32,
BF16, FP16 or FP8 as the `precision` config says, and returns float32 logits.

    python -m lowtrain recipe=mnist_fp8               # the default
    python -m lowtrain recipe=mnist precision=bf16 model=cnn trainer.epochs=3
"""

from __future__ import annotations

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, UInt8
from omegaconf import DictConfig

import lowtrain
import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U

from . import _common
from ._config import CNNConfig, Config, MLPConfig, MLPUnitConfig, MnistDataConfig
from ._layers import Conv2d, Linear, decay_mask
from ._mnist_data import digests, load_mnist

MEAN, STD = 0.1307, 0.3081  # of the training pixels, scaled to [0, 1]


class MLP(eqx.Module):
    """ReLU MLP on flattened images: `(B, 784) -> (B, 10)` logits."""

    layers: tuple[Linear, ...]

    def __init__(self, hidden=(512, 512), *, key: PRNGKeyArray):
        sizes = (784, *hidden, 10)
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            # He init for layers feeding a ReLU; the logits layer 1/sqrt(fan_in).
            Linear(n, m, std=(2 / n) ** 0.5 if m != 10 else None, key=k)
            for n, m, k in zip(sizes[:-1], sizes[1:], keys)
        )

    def __call__(self, images: Float[Array, "B 28 28"]) -> Float[Array, "B 10"]:
        x = images.reshape(images.shape[0], 784)
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(eqx.Module):
    """Conv3x3-ReLU-MaxPool2 stages, then a ReLU MLP head: `(B, 28, 28) -> (B, 10)`."""

    convs: tuple[Conv2d, ...]
    head: tuple[Linear, Linear]

    def __init__(self, channels=(32, 64), hidden=128, *, key: PRNGKeyArray):
        keys = jax.random.split(key, len(channels) + 2)
        ins = (1, *channels[:-1])
        self.convs = tuple(Conv2d(i, o, key=k) for i, o, k in zip(ins, channels, keys))
        side = 28 // 2 ** len(channels)
        flat = side * side * channels[-1]
        self.head = (
            Linear(flat, hidden, std=(2 / flat) ** 0.5, key=keys[-2]),
            Linear(hidden, 10, key=keys[-1]),
        )

    def __call__(self, images: Float[Array, "B 28 28"]) -> Float[Array, "B 10"]:
        x = images[..., None]  # (B, 28, 28, 1): NHWC
        for conv in self.convs:
            x = jax.nn.relu(conv(x))
            b, h, w, c = x.shape  # 2x2 max-pool, floor like PyTorch's
            x = x[:, : h // 2 * 2, : w // 2 * 2]
            x = x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
        x = jax.nn.relu(self.head[0](x.reshape(x.shape[0], -1)))
        return self.head[1](x)


class UnitMLP(eqx.Module):
    """The MLP unit-scaled (`model=mlp_unit`): `uu.Linear` layers with `U.gelu`,
    then a `uu.LinearReadout`: `(B, 28, 28) -> (B, 10)` logits."""

    layers: tuple[uu.Linear, ...]
    readout: uu.LinearReadout

    def __init__(self, hidden=(512, 512), *, key: PRNGKeyArray):
        sizes = (784, *hidden)
        keys = jax.random.split(key, len(sizes))
        self.layers = tuple(
            uu.Linear(n, m, key=k) for n, m, k in zip(sizes[:-1], sizes[1:], keys)
        )
        self.readout = uu.LinearReadout(sizes[-1], 10, key=keys[-1])

    def __call__(self, images: Float[Array, "B 28 28"]) -> Float[Array, "B 10"]:
        x = images.reshape(images.shape[0], 784)
        for layer in self.layers:
            x = U.gelu(layer(x))
        return self.readout(x)


def build_model(config: Config, *, key: PRNGKeyArray) -> eqx.Module:
    m = config.model
    if isinstance(m, MLPConfig):
        return MLP(tuple(m.hidden), key=key)
    if isinstance(m, MLPUnitConfig):
        return UnitMLP(tuple(m.hidden), key=key)
    if isinstance(m, CNNConfig):
        return CNN(tuple(m.channels), m.hidden, key=key)
    raise ValueError(
        "Expected model=mlp, model=mlp_unit or model=cnn for MNIST, got "
        f"{type(m).__name__} instead."
    )


def cross_entropy(logits: Float[Array, "B K"], labels: Int[Array, " B"]):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


class MnistTrainer(lowtrain.Trainer):
    """Cross-entropy on uint8 images; logs the batch accuracy next to the loss."""

    cross_entropy = staticmethod(cross_entropy)

    def loss(self, model, batch, *, key):
        logits = model(normalize(batch["x"]))  # f32 logits, whatever the precision
        labels = batch["y"].astype(jnp.int32)
        accuracy = jnp.mean(jnp.argmax(logits, 1) == labels)
        return self.cross_entropy(logits, labels), {"accuracy": accuracy}

    def evaluate(self, model, batch):
        loss, aux = self.loss(model, batch, key=None)
        return {"loss": loss, "accuracy": aux["accuracy"]}


class UnitMnistTrainer(MnistTrainer):
    """For `model=mlp_unit`: `U.cross_entropy`, the same value with a unit-scaled
    gradient."""

    cross_entropy = staticmethod(U.cross_entropy)


def normalize(images: UInt8[Array, "B 28 28"]) -> Float[Array, "B 28 28"]:
    return (images.astype(jnp.float32) / 255 - MEAN) / STD


def train(config: Config, cfg: DictConfig, out: pathlib.Path) -> dict:
    """Train on MNIST as `config` says, writing to `out`; returns the results."""
    if not isinstance(config.data, MnistDataConfig):
        raise ValueError(
            f"Expected data=mnist for the MNIST recipe, got "
            f"{type(config.data).__name__} instead."
        )
    arrays = load_mnist(config.data.path, config.data.cache_dir)
    t = config.trainer
    # Each process loads only its share of every global batch.
    share = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    train_data = lowtrain.ArrayBatches(
        {"x": arrays["x_train"], "y": arrays["y_train"]},
        t.batch_size,
        seed=t.seed,
        **share,
    )
    n_test = len(arrays["y_test"])
    test_data = lowtrain.ArrayBatches(  # in order; all of it if the size divides
        {"x": arrays["x_test"], "y": arrays["y_test"]},
        min(t.eval_batch_size, n_test),
        shuffle=False,
        **share,
    )
    steps = _common.total_steps(config, train_data.steps_per_epoch)
    model_key, state_key = jax.random.split(jax.random.key(t.seed))
    model = build_model(config, key=model_key)
    trainer_class = UnitMnistTrainer if isinstance(model, UnitMLP) else MnistTrainer
    trainer = trainer_class(
        model,
        _common.optimizer(cfg, steps, decay_mask, model),
        **_common.trainer_options(config),
    )
    state = _common.fit(
        trainer,
        config,
        train_data,
        test_data,
        steps,
        out,
        key=state_key,
        cfg=cfg,
        data_fingerprint={"digests": digests(arrays)},
    )
    test = trainer.run_evaluation(state, test_data)
    return {
        "final": {"test_accuracy": test["accuracy"], "test_loss": test["loss"]},
        "steps": int(state.step),
        "epochs": int(state.step) / train_data.steps_per_epoch,
        "test_examples": test_data.steps_per_epoch * test_data.batch_size,
        "parameters": _common.count_parameters(model),
        "skipped_steps": int(state.skipped),
        "final_loss_scale": _common.final_loss_scale(state),
    }
