"""Several processes training one model: 2 processes x 2 CPU devices against 1 x 4,
resume across processes from orbax checkpoints, and the two-process CLI command."""

import json
import shutil

import numpy as np
import pytest

from .helpers import free_port, run_processes

# argv: out_dir, processes, process_id, port, steps, resume (0/1), checkpoint_every.
# Trains `Regression` on all devices of all processes; process 0 writes the loss of
# every step (metrics.jsonl) and the final state (final.npz).
WORKER = """
    import os, sys
    out, n, pid, port, steps, resume, every = sys.argv[1:]
    n, pid, steps, every = int(n), int(pid), int(steps), int(every)
    import jax
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}", num_processes=n, process_id=pid
        )
    import numpy as np
    sys.path.insert(0, ".")
    from tests.helpers import SGD, Regression, make_data, make_model, snapshot

    assert jax.device_count() == 4 and jax.local_device_count() == 4 // n
    trainer = Regression(make_model(), SGD(1e-2))
    state = trainer.fit(
        trainer.init(key=jax.random.key(1)),
        make_data(n=64, batch_size=16, process=(pid, n)),
        steps=steps,
        log_every=1,
        metrics_file=os.path.join(out, "metrics.jsonl"),
        checkpoint_dir=os.path.join(out, "ckpt"),
        checkpoint_every=every,
        keep_checkpoints=5,
        resume=resume == "1",
        progress=False,
    )
    if pid == 0:
        np.savez(os.path.join(out, "final.npz"), *snapshot(state))
"""


def train(out, processes, steps=30, *, resume=False, every=15):
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // processes}"}
    argvs = [
        (out, processes, i, port, steps, int(resume), every) for i in range(processes)
    ]
    for code, output in run_processes(WORKER, argvs, env=env, timeout=180):
        assert code == 0, output[-3000:]
    losses = [
        json.loads(line)["loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    with np.load(out / "final.npz") as f:
        final = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    return losses, final


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The 2 x 2 run: 30 steps, checkpoints at 15 and 30."""
    out = tmp_path_factory.mktemp("two")
    return out, *train(out, 2)


def test_two_processes_train_as_one(two_processes, tmp_path):
    out, losses, final = two_processes
    one_losses, one_final = train(tmp_path, 1)
    assert len(losses) == len(one_losses) == 30
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-6)
    assert losses[-1] < 0.5 * losses[0]  # it trained
    for a, b in zip(final, one_final):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # One checkpoint per step, its shards written by both processes.
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert names == ["ckpt_00000015", "ckpt_00000030"]
    arrays = out / "ckpt" / "ckpt_00000030" / "arrays"
    assert {p.name for p in arrays.iterdir()} >= {"ocdbt.process_0", "ocdbt.process_1"}


def test_two_processes_resume_bit_for_bit(two_processes, tmp_path):
    out, losses, final = two_processes
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(out / "ckpt" / "ckpt_00000015", tmp_path / "ckpt" / "ckpt_00000015")
    resumed_losses, resumed = train(tmp_path, 2, resume=True)
    assert resumed_losses == losses[15:]  # steps 16..30, exactly
    assert all(a.tobytes() == b.tobytes() for a, b in zip(resumed, final))
    assert [a.dtype for a in resumed] == [a.dtype for a in final]
