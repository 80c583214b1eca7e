"""Several processes training one model: 2 processes x 2 CPU devices against 1 x 4,
resume across processes from orbax checkpoints, and the two-process CLI command."""

import json
import shutil

import numpy as np
import pytest

from lowtrain.recipes._mnist_data import load_mnist

from .helpers import fake_mnist, free_port, run_processes

# argv: out_dir, processes, process_id, port, steps, resume (0/1), checkpoint_every,
# async_checkpoint (0/1), sharding, model width.
# Trains `Regression` on all devices of all processes; process 0 writes the loss of
# every step (metrics.jsonl) and the final state (final.npz).
WORKER = """
    import os, sys
    out, n, pid, port, steps, resume, every, asynchronous, sharding, width = (
        sys.argv[1:]
    )
    n, pid, steps, every, width = map(int, (n, pid, steps, every, width))
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
    trainer = Regression(make_model(width), SGD(1e-2), sharding=sharding)
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
        async_checkpoint=asynchronous == "1",
        progress=False,
    )
    final = snapshot(state)  # a collective: on every process
    if pid == 0:
        np.savez(os.path.join(out, "final.npz"), *final)
"""


def train(
    out,
    processes,
    steps=30,
    *,
    resume=False,
    every=15,
    asynchronous=False,
    sharding="replicated",
    width=16,
):
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // processes}"}
    argvs = [
        (out, processes, i, port, steps, int(resume), every, int(asynchronous))
        + (sharding, width)
        for i in range(processes)
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
    """The 2 x 2 run: 30 steps, checkpoints at 15 and 30, saved asynchronously."""
    out = tmp_path_factory.mktemp("two")
    return out, *train(out, 2, asynchronous=True)


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


@pytest.mark.slow  # four launches of about 40 s each
def test_two_processes_fsdp_train_as_one_and_resume(tmp_path):
    """FSDP over 2 processes x 2 devices: a model wide enough to be sharded (its
    two matrices, 512 x 4 and 2 x 512, split over the 4 devices) trains as one
    process with 4 replicated devices, and resumes from its checkpoint bit for bit."""
    kw = {"width": 512}
    one_losses, one_final = train(tmp_path / "one", 1, **kw)
    losses, final = train(tmp_path / "two", 2, sharding="fsdp", **kw)
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-6)
    for a, b in zip(final, one_final):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    shards = tmp_path / "two" / "ckpt" / "ckpt_00000030" / "arrays"
    assert {p.name for p in shards.iterdir()} >= {"ocdbt.process_0", "ocdbt.process_1"}
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "ckpt").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "two" / "ckpt" / "ckpt_00000015",
        resumed_dir / "ckpt" / "ckpt_00000015",
    )
    resumed_losses, resumed = train(resumed_dir, 2, resume=True, sharding="fsdp", **kw)
    assert resumed_losses == losses[15:]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(resumed, final))


@pytest.mark.slow
def test_two_processes_resume_bit_for_bit(two_processes, tmp_path):
    out, losses, final = two_processes
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(out / "ckpt" / "ckpt_00000015", tmp_path / "ckpt" / "ckpt_00000015")
    resumed_losses, resumed = train(tmp_path, 2, resume=True)
    assert resumed_losses == losses[15:]  # steps 16..30, exactly
    assert all(a.tobytes() == b.tobytes() for a, b in zip(resumed, final))
    assert [a.dtype for a in resumed] == [a.dtype for a in final]


# -- the two-process command line -----------------------------------------------------

# argv: the Hydra overrides. `python -m lowtrain` from the working directory.
CLI = """
    import runpy, sys
    sys.argv = ["lowtrain", *sys.argv[1:]]
    runpy.run_module("lowtrain", run_name="__main__")
"""


