"""The steps `scripts/bench.py` times, built as `python -m lowtrain` builds them, and
what it computes about them: FLOPs, the device's peak, memory, FP8 GEMMs.

A `Case` is one model size in one precision: its config composed from the recipe
(`recipe=gpt_<precision>`, `model=gpt_small` for the GPU-size GPT), its Trainer built
by the recipe's own code (`recipes.gpt.build_model`, `recipes._common.optimizer` and
`trainer_options`, so the `precision` configs' factories in `recipes/precisions.py`),
and its hand-cast twin where `benchlib.models` has one (fp32: the plain float32 loss;
bf16, fp16: `hand_gpt_loss`, mixed precision placed by hand, jmp/mpx style; fp8: the
same with each matmul a `lowtrain.fp8.fp8_dot_general` called by hand; unit_fp32: the
unit-scaled model's own float32 loss; unit_bf16, unit_fp16, unit_fp8: the unit-scaled
model with its casts written by hand, `benchlib.unit_twin`). scalify_fp8 and
fp8_delayed (`recipe=gpt_fp8_delayed`: the fp8 policy, the Linear layers' FP8
scaled from the amax history of earlier steps) have none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import numpy as np
from hydra import compose, initialize_config_module

from lowtrain.recipes import gpt
from lowtrain.recipes import internal as recipes
from lowtrain.recipes.internal import CrossEntropy, decay_mask
from lowtrain.train import async_filter_jit

from . import models, timing, unit_twin

# Precision name -> the recipe that trains the char-GPT in it.
RECIPES = {
    "fp32": "gpt_fp32",
    "bf16": "gpt_bf16",
    "fp16": "gpt_fp16",
    "fp8": "gpt_fp8",
    "fp8_delayed": "gpt_fp8_delayed",
    "scalify_fp8": "gpt_scalify_fp8",
    # Block-scaled, simulated (`lowtrain.train.block_scaled`).
    "mxfp8": "gpt_mxfp8",
    "fp8_block": "gpt_fp8_block",
    "nvfp4": "gpt_nvfp4",
    "unit_fp32": "gpt_unit_fp32",
    "unit_bf16": "gpt_unit_bf16",
    "unit_fp16": "gpt_unit_fp16",
    "unit_fp8": "gpt_unit_fp8",
}
# The dtype whose peak bounds each precision's matmuls. fp32 runs at JAX's default
# matmul precision, which on A100/H100/H200 is TF32 for float32 dots. unit_fp8's
# matmuls are FP8 GEMMs with static scale 1 (the readout bf16).
PEAK_DTYPE = {
    "fp32": "tf32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8": "fp8",
    "fp8_delayed": "fp8",
    "scalify_fp8": "fp8",
    # Simulated: quantised, dequantised, multiplied in bf16 GEMMs.
    "mxfp8": "bf16",
    "fp8_block": "bf16",
    "nvfp4": "bf16",
    "unit_fp32": "tf32",
    "unit_bf16": "bf16",
    "unit_fp16": "fp16",
    "unit_fp8": "fp8",
}
# Dense tensor-core peaks in TFLOP/s (no sparsity), from NVIDIA's data sheets.
PEAKS = {
    "H100 SXM": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H200": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "A100": {"tf32": 156.0, "bf16": 312.0, "fp16": 312.0},  # no FP8 units
}
# The model sizes: config overrides, and the vocabulary of the synthetic tokens.
# `quick` is a tiny GPT for the test suite.
SIZES = {
    "gpt": ([], 65),  # the recipes' char-GPT; 65 characters in Shakespeare
    # Batch 16: at 32 x 1024 tokens the float32 step holds about 91 GiB (XLA's memory
    # analysis), more than an 80 GB H100 has.
    # Batch 32 at GPT-2 small's shape (llm.c runs 64 with cuDNN attention): with
    # the lean cross-entropy and fused attention the bf16 step fits an 80 GB GPU.
    "gpt_small": (["model=gpt_small", "trainer.batch_size=32"], 50304),
    # Batch 2 x 2048 tokens at 1.3B parameters: the bf16 step saves about 115 bytes
    # per token, layer and channel (gpt_4k on an H100), so with AdamW state (21 GB)
    # batch 4 does not fit an 80 GB H100 (out of memory there); 2 does.
    "gpt_1b": (["model=gpt_1b", "trainer.batch_size=2"], 50304),
    "gpt_4k": (["model=gpt_4k", "trainer.batch_size=8"], 50304),
    "quick": (
        ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16"],
        65,
    ),
}
# model=gpt_unit at the GPU sizes: the same shapes by overrides (its MLP is a
# SwiGLU, so it has more parameters at the same width).
UNIT_SIZES = {
    name: [
        *(f"model.{k}={v}" for k, v in shape.items()),
        f"trainer.batch_size={batch}",
    ]
    for name, shape, batch in [
        ("gpt_small", dict(n_layer=12, n_head=12, n_embd=768, block_size=1024), 32),
        ("gpt_1b", dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048), 2),
        ("gpt_4k", dict(n_layer=4, n_head=32, n_embd=4096, block_size=2048), 8),
    ]
}
FP8_GEMM = "__cublas$lt$matmul$f8"

recipes.register()


def device_name() -> str | None:
    """The `PEAKS` key of the first device, or None (a CPU, another GPU)."""
    kind = jax.devices()[0].device_kind
    if "H200" in kind:
        return "H200"
    if "H100" in kind and ("SXM" in kind or "HBM3" in kind):
        return "H100 SXM"
    if "A100" in kind:
        return "A100"
    return None


def peak_flops(precision: str) -> float | None:
    """The device's dense peak in FLOP/s for `precision`'s matmuls, or None."""
    name = device_name()
    tflops = PEAKS.get(name or "", {}).get(PEAK_DTYPE[precision])
    return None if tflops is None else tflops * 1e12


@dataclass
class Case:
    """One model size in one precision, built as `python -m lowtrain` builds it."""

    model_name: str  # a key of `SIZES`
    precision: str
    trainer: Any  # the recipe's Trainer subclass
    config: Any  # recipes._config.Config
    vocab: int
    batch_size: int
    block_size: int
    optimizer: Any  # the recipe's optax optimizer (the Trainer wraps it)
    hand_loss: Callable | None  # the same loss with casts by hand, or None

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch_size * self.block_size

    def trainer_loss(self, model, x, y, key=None):
        """The loss the Trainer differentiates, called without the Trainer: its
        `loss` of the precision's `wrap_model(model)` on the precision's `inputs`
        of the batch `{"x": x, "y": y}` (the value, without any aux)."""
        p = self.trainer.precision
        batch = p.inputs({"x": x, "y": y})
        out = self.trainer.loss(p.wrap_model(model), batch, key=key)
        return out[0] if isinstance(out, tuple) else out

    def parameters(self) -> int:
        """Parameters in matmuls: all but the lookups, the GPT's position embedding
        (`wpe`; its token embedding is the head too) and the unit-scaled model's
        token embedding (`embedding`, untied from its `projection`)."""
        model = self.trainer.model
        params = eqx.filter(model, eqx.is_inexact_array)
        n = sum(x.size for x in jax.tree.leaves(params))
        lookups = (getattr(model, "wpe", None), getattr(model, "embedding", None))
        lookups = [getattr(x, "weight", x) for x in lookups if x is not None]
        return n - sum(x.size for x in lookups)

    def flops(self) -> float:
        """Model FLOPs per step, as nanoGPT counts them: 6 x parameters x tokens
        (forward 2, backward 4 per parameter and token; the position embedding, a
        lookup, not counted) plus attention's 12 x layers x width x context per
        token (QK^T and AV, forward and backward, causal mask not discounted)."""
        n, m = self.parameters(), self.config.model
        attention = 12 * m.n_layer * m.n_embd * self.block_size
        return float((6 * n + attention) * self.tokens)


def add_set_argument(parser, what: str, example: str) -> None:
    """`--set KEY=VALUE`, repeatable: the Hydra overrides `make_case` applies to
    every `what` (a script's cases or rows), in `args.set`."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a Hydra override for every {what}, e.g. {example}",
    )


