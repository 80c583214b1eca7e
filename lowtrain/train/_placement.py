"""Where the Trainer's arrays live: the state replicated or sharded (FSDP) over the
"data" axis of its mesh, batches split over it."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._multiprocess import put_global

# Under "fsdp", arrays with fewer elements than this stay replicated: biases, norm
# scales, loss scales, counters. Gathering them costs a collective each for a few
# bytes saved.
FSDP_MIN_SIZE = 1024


def data_mesh(
    devices: Sequence[jax.Device] | None, sharding: str
) -> tuple[list[jax.Device], Mesh, str]:
    """The Trainer's devices (default `jax.devices()`), their 1-D "data" mesh, and
    `sharding` checked to name a strategy ("replicated" or "fsdp")."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("Expected at least one device in `devices`, got none.")
    if sharding not in _SPECS:
        raise ValueError(
            f"Expected `sharding` 'replicated' or 'fsdp', got {sharding!r} instead."
        )
    return devices, Mesh(np.array(devices), ("data",)), sharding


def array_spec(shape: tuple[int, ...], n_devices: int, sharding: str) -> P:
    """The `PartitionSpec` the Trainer gives a state array of `shape` (a parameter,
    an optimizer moment, a loss scale, ...) on a "data" mesh of `n_devices`.

    "replicated": `P()`. "fsdp": split over "data" along its largest dimension that
    divides by `n_devices` (the first such if several are as large), or `P()`
    (replicated) if it has fewer than 1024 elements (`FSDP_MIN_SIZE`: biases, norm
    scales, counters), no such dimension, or there is one device.

    **Arguments:**

    - `shape`: the array's shape, a tuple of ints.
    - `n_devices`: the number of devices on the "data" mesh axis.
    - `sharding`: the strategy, `Trainer`'s `sharding`: "replicated" or "fsdp".

    ```python
    from jax.sharding import PartitionSpec as P
    from lowtrain.train import array_spec

    assert array_spec((64, 256), 8, "fsdp") == P(None, "data")
    assert array_spec((100, 30), 8, "fsdp") == P()  # no dimension divides by 8
    assert array_spec((256,), 8, "fsdp") == P()  # small: replicated
    assert array_spec((64, 256), 8, "replicated") == P()
    ```
    """
    return _SPECS[sharding](tuple(shape), n_devices)


def _replicated_spec(shape: tuple[int, ...], n_devices: int) -> P:
    return P()


def _fsdp_spec(shape: tuple[int, ...], n_devices: int) -> P:
    if n_devices == 1 or int(np.prod(shape, dtype=np.int64)) < FSDP_MIN_SIZE:
        return P()
    axes = [a for a, d in enumerate(shape) if d % n_devices == 0]
    if not axes:
        return P()
    axis = max(axes, key=lambda a: (shape[a], -a))
    return P(*(None,) * axis, "data")


# The strategies `Trainer(sharding=...)` knows: name -> the spec of one state array.
_SPECS = {"replicated": _replicated_spec, "fsdp": _fsdp_spec}


def _state_sharding(mesh: Mesh, sharding: str, x) -> NamedSharding:
    return NamedSharding(mesh, array_spec(x.shape, mesh.size, sharding))


def constrain_state(mesh: Mesh, sharding: str, tree: PyTree) -> PyTree:
    """`tree` with every array constrained to its `array_spec` (in a trace)."""
    return jax.tree.map(
        lambda x: (
            jax.lax.with_sharding_constraint(x, _state_sharding(mesh, sharding, x))
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


def put_state(mesh: Mesh, sharding: str, tree: PyTree) -> PyTree:
    """A copy of `tree` with every array placed on `mesh` as `array_spec` says."""
    dynamic, static = eqx.partition(tree, eqx.is_array)
    shardings = jax.tree.map(lambda x: _state_sharding(mesh, sharding, x), dynamic)
    dynamic = put_global(dynamic, shardings)  # also multi-process
    return eqx.combine(dynamic, static)


def shard_batch(devices: Sequence[jax.Device], mesh: Mesh, batch: PyTree) -> PyTree:
    """`batch` placed on `mesh`, split along its leading axis (see `Trainer`)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(x)
        if not shape or shape[0] % len(local):
            raise ValueError(
                f"Expected every batch array's leading axis to divide by the "
                f"number of devices ({len(local)}), got shape {shape} at "
                f"`batch{jax.tree_util.keystr(path)}` instead. Use a batch size "
                f"that is a multiple of {len(local)}, or pass "
                "`devices=jax.devices()[:n]` to the Trainer."
            )
    sharding = NamedSharding(mesh, P("data"))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
        batch,
    )


def step_batch(devices: Sequence[jax.Device], mesh: Mesh, batch: PyTree) -> PyTree:
    """`batch` as `Trainer.fit` passes it to the compiled step: `shard_batch(...)`,
    except on one device of one process with every leaf a NumPy array (of rank >= 1),
    where it is a host copy of `batch` that the call itself puts on the device.

    That call does in C++ what `jax.device_put` does in tens of microseconds of
    Python per step (the plain loop `step(data(s), state)` does the same), and the
    step computes the same bits. The copy is ours because on a CPU the step may read
    a NumPy argument in place while it runs, when `data` may already be refilling it.
    """
    if len(devices) != 1 or jax.process_count() != 1:
        return shard_batch(devices, mesh, batch)
    leaves, treedef = jax.tree.flatten(batch)
    if not all(isinstance(x, np.ndarray) and x.ndim for x in leaves):
        return shard_batch(devices, mesh, batch)  # places them, or says what is wrong
    return jax.tree.unflatten(treedef, [x.copy() for x in leaves])


def eval_batch(devices: Sequence[jax.Device], mesh: Mesh, batch: PyTree) -> PyTree:
    """`batch` placed for evaluation: split as `shard_batch` does, or, in one
    process, whole on every device when its leading axis does not divide over
    them (a last partial batch)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    sizes = {np.shape(x)[0] if np.ndim(x) else 0 for x in jax.tree.leaves(batch)}
    if jax.process_count() == 1 and any(n % len(local) for n in sizes):
        return jax.device_put(batch, NamedSharding(mesh, P()))
    return shard_batch(devices, mesh, batch)
