"""`python -m lowtrain`: the Hydra app that trains the recipes.

    python -m lowtrain                                   # recipe=mnist_fp8
    python -m lowtrain recipe=gpt_fp16 trainer.steps=200 optimizer.lr=3e-3
    python -m lowtrain -m recipe=mnist precision=fp32,bf16,fp16,fp8

The configs are in `conf/` (installed as `lowtrain.conf`), their types in
`lowtrain/recipes/_config.py`, the code in `lowtrain/recipes/`. See the "Recipes
and the CLI" guide (docs/guides/recipes.md).
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lowtrain.recipes import _config, _run

_config.register()


@hydra.main(version_base="1.3", config_path="pkg://lowtrain.conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Train the recipe `cfg` names in the Hydra run directory; return its headline
    metric (test accuracy or validation loss), which sweepers can optimise."""
    summary = _run.run(cfg, HydraConfig.get().runtime.output_dir)
    return next(iter(summary["final"].values()))


if __name__ == "__main__":
    main()
