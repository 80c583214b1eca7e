"""The schemas of the `model` group: `model=mlp`, `cnn`, `gpt`, `gpt_unit`,
`mlp_unit` (see `_config.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ._checks import positive


@dataclass
class MLPConfig:
    hidden: list[int] = field(default_factory=lambda: [512, 512])

    def __post_init__(self):
        for i, width in enumerate(self.hidden):
            positive(width, f"model.hidden[{i}]")


@dataclass
class CNNConfig:
    channels: list[int] = field(default_factory=lambda: [32, 64])  # 3x3 conv + pool
    hidden: int = 128

    def __post_init__(self):
        for i, width in enumerate(self.channels):
            positive(width, f"model.channels[{i}]")
        if not 1 <= len(self.channels) <= 4:  # each stage halves the 28x28 image
            raise ValueError(
                f"Expected 1 to 4 `model.channels` (each conv stage halves the 28x28 "
                f"image), got {len(self.channels)} instead."
            )
        positive(self.hidden, "model.hidden")


class Attention(Enum):
    """How `model=gpt` computes attention (`model.attention`)."""

    # `jnp.einsum` and `jax.nn.softmax`, placed op by op by the precision: the
    # recipes' results in docs/results.md.
    einsum = "einsum"
    # `lowtrain.dot_product_attention`: one op, cuDNN's fused kernel on an NVIDIA GPU
    # in float16/bfloat16 (`amp` runs it whole in the compute dtype). No dropout on
    # the attention weights: `jax.nn.dot_product_attention` has none.
    fused = "fused"


class CrossEntropy(Enum):
    """How `model=gpt`'s loss is computed (`model.cross_entropy`)."""

    # The logits leave the model (in float32 under every precision) and the loss is
    # `log_softmax` in float32: the recipes' results in docs/results.md.
    float32 = "float32"
    # The loss is computed inside the model (`GPT.__call__(..., targets=)`), so the
    # logits stay in the compute dtype: reductions in float32 within one fusion, the
    # gradient written in the logits' dtype, and no float32 (batch, context, vocab)
    # tensor saved or written (`recipes.gpt.cross_entropy`). For large vocabularies.
    lean = "lean"


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64  # context length: the length of the training crops
    scan_layers: bool = True  # run the blocks under `lax.scan`: one block to compile
    # nanoGPT's dropout (embeddings, attention weights, residual branches) in
    # training; 0.0 adds no op, so the step is bit for bit the one without it.
    dropout: float = 0.0
    # None: the data's vocabulary; else the embedding's rows, at least the data's
    # (GPT-2's 50257 tokens padded to 50304, a multiple of 64, for the matmuls).
    vocab_size: int | None = None
    attention: Attention = Attention.einsum
    cross_entropy: CrossEntropy = CrossEntropy.float32

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            positive(getattr(self, name), f"model.{name}")
        if not 0 <= self.dropout < 1:
            raise ValueError(
                f"Expected `model.dropout` in [0, 1), got {self.dropout} instead."
            )
        names = [a.value for a in Attention]
        if self.attention not in (*Attention, *names):
            raise ValueError(
                f"Expected `model.attention` in {names}, got {self.attention!r} "
                "instead. Use `einsum` (op by op) or `fused` (one op: cuDNN's on a "
                "GPU)."
            )
        self.attention = Attention(self.attention)
        names = [c.value for c in CrossEntropy]
        if self.cross_entropy not in (*CrossEntropy, *names):
            raise ValueError(
                f"Expected `model.cross_entropy` in {names}, got "
                f"{self.cross_entropy!r} instead. Use `lean` for a large vocabulary "
                "(no float32 logits), `float32` for the recipes' results."
            )
        self.cross_entropy = CrossEntropy(self.cross_entropy)
        if self.attention is Attention.fused and self.dropout:
            raise ValueError(
                f"Expected `model.dropout` 0 with `model.attention=fused` (the fused "
                f"kernel has no dropout on the attention weights), got {self.dropout} "
                "instead. Set `model.dropout=0` or `model.attention=einsum`."
            )
        if self.vocab_size is not None:
            positive(self.vocab_size, "model.vocab_size")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"Expected `model.n_embd` divisible by `model.n_head`, got "
                f"{self.n_embd} and {self.n_head} instead."
            )


@dataclass
class GPTUnitConfig:
    """`model=gpt_unit`: `lowtrain.unit_scaling.TransformerDecoder` (unit-scaled, u-μP:
    no position embedding, RMS norms, SwiGLU MLPs, residual weights by depth)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64  # context length: the length of the training crops
    # `uu.MLP(fold_scales=...)`: the SwiGLU's backward constants on its weight and
    # input gradients (faster); false for float16 (`gpt_unit_fp16`), which overflows.
    fold_mlp_scales: bool = True

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            positive(getattr(self, name), f"model.{name}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"Expected `model.n_embd` divisible by `model.n_head`, got "
                f"{self.n_embd} and {self.n_head} instead."
            )


@dataclass
class MLPUnitConfig:
    """`model=mlp_unit`: a unit-scaled MLP (`uu.Linear`, `U.gelu`,
    `uu.LinearReadout`)."""

    hidden: list[int] = field(default_factory=lambda: [512, 512])

    def __post_init__(self):
        for i, width in enumerate(self.hidden):
            positive(width, f"model.hidden[{i}]")
