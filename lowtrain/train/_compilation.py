"""How steps compile: JAX's persistent compilation cache (`use_compilation_cache`), so
that a program's second launch reads its compiled steps from disk instead of compiling
them again, and which kernels XLA may use for GEMMs on a GPU (`use_triton_gemm`)."""

from __future__ import annotations

import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from .._compat import backends_initialized

# `LOWTRAIN_COMPILE_CACHE`: a folder, or "off"; read by `use_compilation_cache()`.
ENV = "LOWTRAIN_COMPILE_CACHE"
OFF = ("off", "none", "false", "0", "")


def default_compilation_cache() -> pathlib.Path | None:
    """Where `use_compilation_cache("default")` puts the cache:
    `$LOWTRAIN_COMPILE_CACHE` if set (None where it says "off"), else `jax-compile/`
    in lowtrain's cache folder: `$LOWTRAIN_CACHE`, else `$XDG_CACHE_HOME/lowtrain`,
    else `~/.cache/lowtrain`.

    ```python
    import os

    import lowtrain

    os.environ["LOWTRAIN_COMPILE_CACHE"] = "off"  # as the test suite runs
    assert lowtrain.train.default_compilation_cache() is None
    ```
    """
    if ENV in os.environ:
        value = os.environ[ENV].strip()
        return None if value.lower() in OFF else pathlib.Path(value).expanduser()
    if root := os.environ.get("LOWTRAIN_CACHE"):
        return pathlib.Path(root).expanduser() / "jax-compile"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return pathlib.Path(xdg).expanduser() / "lowtrain" / "jax-compile"


def use_compilation_cache(
    path: str | os.PathLike | None = "default",
) -> pathlib.Path | None:
    """Turn JAX's persistent compilation cache on in `path`, or off (`None`); the
    folder in use, or None.

    **Arguments:**

    - `path`: a folder (made if missing); `"default"`: the folder JAX is already
      configured with (`JAX_COMPILATION_CACHE_DIR`, `jax_compilation_cache_dir`) if
      any, else `default_compilation_cache()`; `None` or `"off"`: no persistent
      cache (programs compile at every launch).

    Every program compiled afterwards whose compile took at least
    `jax_persistent_cache_min_compile_time_secs` (JAX's default: 1 s) is written to
    the folder, and read from it by any later process that compiles the same
    program with the same JAX, XLA flags and devices. `python -m lowtrain` calls it
    at launch with `trainer.compile_cache` (default `"default"`), and
    `scripts/bench.py` with `--compile-cache`.

    The folder holds executables that JAX loads and runs: keep it where only you
    can write (JAX's own warning: a writable shared cache lets others run code in
    your process).

    ```python
    import tempfile

    import jax
    import jax.numpy as jnp
    import lowtrain

    folder = lowtrain.train.use_compilation_cache(tempfile.mkdtemp())
    assert jax.config.jax_compilation_cache_dir == str(folder)
    jax.jit(jnp.sin)(1.0)  # compiled, and kept if its compile took >= 1 s
    assert lowtrain.train.use_compilation_cache(None) is None  # off again
    ```
    """
    if isinstance(path, str) and path.strip().lower() in OFF:
        path = None
    if isinstance(path, str) and path == "default":
        configured = jax.config.jax_compilation_cache_dir
        found = pathlib.Path(configured) if configured else default_compilation_cache()
    else:
        found = None if path is None else pathlib.Path(path).expanduser()
    if found is not None:
        found = found.resolve()
        try:
            found.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"Expected a folder the compilation cache can be written to, got "
                f"{str(found)!r} ({e.strerror}). Pass another folder, or None to "
                f"compile at every launch (`trainer.compile_cache=null`, "
                f"`{ENV}=off`)."
            ) from None
    jax.config.update("jax_enable_compilation_cache", found is not None)
    jax.config.update(
        "jax_compilation_cache_dir", None if found is None else str(found)
    )
    # JAX opens its cache once, at the first compile: reset it so that this folder
    # (or none) is the one the next compile uses.
    _jax_cache.reset_cache()
    return found


TRITON_GEMM_FLAG = "--xla_gpu_enable_triton_gemm"


def use_triton_gemm(enabled: bool) -> bool:
    """Let XLA run GEMMs as Triton fusions on a GPU (`True`, XLA's default) or leave
    every GEMM to cuBLAS/cuBLASLt (`False`); whether the choice is in effect.

    **Arguments:**

    - `enabled`: `False` adds `--xla_gpu_enable_triton_gemm=false` to `XLA_FLAGS`.
      With Triton GEMMs XLA's autotuner times tile configurations for every GEMM
      shape when a step compiles: on an H200 that took the first compile of the fp8
      gpt_small step from 6 s (cuBLAS only) to 112 s, and the bf16 step was no
      faster for it (docs/performance.md).

    XLA reads `XLA_FLAGS` once, when JAX first uses a device: call it before. It
    returns False, changing nothing, where that has happened already, or where
    `XLA_FLAGS` sets the flag otherwise (the user's own flag wins). Other
    platforms ignore the flag. `python -m lowtrain` calls it at launch with
    `trainer.triton_gemm` (default false).

    ```python
    import lowtrain

    in_effect = lowtrain.train.use_triton_gemm(False)
    # Here JAX has run already (this page's other examples): nothing changes.
    assert in_effect in (True, False)
    ```
    """
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = f"{TRITON_GEMM_FLAG}={str(bool(enabled)).lower()}"
    given = [f for f in flags.split() if f.split("=")[0] == TRITON_GEMM_FLAG]
    if given:
        value = given[-1].partition("=")[2].lower() or "true"
        return value in ("true", "1") if enabled else value in ("false", "0")
    if enabled:  # XLA's default
        return True
    if backends_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {wanted}".strip()
    return True
