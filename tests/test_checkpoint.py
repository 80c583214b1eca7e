"""Checkpoints on orbax: any pytree round trips, mismatches are refused before any
array is read, other device counts, and a process SIGKILLed mid-save."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowtrain
from lowtrain.train._checkpoint import list_checkpoints

from .helpers import (
    SGD,
    Regression,
    make_data,
    make_model,
    run_processes,
    same_bits,
    snapshot,
)


class Scaled(eqx.Module):
    """Static fields, a PRNG key, a numpy leaf and mixed dtypes."""

    weight: jax.Array
    bias: jax.Array
    key: jax.Array
    table: np.ndarray
    name: str = eqx.field(static=True)
    act: object = eqx.field(static=True)


def scaled(seed):
    k = jax.random.key(seed)
    return Scaled(
        jax.random.normal(k, (3, 5), jnp.bfloat16),
        jnp.arange(5, dtype=jnp.int8) + seed,
        jax.random.split(k, 2),
        np.full((2,), seed, np.uint16),
        "dense",
        jax.nn.gelu,
    )


def test_any_pytree_round_trips_bit_for_bit(tmp_path):
    saved = {"module": scaled(1), "step": jnp.int32(7), "scale": jnp.float16(2.0**-3)}
    path = lowtrain.save_checkpoint(tmp_path / "state", saved)
    assert path.is_dir() and {p.name for p in path.iterdir()} >= {"arrays", "meta"}
    like = {"module": scaled(2), "step": jnp.int32(0), "scale": jnp.float16(1)}
    loaded = lowtrain.load_checkpoint(path, like)
    assert same_bits(snapshot(loaded), snapshot(saved))
    module = loaded["module"]
    assert module.name == "dense" and module.act is jax.nn.gelu  # from `like`
    assert module.weight.dtype == jnp.bfloat16 and module.bias.dtype == jnp.int8
    assert jax.random.key_impl(module.key) == jax.random.key_impl(saved["module"].key)
    assert isinstance(module.table, np.ndarray) and module.table.dtype == np.uint16
    assert loaded["scale"].dtype == jnp.float16 and float(loaded["scale"]) == 0.125
    # Saving again to the same path replaces the checkpoint.
    lowtrain.save_checkpoint(path, like)
    assert int(lowtrain.load_checkpoint(path, saved)["step"]) == 0


def test_mismatched_or_foreign_checkpoints_are_refused(tmp_path):
    trainer = Regression(make_model(), SGD(1e-2))
    state = trainer.init(key=jax.random.key(1))
    path = lowtrain.save_checkpoint(tmp_path / "ckpt_00000000", state)
    loaded = lowtrain.load_checkpoint(path, trainer.init(key=jax.random.key(2)))
    assert same_bits(snapshot(loaded), snapshot(state))

    def refused(trainer, match, at=path):
        with pytest.raises(ValueError, match=match):
            lowtrain.load_checkpoint(at, trainer.init(key=jax.random.key(1)))

    refused(
        Regression(make_model(width=32), SGD(1e-2)),
        r"at `\.model\.layers\[0\]\.weight`: expected float32\[32, 4\], got "
        r"float32\[16, 4\] instead\. Load it into a state built exactly",
    )
    refused(
        Regression(make_model(), SGD(1e-2), precision="params=bfloat16"),
        r"at `\.model\.layers\[0\]\.weight`: expected bfloat16\[16, 4\], got "
        r"float32\[16, 4\]",
    )
    refused(
        Regression(make_model(), optax.sgd(1e-2)),
        r"does not match the structure .* at array 8 expected `\.key` key<fry>\[\], "
        r"got `\.opt_state\.inner_state\[0\]\.trace\.layers\[0\]\.weight` "
        r"float32\[16, 4\] instead \(9 arrays expected, 13 in the checkpoint\)",
    )
    with pytest.raises(ValueError, match="does not match the structure"):  # resuming
        other = Regression(make_model(), optax.sgd(1e-2))
        other.fit(
            other.init(key=jax.random.key(1)),
            make_data(),
            steps=1,
            checkpoint_dir=tmp_path,
            resume=True,
        )
    old = tmp_path / "ckpt_00000001.lowtrain"  # lowtrain 0.1's single-file format
    old.write_bytes(b"LOWTRAIN-CKPT-1\n" + bytes(100))
    refused(trainer, r"got the file .*\.lowtrain instead.* no longer read", at=old)
    (tmp_path / "empty").mkdir()
    refused(trainer, "Expected a lowtrain checkpoint at", at=tmp_path / "empty")
    with pytest.raises(ValueError, match=r"Expected an empty `checkpoint_dir`"):
        trainer.fit(state, make_data(), steps=1, checkpoint_dir=tmp_path)


# Saves on 4 devices; loads into 2 devices and into 1, and into the 2-device
# placement of a fresh Trainer's state (orbax reshards as it reads).
OTHER_DEVICES = """
    import sys
    import jax
    sys.path.insert(0, ".")
    import lowtrain
    from tests.helpers import SGD, Regression, make_data, make_model
    from tests.helpers import same_bits, snapshot

    trainer = Regression(make_model(), SGD(1e-2))
    assert len(trainer.devices) == 4
    state = trainer.fit(trainer.init(key=jax.random.key(1)), make_data(), steps=3,
                        checkpoint_dir=sys.argv[1], progress=False)
    path = lowtrain.latest_checkpoint(sys.argv[1])
    for n in (2, 1):
        small = Regression(make_model(), SGD(1e-2), devices=jax.devices()[:n])
        like = small.init(key=jax.random.key(5))
        target = like.model.layers[0].weight.sharding
        loaded = lowtrain.load_checkpoint(path, like)
        assert same_bits(snapshot(loaded), snapshot(state))
        weight = loaded.model.layers[0].weight
        assert weight.sharding == target
        assert len(weight.sharding.device_set) == n
        more = small.fit(loaded, make_data(), steps=5, progress=False)
        assert int(more.step) == 5
    print("ok")
