"""Where the Trainer's arrays live: the state replicated, batches split over "data"."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._multiprocess import put_global


def replicated(mesh: Mesh, tree: PyTree) -> PyTree:
    """`tree` with every array constrained to be replicated over `mesh` (in a trace)."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: (
            jax.lax.with_sharding_constraint(x, sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


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


def put_replicated(mesh: Mesh, tree: PyTree) -> PyTree:
    """A copy of `tree` with every array replicated on the devices of `mesh`."""
    dynamic, static = eqx.partition(tree, eqx.is_array)
    dynamic = put_global(dynamic, NamedSharding(mesh, P()))  # also multi-process
    return eqx.combine(dynamic, static)
