"""Flax NNX modules in the Trainer: the state their calls change in place.

An NNX module keeps, beside its parameters (`nnx.Param`), state that a call changes
in place in its other `nnx.Variable`s: BatchNorm's running statistics
(`nnx.BatchStat`), an RNG stream's count (`nnx.RngCount`, one more per draw). The
Trainer reads that state off the model after the loss has run (where NNX, or `amp`'s
write-back, set it) and puts it into the next `state.model` where the step is
applied, as `nnx.jit` writes it back to the caller's module. Flax is never imported
here: a model can only hold NNX Variables once `flax.nnx` is.
"""

import sys

import jax
from jax import lax
from jaxtyping import PyTree

from .._interpret import variable_owners


def has_inplace_state(model: PyTree) -> bool:
    """Whether `model` holds NNX Variables other than `nnx.Param`."""
    return bool(_state_indices(model))


def _state_indices(model: PyTree) -> list[int]:
    # Indices, among `jax.tree.leaves(model)`, of the arrays held by Variables that
    # are not Params.
    nnx = sys.modules.get("flax.nnx")
    return [
        i
        for i, owner in enumerate(variable_owners(model))
        if owner is not None and not isinstance(owner, nnx.Param)
    ]


def read_inplace_state(model: PyTree) -> list:
    """The arrays of `model`'s non-Param NNX Variables, in leaf order: what its calls
    have set in place so far."""
    leaves = jax.tree.leaves(model)
    return [leaves[i] for i in _state_indices(model)]


def carry_inplace_state(model: PyTree, new: list, old: PyTree, applied) -> PyTree:
    """`model` with its non-Param NNX Variables set to `new` (what the step's call
    left) where `applied`, else to `old`'s (a skipped step changes nothing), each in
    its own dtype."""
    leaves, treedef = jax.tree.flatten(model)
    before = jax.tree.leaves(old)
    for i, value in zip(_state_indices(model), new, strict=True):
        if value.dtype != before[i].dtype:
            value = value.astype(before[i].dtype)
        leaves[i] = lax.select(applied, value, before[i])
    return jax.tree.unflatten(treedef, leaves)