def add_triton_gemm_argument(parser) -> None:
    """`--triton-gemm on|off`: XLA's Triton GEMM fusions on a GPU, as
    `trainer.triton_gemm` (default off: cuBLAS GEMMs, as `python -m lowtrain`)."""
    parser.add_argument(
        "--triton-gemm",
        choices=["on", "off"],
        default="off",
        help="XLA's Triton GEMM fusions on a GPU (off: cuBLAS only, the CLI's default)",
    )


def compose_config(recipe: str, overrides: list[str]):
    """The recipe's composed config (`DictConfig`) and its checked `Config`."""
    with initialize_config_module("lowtrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"recipe={recipe}", *overrides])
    return cfg, recipes.to_config(cfg)


def make_case(
    model_name: str,
    precision: str,
    batch_size: int | None,
    extra: Sequence[str] = (),
) -> Case:
    """The Trainer of `recipe=gpt_<precision>` at size `model_name`, on synthetic
    tokens; `batch_size` None: the recipe's; `extra`: more Hydra overrides."""
    overrides, vocab = SIZES[model_name]
    if precision.startswith("unit") and model_name in UNIT_SIZES:
        overrides = UNIT_SIZES[model_name]
    if batch_size is not None:
        overrides = [*overrides, f"trainer.batch_size={batch_size}"]
    overrides = [*overrides, *extra]
    cfg, config = compose_config(RECIPES[precision], overrides)
    model, trainer_class = gpt.build_model(config.model, vocab, key=jax.random.key(0))
    steps = config.trainer.steps  # the schedule's length; the bench runs fewer
    optimizer = recipes.optimizer(cfg, steps, decay_mask, model)
    trainer = trainer_class(model, optimizer, **recipes.trainer_options(config))
    hand = None
    if precision == "fp32":
        hand = models.loss
    elif precision == "unit_fp32":  # no casts: the plain step of the unit model
        hand = models.unit_loss
    elif precision in ("bf16", "fp16", "fp8"):
        lean = getattr(config.model, "cross_entropy", None) is CrossEntropy.lean
        hand = models.twin(models.hand_gpt_loss, precision, lean=lean)
    elif precision in ("unit_bf16", "unit_fp16", "unit_fp8"):
        hand = unit_twin.twin(config)
    return Case(
        model_name,
        precision,
        trainer,
        config,
        vocab,
        config.trainer.batch_size,
        config.model.block_size,
        optimizer,
        hand,
    )


def synthetic_data(case: Case, n: int = 8) -> Callable[[int], dict]:
    """`data(step)`: one of `n` fixed batches of uniform random tokens, as NumPy
    arrays (the recipes' `Crops` returns NumPy too)."""
    rng = np.random.default_rng(0)
    shape = (n, case.batch_size, case.block_size + 1)
    stream = rng.integers(0, case.vocab, shape, dtype=np.int32)
    batches = [{"x": s[:, :-1], "y": s[:, 1:]} for s in stream]
    return lambda step: batches[step % n]


def lowtrain_step(case: Case) -> tuple[Callable, tuple]:
    """`(fn, state)`: `fn(state, batch) -> (state, loss)`, the Trainer's compiled
    step (`trainer.compiled_step`, what `fit` calls), and its initial state."""
    trainer = case.trainer

    def fn(state, batch):
        state, metrics = trainer.compiled_step(batch, state)
        return state, metrics["loss"]

    return fn, (trainer.init(key=jax.random.key(1)),)


def hand_step(case: Case) -> tuple[Callable, tuple]:
    """`(fn, (model, opt_state))`: the same step written by hand (the hand-cast loss,
    its gradient and the recipe's optimizer; no Trainer, no loss scale, no finite
    check), jitted with the state donated as the Trainer donates it."""
    step = timing.make_step(case.hand_loss, case.optimizer)
    jitted = async_filter_jit(  # as the Trainer's step is compiled
        lambda batch, model, opt: step(model, opt, batch["x"], batch["y"]),
        donate="all-except-first",
    )
    model = case.trainer.model
    opt_state = case.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    # Copies: the model is the Trainer's too, and the step donates its buffers.
    model = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
    return (lambda model, opt, batch: jitted(batch, model, opt)), (model, opt_state)


def compile_step(case: Case, state, batch) -> tuple[str, Any, str]:
    """`(optimized HLO, XLA's memory analysis, lowered StableHLO)` of the Trainer's
    step: a separate lower + compile of `trainer.compiled_step`."""
    lowered = case.trainer.compiled_step.lower(batch, state)
    compiled = lowered.compile()
    inner = getattr(compiled, "compiled", compiled)  # equinox's wrapper, or jax's
    return inner.as_text(), inner.memory_analysis(), lowered.as_text()


def analysis_bytes(analysis) -> int | None:
    """Arguments + outputs - donated (aliased) + temporaries of a compiled step:
    what it holds at once, by XLA's own buffer assignment."""
    if analysis is None:
        return None
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def _f8_gemm_computations(optimized_hlo: str) -> set[str]:
    """Names of the computations in the HLO text holding a `dot` of two FP8 operands."""
    found = set()
    for match in re.finditer(r"^%?([\w.\-]+) \(.*?\n\}", optimized_hlo, re.M | re.S):
        body = match.group(0)
        for dot in re.finditer(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", body):
            types = [
                re.search(rf"%{re.escape(n)} = (\w+)\[", body) for n in dot.groups()
            ]
            if all(t and t.group(1).startswith("f8") for t in types):
                found.add(match.group(1))
    return found


def count_dots(lowered_text: str) -> tuple[int, int]:
    """`(dot_generals, those of two FP8 operands)` written in the lowered step
    (StableHLO). The first minus the second are the matmuls the precision keeps wide
    (by `keep` or the shape filter): those are written where they run. (A function
    the program calls several times is written once: an FP8 matmul under a
    static-scale jit is, so count the GEMMs in the compiled step instead.)"""
    dots = re.findall(r"\bstablehlo\.dot_general\b.*", lowered_text)
    f8 = [d for d in dots if len(re.findall(r"xf8E\w+>", d.split(" -> ")[0])) >= 2]
    return len(dots), len(f8)


def count_fp8_gemms(optimized_hlo: str) -> tuple[int, int, int]:
    """`(cuBLASLt FP8 GEMM custom calls, Triton GEMM fusions of FP8 operands, all
    GEMMs)` in the optimized HLO of a GPU step: the matmuls of forward and backward,
    a scan's body once. XLA's autotuner picks cuBLASLt or a Triton kernel per GEMM;
    both run on the FP8 tensor cores. All GEMMs: the cuBLAS calls and the `dot`s
    left in fusions (Triton's)."""
    cublaslt = optimized_hlo.count(f'custom_call_target="{FP8_GEMM}"')
    f8 = _f8_gemm_computations(optimized_hlo)
    triton = sum(
        1
        for line in optimized_hlo.splitlines()
        if "kind=kCustom" in line
        and re.search(r'"kind":"__triton\w*gemm', line)
        and (m := re.search(r"calls=%([\w.\-]+)", line))
        and m.group(1) in f8
    )
    cublas = len(re.findall(r'custom_call_target="__cublas\$[\w$]*"', optimized_hlo))
    dots = len(re.findall(r" dot\(", optimized_hlo))
    return cublaslt, triton, cublas + dots
