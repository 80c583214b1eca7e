"""The command line's arguments before Hydra reads them: `-m` / `--multirun` (a
sweep) stands anywhere among the overrides, not only before or after all of them."""

import subprocess
import sys

import pytest

from lowtrain.__main__ import _multirun_first

from .helpers import fake_mnist

P = "lowtrain"  # sys.argv[0]: never moved


@pytest.mark.parametrize(
    "argv, expected",
    [
        # Between the overrides: moved to the front, the overrides in order.
        ([P, "recipe=mnist", "-m", "precision=fp32,bf16"], None),
        ([P, "recipe=mnist", "--multirun", "precision=fp32,bf16"], None),
        ([P, "-m", "recipe=mnist", "precision=fp32,bf16"], None),  # already first
        ([P, "recipe=mnist", "precision=fp32,bf16", "-m"], None),  # last
        # Hydra's other flags and their values keep their order and pairing.
        (
            [P, "--config-dir", "conf", "task=a.T", "-m", "precision=fp32,bf16"],
            [P, "-m", "--config-dir", "conf", "task=a.T", "precision=fp32,bf16"],
        ),
        # Twice (argparse takes a flag again): both moved, nothing lost.
        ([P, "a=1", "-m", "b=2", "--multirun"], [P, "-m", "--multirun", "a=1", "b=2"]),
    ],
)
def test_multirun_flag_moves_to_the_front(argv, expected):
    if expected is None:
        flag = next(a for a in argv if a in ("-m", "--multirun"))
        expected = [P, flag, "recipe=mnist", "precision=fp32,bf16"]
    assert _multirun_first(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        [P],
        [P, "recipe=mnist", "precision=bf16"],  # no sweep
        [P, "-m", "recipe=mnist"],
        # `-m` in an override's value is that value, not the flag.
        [P, "recipe=mnist", "sample.prompt=-m", "data.path=/data/-m"],
        [P, "recipe=mnist", "sample.prompt=-m x"],
        # Only the standalone flag moves: these are argparse's to refuse.
        [P, "recipe=mnist", "-mx", "--multirun=yes"],
        # After `--` argparse reads every argument as an override: left there.
        [P, "recipe=mnist", "--", "-m"],
    ],
)
def test_arguments_without_a_flag_to_move_are_unchanged(argv):
    assert _multirun_first(argv) == argv


def test_a_copy_not_the_list_given():
    argv = [P, "a=1", "-m"]
    assert _multirun_first(argv) == [P, "-m", "a=1"] and argv == [P, "a=1", "-m"]


@pytest.mark.slow  # 12 s on 2 cores
def test_cli_sweep_with_the_flag_between_overrides(tmp_path):
    # The real command line: `-m` after the first override used to be Hydra's
    # "unrecognized arguments" (exit 2); now a two-job sweep at a tiny size.
    folder = fake_mnist(tmp_path / "idx", n_train=64, n_test=16)
    command = [
        *(sys.executable, "-m", "lowtrain"),
        *("recipe=mnist", "-m", "precision=fp32,bf16"),
        *(f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}"),
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *("model.hidden=[8]", "trainer.epochs=null", "trainer.steps=2"),
        *("trainer.batch_size=8", "trainer.eval_batch_size=16"),
        *("trainer.eval_every=null", "trainer.checkpoint_every=null"),
        *("trainer.log_every=1", "trainer.progress=false"),
    ]
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "sweep").glob("*_mnist_*"))
    assert runs == ["0_mnist_fp32", "1_mnist_bf16"]
    for run in runs:
        assert (tmp_path / "sweep" / run / "summary.json").is_file()
    assert done.stdout.count("test accuracy:") == 2
