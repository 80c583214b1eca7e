"""What the Trainer's `precision` argument means (`resolve`), and the precisions a
name stands for beyond the policies: `Trainer(precision=name)` and `python -m
lowtrain precision=name` build the same one for "fp8_delayed", "fp8_naive",
"scalify_fp16", "scalify_fp8" and the block-scaled "mxfp8", "fp8_block" and "nvfp4"
(`NAMED`). Their factories are public, with the
fields the recipes' configs set."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

from .. import fp8
from .._amp import Policy, get_policy
from .._loss_scale import AbstractLossScale, NoOpLossScale
from ..scalify import cast_fp8, dynamic_rescale_l2, dynamic_rescale_l2_grad
from ..unit_scaling import (
    MATMULS,
    format_scope,
    fp8_cast_rules,
    keep_scopes,
    route_scopes,
)
from ._precisions import Amp, DelayedFp8, Rewrite, Scalify
from ._protocol import Chain, Precision


class Fp8Linears(Precision):
    """Every `eqx.nn.Linear` of the model as a `lowtrain.fp8.Fp8Linear` with
    delayed scaling (`delayed=True`), the same `weight` and `bias`: in
    `cast_params`, so in `Trainer.init` (the state, its checkpoints and `export`
    hold the swapped model). `delayed_fp8` chains it with `Amp("fp8")` for the
    other matmuls and `DelayedFp8` for the scales' state.

    **Arguments:**

    - `history`: the amaxes each scale looks back on (default 16 steps).
    - `margin`: powers of two of headroom below the format's largest value.
    - `min_dim`: a `Linear` whose input or output width is below it stays as it
      is (default 0: every one is swapped).

    ```python
    import equinox as eqx
    import jax
    import lowtrain

    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    swapped = lowtrain.train.Fp8Linears(history=4).cast_params(mlp)
    first = swapped.layers[0]
    assert isinstance(first, lowtrain.fp8.Fp8Linear)
    assert first.weight is mlp.layers[0].weight
    assert first.x_scale.amax_history.shape == (4,)
    ```
    """

    history: int = eqx.field(static=True, default=16)
    margin: int = eqx.field(static=True, default=0)
    min_dim: int = eqx.field(static=True, default=0)

    def __check_init__(self):
        for name in ("history", "min_dim", "margin"):
            value, least = getattr(self, name), 1 if name == "history" else 0
            if not isinstance(value, int) or value < least:
                raise ValueError(
                    f"Expected `{name}` an int of at least {least}, got {value!r} "
                    "instead."
                )

    def cast_params(self, model: PyTree) -> PyTree:
        is_linear = lambda m: isinstance(m, eqx.nn.Linear)
        found = [m for m in jax.tree.leaves(model, is_leaf=is_linear) if is_linear(m)]
        if not found:
            raise ValueError(
                "Expected a model with `eqx.nn.Linear` layers for "
                f"`precision='fp8_delayed'`, got a {type(model).__name__} without "
                "any. A model of the recipes has its own: "
                "`lowtrain.recipes.precisions.delayed_fp8()`; use `precision='fp8'` "
                "for current scaling of any model's matmuls."
            )

        def swap(m):
            if not is_linear(m) or "scalar" in (m.in_features, m.out_features):
                return m
            if min(m.in_features, m.out_features) < self.min_dim:
                return m
            return fp8.Fp8Linear.from_linear(
                m, delayed=True, history=self.history, margin=self.margin
            )

        return jax.tree.map(swap, model, is_leaf=is_linear)


def delayed_fp8(history: int = 16, margin: int = 0, min_dim: int = 0) -> Precision:
    """`precision="fp8_delayed"`: the `fp8` policy with delayed scaling for the
    model's `eqx.nn.Linear` layers (`Fp8Linears`), current scaling for its other
    matmuls (`Amp("fp8")`), and `DelayedFp8` carrying the scales from step to step.

    **Arguments:**

    - `history`, `margin`, `min_dim`: as `Fp8Linears` takes them; with `min_dim`,
      the policy's other matmuls whose GEMM has an M, N or K below it stay bf16
      (`lowtrain.Policy.with_fp8_min_dim`).

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    mlp = eqx.nn.MLP(4, 1, 16, 1, key=jax.random.key(0))
    trainer = Fit(mlp, optax.adam(1e-2), precision="fp8_delayed")  # by name
    state = trainer.init(key=jax.random.key(1))
    assert isinstance(state.model.layers[0], lowtrain.fp8.Fp8Linear)
    data = {"x": jax.numpy.ones((8, 4)), "y": jax.numpy.zeros((8, 1))}
    state = trainer.fit(state, lambda s: data, steps=3, progress=False)
    assert state.model.layers[0].x_scale.amax_history[0] > 0  # recorded
    ```
    """
    policy = get_policy("fp8").with_fp8_min_dim(min_dim)
    return Chain(Fp8Linears(history, margin, min_dim), Amp(policy), DelayedFp8())


def naive_fp8(
    policy: str = "bf16",
    weights_only: bool = False,
    keep: Sequence[str] = (),
    min_dim: int = 0,
    rounding: str = "nearest",
) -> Precision:
    """`precision="fp8_naive"`: every matmul's operands cast to FP8 with scale 1
    (E4M3 forward, E5M2 backward: `lowtrain.unit_scaling.fp8_cast_rules`; on a GPU
    an FP8 GEMM with no amax pass), then AMP under `policy`: the baseline that
    shows what scaling buys.

    **Arguments:**

    - `policy`: the AMP policy of the rest (default "bf16"; not an FP8 one, which
      would quantize the matmuls twice).
    - `weights_only`: only the `dot_general`s with a weight operand.
    - `keep`: matmuls kept as `policy` has them (`lowtrain.unit_scaling.keep_scopes`
      entries: how a `lowtrain.numerics.Plan` names them).
    - `min_dim`: matmuls whose GEMM has an M, N or K below it kept too.
    - `rounding`: the casts' rounding, "nearest" or "stochastic".

    ```python
    import jax.numpy as jnp
    import lowtrain

    p = lowtrain.train.naive_fp8()
    f = p.wrap_model(lambda x, w: x @ w)
    assert f(jnp.full((1, 2), 1.0 + 2.0**-6), jnp.ones((2, 1)))[0, 0] == 2.0
    ```
    """
    if get_policy(policy) == get_policy("fp8"):
        raise ValueError(
            "Expected a policy that leaves matmuls alone (e.g. bf16) for the naive "
            f"FP8 baseline, got {policy!r} instead, which would quantize them twice. "
            "Use `precision=fp8_naive precision.policy=bf16`."
        )
    rules = fp8_cast_rules(weights_only, min_dim, rounding)
    return Chain(Rewrite(rules, keep_scopes(keep, rules)), Amp(policy))


def scalify_fp8_op(op: Callable, lhs: Array, rhs: Array) -> Array:
    """`op(lhs, rhs)` (a matmul of `lowtrain.rewrite`) under the Scalify precision:
    both operands, `lhs` and `rhs`, rescaled to unit RMS and their data cast to
    E4M3; in the backward pass the output cotangent rescaled to unit RMS and its
    data cast to E5M2
    (`lowtrain.scalify.dynamic_rescale_l2[_grad]`, `cast_fp8`: the scales are kept,
    so values change only by FP8 rounding). Unit RMS puts the data where the FP8
    formats have their precision and range. Outside `scalify` the rescales are the
    identity and the casts have scale 1.

    ```python
    import jax.numpy as jnp
    import lowtrain

    rule = {"dot_general": lowtrain.train.scalify_fp8_op}
    f = lowtrain.rewrite(lambda x, w: x @ w, rule)
    assert f(jnp.ones((1, 2)), jnp.ones((2, 1)))[0, 0] == 2.0
    ```
    """
    lhs = cast_fp8(dynamic_rescale_l2(lhs), fp8.E4M3, None)
    rhs = cast_fp8(dynamic_rescale_l2(rhs), fp8.E4M3, None)
    # Backward, the cotangent meets the rescale first, then the E5M2 cast.
    return dynamic_rescale_l2_grad(cast_fp8(op(lhs, rhs), None, fp8.E5M2))


def scalify_fp8(policy: str = "p=f32,c=f16") -> Precision:
    """`precision="scalify_fp8"`: `Scalify(policy)` with every matmul through
    `scalify_fp8_op`. `policy`: the scaled arrays' `lowtrain.Policy` (default
    float32 parameters, float16 compute).

    ```python
    import lowtrain

    p = lowtrain.train.scalify_fp8()
    assert [type(x).__name__ for x in p.parts] == ["Scalify", "Rewrite"]
    ```
    """
    return Chain(Scalify(policy), Rewrite(dict.fromkeys(MATMULS, scalify_fp8_op)))


def block_scaled(
    recipe: str = "mxfp8",
    *,
    weight_2d: bool | None = None,
    hadamard: bool | None = None,
    stochastic: bool | None = None,
    grads: str | None = None,
    keep: Sequence[str] = (),
    routes: Sequence[str] | Mapping[str, str] = (),
    base: str | None = None,
    min_dim: int = 0,
) -> Precision:
    """`precision="mxfp8"`, `"fp8_block"`, `"nvfp4"`: `Amp` with the policy of that
    name (`lowtrain.get_policy`): every `dot_general` through
    `lowtrain.fp8.block_recipe_dot` with the recipe `lowtrain.fp8.BLOCK_RECIPES`
    names, its product in bfloat16; everything else as "bf16". Simulated:
    each operand is quantized and dequantized, and the product computed in float32.

    The weight of a matmul is the operand computed from a model parameter
    (`lowtrain.Policy`'s `block`). The recipe's parts are switchable (None keeps
    the recipe's own):

    **Arguments:**

    - `recipe`: "mxfp8" (MXFP8 E4M3, gradients too), "fp8_block" (DeepSeek-V3:
      1x128 activations and gradients, 128x128 weights) or "nvfp4".
    - `weight_2d`: weights in 2-D tiles of the block's length (NVFP4's 16x16, FP8's
      128x128) rather than 1-D blocks like the activations'.
    - `hadamard`: the 16x16 random Hadamard transform on the weight-gradient GEMM's
      inputs (NVFP4's recipe: on).
    - `stochastic`: the gradients rounded stochastically (NVFP4's recipe: on).
    - `grads`: the gradients' `lowtrain.fp8.BlockFormat` by name, e.g.
      "mxfp8_e5m2_ceil" (Transformer Engine's "HYBRID" MXFP8).
    - `keep`: matmuls kept in bfloat16 (`jax.named_scope` names, or a name, `@`
      and the right operand's shape: `lowtrain.unit_scaling.keep_scopes`), e.g. the
      last layers, which NVIDIA's NVFP4 recipe keeps in BF16.
    - `routes`: matmuls run in another format, as `"<entry>=<format>"` strings or
      a dict from entry to format (entries as `keep`'s; formats among `FORMATS`:
      "nvfp4", "mxfp8", "fp8_block" or "fp8", per-tensor current scaling): how a
      `lowtrain.numerics.Plan` with several formats applies (`Plan.routes`). A
      recipe named here other than `recipe` runs as `lowtrain.fp8.BLOCK_RECIPES`
      has it.
    - `base`: the format of the matmuls neither `keep` nor `routes` names (one of
      `FORMATS`; default `recipe`).
    - `min_dim`: matmuls whose GEMM has an M, N or K below it kept in bfloat16 too
      (`lowtrain.Policy.with_fp8_min_dim`).

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain

    p = lowtrain.train.block_scaled("nvfp4", hadamard=False)
    recipe = p.parts[-1].policy.block
    assert recipe.stochastic and not recipe.hadamard
    f = p.wrap_model(lambda x, w: x @ w)  # float32 out, as the policy's output
    assert f(jnp.ones((2, 32)), jnp.ones((32, 16)))[0, 0] == 32.0

    def two(x, w):
        with jax.named_scope("a"):
            a = x @ w
        with jax.named_scope("b"):
            b = x @ w
        return a, b

    x, w = jnp.full((1, 32), 0.2).at[0, 0].set(6.0), jnp.ones((32, 1))
    mixed = lowtrain.train.block_scaled("nvfp4", routes=["b=mxfp8"]).wrap_model(two)
    a, b = mixed(x, w)
    assert a[0, 0] == 9.1875 and abs(b[0, 0] - 12.2) < 0.2  # 0.2 flushes in NVFP4
    ```
    """
    policy = get_policy(recipe)
    if policy.block is None:
        raise ValueError(
            "Expected a block-scaled recipe among 'mxfp8', 'fp8_block', 'nvfp4', got "
            f"{recipe!r} instead."
        )
    block = policy.block
    changes: dict = {}
    if weight_2d is not None and bool(weight_2d) != (block.weights.block[0] > 1):
        # On: the activations' format in square tiles of its block length; off:
        # the activations' format itself.
        act, length = block.activations, block.activations.block[1]
        square = dataclasses.replace(
            act, name=f"{act.name}_{length}x{length}", block=(length, length)
        )
        changes["weights"] = square if weight_2d else act
    if hadamard is not None:
        changes["hadamard"] = bool(hadamard)
    if stochastic is not None:
        changes["stochastic"] = bool(stochastic)
    if grads is not None:
        changes["grads"] = fp8.block_format(grads)
    if changes:
        policy = policy.with_block(dataclasses.replace(block, **changes))
    policy = policy.with_fp8_min_dim(min_dim)
    if base is not None:
        policy = policy.with_rules(dot_general=_format(base, "base"))
    routed = _routes(routes)
    if not keep and not routed:
        return Chain(Amp(policy))
    # A kept matmul runs in `fp8.KEEP_SCOPE` (`keep_op`): in the compute dtype; a
    # routed one in its format's scope, which the policy maps to that format.
    scopes = {format_scope(f): f for f in set(routed.values())}
    policy = policy.with_scopes({fp8.KEEP_SCOPE: "compute", **scopes})
    table = route_scopes({**routed, **dict.fromkeys(keep, "wide")}, amax=True)
    return Chain(Rewrite({}, table), Amp(policy))


# The formats a block-scaled precision routes a matmul to (`block_scaled`'s
# `routes` and `base`): the block recipes, and per-tensor current-scaled FP8.
FORMATS = ("nvfp4", "mxfp8", "fp8_block", "fp8")


def _format(name, what: str) -> str:
    if name not in FORMATS:
        raise ValueError(
            f"Expected a format among {', '.join(FORMATS)} for `{what}`, got "
            f"{name!r} instead."
        )
    return name


def _routes(routes: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    # `routes` as a dict, entry -> format, checked.
    if isinstance(routes, Mapping):
        pairs = list(routes.items())
    elif isinstance(routes, str) or not all(isinstance(r, str) for r in routes):
        raise TypeError(
            "Expected `routes` as a list of '<entry>=<format>' strings, e.g. "
            f"['attn=mxfp8'], or a dict, got {routes!r} instead."
        )
    else:
        pairs = []
        for r in routes:
            entry, eq, name = r.rpartition("=")
            if not eq or not entry:
                raise ValueError(
                    f"Expected a route as '<entry>=<format>', e.g. 'attn=mxfp8', "
                    f"got {r!r} instead."
                )
            pairs.append((entry, name))
    return {str(e): _format(f, f"routes[{e!r}]") for e, f in pairs}


# Each name and what it builds in Python (`python -m lowtrain precision=<name>`
# builds the same from `conf/precision/<name>.yaml`).
NAMED: dict[str, Callable[[], Precision]] = {
    "fp8_delayed": delayed_fp8,
    "fp8_naive": naive_fp8,
    "scalify_fp16": lambda: Scalify("p=f32,c=f16"),
    "scalify_fp8": scalify_fp8,
    "mxfp8": lambda: block_scaled("mxfp8"),
    "fp8_block": lambda: block_scaled("fp8_block"),
    "nvfp4": lambda: block_scaled("nvfp4"),
}


def resolve(precision) -> Precision:
    """The `Precision` the Trainer runs, from its `precision` argument (see
    `Trainer`): a name of `NAMED`, its precision; a policy (or None: "fp32"),
    `[Amp(policy), DelayedFp8()]`; a list or tuple of precisions, their `Chain`."""
    if isinstance(precision, str) and precision in NAMED:
        return NAMED[precision]()
    if precision is None or isinstance(precision, str | Policy):
        # A policy: AMP, and the FP8 delayed-scaling state of the model if it has
        # any (`DelayedFp8` leaves a model without it alone).
        return Chain(Amp(precision or "fp32"), DelayedFp8())
    if isinstance(precision, Precision):
        return precision
    if isinstance(precision, list | tuple):
        return Chain(*precision)
    raise TypeError(
        "Expected a `lowtrain.train.Precision` (e.g. `lowtrain.train.Amp('bf16')`), "
        "a list of them, or a name such as 'bf16' or 'fp8_delayed', got "
        f"{type(precision).__name__} instead."
    )


def resolve_loss_scale(precision: Precision, loss_scale) -> AbstractLossScale:
    """The Trainer's loss scale: `loss_scale`, or the precision's default
    (`NoOpLossScale()` where it has none)."""
    if loss_scale is None:
        loss_scale = precision.default_loss_scale() or NoOpLossScale()
    if not isinstance(loss_scale, AbstractLossScale):
        raise TypeError(
            "Expected a loss scale such as `lowtrain.DynamicLossScale()`, got "
            f"{type(loss_scale).__name__} instead."
        )
    return loss_scale
