"""A user's own task, defined outside lowtrain: a small CNN with BatchNorm on MNIST,
written the way Equinox's docs write it (a per-example module with `eqx.nn.State`,
batched by `jax.vmap(..., axis_name="batch")`). It reuses the built-in MNIST data by
subclassing `MnistTask`, and trains from the CLI with every option of the recipes:

    PYTHONPATH=tests/user_task python -m lowtrain task=cnn_bn.CnnBnTask \\
        model=cnn_bn --config-dir tests/user_task/conf precision=fp8

`model=cnn_bn` is `conf/model/cnn_bn.yaml` of this folder: a group of the user's own,
with keys of their choosing (it reaches `model` below as a dict).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import lowtrain
from lowtrain.recipes import TaskData
from lowtrain.recipes.mnist import MnistTask, normalize


class CnnBn(eqx.Module):
    """Conv-BatchNorm-ReLU-pool twice, then a linear head: one image `(28, 28)` to
    10 logits, with the BatchNorm statistics in `state`."""

    convs: tuple[eqx.nn.Conv2d, ...]
    norms: tuple[eqx.nn.BatchNorm, ...]
    head: eqx.nn.Linear

    def __init__(self, channels=(8, 16), *, key):
        keys = jax.random.split(key, len(channels) + 1)
        ins = (1, *channels[:-1])
        self.convs = tuple(
            eqx.nn.Conv2d(i, o, 3, padding=1, key=k)
            for i, o, k in zip(ins, channels, keys)
        )
        self.norms = tuple(
            eqx.nn.BatchNorm(c, axis_name="batch", mode="ema") for c in channels
        )
        side = 28 // 2 ** len(channels)
        self.head = eqx.nn.Linear(side * side * channels[-1], 10, key=keys[-1])

    def __call__(self, image, state):
        x = image[None]  # (1, 28, 28): channels first, as eqx.nn.Conv2d expects
        for conv, norm in zip(self.convs, self.norms):
            x, state = norm(conv(x), state)
            c, h, w = x.shape
            x = jax.nn.relu(x).reshape(c, h // 2, 2, w // 2, 2).max(axis=(2, 4))
        return self.head(x.reshape(-1)), state


class CnnBnTrainer(lowtrain.Trainer):
    def loss(self, model, batch, *, key, state):
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        logits, state = batched(normalize(batch["x"]), state)
        logits = logits.astype(jnp.float32)
        labels = batch["y"].astype(jnp.int32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return loss, {"accuracy": accuracy}, state


class CnnBnTask(MnistTask):
    trainer = CnnBnTrainer

    def model(self, config, *, key):
        channels = tuple(config.model["channels"])
        return eqx.nn.make_with_state(CnnBn)(channels, key=key)

    def data(self, config):
        # The built-in MNIST data, its test set cut to `model.eval_examples` images
        # (a quick eval for early stopping).
        data = super().data(config)
        n = config.model["eval_examples"]
        arrays = jax.tree.map(lambda x: x[:n], data.eval.arrays)
        test = lowtrain.ArrayBatches(arrays, min(n, 500), shuffle=False)
        return TaskData(data.train, test, data.fingerprint)

    def results(self, trainer, state, data, config, out):
        test = trainer.run_evaluation(state, data.eval)
        return {"final": {"eval_accuracy": test["accuracy"], "eval_loss": test["loss"]}}
