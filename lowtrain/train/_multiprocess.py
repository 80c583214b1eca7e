"""Placing host values on devices that span several processes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding
from jaxtyping import PyTree


def put_global(tree: PyTree, shardings: PyTree) -> PyTree:
    """A copy of the arrays `tree` (all leaves arrays) placed with `shardings` (one
    `Sharding` for every leaf, or a tree of them shaped like `tree`).

    `jax.device_put` of a copy on one process (copied first: onto several devices,
    `device_put(..., may_alias=False)` still reuses the source buffer for one shard,
    which a donating step then deletes). In a multi-process run the shardings span
    devices that this process cannot address, which `jax.device_put` refuses for
    arrays already on a device: each process then passes the same values, and puts
    the parts of its own devices from a host copy (`jax.make_array_from_callback`).
    """
    if isinstance(shardings, Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    if jax.process_count() == 1:
        tree = jax.tree.map(lambda x: x.copy(), tree)
        return jax.device_put(tree, shardings, may_alias=False)

    def put(x, sharding):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)  # this process's value: the same on every process
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return jax.tree.map(put, tree, shardings)