"""


def test_restores_into_another_device_count(tmp_path):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    ((code, output),) = run_processes(OTHER_DEVICES, [(tmp_path,)], env=env)
    assert code == 0 and output.strip().endswith("ok"), output[-3000:]


# argv: checkpoint dir, "sync"/"async". Trains 4 steps with a checkpoint after each;
# the second save is SIGKILLed as orbax finalizes it: its arrays are written into a
# temporary directory, not yet renamed to `ckpt_00000002`.
KILLED = """
    import os, signal, sys
    import jax
    from orbax.checkpoint._src.path import atomicity  # where orbax renames
    sys.path.insert(0, ".")
    from tests.helpers import SGD, Regression, make_data, make_model

    real = atomicity.AtomicRenameTemporaryPath.finalize

    async def killed_on_second(self):
        if self.get_final().name == "ckpt_00000002":
            os.kill(os.getpid(), signal.SIGKILL)
        return await real(self)

    atomicity.AtomicRenameTemporaryPath.finalize = killed_on_second
    trainer = Regression(make_model(), SGD(1e-2))
    trainer.fit(trainer.init(key=jax.random.key(1)), make_data(), steps=4,
                checkpoint_dir=sys.argv[1], checkpoint_every=1, progress=False,
                async_checkpoint=sys.argv[2] == "async")
"""


@pytest.mark.parametrize(
    "mode", ["sync", pytest.param("async", marks=pytest.mark.slow)]
)
def test_sigkill_during_save_keeps_previous_checkpoint(mode, tmp_path):
    ckpt = tmp_path / "ckpt"
    ((code, output),) = run_processes(KILLED, [(ckpt, mode)])
    assert code == -9, output[-3000:]  # SIGKILL
    # The killed run's lock stays (a stale one, taken over by the next launch).
    assert (ckpt / ".lowtrain.lock").is_file()
    left = sorted(p.name for p in ckpt.iterdir() if p.name != ".lowtrain.lock")
    assert left[0] == "ckpt_00000001" and len(left) == 2, left
    assert left[1].startswith("ckpt_00000002.orbax-checkpoint-tmp")  # the killed save
    assert (ckpt / left[1] / "arrays").is_dir()  # its arrays were being written
    assert [s for s, _ in list_checkpoints(ckpt)] == [1]
    assert lowtrain.latest_checkpoint(ckpt).name == "ckpt_00000001"
    # Resuming from the newest complete checkpoint ends where an uninterrupted run
    # does, bit for bit, and clears the killed save's temporary directory.
    trainer = Regression(make_model(), SGD(1e-2))
    resumed = trainer.fit(
        trainer.init(key=jax.random.key(9)),
        make_data(),
        steps=4,
        checkpoint_dir=ckpt,
        checkpoint_every=1,
        resume=True,
        progress=False,
    )
    whole = trainer.fit(trainer.init(key=jax.random.key(1)), make_data(), steps=4)
    assert int(resumed.step) == 4 and same_bits(snapshot(resumed), snapshot(whole))
    assert sorted(p.name for p in ckpt.iterdir()) == [  # the newest 3 kept
        "ckpt_00000002",
        "ckpt_00000003",
        "ckpt_00000004",
    ]


def test_async_save_returns_before_the_write(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity  # where orbax renames

    from lowtrain.train._checkpoint import Checkpoints

    real, release = atomicity.AtomicRenameTemporaryPath.finalize, threading.Event()

    async def held(self):  # the write cannot complete before `release`
        assert release.wait(timeout=60), "the save was never released"
        return await real(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held)
    trainer = Regression(make_model(), SGD(1e-2))
    state = trainer.init(key=jax.random.key(1))
    saver = Checkpoints(tmp_path, keep_checkpoints=2, asynchronous=True)
    saver.save(1, state)  # returns with the write still pending
    assert lowtrain.latest_checkpoint(tmp_path) is None
    # The state's buffers are free to be donated: the next step may run.
    state = trainer.fit(state, make_data(), steps=1, progress=False)
    release.set()
    saver.close()  # waits for the pending write
    assert lowtrain.latest_checkpoint(tmp_path).name == "ckpt_00000001"
    saved = lowtrain.load_checkpoint(
        tmp_path / "ckpt_00000001", trainer.init(key=jax.random.key(3))
    )
    assert int(saved.step) == 0 and same_bits(
        snapshot(saved), snapshot(trainer.init(key=jax.random.key(1)))
    )
