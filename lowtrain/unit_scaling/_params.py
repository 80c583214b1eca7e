"""What the u-μP optimizers know of each parameter: its kind, shape and depth, read
from the Equinox model's structure (`param_info`)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.tree_util import DictKey, GetAttrKey, SequenceKey
from jaxtyping import PyTree

from ._transformer import DepthSequential

KINDS = ("weight", "bias", "norm", "embedding", "output")


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter as u-μP sees it (a leaf, not a pytree).

    - `kind`: "weight" (a hidden layer's), "bias", "norm" (a norm's gain),
      "embedding" (an input table) or "output" (the readout's weight); None for an
      array no unit-scaled module declares.
    - `shape`: the array's shape; the fan-in is `shape[0]` for a vector,
      `shape[1]` for a matrix (`(out, in)`, or `(vocab, dim)` for an embedding,
      whose "fan-in" in u-μP is its width), `shape[1] * shape[2]` for a 3-D kernel.
    - `depth`: the length of the innermost enclosing `DepthSequential`, or None.

    ```python
    from lowtrain.unit_scaling.optim import ParamInfo

    assert ParamInfo("weight", (128, 64), depth=4).fan_in == 64
    ```
    """

    kind: str | None
    shape: tuple[int, ...]
    depth: int | None = None

    @property
    def fan_in(self) -> int:
        if len(self.shape) == 1:
            return self.shape[0]
        if len(self.shape) == 2:
            return self.shape[1]
        if len(self.shape) == 3:
            return self.shape[1] * self.shape[2]
        raise ValueError(
            f"Expected a parameter of 1 to 3 dimensions for its fan-in, got shape "
            f"{self.shape} instead."
        )


_UNRESOLVED = object()


def _is_param(leaf) -> bool:
    # A floating-point array, or its shape (a model from `eqx.filter_eval_shape`).
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.issubdtype(leaf.dtype, jnp.inexact)
    return eqx.is_inexact_array(leaf)


def _child(node, key):
    if isinstance(key, GetAttrKey):
        return getattr(node, key.name, _UNRESOLVED)
    if isinstance(key, SequenceKey):
        return node[key.idx]
    if isinstance(key, DictKey):
        return node[key.key]
    return _UNRESOLVED  # a custom pytree node: its children have no names to read


def param_info(model: PyTree) -> PyTree[ParamInfo | None]:
    """A `ParamInfo` for every floating-point array of `model`, None for its other
    leaves: the structure of `eqx.filter(model, eqx.is_inexact_array)`. `model` may
    also be abstract (`eqx.filter_eval_shape` of its constructor).

    A parameter's kind comes from the module holding it: its class lists the kind
    of each field in a class attribute `mup_kinds` (`Linear`: weight and bias,
    `LinearReadout`: output and bias, `Embedding`: embedding, `LayerNorm` and
    `RMSNorm`: norm and bias). Your own module opts in the same way, e.g.
    `mup_kinds: ClassVar[dict[str, str]] = {"scale": "norm"}`. The depth is the
    length of the enclosing `DepthSequential`; nesting one in another is an error.

    ```python
    import jax
    import lowtrain.unit_scaling as uu

    model = uu.DepthSequential([uu.Linear(4, 8, key=jax.random.key(0))])
    info = uu.optim.param_info(model)
    assert info.layers[0].weight == uu.optim.ParamInfo("weight", (8, 4), 1)
    ```
    """

    def info(path, leaf):
        if not _is_param(leaf):
            return None
        node, owner, depth = model, None, None
        for key in path:
            if isinstance(node, DepthSequential):
                if depth is not None:
                    raise ValueError(
                        f"Expected no `DepthSequential` inside another, got one at "
                        f"{jax.tree_util.keystr(path)}. Flatten them into one."
                    )
                depth = len(node)
            owner, node = node, _child(node, key)
            if node is _UNRESOLVED:
                owner = None
                break
        name = path[-1].name if path and isinstance(path[-1], GetAttrKey) else None
        kind = getattr(type(owner), "mup_kinds", {}).get(name)
        return ParamInfo(kind, tuple(leaf.shape), depth)

    return jax.tree_util.tree_map_with_path(info, model)
