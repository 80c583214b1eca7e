"""Placing host values on devices that span several processes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding
from jaxtyping import PyTree


def put_global(tree: PyTree, sharding: Sharding) -> PyTree:
    """A copy of the arrays `tree` (all leaves arrays) placed with `sharding`.

    `jax.device_put` on one process. In a multi-process run `sharding` spans devices
    that this process cannot address, which `jax.device_put` refuses for arrays
    already on a device: each process then passes the same values, and puts the
    parts of its own devices from a host copy (`jax.make_array_from_callback`).
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding, may_alias=False)

    def put(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)  # this process's value: the same on every process
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return jax.tree.map(put, tree)
