"""`Policy`: the dtypes of a mixed-precision program, and `get_policy` to name one."""

from __future__ import annotations

from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._scopes import match_scope
from ..fp8 import BlockRecipe, block_recipe

RESIDUALS = ("all", "half")

from ._rules import (  # noqa: E402
    ACTIONS,
    AMP_STOP_SCOPE,
    BLOCK,
    BLOCK_NAMES,
    BLOCK_PRIMITIVES,
    DEFAULT_RULES,
    FP8,
    FP8_PRIMITIVES,
    KEEP,
    WIDEST,
)

_DTYPE_ALIASES = {
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "full": "float32",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
}


def _float_dtype(value, what: str) -> np.dtype:
    name = _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"Expected a floating dtype for `{what}` (e.g. 'float32', 'bfloat16', "
            f"'float16'), got {value!r} instead."
        )
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"Expected `{what}` of at most 32 bits, got {value!r} (float64), which "
            "JAX runs as float32 unless 64-bit mode is on. Turn it on first "
            "(`jax.config.update('jax_enable_x64', True)`), or use 'float32'."
        )
    return dtype


def _action(value, what: str) -> str:
    if value in ACTIONS:
        return value
    try:
        return str(_float_dtype(value, what))
    except ValueError:
        raise ValueError(
            f"Expected an AMP action for `{what}`: one of {', '.join(ACTIONS)} or a "
            f"float dtype name, got {value!r} instead."
        ) from None


def _mapping(mapping: Mapping[str, object] | None, what: str) -> dict:
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"Expected a mapping for `{what}` such as {{'exp': 'float32'}}, got "
            f"{type(mapping).__name__} instead."
        )
    return dict(mapping)


def _table(mapping: Mapping[str, object], what: str) -> tuple:
    return tuple(
        (str(k), _action(v, f"{what}[{k!r}]")) for k, v in sorted(mapping.items())
    )


