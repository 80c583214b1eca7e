"""The GPT recipe's lean cross-entropy (`model.cross_entropy=lean`): the float32
loss and gradient within rounding, without a float32 copy of the logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowtrain.recipes import _common, _run, gpt
from lowtrain.recipes._layers import decay_mask

from .test_recipes import make_config

F32, BF16 = jnp.float32, jnp.bfloat16


def _reference(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_value_and_gradient_are_the_float32_ones(dtype, getkey):
    logits = (jax.random.normal(getkey(), (4, 8, 300)) * 3).astype(dtype)
    targets = jax.random.randint(getkey(), (4, 8), 0, 300)
    value, grad = jax.value_and_grad(gpt.cross_entropy)(logits, targets)
    ref_value, ref_grad = jax.value_and_grad(_reference)(logits, targets)
    assert value.dtype == F32 and grad.dtype == dtype
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    # The gradient is computed in float32 and rounded once to the logits' dtype.
    tol = 2e-6 if dtype == F32 else 2**-9
    np.testing.assert_allclose(
        grad.astype(F32), ref_grad.astype(F32), rtol=tol, atol=tol / 300
    )


def _trainer(cross_entropy, vocab):
    cfg = make_config(
        "recipe=gpt_bf16",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=64",
        "trainer.batch_size=4",
        f"model.cross_entropy={cross_entropy}",
    )
    config = _run.to_config(cfg)
    model, trainer_class = gpt.build_model(config.model, vocab, key=jax.random.key(0))
    trainer = trainer_class(
        model,
        _common.optimizer(cfg, 1000, decay_mask, model),
        **_common.trainer_options(config),
    )
    return trainer


def test_lean_loss_is_the_recipes_loss_without_float32_logits():
    vocab, batch = 2048, 4
    tokens = np.random.default_rng(0).integers(0, vocab, (batch, 65), dtype=np.int32)
    data = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    memory, losses = {}, {}
    for name in ("lean", "float32"):
        trainer = _trainer(name, vocab)
        lean = name == "lean"
        assert type(trainer) is (gpt.LeanGptTrainer if lean else gpt.GptTrainer)
        state = trainer.init(key=jax.random.key(1))
        step = jax.jit(trainer.train_step)
        losses[name] = step(state, data)[1]["loss"]
        memory[name] = step.lower(state, data).compile().memory_analysis()
    np.testing.assert_allclose(losses["lean"], losses["float32"], rtol=1e-5)
    # The bf16 training step holds one float32 (batch, context, vocab) tensor less.
    logits_f32 = batch * 64 * vocab * 4
    lean, full = (memory[n].temp_size_in_bytes for n in ("lean", "float32"))
    assert lean + 0.9 * logits_f32 <= full


def test_cross_entropy_config_is_checked():
    with pytest.raises(Exception, match="model.cross_entropy"):
        _run.to_config(make_config("recipe=gpt", "model.cross_entropy=fp16"))
    config = _run.to_config(make_config("recipe=gpt", "model=gpt_small"))
    assert config.model.cross_entropy.value == "lean"