def run_cli(cwd, overrides, processes):
    """`python -m lowtrain` as `processes` processes (one shell each) from `cwd`."""
    cwd.mkdir(parents=True, exist_ok=True)
    port = free_port()
    keys = [
        f"distributed.coordinator_address=localhost:{port}",
        f"distributed.num_processes={processes}",
    ]
    argvs = [
        (*overrides, *keys, f"distributed.process_id={i}")
        if processes > 1
        else overrides
        for i in range(processes)
    ]
    results = run_processes(CLI, argvs, timeout=400, cwd=cwd)
    for code, output in results:
        assert code == 0, output[-3000:]
    runs = sorted((cwd / "outputs" / "mnist_fp32").iterdir())
    assert len(runs) == 1, runs  # one run directory for all processes
    return runs[0], [output for _, output in results]


@pytest.mark.slow
def test_two_process_cli_writes_one_run(tmp_path):
    folder = fake_mnist(tmp_path / "idx", n_train=128, n_test=32)
    overrides = (
        "recipe=mnist_fp32",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.hidden=[16]",
        "trainer.batch_size=16",
        "trainer.eval_batch_size=16",
        *("trainer.steps=6", "trainer.epochs=null", "trainer.eval_every=null"),
        *("trainer.log_every=2", "trainer.checkpoint_every=3"),
        "trainer.progress=false",
    )
    run, outputs = run_cli(tmp_path, overrides, 2)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["test_examples"] == 32
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]  # by process 0
    assert "test accuracy:" in outputs[0] and "test accuracy:" not in outputs[1]
    shards = {p.name for p in (run / "checkpoints/ckpt_00000006/arrays").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "ckpt_00000003",
        "ckpt_00000006",
    ]


@pytest.mark.slow
def test_two_process_cli_matches_one_process_on_mnist(tmp_path):
    try:
        load_mnist()
    except FileNotFoundError as e:
        pytest.skip(f"the real MNIST is not available: {str(e).splitlines()[0]}")
    overrides = (
        "recipe=mnist_fp32",
        *("trainer.steps=50", "trainer.epochs=null", "trainer.progress=false"),
    )
    two, _ = run_cli(tmp_path / "two", overrides, 2)
    one, _ = run_cli(tmp_path / "one", overrides, 1)
    a, b = (json.loads((r / "summary.json").read_text())["final"] for r in (two, one))
    assert abs(a["test_accuracy"] - b["test_accuracy"]) <= 0.001  # 0.1 point
    assert a["test_accuracy"] > 0.85


# The worker of `WORKER`, signalled: process 1 sends itself SIGTERM after step 5.
STOPPED = WORKER.replace(
    "    state = trainer.fit(",
    """    import signal
    from lowtrain.train import Preempted

    def notice(info):
        if pid == 1 and info.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.add_hook(notice)
    try:
        state = trainer.fit(""",
).replace(
    "    final = snapshot(state)",
    """    except Preempted as e:
        print(f"STOPPED {e.step} {e.path}", flush=True)
        sys.exit(e.exit_code)
    final = snapshot(state)""",
)


@pytest.mark.slow  # three two-process launches
def test_a_signal_to_one_process_stops_every_process_at_one_step(
    two_processes, tmp_path
):
    # One process told to stop (the scheduler's SIGTERM may reach only one): both
    # agree at the next step that logs, save that step together, and exit 143;
    # the resume ends where the uninterrupted two-process run does, bit for bit.
    _, losses, final = two_processes
    port = free_port()
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    argvs = [(tmp_path, 2, i, port, 30, 0, 15, 1, "replicated", 16) for i in range(2)]
    results = run_processes(STOPPED, argvs, env=env, timeout=180)
    stops = []
    for code, output in results:
        assert code == 143, output[-3000:]
        (line,) = [x for x in output.splitlines() if x.startswith("STOPPED")]
        stops.append(line.split()[1:])
    assert stops[0] == stops[1] and stops[0][0] == "6"  # the step after the signal
    assert stops[0][1].endswith("ckpt_00000006")
    resumed_losses, resumed = train(tmp_path, 2, resume=True, asynchronous=True)
    assert resumed_losses == losses
    assert all(a.tobytes() == b.tobytes() for a, b in zip(resumed, final))