class Policy(eqx.Module):
    """The dtypes of a mixed-precision program and the rules that place each op.

    - `param_dtype`: the dtype parameters are stored (and updated) in;
    - `compute_dtype`: the dtype matmuls and convolutions cast their operands to
      and run in (`amp` casts each input where an op uses it);
    - `output_dtype`: the dtype of the float outputs `amp` returns;
    - `rules`: per-primitive actions (see `lowtrain.amp` docs), on top of the defaults,
      and the action for `"dot_product_attention"` (`lowtrain.dot_product_attention`,
      run whole in the dtype it gives);
    - `scopes`: per-`jax.named_scope` actions; a scope name may be a glob such as
      `"eqx.nn.*"`. For an op inside several matching scopes the outermost wins, and a
      scope rule takes precedence over the primitive rules;
    - `residuals`: what the forward pass saves for the backward one. "all": every
      value the backward pass needs, as JAX chooses (float32 ones included). "half":
      only values in the compute dtype (and integers); the float32 ones (a layer
      norm's, a softmax's, GELU's internals) are recomputed from them in the backward
      pass, which roughly halves the saved bytes for a little extra compute;
    - `fp8_min_dim`: a `dot_general` that the "fp8" (or "block") action would run
      in FP8 runs in the compute dtype instead when its GEMM's M, N or K
      (`lowtrain.fp8.gemm_dims`) is below this: too small for an FP8 GEMM to pay
      for its casts (0: none is);
    - `block`: the `lowtrain.fp8.BlockRecipe` (or its name) the "block" action runs
      matmuls with (None: no block action). The "mxfp8", "fp8_block" and "nvfp4"
      presets set it. Which operand of a matmul is the weight: the one computed
      from a parameter (an array leaf of the module `amp` wraps) by layout
      changes only (casts, transposes, reshapes, slices, a scan's slicing of
      stacked layers); if both are, the right one; if neither (attention's
      products, or a plain function's arguments), there is none.

    The policy is static data: it is hashable and never traced.

    ```python
    import jax.numpy as jnp
    import lowtrain

    policy = lowtrain.Policy(
        compute_dtype=jnp.bfloat16,
        scopes={"head": "float32"},
        rules={"tanh": "compute"},
    )
    assert policy.action("dot_general", ()) == "compute"
    assert policy.action("dot_general", ("head",)) == "float32"
    lean = lowtrain.get_policy("bf16").with_residuals("half")
    assert lean.residuals == "half" and lean.compute_dtype == jnp.bfloat16
    big_only = lowtrain.get_policy("fp8").with_fp8_min_dim(1024)
    assert big_only.fp8_min_dim == 1024
    assert lowtrain.get_policy("nvfp4").block.name == "nvfp4"
    ```
    """

    param_dtype: np.dtype = eqx.field(static=True)
    compute_dtype: np.dtype = eqx.field(static=True)
    output_dtype: np.dtype = eqx.field(static=True)
    rules: tuple[tuple[str, str], ...] = eqx.field(static=True)
    scopes: tuple[tuple[str, str], ...] = eqx.field(static=True)
    residuals: str = eqx.field(static=True)
    fp8_min_dim: int = eqx.field(static=True)
    block: BlockRecipe | None = eqx.field(static=True)

    def __init__(
        self,
        param_dtype="float32",
        compute_dtype="float32",
        output_dtype=None,
        *,
        rules: Mapping[str, object] | None = None,
        scopes: Mapping[str, object] | None = None,
        residuals: str = "all",
        fp8_min_dim: int = 0,
        block: BlockRecipe | str | None = None,
    ):
        self.param_dtype = _float_dtype(param_dtype, "param_dtype")
        self.compute_dtype = _float_dtype(compute_dtype, "compute_dtype")
        self.output_dtype = _float_dtype(
            self.param_dtype if output_dtype is None else output_dtype, "output_dtype"
        )
        self.rules = _table({**DEFAULT_RULES, **_mapping(rules, "rules")}, "rules")
        for prim, act in self.rules:
            if act == FP8 and prim not in FP8_PRIMITIVES:
                raise ValueError(
                    f"The 'fp8' action applies to {', '.join(FP8_PRIMITIVES)} only, "
                    f"got it for `{prim}`. Use 'compute' or a dtype name for other ops."
                )
            if act in (BLOCK, *BLOCK_NAMES) and prim not in BLOCK_PRIMITIVES:
                raise ValueError(
                    f"The {act!r} action applies to {', '.join(BLOCK_PRIMITIVES)} "
                    f"only, got it for `{prim}`. Use 'compute' for convolutions."
                )
        self.block = None if block is None else block_recipe(block)
        self.scopes = _table(
            {AMP_STOP_SCOPE: KEEP, **_mapping(scopes, "scopes")}, "scopes"
        )
        used = {*dict(self.rules).values(), *dict(self.scopes).values()}
        if self.block is None and BLOCK in used:
            raise ValueError(
                "Expected a `block` recipe with the 'block' action, got none. Pass "
                "one, e.g. `Policy(..., block='mxfp8')`, or use a preset: "
                "`get_policy('mxfp8')`."
            )
        if residuals not in RESIDUALS:
            raise ValueError(
                f"Expected `residuals` in {RESIDUALS}, got {residuals!r} instead. "
                "Use 'half' to save only compute-dtype values for the backward pass "
                "(float32 ones recomputed), or 'all' (the default) for what JAX saves."
            )
        self.residuals = residuals
        if isinstance(fp8_min_dim, bool) or not isinstance(
            fp8_min_dim, int | np.integer
        ):
            raise TypeError(
                f"Expected `fp8_min_dim` as an int, got {fp8_min_dim!r} instead."
            )
        if fp8_min_dim < 0:
            raise ValueError(
                f"Expected `fp8_min_dim` >= 0, got {fp8_min_dim} instead (0: every "
                "matmul the 'fp8' action names runs in FP8)."
            )
        self.fp8_min_dim = int(fp8_min_dim)

    def _replace(self, **changes) -> Policy:
        # A new Policy (so every field is checked again) with `changes` applied.
        fields = dict(
            rules=dict(self.rules),
            scopes=dict(self.scopes),
            residuals=self.residuals,
            fp8_min_dim=self.fp8_min_dim,
            block=self.block,
        )
        return Policy(
            self.param_dtype,
            self.compute_dtype,
            self.output_dtype,
            **(fields | changes),
        )

    def with_rules(self, **rules) -> Policy:
        """A copy with these primitive rules added: `with_rules(tanh="compute")`."""
        return self._replace(rules={**dict(self.rules), **rules})

    def with_scopes(self, scopes: Mapping[str, object]) -> Policy:
        """A copy with the scope rules `scopes` (scope name or glob -> action) added:
        `with_scopes({"head": "float32"})`."""
        return self._replace(scopes={**dict(self.scopes), **scopes})

    def with_residuals(self, residuals: str) -> Policy:
        """A copy that saves `residuals` ("all" or "half") for the backward pass."""
        return self._replace(residuals=residuals)

    def with_fp8_min_dim(self, fp8_min_dim: int) -> Policy:
        """A copy whose FP8 matmuls with an M, N or K below `fp8_min_dim` run in the
        compute dtype instead (`fp8_min_dim` above)."""
        return self._replace(fp8_min_dim=fp8_min_dim)

    def with_block(self, block: BlockRecipe | str) -> Policy:
        """A copy whose "block" action runs the recipe `block` (a
        `lowtrain.fp8.BlockRecipe` or its name; `block` above)."""
        return self._replace(block=block)

    @property
    def blocks(self) -> bool:
        """Whether a rule or scope runs a matmul block-scaled ("block" or a block
        recipe's name)."""
        used = {*dict(self.rules).values(), *dict(self.scopes).values()}
        return bool(used & {BLOCK, *BLOCK_NAMES})

    def recipe(self, action: str) -> BlockRecipe:
        """The `lowtrain.fp8.BlockRecipe` a block action runs.

        - `action`: "block" or a recipe's name ("mxfp8", "fp8_block", "nvfp4"):
          `block` for "block" and for its own name, else the named recipe.
        """
        if action == BLOCK or (self.block is not None and self.block.name == action):
            return self.block
        return block_recipe(action)

    def action(self, primitive: str, scopes: tuple[str, ...]) -> str:
        """The action for primitive `primitive` inside `scopes` (outermost first).
        Inside `amp_stop` it is "keep", whatever scope is around it: lowtrain's own
        FP8 ops run their internals there, also inside a scope a plan routes to
        FP8."""
        if AMP_STOP_SCOPE in scopes:
            return KEEP
        act = match_scope(self.scopes, scopes)
        return dict(self.rules).get(primitive, WIDEST) if act is None else act

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Cast the float arrays of `tree` to `param_dtype`."""
        return _cast_floats(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Cast the float arrays of `tree` to `compute_dtype`."""
        return _cast_floats(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Cast the float arrays of `tree` to `output_dtype`."""
        return _cast_floats(tree, self.output_dtype)


def _cast_floats(tree, dtype):
    def cast(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


# The presets that name a block recipe (`lowtrain.fp8.BLOCK_RECIPES`).
BLOCK_PRESETS = ("mxfp8", "fp8_block", "nvfp4")
_PRESETS = {
    "fp32": ("float32", "float32", "float32"),
    "bf16": ("float32", "bfloat16", "float32"),
    "fp16": ("float32", "float16", "float32"),
    # Matmuls and convolutions in FP8, everything else as "bf16".
    "fp8": ("float32", "bfloat16", "float32"),
    # Matmuls block-scaled (`lowtrain.fp8.BLOCK_RECIPES`), everything else as "bf16".
    "mxfp8": ("float32", "bfloat16", "float32"),
    "fp8_block": ("float32", "bfloat16", "float32"),
    "nvfp4": ("float32", "bfloat16", "float32"),
}
_PRESET_RULES = {
    "fp8": {p: FP8 for p in FP8_PRIMITIVES},
    **{name: {p: BLOCK for p in BLOCK_PRIMITIVES} for name in BLOCK_PRESETS},
}
_PRESET_ALIASES = {
    "float32": "fp32",
    "full": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
}
_KEYS = {"params": 0, "p": 0, "compute": 1, "c": 1, "output": 2, "o": 2}


def get_policy(name: str) -> Policy:
    """A `Policy` from `name`: "fp32", "bf16", "fp16", "fp8", "mxfp8", "fp8_block",
    "nvfp4" (case-insensitive; "float32", "full", "bfloat16" and "float16" are
    aliases), or a jmp-style string.

    The presets keep parameters and outputs in float32 and compute in the named dtype;
    "fp8" runs matmuls and convolutions through `lowtrain.fp8` (E4M3 forward, E5M2
    backward, current scaling) and everything else as "bf16"; "mxfp8", "fp8_block"
    and "nvfp4" run every `dot_general` block-scaled (the "block" action with the
    `lowtrain.fp8.BLOCK_RECIPES` recipe of that name) and everything else, the
    convolutions included, as "bf16".
    A jmp-style string names each dtype, e.g. "params=float32,compute=bfloat16,
    output=float32" or "p=f32,c=f16,o=f32"; a missing `output` defaults to `params`.

    ```python
    import jax.numpy as jnp
    import lowtrain

    assert lowtrain.get_policy("bf16").compute_dtype == jnp.bfloat16
    assert lowtrain.get_policy("p=f32,c=f16").output_dtype == jnp.float32
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"Expected a policy name (str), got {type(name).__name__}.")
    key = _PRESET_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in _PRESETS:
        block = key if key in BLOCK_PRESETS else None
        return Policy(*_PRESETS[key], rules=_PRESET_RULES.get(key), block=block)
    if "=" not in name:
        raise ValueError(
            f"Unknown policy {name!r}. Expected one of {', '.join(_PRESETS)} or a "
            "jmp-style string such as 'params=float32,compute=bfloat16,output=float32'."
        )
    dtypes: list = [None, None, None]
    for part in name.split(","):
        k, _, v = part.partition("=")
        k = k.strip().lower()
        if k not in _KEYS or not v.strip():
            raise ValueError(
                f"Cannot parse {part!r} in policy {name!r}: expected `KEY=DTYPE` with "
                "KEY one of params/p, compute/c, output/o."
            )
        dtypes[_KEYS[k]] = v.strip()
    param, compute, output = dtypes
    param = param or "float32"
    return Policy(param, compute or param, output or param)
