"""MNIST in any precision: an MLP 784-512-512-10 (or a small CNN) and its Trainer.

The worked example of subclassing `lowtrain.Trainer`: `MnistTrainer.loss` is the
whole of the training logic. The precision is not written anywhere here: the Trainer
runs `loss` on `lowtrain.amp(model, policy)`, so the model below computes in FP32,
BF16, FP16 or FP8 as the `precision` config says, and returns float32 logits.

    python -m lowtrain recipe=mnist_fp8               # the default
    python -m lowtrain recipe=mnist precision=bf16 model=cnn trainer.epochs=3

`MnistTask` is what `task=mnist` trains.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, UInt8

import lowtrain
import lowtrain.unit_scaling as uu
import lowtrain.unit_scaling.functional as U

from ._config import CNNConfig, Config, MLPConfig, MLPUnitConfig, MnistDataConfig
from ._layers import Conv2d, Linear, decay_mask
from ._mnist_data import digests, load_mnist
from ._task import Task, TaskData

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
    # A label outside [0, K) reads NaN (the gather's fill), which stops the run; a
    # negative one would otherwise wrap around to a class from the end.
    labels = jnp.where(labels < 0, logits.shape[1], labels)
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


class MnistTask(Task):
    """`task=mnist`: MNIST from the IDX files (`data=mnist`), the model `model=`
    names (`mlp`, `mlp_unit`, `cnn`), cross-entropy; the headline is the test
    accuracy. Subclass it to train your own model on MNIST (override `model` and
    `trainer`), as the "Your own task" guide does."""

    def data(self, config: Config) -> TaskData:
        if not isinstance(config.data, MnistDataConfig):
            raise ValueError(
                f"Expected data=mnist for the MNIST task, got "
                f"{type(config.data).__name__} instead."
            )
        arrays = load_mnist(config.data.path, config.data.cache_dir)
        t = config.trainer
        # Each process loads only its share of every global batch.
        share = {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
        }
        train_data = lowtrain.ArrayBatches(
            {"x": arrays["x_train"], "y": arrays["y_train"]},
            t.batch_size,
            seed=t.seed,
            **share,
        )
        n_test = len(arrays["y_test"])
        test_data = lowtrain.ArrayBatches(  # in order, every image
            {"x": arrays["x_test"], "y": arrays["y_test"]},
            min(t.eval_batch_size, n_test),
            shuffle=False,
            **share,
        )
        return TaskData(train_data, test_data, {"digests": digests(arrays)})

    def model(self, config: Config, *, key: PRNGKeyArray) -> eqx.Module:
        return build_model(config, key=key)

    def trainer_class(self, config: Config, model) -> type[lowtrain.Trainer]:
        if self.trainer is not None:  # a subclass's own
            return self.trainer
        return UnitMnistTrainer if isinstance(model, UnitMLP) else MnistTrainer

    def decay_mask(self, params):
        return decay_mask(params)

    def results(self, trainer, state, data: TaskData, config: Config, out) -> dict:
        test = trainer.run_evaluation(state, data.eval)
        train_data, test_data = data.train, data.eval
        return {
            "final": {"test_accuracy": test["accuracy"], "test_loss": test["loss"]},
            "steps": int(state.step),
            "epochs": int(state.step) / train_data.steps_per_epoch,
            "test_examples": _evaluated(test_data),
        }


def _evaluated(data: lowtrain.ArrayBatches) -> int:
    # The test images an evaluation sees, over all processes (a last partial batch
    # only on one process: see `ArrayBatches`).
    full = data.steps_per_epoch * data.batch_size
    return data.num_examples if data.process_count == 1 else full
