"""`python -m lowtrain`: the Hydra app that trains the recipes.

    python -m lowtrain                                   # recipe=mnist_fp8
    python -m lowtrain recipe=gpt_fp16 trainer.steps=200 optimizer.lr=3e-3
    python -m lowtrain -m recipe=mnist precision=fp32,bf16,fp16,fp8
    python -m lowtrain recipe=mnist -m precision=fp32,bf16   # -m anywhere: a sweep

The configs are in `conf/` (installed as `lowtrain.conf`), their types in
`lowtrain/recipes/_config.py`, the code in `lowtrain/recipes/`. See the "Recipes
and the CLI" guide (docs/guides/recipes.md).
"""

import logging
import pathlib
import shutil
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lowtrain.recipes import _config, _run

_config.register()

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
    # refused for its config leaves none behind (a directory holding anything else,
    # a run's outputs, is kept).
    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {"lowtrain.log"}:
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
    that does not check out (`_run.check`) is one line on stderr and exit status 2,
    before anything is written."""
    output_dir = pathlib.Path(HydraConfig.get().runtime.output_dir)
    try:
        _run.check(cfg)
    except (ValueError, TypeError) as e:
        logging.shutdown()
        _remove_if_new(output_dir)
        print(f"lowtrain: {e}", file=sys.stderr)
        sys.exit(2)
    summary = _run.run(cfg, output_dir)
    if cfg.mode != "train":  # evaluate, sample: printed, nothing to keep
        logging.shutdown()
        _remove_if_new(output_dir)
    return next(iter(summary["final"].values()))


if __name__ == "__main__":
    sys.argv = _multirun_first(sys.argv)  # Hydra parses `sys.argv` in `main`
    main()
