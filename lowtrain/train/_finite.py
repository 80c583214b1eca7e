"""`apply_if_finite`: `optax.apply_if_finite` with its skip as a select, not a branch.

XLA's GPU runtime runs a `conditional` by copying its predicate to the host and
waiting for the stream to finish (`ConditionalThunk::ExecuteOnStream` calls
`BlockHostUntilDone`). `optax.apply_if_finite` puts the inner optimizer's update under
`lax.cond`, so on a GPU every train step stops the host halfway, once its gradients
are done: the optimizer's kernels are launched only then, the GPU idle while they
are, and the next step cannot be queued behind this one. On short steps (the
char-GPT's 1-2 ms on an H200) that host time is a large part of the step. jmp skips a
non-finite step the same way as here, by selecting (`jmp.select_tree`).

A CPU runs a conditional on its own threads, with no such stop; there the Trainer
keeps optax's, whose results the recipes' records were made with: without the
branch XLA may fuse the update into the weights' `p + u`, which then rounds once
instead of twice (a contracted multiply-add) and moves the last bit of some weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._devices import any_gpu


def apply_if_finite(
    inner: optax.GradientTransformation, max_consecutive_errors: int
) -> optax.GradientTransformationExtraArgs:
    """`optax.apply_if_finite(inner, max_consecutive_errors)` without a branch: the
    same state (`optax.ApplyIfFiniteState`), updates and counts (bit for bit, jitted
    on its own), but the inner update is always computed and kept or dropped by
    `jnp.where` (zero updates and the old inner state on a skipped step, as optax's),
    so the step has no branch for a GPU to stop at. A skipped step costs the inner
    update's arithmetic, which a GPU spends anyway on the steps it applies. The
    Trainer uses it on GPUs (module docstring).

    **Arguments:**

    - `inner`: the optax optimizer whose updates are applied when finite.
    - `max_consecutive_errors`: how many non-finite steps in a row are skipped;
      those after them are applied until a finite step resets the count (the
      Trainer passes the int32 maximum, which the count never exceeds).

    ```python
    import jax.numpy as jnp
    import optax
    from lowtrain.train import apply_if_finite

    opt = apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    updates, state = opt.update({"w": jnp.array([1.0, jnp.nan])}, state, params)
    assert (updates["w"] == 0).all() and int(state.notfinite_count) == 1
    updates, state = opt.update({"w": jnp.ones(2)}, state, params)
    assert jnp.allclose(updates["w"], -0.1) and int(state.total_notfinite) == 1
    ```
    """
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update(updates, state, params=None, **extra_args):
        leaves = jax.tree.leaves(updates)
        isfinite = jnp.all(jnp.array([jnp.all(jnp.isfinite(u)) for u in leaves]))
        notfinite_count = jnp.where(
            isfinite,
            jnp.zeros([], jnp.int32),
            optax.safe_increment(state.notfinite_count),
        )
        apply = jnp.logical_or(isfinite, notfinite_count > max_consecutive_errors)
        new_updates, new_inner = inner.update(
            updates, state.inner_state, params, **extra_args
        )

        def pick(new, old):
            return jnp.where(apply, new, old) if eqx.is_array(new) else new

        new_updates = jax.tree.map(
            pick, new_updates, optax.tree.zeros_like(new_updates)
        )
        new_inner = jax.tree.map(pick, new_inner, state.inner_state)
        total = jnp.where(
            isfinite,
            state.total_notfinite,
            optax.safe_increment(state.total_notfinite),
        )
        return new_updates, optax.ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=isfinite,
            total_notfinite=total,
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init, update)


# The Trainer never applies a non-finite update: the skip count saturates here.
NEVER = int(np.iinfo(np.int32).max)


def skip_nonfinite(
    optimizer: optax.GradientTransformation, devices: Sequence[jax.Device]
) -> optax.GradientTransformationExtraArgs:
    """The Trainer's optimizer: `optimizer` wrapped to skip every non-finite step,
    by `apply_if_finite` (a select) when `devices` are GPUs and by
    `optax.apply_if_finite` (a branch) elsewhere (module docstring)."""
    if any_gpu(devices):
        return apply_if_finite(optimizer, NEVER)
    return optax.apply_if_finite(optimizer, NEVER)
