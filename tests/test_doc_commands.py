"""Every shell command of the README and of the docs site (its ```bash blocks) is
checked, so a documented command cannot fail:

- `python -m lowtrain ...`: its overrides compose into a config that checks out
  (fast: Hydra's compose API, each job of a sweep), and it runs, at a tiny size on
  fake data, in a subprocess (slow: the overrides of `_tiny` added);
- `python <script>.py ...`: the script's argparse parser takes its arguments (the
  script stops there, nothing runs);
- anything else is in `SKIPPED` with the reason, or this test fails.

Words in angle brackets (`<run>`) are the reader's to fill in: see `_RUN_KEYS`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from lowtrain.recipes import _config, _run

from .helpers import fake_mnist
from .test_docs import PAGES, README, ROOT
from .test_recipes import RECIPES

_config.register()

# Documented commands that are not checked here, matched as a substring of the
# command, each with why.
SKIPPED = {
    "python3 -m venv": "makes a virtualenv: the suite runs in one already",
    ". .venv/bin/activate": "activates that virtualenv",
    "pip install": "installs packages from PyPI: needs the network",
    "python -m pytest": "the test suite itself",
    "mkdocs build": "tests/test_docs.py::test_site_builds_strict builds the site",
    # A placeholder for the reader's own package; the guide's real one
    # (tests/user_task) runs.
    "task=my_pkg.": "names the reader's own task package, which does not exist",
}
# Documented `python -m lowtrain` commands that compose but do not run here.
NOT_RUN = {
    # Each waits for the other at the coordinator; tests/test_distributed.py runs
    # such a pair through the CLI.
    "distributed.coordinator_address=": "one of two processes that run together",
}

# Words in angle brackets name a run directory a reader made before, in these keys'
# values (`checkpoint=outputs/gpt_bf16/<run>`, `hydra.run.dir=outputs/gpt_fp16/
# <date>_<time>`): the word becomes the folder's name (`outputs/gpt_bf16/run`), and
# the run test trains the command's recipe there first, at the tiny size.
_RUN_KEYS = ("checkpoint", "hydra.run.dir")
_PLACEHOLDER = re.compile(r"<(\w+)>")
# Keys (and, ending in a dot, prefixes) that use a run rather than define it: left
# out of that first run.
_RUN_USE = (
    *("checkpoint", "mode", "sample."),
    *("trainer.resume", "trainer.resume_allow", "hydra."),
)

# Hydra's flags that take a value (`--config-dir DIR`); its other flags stand alone.
_VALUE_FLAGS = {"--config-dir", "-cd", "--config-name", "-cn", "--cfg", "-c"}
_BASH = re.compile(r"```bash\n(.*?)```", re.S)
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


@dataclasses.dataclass(frozen=True)
class Command:
    """One documented shell command: its environment assignments and its words
    (shell quoting and comments removed, `nice -n N` dropped), and where it is."""

    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    where: str

    def __str__(self):
        return shlex.join([f"{k}={v}" for k, v in self.env] + list(self.argv))

    @property
    def kind(self) -> str:
        """`lowtrain` (`python -m lowtrain`), `script` (`python <file>.py`), `skip`
        (in `SKIPPED`) or `unknown`."""
        if any(pattern in str(self) for pattern in SKIPPED):
            return "skip"
        python = self.argv[0] in ("python", "python3")
        if python and self.argv[1:3] == ("-m", "lowtrain"):
            return "lowtrain"
        if python and len(self.argv) > 1 and self.argv[1].endswith(".py"):
            return "script"
        return "unknown"

    def hydra_args(self) -> tuple[list[str], dict[str, str]]:
        """A `python -m lowtrain` command's overrides (placeholders filled in) and
        Hydra flags (`{"--config-dir": "tests/user_task/conf", "-m": ""}`)."""
        overrides, flags = [], {}
        words = iter(self.argv[3:])
        for word in words:
            if word.startswith("-"):
                flags[word] = next(words) if word in _VALUE_FLAGS else ""
            else:
                overrides.append(_PLACEHOLDER.sub(r"\1", word))
        return overrides, flags


def _commands(path: pathlib.Path) -> list[Command]:
    text = path.read_text()
    found = []
    for block in _BASH.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        joined, start = "", first
        for number, line in enumerate(block.group(1).split("\n"), first):
            if not joined:
                start = number
            if line.endswith("\\"):  # goes on in the next line: one command
                joined += line[:-1] + " "
                continue
            words = shlex.split(joined + line, comments=True)
            joined = ""
            where = f"{path.relative_to(ROOT).as_posix()}:{start}"
            while words:  # `a && b`: two commands
                end = words.index("&&") if "&&" in words else len(words)
                found.append(_command(words[:end], where))
                words = words[end + 1 :]
    return found


def _command(words: list[str], where: str) -> Command:
    env = []
    while words and _ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env.append((key, value))
    if words[:1] == ["nice"]:  # a lower priority changes nothing the test checks
        words = words[3:] if words[1:2] == ["-n"] else words[1:]
    return Command(tuple(env), tuple(words), where)


COMMANDS = [c for page in (README, *PAGES) for c in _commands(page)]


def _unique(kind: str) -> list[Command]:
    # A command documented on two pages is checked once (its first place).
    seen = {}
    for command in COMMANDS:
        if command.kind == kind:
            seen.setdefault(str(command), command)
    return list(seen.values())


LOWTRAIN = _unique("lowtrain")
SCRIPTS = _unique("script")


def test_every_documented_command_is_checked_or_skipped():
    assert len(LOWTRAIN) >= 20 and len(SCRIPTS) >= 10  # the collection works
    unknown = [f"{c.where}: {c}" for c in COMMANDS if c.kind == "unknown"]
    assert not unknown, (
        "Expected every documented shell command to be `python -m lowtrain ...`, "
        f"`python <script>.py ...` or in SKIPPED, got {unknown} instead. Check it "
        "here, or add it to SKIPPED in tests/test_doc_commands.py with why."
    )
    for command in LOWTRAIN:
        placeholders = [w for w in command.argv if _PLACEHOLDER.search(w)]
        stray = [w for w in placeholders if w.partition("=")[0] not in _RUN_KEYS]
        assert not stray, (
            f"{command.where}: expected words in angle brackets only in "
            f"{_RUN_KEYS}, got {stray} instead: say in _RUN_KEYS (tests/"
            "test_doc_commands.py) what the test fills in."
        )


def _jobs(overrides: list[str]) -> list[list[str]]:
    # A sweep's jobs, each as its overrides: `precision=fp32,bf16` is two jobs, one
    # with `precision=fp32`, one with `precision=bf16` (Hydra's basic sweeper runs
    # every combination of the swept values).
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    return [list(job) for job in itertools.product(*values)]


def _compose(command: Command, *extra: str, job: int = 0, hydra: bool = False):
    """The config of `command`'s job number `job` (a sweep's; else its only one),
    with `extra` overrides after its own, as `python -m lowtrain` composes it:
    `--config-dir` as a search path (with the Hydra config if `hydra`)."""
    overrides, flags = command.hydra_args()
    overrides = _jobs(overrides)[job] + list(extra)
    if "--config-dir" in flags:
        folder = (ROOT / flags["--config-dir"]).resolve()
        overrides.append(f"hydra.searchpath=[file://{folder}]")
    name = flags.get("--config-name", "config")
    with initialize_config_module("lowtrain.conf", version_base="1.3"):
        return compose(name, overrides=overrides, return_hydra_config=hydra)


@pytest.fixture
def command_path(monkeypatch):
    """Makes the `PYTHONPATH` of a command (relative to the checkout) importable."""

    def use(command: Command):
        for key, value in command.env:
            if key == "PYTHONPATH":
                for folder in value.split(os.pathsep):
                    monkeypatch.syspath_prepend(str(ROOT / folder))

    return use


@pytest.mark.parametrize("command", LOWTRAIN, ids=str)
def test_documented_lowtrain_command_composes(command, command_path, monkeypatch):
    # What the CLI checks before it starts (`_run.check`: keys, types, values, the
    # task, precision and optimizer it builds), for every job of a sweep.
    command_path(command)
    for job in range(len(_jobs(command.hydra_args()[0]))):
        cfg = _compose(command, job=job)
        # A task of the user's own (`cnn_bn.CnnBnTask`) is imported from where the
        # command says (its PYTHONPATH), not found in `sys.modules` because another
        # test in this process imported it (tests/test_user_task.py does).
        top, dot, _ = cfg.task.partition(".")
        if dot and top != "lowtrain":
            for name in [n for n in sys.modules if n.partition(".")[0] == top]:
                monkeypatch.delitem(sys.modules, name)
        _run.check(cfg)


# -- scripts: their arguments parsed, nothing run ----------------------------------

# Runs each script (`sys.argv[1:]`: JSON `[[env, argv], ...]`) as `python
# <script>.py` would, until its argparse parser has taken the arguments; prints one
# line per command, `@@ ` and JSON: the exit status (0: parsed, 2: argparse refused)
# and what argparse wrote.
_PARSE_ONLY = r"""
import argparse, contextlib, io, json, os, runpy, sys

