"""`Trainer.fit`'s host work per step: it does not wait for the device between the
steps that log (but for `stop_on_nonfinite`'s check, one step late), and on one
device it passes the compiled step a host copy of each batch, no `jax.device_put`."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowtrain.train._metrics as metrics_module
from lowtrain.train._metrics import LearningRates, learning_rate

from .helpers import SGD, Mse, make_data, make_model, same_bits, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slow(x, n=16):
    """A few tenths of a second of float32 matmuls on a CPU core."""
    a = jnp.full((384, 384), 1 / 384, jnp.float32) + x.mean()
    a = jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a) * 2.0, a)
    return a.mean()


class SlowMse(Mse):
    """`Mse` plus work that adds 0 to the loss: each step takes a while."""

    def loss(self, model, batch, *, key):
        loss, aux = super().loss(model, batch, key=key)
        return loss + 0.0 * slow(batch["x"]), aux


def recorded(trainer) -> list:
    """`(batch, metrics)` of each call of `trainer.compiled_step` from now on."""
    step, calls = trainer.compiled_step, []

    def recording(batch, state):
        state, metrics = step(batch, state)
        calls.append((batch, metrics))
        return state, metrics

    trainer.__dict__["compiled_step"] = recording  # the cached property's slot
    return calls


def test_fit_keeps_a_step_queued_between_logs():
    # Between logs fit reads each step's health (loss, skipped, skips in a row) one
    # step late: when it asks for batch `s`, step `s - 1` is still queued or
    # running, so the device never waits for the host. A host read of the newest
    # step's results (a loss, `state.step`) would wait for it.
    trainer = SlowMse(make_model(), SGD(1e-2), stop_on_nonfinite=False)
    data = make_data()
    trainer.fit(trainer.init(key=jax.random.key(0)), data, steps=1, progress=False)
    calls, newest_ready = recorded(trainer), {}

    def watched(s):
        if calls:
            newest_ready[s] = calls[-1][1]["loss"].is_ready()
        return data(s)

    state = trainer.init(key=jax.random.key(0))
    trainer.fit(state, watched, steps=5, log_every=None, progress=False)
    assert newest_ready == {1: False, 2: False, 3: False, 4: False}


def test_one_device_gets_a_host_copy_of_each_batch_and_no_device_put(monkeypatch):
    trainer = Mse(make_model(), SGD(1e-2))
    state = trainer.init(key=jax.random.key(0))
    calls, given, data = recorded(trainer), [], make_data()
    puts = []
    put = jax.device_put
    monkeypatch.setattr(
        jax, "device_put", lambda *a, **k: puts.append(1) or put(*a, **k)
    )
    trainer.fit(state, lambda s: given.append(data(s)) or given[-1], steps=3)
    assert not puts  # the call of the compiled step puts the batch on the device
    for (batch, _), ours in zip(calls, given, strict=True):
        for x, y in zip(jax.tree.leaves(batch), jax.tree.leaves(ours), strict=True):
            assert type(x) is np.ndarray and not np.shares_memory(x, y)
            np.testing.assert_array_equal(x, y)


def test_a_batch_buffer_refilled_in_place_trains_as_new_batches():
    # `data` refills one buffer while the steps that read it wait in the queue: on
    # a CPU a step may read a NumPy argument in place, so fit passes a copy.
    trainer = SlowMse(make_model(), SGD(1e-2), stop_on_nonfinite=False)
    data = make_data()
    buffer = jax.tree.map(np.empty_like, data(0))

    def refilled(s):
        for out, x in zip(jax.tree.leaves(buffer), jax.tree.leaves(data(s))):
            out[...] = x
        return buffer

    fit = lambda d: trainer.fit(
        trainer.init(key=jax.random.key(0)), d, steps=4, progress=False
    )
    assert same_bits(snapshot(fit(refilled).model), snapshot(fit(data).model))


def test_learning_rates_finds_the_injected_state_once(monkeypatch):
    params = {"w": jnp.ones(2)}
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    state = optax.apply_if_finite(optax.chain(optax.clip(1.0), injected), 3).init(
        params
    )
    searches = []
    find = metrics_module._find_injected
    monkeypatch.setattr(
        metrics_module, "_find_injected", lambda s: searches.append(1) or find(s)
    )
    rates = LearningRates()
    assert rates(state, None, 1) == rates(state, None, 2) == 0.5
    assert len(searches) == 1
    # A state without it, where it was: searched anew; then the schedule's rate.
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    plain = optax.sgd(0.5).init(params)
    assert (
        rates(plain, schedule, 3)
        == float(schedule(2))
        == learning_rate(plain, schedule, 3)
    )
    assert len(searches) == 3  # (`learning_rate` searches too)
    assert rates(plain, 0.25, 3) == 0.25 and len(searches) == 3


SECOND_DEVICE = """
import sys
sys.path.insert(0, ".")
import jax
from tests.helpers import SGD, Mse, make_data, make_model, same_bits, snapshot

runs = {}
for device in jax.devices():
    trainer = Mse(make_model(), SGD(1e-2), devices=[device])
    state = trainer.init(key=jax.random.key(1))
    state = trainer.fit(state, make_data(), steps=3, progress=False)
    assert {d for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
            for d in x.devices()} == {device}
    runs[device.id] = snapshot(state)
assert same_bits(runs[0], runs[1])
print("ok")
"""


def test_one_device_other_than_the_default_trains_there(tmp_path):
    # The host batch goes where the (committed) state is.
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(SECOND_DEVICE))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    child = subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr
