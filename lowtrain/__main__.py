"""`python -m lowtrain`: the Hydra app that trains the recipes.

    python -m lowtrain                                   # recipe=mnist_fp8
    python -m lowtrain recipe=gpt_fp16 trainer.steps=200 optimizer.lr=3e-3
    python -m lowtrain -m recipe=mnist precision=fp32,bf16,fp16,fp8
    python -m lowtrain recipe=mnist -m precision=fp32,bf16   # -m anywhere: a sweep

The configs are in `conf/` (installed as `lowtrain.conf`), their types in
`lowtrain/recipes/_config.py`, the code in `lowtrain/recipes/`. See the "Recipes
and the CLI" guide (docs/guides/recipes.md).
"""

import errno
import logging
import os
import pathlib
import shutil
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import lowtrain
from lowtrain.recipes import internal as recipes
from lowtrain.train import CheckpointCorruptError, Preempted, RunFolderLocked

recipes.register()

_MULTIRUN = ("-m", "--multirun")


def _multirun_first(argv: list[str]) -> list[str]:
    """`argv` (as `sys.argv`: the program, then its arguments) with every standalone
    `-m` / `--multirun` moved to the front of the arguments, the rest in order, so
    that a sweep's flag may stand anywhere among the overrides. An override that
    holds `-m` in its value (`x=-m`) is one argument, not the flag: it stays.

        >>> _multirun_first(["lowtrain", "recipe=mnist", "-m", "precision=fp32,bf16"])
        ['lowtrain', '-m', 'recipe=mnist', 'precision=fp32,bf16']
    """
    program, args = argv[:1], argv[1:]
    # Hydra's argparse reads the overrides as one positional run (`nargs="*"`): a
    # flag between two overrides ends the run, and the overrides after it are
    # "unrecognized arguments". After `--` argparse reads everything as positional:
    # what stands there stays there.
    end = args.index("--") if "--" in args else len(args)
    flags = [a for a in args[:end] if a in _MULTIRUN]
    rest = [a for a in args[:end] if a not in _MULTIRUN]
    return [*program, *flags, *rest, *args[end:]]


def _remove_if_new(folder: pathlib.Path) -> None:
    # Hydra makes the run directory and its log file before `main` runs: a launch
    # refused for its config, or stopped before its first step, leaves none behind.
    # A folder that holds anything else (a run's outputs, an earlier launch's
    # records) is kept.
    if not folder.is_dir():
        return
    made = {"lowtrain.log", "config.yaml", "launches", ".lowtrain.lock"}
    launches = folder / "launches"
    first = not launches.is_dir() or [p.name for p in launches.iterdir()] == [
        "001.yaml"
    ]
    if {p.name for p in folder.iterdir()} <= made and first:
        shutil.rmtree(folder)
        # And the folders made for it that are empty now (`outputs/mnist_fp8/`).
        cwd = pathlib.Path.cwd().resolve()
        for parent in folder.resolve().parents:
            if parent == cwd or parent in cwd.parents or any(parent.iterdir()):
                break
            parent.rmdir()


@hydra.main(version_base="1.3", config_path="pkg://lowtrain.conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Train the recipe `cfg` names in the Hydra run directory; return its headline
    metric (test accuracy or validation loss), which sweepers can optimise. A config
    that does not check out (`recipes.check`) is one line on stderr and exit status 2,
    before anything is written."""
    output_dir = pathlib.Path(HydraConfig.get().runtime.output_dir)
    try:
        recipes.check(cfg)
    except (ValueError, TypeError) as e:
        if _full_error():
            raise
        logging.shutdown()
        _remove_if_new(output_dir)
        print(f"lowtrain: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        summary = recipes.run(cfg, output_dir, list(HydraConfig.get().overrides.task))
    except RunFolderLocked as e:  # another launch trains there: nothing written
        logging.shutdown()
        print(f"lowtrain: {e}", file=sys.stderr)
        sys.exit(2)
    except Preempted as e:
        # Stopped from outside, saved: one line, the signal's exit status.
        logging.shutdown()
        overrides = [
            o
            for o in HydraConfig.get().overrides.task
            if not o.startswith("trainer.resume")
        ]
        again = " ".join(["python -m lowtrain", *overrides])
        if e.path is not None:
            again += f" hydra.run.dir={output_dir} trainer.resume=true"
        print(f"lowtrain: {e}; resume with: {again}", file=sys.stderr)
        sys.exit(e.exit_code)
    except _RUN_ERRORS as e:
        # lowtrain's own refusals (a resume that would change the run, a checkpoint
        # that is not there or is damaged, a run that diverged): one line. What
        # lowtrain did not raise itself is a bug: its traceback, as is every error
        # with HYDRA_FULL_ERROR=1.
        if not _raised_here(e) or _full_error():
            raise
        logging.shutdown()
        _remove_if_new(output_dir)
        print(f"lowtrain: {' '.join(str(e).split())}", file=sys.stderr)
        failed = isinstance(e, FloatingPointError | CheckpointCorruptError) or (
            getattr(e, "errno", None) == errno.ENOSPC
        )
        sys.exit(1 if failed else 2)
    if cfg.mode != "train":  # evaluate, sample: printed, nothing to keep
        logging.shutdown()
        _remove_if_new(output_dir)
    return next(iter(summary["final"].values()))


# What a run raises for its user (exit 2), or for a run that failed (exit 1: it
# diverged, its checkpoints are all damaged, the disk is full), as one line.
_RUN_ERRORS = (
    ValueError,
    TypeError,
    OSError,
    FloatingPointError,
    CheckpointCorruptError,
)
# lowtrain's code: the package and its recipes (installed as `lowtrain.recipes`
# from the checkout's `recipes/`).
_OURS = {pathlib.Path(m.__file__).resolve().parent for m in (lowtrain, recipes)}


def _full_error() -> bool:
    # Hydra's switch for whole tracebacks: lowtrain's one-line errors honour it.
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _raised_here(e: BaseException) -> bool:
    # Whether the innermost frame of `e`'s traceback is lowtrain's own code (a
    # message written for the user), not a library's or Python's.
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    where = pathlib.Path(tb.tb_frame.f_code.co_filename).resolve().parents
    return any(folder in where for folder in _OURS)


if __name__ == "__main__":
    sys.argv = _multirun_first(sys.argv)  # Hydra parses `sys.argv` in `main`
    sys.argv = [sys.argv[0], *recipes.with_recipe_of_checkpoint(sys.argv[1:])]
    error = None if _full_error() else recipes.check_overrides(sys.argv[1:])
    if error is not None:  # before Hydra makes a run folder
        print(f"lowtrain: {error}", file=sys.stderr)
        sys.exit(2)
    main()
