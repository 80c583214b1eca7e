"""How steps compile: JAX's persistent compilation cache (`use_compilation_cache`, on
by default in the CLI) and XLA's GEMM kernels (`use_triton_gemm`). Each launch is a
real, fresh process, as a user's second launch is."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import lowtrain
from lowtrain.train import default_compilation_cache, use_compilation_cache

from .helpers import fake_mnist
from .test_recipes import TINY_MNIST

# One launch: the cache as `argv[1]` says, one program compiled (its compile counts
# however short: the threshold at 0), JAX's cache events and the result printed.
LAUNCH = r"""
import json, sys
import jax, jax.numpy as jnp
import lowtrain

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.jit(jnp.cos)(1.0)  # JAX used before the cache is set: it must still apply
given = None if sys.argv[1] == "None" else sys.argv[1]
folder = lowtrain.train.use_compilation_cache(given)
events.clear()  # the events of this program only
x = jnp.arange(64.0).reshape(8, 8)
y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(x)
kinds = [e.rsplit("/", 1)[-1] for e in events if "compilation_cache/cache_" in e]
print(json.dumps({"folder": str(folder), "events": kinds, "y": y.tolist()}))
"""


def _launch(cache, env=None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(cache)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_launch_reads_what_the_first_compiled(tmp_path):
    first = _launch(tmp_path / "cache")
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    second = _launch(tmp_path / "cache")
    assert first["folder"] == str((tmp_path / "cache").resolve())
    assert "cache_misses" in first["events"] and "cache_hits" not in first["events"]
    assert "cache_hits" in second["events"] and "cache_misses" not in second["events"]
    assert any(name.startswith("jit__lambda") for name in entries)
    # Nothing new written by the second launch, and the same numbers from the read.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries
    assert second["y"] == first["y"]


def test_off_writes_nothing_and_reads_nothing(tmp_path):
    _launch(tmp_path / "cache")  # a filled cache, which `None` must not read
    off = _launch("None", env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")})
    assert off["folder"] == "None" and off["events"] == []


def test_default_folder(monkeypatch, tmp_path):
    for name in ("LOWTRAIN_COMPILE_CACHE", "LOWTRAIN_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    home = pathlib.Path("~/.cache/lowtrain/jax-compile").expanduser()
    assert default_compilation_cache() == home
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compilation_cache() == tmp_path / "xdg" / "lowtrain" / "jax-compile"
    monkeypatch.setenv("LOWTRAIN_CACHE", str(tmp_path / "lt"))
    assert default_compilation_cache() == tmp_path / "lt" / "jax-compile"
    monkeypatch.setenv("LOWTRAIN_COMPILE_CACHE", str(tmp_path / "mine"))
    assert default_compilation_cache() == tmp_path / "mine"
    for off in ("off", "OFF", "none", ""):
        monkeypatch.setenv("LOWTRAIN_COMPILE_CACHE", off)
        assert default_compilation_cache() is None


@pytest.fixture
def restore_cache_config():
    saved = (
        jax.config.jax_enable_compilation_cache,
        jax.config.jax_compilation_cache_dir,
    )
    yield
    use_compilation_cache(saved[1] if saved[0] else None)


def test_default_keeps_the_folder_jax_was_given(tmp_path, restore_cache_config):
    use_compilation_cache(tmp_path / "given")
    assert use_compilation_cache("default") == (tmp_path / "given").resolve()
    assert jax.config.jax_compilation_cache_dir == str((tmp_path / "given").resolve())
    assert use_compilation_cache("off") is None
    assert not jax.config.jax_enable_compilation_cache


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path, restore_cache_config):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(
        ValueError, match="Expected a folder the compilation cache"
    ) as e:
        use_compilation_cache(tmp_path / "file" / "cache")
    assert "trainer.compile_cache=null" in str(e.value)


TRITON = r"""
import json, os, sys
import lowtrain
before = lowtrain.train.use_triton_gemm(sys.argv[1] == "on")
flags_before_jax = os.environ.get("XLA_FLAGS", "")
import jax.numpy as jnp
jnp.ones(3).sum().block_until_ready()  # the backend reads XLA_FLAGS now
after = lowtrain.train.use_triton_gemm(sys.argv[1] != "on")
print(json.dumps({"before": before, "flags": flags_before_jax, "after": after,
                  "flags_after": os.environ.get("XLA_FLAGS", "")}))
"""


@pytest.mark.parametrize(
    "given, wanted, in_effect, flags, after",
    [
        ("", "off", True, "--xla_gpu_enable_triton_gemm=false", False),
        ("", "on", True, "", False),  # XLA's default: nothing to add
        # The user's own flag wins: "on" is in effect, whatever is asked later.
        ("--xla_gpu_enable_triton_gemm=true", "off", False, None, True),
        ("--xla_dump_to=/tmp/x", "off", True, None, False),  # other flags kept
    ],
)
def test_triton_gemm_flag(given, wanted, in_effect, flags, after):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if given:
        env["XLA_FLAGS"] = given
    done = subprocess.run(
        [sys.executable, "-c", TRITON, wanted], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] is in_effect
    if flags is not None:
        assert out["flags"] == flags
    if given:
        assert out["flags"].startswith(given)
    if given == "--xla_dump_to=/tmp/x":
        assert out["flags"].endswith("--xla_gpu_enable_triton_gemm=false")
    # Once JAX has read XLA_FLAGS, asking for the other choice changes nothing.
    assert out["flags_after"] == out["flags"]
    assert out["after"] is after


@pytest.mark.slow
def test_the_cli_launches_twice_from_its_cache(tmp_path):
    # `python -m lowtrain` with its cache on: the second launch reads the step the
    # first one compiled (nothing new in the folder) and trains to the same loss.
    data = fake_mnist(tmp_path / "idx", n_train=128, n_test=32)
    cache = tmp_path / "compile-cache"
    losses = []
    for n in range(2):
        command = [
            *(sys.executable, "-m", "lowtrain", "recipe=mnist_bf16"),
            *(f"data.path={data}", f"hydra.run.dir={tmp_path / f'run{n}'}"),
            *TINY_MNIST,
            *("trainer.steps=4", "trainer.eval_every=null", "trainer.log_every=2"),
            *("trainer.checkpoint_every=null", "trainer.progress=false"),
            f"trainer.compile_cache={cache}",
        ]
        env = {k: v for k, v in os.environ.items() if k != "LOWTRAIN_COMPILE_CACHE"}
        # Every program kept, however short its compile (a tiny MLP on a CPU).
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        log = (tmp_path / f"run{n}" / "lowtrain.log").read_text()
        assert f"compilation cache: {cache.resolve()}" in log
        if n == 0:
            entries = sorted(p.name for p in cache.iterdir())
            assert any(name.startswith("jit_") for name in entries)
        rows = (tmp_path / f"run{n}" / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(r)["loss"] for r in rows if '"loss"' in r])
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert losses[0] == losses[1]


def test_the_cli_config_keys():
    from lowtrain.recipes import _run

    from .test_recipes import make_config

    config = _run.to_config(make_config("recipe=mnist"))
    assert config.trainer.compile_cache == "default"
    assert config.trainer.triton_gemm is False
    config = _run.to_config(
        make_config(
            "recipe=mnist", "trainer.compile_cache=null", "trainer.triton_gemm=true"
        )
    )
    assert config.trainer.compile_cache is None and config.trainer.triton_gemm is True
    assert lowtrain.train.use_compilation_cache is use_compilation_cache