class Parsed(BaseException):
    pass

parse_args = argparse.ArgumentParser.parse_args

def parse_only(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_only
path = list(sys.path)
for env, argv in json.loads(sys.argv[1]):
    os.environ.update(env)
    sys.argv, sys.path[:] = argv, [os.path.dirname(os.path.abspath(argv[0])), *path]
    status, err = None, io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except Parsed:
            status = 0
        except SystemExit as e:
            status = e.code
    print("@@", json.dumps({"status": status, "stderr": err.getvalue()}))
"""


def test_documented_script_commands_parse():
    # One process for all (the scripts share their imports: JAX, the benchlib).
    commands = [[dict(c.env), list(c.argv[1:])] for c in SCRIPTS]
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, json.dumps(commands)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@ ")]
    results = [json.loads(line[3:]) for line in lines]
    assert len(results) == len(SCRIPTS), done.stdout[-3000:]
    failed = [
        f"{c.where}: {c}\n  exit {r['status']}: {r['stderr'].strip()[-500:]}"
        for c, r in zip(SCRIPTS, results)
        if r["status"] != 0
    ]
    assert not failed, (
        "Expected every documented script command's arguments to parse (exit "
        "status 0: parsed; None: the script ran without parsing any), got:\n"
        + "\n".join(failed)
    )


# -- lowtrain commands, run at a tiny size -----------------------------------------

_TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\n" * 40
# Intervals that, named by a command, are what it shows (`trainer.eval_every=10`
# with early stopping, `trainer.numerics_every=100`): every 2 steps in the tiny run;
# unnamed, off.
_INTERVALS = ("eval_every", "checkpoint_every", "numerics_every")


def _tiny(command: Command, data: dict[str, pathlib.Path]) -> list[str]:
    """The overrides that make `command` tiny: 4 steps of a tiny model on fake data
    (`data`: "mnist", a folder of IDX files, and "text", a text file)."""
    cfg = _compose(command, hydra=True)
    choice = cfg.hydra.runtime.choices.data
    assert choice in ("mnist", "shakespeare", "text"), (
        f"{command.where}: expected data=mnist, shakespeare or text, got {choice} "
        "instead: say in _tiny (tests/test_doc_commands.py) what data it gets."
    )
    kind = "mnist" if choice == "mnist" else "text"
    tiny = [f"data.path={data[kind]}", f"data.cache_dir={data['cache']}"]
    if kind == "text":
        tiny.append("data.eval_batches=2")
    model = cfg.model
    if "n_layer" in model:  # the GPTs: 2 layers, width 16, context 8
        tiny += [f"model.{k}={v}" for k, v in (("n_layer", 2), ("n_head", 2))]
        tiny += ["model.n_embd=16", "model.block_size=8"]
    if "hidden" in model:  # a list (MLP) or a number (CNN's head)
        tiny.append(f"model.hidden={[16] if OmegaConf.is_list(model.hidden) else 16}")
    if "channels" in model:
        tiny.append("model.channels=[4,8]")
    if "eval_examples" in model:  # the user task's own key
        tiny.append("model.eval_examples=16")
    if "warmup_steps" in cfg.optimizer:
        tiny.append("optimizer.warmup_steps=1")
    named = {o.split("=")[0].lstrip("+~") for o in command.hydra_args()[0]}
    tiny += [
        f"trainer.{k}={2 if f'trainer.{k}' in named else 'null'}" for k in _INTERVALS
    ]
    tiny += [
        *("trainer.epochs=null", "trainer.steps=4", "trainer.log_every=2"),
        *("trainer.batch_size=8", "trainer.eval_batch_size=8"),
        *("trainer.progress=false", "sample.length=16"),
    ]
    return tiny


def _uses_run(key: str) -> bool:
    return any(key == k or k.endswith(".") and key.startswith(k) for k in _RUN_USE)


def _first_run(command: Command, tiny: list[str], cwd: pathlib.Path) -> None:
    # The run a `<run>` of the command names, trained in process: the command's
    # overrides but those that use a run, at the same tiny size.
    overrides, _ = command.hydra_args()
    for override in overrides:
        key, _, value = override.partition("=")
        if key in _RUN_KEYS and not (cwd / value).exists():
            keep = [o for o in overrides if not _uses_run(o.partition("=")[0])]
            base = dataclasses.replace(command, argv=command.argv[:3] + tuple(keep))
            _run.run(_compose(base, *tiny), cwd / value)


def _with_run_recipe(command: Command) -> Command:
    # A command that names only a run (`mode=sample checkpoint=outputs/gpt_bf16/
    # <run>`, which takes its config from the run's checkpoint): sized and trained
    # as the recipe the run's folder is named after.
    overrides, _ = command.hydra_args()
    if any(o.startswith("recipe=") for o in overrides):
        return command
    for override in overrides:
        key, _, value = override.partition("=")
        recipe = pathlib.Path(value).parent.name
        if key in _RUN_KEYS and recipe in RECIPES:
            return dataclasses.replace(
                command, argv=(*command.argv, f"recipe={recipe}")
            )
    return command


def _not_run(command: Command) -> list:
    # The skip marks of NOT_RUN's patterns in `command`: the report says why.
    why = [why for pattern, why in NOT_RUN.items() if pattern in str(command)]
    return [pytest.mark.skip(reason=w) for w in why]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=_not_run(c)) for c in LOWTRAIN], ids=str
)
def test_documented_lowtrain_command_runs(command, tmp_path, command_path):
    data = {
        "mnist": fake_mnist(tmp_path / "data" / "mnist", n_train=64, n_test=16),
        "text": tmp_path / "data" / "text.txt",
        "cache": tmp_path / "data" / "cache",
    }
    data["text"].write_text(_TEXT)
    command_path(command)
    tiny = _tiny(_with_run_recipe(command), data)
    # The command runs in an empty folder, where its outputs/ and multirun/ land;
    # its relative paths into the checkout (tests/user_task) go through a link.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "tests").symlink_to(ROOT / "tests")
    _first_run(_with_run_recipe(command), tiny, cwd)
    # The command's own words, `-m` where it stands, the tiny overrides after its
    # last override: after a flag (`--cfg job`) Hydra's argparse takes none.
    words = [_PLACEHOLDER.sub(r"\1", w) for w in command.argv[1:]]
    overrides = [i for i, w in enumerate(words) if "=" in w and w[0] != "-"]
    last = max(overrides, default=len(words) - 1)
    words[last + 1 : last + 1] = tiny
    done = subprocess.run(
        [sys.executable, *words],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **dict(command.env)},
    )
    assert done.returncode == 0, (
        f"{command.where}: `{command}` failed at the tiny size:\n{done.stderr[-4000:]}"
    )
