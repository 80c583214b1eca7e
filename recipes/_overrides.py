"""The command line's overrides, before Hydra composes them: a key or option that
names nothing is refused with the closest valid ones (Hydra would print a block and
exit 1), and `mode=evaluate|sample checkpoint=<run>` gets the run's recipe, so that
the keys given compose against the run's own schemas."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources

import lowtrain

from . import _config
from ._run import checkpoint_path


def _schema_keys() -> dict[str, set[str]]:
    # The keys each top-level node of the config holds (a group's: any of its
    # schemas'), by the config's types (`_config.py`).
    nodes = {
        "trainer": [_config.TrainerConfig],
        "sample": [_config.SampleConfig],
        "distributed": [_config.DistributedConfig],
    }
    for path, schema in _config.SCHEMAS.items():
        nodes.setdefault(path.split("/")[0], []).append(schema)
    # `name` (a precision's), `_target_`/`_partial_` (what Hydra instantiates).
    extra = {"name", "_target_", "_partial_"}
    return {
        node: {f.name for s in schemas for f in dataclasses.fields(s)} | extra
        for node, schemas in nodes.items()
    }


def _group_options() -> dict[str, list[str]]:
    # The choices of each config group: the YAML files of `lowtrain.conf/<group>/`.
    conf = importlib.resources.files("lowtrain.conf")
    return {
        d.name: sorted(f.name[:-5] for f in d.iterdir() if f.name.endswith(".yaml"))
        for d in conf.iterdir()
        if d.is_dir() and not d.name.startswith("_")
    }


_CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def check_overrides(args: list[str]) -> str | None:
    """The first override in `args` that names no config key or no option of its
    group, as an error message naming the closest valid ones; None if all do.
    Hydra's own checks (and `+key=` additions) run after this for the rest."""
    if any(a.split("=")[0] in _CONFIG_FLAGS for a in args) or any(
        a.startswith(("hydra.searchpath", "+hydra.searchpath")) for a in args
    ):
        return None  # the user's own config groups and schemas: Hydra checks them
    keys, groups = _schema_keys(), _group_options()
    top = {f.name for f in dataclasses.fields(_config.Config)}
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "+", "~", "hydra.", "hydra/")):
            continue
        key, value = arg.split("=", 1)
        parts = key.split(".")
        if parts[0] not in top | set(groups):
            return _unknown(key, sorted(top | set(groups)), "a config key")
        sweep = any(c in value for c in ",()[]")  # a sweep's list or range
        if len(parts) == 1 and key in groups and not sweep and value not in groups[key]:
            options = [f"{key}={o}" for o in groups[key]]
            return _unknown(f"{key}={value}", options, f"an option of `{key}`")
        if len(parts) == 2 and parts[0] in keys and parts[1] not in keys[parts[0]]:
            shown = sorted(k for k in keys[parts[0]] if not k.startswith("_"))
            valid = [f"{parts[0]}.{k}" for k in shown]
            return _unknown(key, valid, f"a key of `{parts[0]}`")
    return None


def _unknown(given: str, valid: list[str], what: str) -> str:
    close = difflib.get_close_matches(given, valid, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""
    shown = ", ".join(valid) if len(valid) <= 12 else ", ".join(valid[:12]) + ", ..."
    return (
        f"Expected {what}, got `{given}` instead.{hint} (Valid: {shown}; "
        "`python -m lowtrain --help` lists them.)"
    )


def with_recipe_of_checkpoint(args: list[str]) -> list[str]:
    """`args` of `mode=evaluate|sample checkpoint=<run>` without a `recipe=`: with
    the recipe the run was trained with (its saved config's task and precision),
    so that the command line's model and data keys compose against the run's own
    schemas; `_run.from_checkpoint` then takes the rest from the checkpoint."""
    given = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
    if given.get("mode") not in ("evaluate", "sample") or "recipe" in given:
        return args
    if "checkpoint" not in given:
        return args
    try:
        path = checkpoint_path(given["checkpoint"])
        saved = lowtrain.checkpoint_extra(path).get("config") or {}
    except (ValueError, OSError, lowtrain.CheckpointCorruptError):
        return args  # the run says what is wrong with it, in one line
    recipe = f"{saved.get('task')}_{(saved.get('precision') or {}).get('name')}"
    if recipe in _group_options().get("recipe", []):
        return [*args, f"recipe={recipe}"]
    return args
