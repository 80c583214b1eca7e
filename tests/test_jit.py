"""`async_filter_jit`: `eqx.filter_jit`'s filtering and results, without its wait;
the Trainer's step built with it runs ahead of the host."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowtrain.train import async_filter_jit

from .helpers import SGD, Mse, make_data, make_model, same_bits, snapshot


def slow(x, n=48):
    """About a second of float32 matmuls on a CPU core, compiled in well under one."""
    a = jnp.full((384, 384), 1 / 384, jnp.float32) + x.mean()
    a = jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a) * 2.0, a)
    return a.mean()


def test_same_results_as_filter_jit_with_static_leaves_and_outputs():
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))  # jax.nn.relu: a leaf
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)

    def fn(model, x, *, scale):
        return {"y": jax.vmap(model)(x) * scale, "name": "out", "act": model.activation}

    ours = async_filter_jit(fn)(model, x, scale=2.0)
    ref = eqx.filter_jit(fn)(model, x, scale=2.0)
    assert ours["name"] == "out" and ours["act"] is model.activation
    assert ours["y"].dtype == ref["y"].dtype == jnp.float32
    assert same_bits(snapshot(ours["y"]), snapshot(ref["y"]))
    # Static leaves are compiled in: another value compiles again and is used.
    again = async_filter_jit(fn)(model, x, scale=3.0)["y"]
    assert same_bits(snapshot(again), snapshot(ref["y"] * 1.5))


def test_returns_before_the_device_is_done_unlike_filter_jit():
    x = jnp.ones(3)
    ours, ref = async_filter_jit(slow), eqx.filter_jit(slow)
    jax.block_until_ready((ours(x), ref(x)))  # compiled
    out = ours(x)
    assert not out.is_ready()  # queued: the host is free
    out.block_until_ready()
    assert ref(x).is_ready()  # equinox 0.13 waits for the results


def test_donates_all_but_the_first_argument():
    step = async_filter_jit(
        lambda batch, state: (state * 2 + batch.sum(), batch), donate="all-except-first"
    )
    batch, state = jnp.ones(4), jnp.arange(4.0)
    new, kept = step(batch, state)
    assert state.is_deleted() and not batch.is_deleted()
    np.testing.assert_array_equal(new, np.arange(4.0) * 2 + 4)
    plain = async_filter_jit(lambda a, b: a + b)
    a, b = jnp.ones(2), jnp.ones(2)
    plain(a, b)
    assert not (a.is_deleted() or b.is_deleted())


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"in .* got 'all' instead. Use 'all-except"):
        async_filter_jit(lambda x: x, donate="all")
    with pytest.raises(TypeError, match="Expected a function.*got int.*itself"):
        async_filter_jit(3)
    with pytest.raises(TypeError, match="hashable.*a tuple rather than a list"):
        async_filter_jit(lambda x, opts: x)(jnp.ones(2), {"a": {1, 2}})
    with pytest.raises(TypeError, match="at least one positional argument"):
        async_filter_jit(lambda: 1)()


class SlowMse(Mse):
    """`Mse` plus about a second of work that adds 0 to the loss."""

    def loss(self, model, batch, *, key):
        loss, aux = super().loss(model, batch, key=key)
        return loss + 0.0 * slow(batch["x"]), aux


def test_trainer_step_is_queued_and_fit_runs_one_step_ahead():
    trainer = SlowMse(make_model(), SGD(1e-2))
    data = make_data()
    step = trainer.compiled_step
    state = trainer.init(key=jax.random.key(0))
    state, metrics = step(trainer.shard_batch(data(0)), state)  # compiles
    jax.block_until_ready(state)
    state, metrics = step(trainer.shard_batch(data(1)), state)
    assert not metrics["loss"].is_ready()

    # `fit` asks for step s + 1's batch while step s still runs.
    losses, ready_when_asked = [], {}

    def recording_step(batch, state):
        state, metrics = step(batch, state)
        losses.append(metrics["loss"])
        return state, metrics

    def watched(s):
        if s > 0:
            ready_when_asked[s] = losses[-1].is_ready()
        return data(s)

    trainer.__dict__["compiled_step"] = recording_step  # the cached property's slot
    fresh = trainer.init(key=jax.random.key(0))
    fit_state = trainer.fit(fresh, watched, steps=4, log_every=100, progress=False)
    assert ready_when_asked == {1: False, 2: False, 3: False}
    # ... and trains exactly as the same steps called one at a time.
    trainer.__dict__["compiled_step"] = step
    expected = trainer.init(key=jax.random.key(0))
    for s in range(4):
        expected, _ = step(trainer.shard_batch(data(s)), expected)
    assert same_bits(snapshot(fit_state.model), snapshot(expected.model))


def test_fit_still_stops_on_a_nonfinite_loss_one_step_late():
    # Asynchronous steps leave the one-step-late check of `stop_on_nonfinite` as it
    # was: the error names the step, and nothing is trained past the next one.
    data = make_data()

    def bad(s):
        b = data(s)
        return dict(b, x=b["x"] * np.float32(np.inf)) if s == 2 else b

    trainer = Mse(make_model(), SGD(1e-2))
    asked = []
    with pytest.raises(FloatingPointError, match="at train step 3"):
        trainer.fit(
            trainer.init(key=jax.random.key(0)),
            lambda s: asked.append(s) or bad(s),
            steps=10,
            log_every=100,
            progress=False,
        )
    assert asked == [0, 1, 2, 3]


class CountingMse(Mse):
    traces = 0

    def train_step(self, state, batch):
        CountingMse.traces += 1  # runs once per trace, not per step
        return super().train_step(state, batch)


@pytest.mark.parametrize("policy", ["fp32", "fp16"])
def test_the_step_is_traced_once_for_a_whole_run(policy):
    # The new state's static part (its structure, non-array leaves) keys the next
    # call: it must equal the old one's, or every step would compile again.
    CountingMse.traces = 0
    trainer = CountingMse(make_model(), SGD(1e-2), precision=policy)
    state = trainer.fit(trainer.init(key=jax.random.key(0)), make_data(), steps=6)
    assert int(state.step) == 6 and CountingMse.traces == 1


class Scale(eqx.Module):
    w: jax.Array

    @async_filter_jit
    def apply(self, x):
        return self.w * x


def test_a_module_as_the_function_and_a_decorated_method():
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 4)
    predict = async_filter_jit(model)
    assert same_bits(snapshot(predict(x)), snapshot(model(x)))
    # The module's arrays are arguments of the program, not constants in it.
    n = len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert len(jax.tree.leaves(predict.lower(x).args_info)) == 1 + n
    scale = Scale(jnp.float32(3.0))
    np.testing.assert_array_equal(scale.apply(x), 3.0 * x)
    np.testing.assert_array_equal(Scale(jnp.float32(2.0)).apply(x), 2.0 * x)
