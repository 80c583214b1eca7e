"""Several processes training one model: `jax.distributed` started from the
`distributed` config, and one run directory that every process agrees on.

Hydra names the run directory before any process knows of the others, and
`${now:...}` differs between processes started a second apart. So process 0's
directory is the run's: it is broadcast to the others, which write their checkpoint
shards there, and each other process moves its own Hydra directory (its
`lowtrain.log` and `.hydra/`) into `<run dir>/process_<i>/`. Pass the same
`hydra.run.dir=...` to every process to name the directory yourself.
"""

from __future__ import annotations

import logging
import os
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from ._config import DistributedConfig

log = logging.getLogger("lowtrain")

_PATH_BYTES = 4096  # the longest run directory path broadcast (PATH_MAX on Linux)


def initialize(config: DistributedConfig) -> None:
    """`jax.distributed.initialize` with the keys `config` sets, if it sets any (or
    `auto`); nothing for one process. Call it before any JAX computation."""
    if not config.enabled:
        return
    # CPU devices of several processes talk through gloo (TCP); GPUs and TPUs use
    # their own collectives and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keys = ("coordinator_address", "num_processes", "process_id")
    given = {k: getattr(config, k) for k in keys if getattr(config, k) is not None}
    log.info(
        "waiting up to %d s for %s processes at %s",
        config.timeout_s,
        config.num_processes or "all",
        config.coordinator_address or "the address the cluster gives",
    )
    try:
        jax.distributed.initialize(**given, initialization_timeout=config.timeout_s)
    except Exception as e:  # JAX's own error types vary; re-raised with the setup
        raise RuntimeError(
            f"The processes did not all join within {config.timeout_s} s "
            f"(coordinator {config.coordinator_address}, {config.num_processes} "
            f"processes, this one {config.process_id}): {str(e).splitlines()[0]}. "
            "Start every process with the same coordinator address and process "
            "count, or raise `distributed.timeout_s`."
        ) from e
    log.info(
        "process %d of %d: %d local devices, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def shared_run_dir(own: pathlib.Path) -> pathlib.Path:
    """Process 0's run directory, on every process (`own`: this process's).

    A process other than 0 whose own directory differs moves it into
    `<run dir>/process_<i>` (its open log file moves with it)."""
    if jax.process_count() == 1:
        return own
    encoded = str(own).encode()
    if len(encoded) >= _PATH_BYTES:
        raise ValueError(
            f"Expected a run directory path shorter than {_PATH_BYTES} bytes, got "
            f"{len(encoded)} bytes instead. Pass a shorter `hydra.run.dir`."
        )
    buffer = np.zeros(_PATH_BYTES, np.uint8)
    buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    shared = pathlib.Path(got.tobytes().rstrip(b"\0").decode())
    if jax.process_index() and shared != own:
        shared.mkdir(parents=True, exist_ok=True)
        target = shared / f"process_{jax.process_index()}"
        try:
            os.replace(own, target)
        except OSError as e:  # another file system: leave it where it is
            log.warning("kept this process's log in %s (%s)", own, e)
    multihost_utils.sync_global_devices("lowtrain run directory")
    return shared
