"""Packaging: every package ships, and `python -m lowtrain` finds its configs whether
lowtrain is installed from a wheel or editable."""

import json
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

from .helpers import fake_mnist

ROOT = pathlib.Path(__file__).parent.parent


def test_installed_configs_are_the_checkouts():
    # Catches a YAML file that the package-data globs in setup.py leave out of the
    # wheel (CI installs the wheel; a local run checks the editable install).
    import importlib.resources

    installed = importlib.resources.files("lowtrain.conf")
    for path in (ROOT / "conf").rglob("*.yaml"):
        relative = path.relative_to(ROOT / "conf").parts
        shipped = installed.joinpath(*relative)
        assert shipped.is_file(), f"conf/{'/'.join(relative)} is not installed"
        assert shipped.read_text() == path.read_text()


def _venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / "python"


def _run(*args, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_installed_lowtrain_finds_its_configs(tmp_path, editable):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv))
    python = str(_venv_python(venv))
    # Dependencies come from this environment; lowtrain itself from the new install.
    purelib = _run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    )
    # This environment's packages but its own lowtrain (installed from a wheel, it
    # would shadow the editable install's finder): linked one by one.
    deps = tmp_path / "deps"
    deps.mkdir()
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in pathlib.Path(site).iterdir():
            own = entry.name.startswith(("lowtrain", "__editable__")) or (
                entry.suffix == ".pth"
            )
            if not own and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (pathlib.Path(purelib.strip()) / "_deps.pth").write_text(str(deps))
    install = ["-e", str(ROOT)] if editable else [str(ROOT)]
    _run(python, "-m", "pip", "install", "-q", "--no-deps", *install)

    work = tmp_path / "work"  # outside the checkout: no accidental imports from it
    work.mkdir()
    where = json.loads(
        _run(
            python,
            "-c",
            "import json, lowtrain.recipes, lowtrain.conf; print(json.dumps("
            "[lowtrain.recipes.__file__, lowtrain.conf.__file__]))",
            cwd=work,
        )
    )
    inside = [pathlib.Path(p).resolve().is_relative_to(ROOT.resolve()) for p in where]
    assert inside == [editable, editable], where

    cfg = _run(python, "-m", "lowtrain", "--cfg", "job", "recipe=gpt_fp8", cwd=work)
    assert "task: gpt" in cfg and "name: fp8" in cfg

    folder = fake_mnist(tmp_path / "idx", n_train=64, n_test=32)
    out = _run(
        python,
        "-m",
        "lowtrain",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "model.hidden=[8]",
        "trainer.steps=2",
        "trainer.batch_size=32",
        "trainer.eval_batch_size=32",
        "trainer.progress=false",
        cwd=work,
    )
    assert "test accuracy:" in out and (tmp_path / "run" / "summary.json").is_file()
