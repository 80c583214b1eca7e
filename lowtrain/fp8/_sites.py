"""Cast sites: every FP8 cast of lowtrain names itself in the program it is traced
into, so that a numerics report can judge it as performed (after its scale) and a
plan can name the matmul it belongs to.

`quantize` divides by its scale inside a `jax.named_scope` whose name is a `Site`
(`Site.scope()`): the format, the cast's role in its matmul (`"lhs"`, `"rhs"`,
`"grad"`: the output cotangent), the matmul's GEMM `(batch, M, N, K)` and the shape
of its right operand (a layer's weight), and whether the cast is applied or a shadow
(the matmul runs wide; `probed` names the value its cast would see). The division's
output is the value the cast rounds (before saturation): `lowtrain.numerics.track(fn,
casts=True)` reads it there. A named scope is metadata: the compiled program is the
same.

`lowtrain.fp8._dot.keep_op` is the rule that keeps a matmul wide while still
naming its would-be casts (shadows: dead code XLA removes outside a tracked program).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jaxtyping import Array

from ._formats import E4M3, E5M2

SITE_PREFIX = "lowtrain.fp8_cast"
# Matmuls a plan keeps wide run inside this scope (`keep_op`): a policy that would
# run them in FP8 maps it to its compute dtype (the recipes' `fp8` precision does).
KEEP_SCOPE = "lowtrain.fp8_keep"
# Where a `lowtrain.Policy` finds the format a plan chose for a matmul
# (`lowtrain.unit_scaling.route_scopes`): the scope `"lowtrain.format|<format>"`
# around it, which the policy maps to the action of that name.
FORMAT_SCOPE = "lowtrain.format"
ROLES = ("lhs", "rhs", "grad")


def _dims(shape) -> str:
    return "x".join(str(int(d)) for d in shape)


def _undims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x")) if text else ()


@dataclasses.dataclass(frozen=True)
class Site:
    """What one FP8 cast is: `fmt` its format's name (`"float8_e4m3fn"`); `role`
    `"lhs"`, `"rhs"` (forward operands), `"grad"` (the output cotangent, backward)
    or `""` (a cast outside a matmul); `gemm` the matmul's `(batch, M, N, K)` (its
    `2 * batch * M * N * K` FLOPs; `()` if unknown); `rhs` the right operand's shape;
    `applied` False for a shadow (the matmul runs wide); `amax` True for a shadow of
    a cast with current scaling (its value is judged after dividing by its own
    amax over the format's largest value, which the report computes); `scaling`
    the `lowtrain.fp8.BlockFormat` name of a block-scaled cast (`""`: one scale
    for the tensor), whose value is read after each block's scale, in `fmt` its
    element format; `stochastic` whether the cast rounds stochastically.

    ```python
    from lowtrain.fp8._sites import Site

    site = Site("float8_e5m2", "grad", (1, 2048, 384, 128), (128, 384))
    assert Site.parse(site.scope()) == site
    assert site.flops == 2 * 2048 * 384 * 128
    block = Site("float4_e2m1fn", "grad", (), (128, 384), scaling="nvfp4",
                 stochastic=True)
    assert Site.parse(block.scope()) == block
    ```
    """

    fmt: str
    role: str = ""
    gemm: tuple[int, ...] = ()
    rhs: tuple[int, ...] = ()
    applied: bool = True
    amax: bool = False
    scaling: str = ""
    stochastic: bool = False

    def scope(self) -> str:
        kind = "cast" if self.applied else ("shadow-amax" if self.amax else "shadow")
        rounding = "stochastic" if self.stochastic else "nearest"
        parts = (self.fmt, self.role, _dims(self.gemm), _dims(self.rhs), kind)
        return "|".join((SITE_PREFIX, *parts, self.scaling, rounding))

    @classmethod
    def parse(cls, name: str) -> Site | None:
        """The `Site` a scope name holds, or None for any other scope."""
        parts = name.split("|")
        if len(parts) != 8 or parts[0] != SITE_PREFIX:
            return None
        _, fmt, role, gemm, rhs, kind, scaling, rounding = parts
        return cls(
            fmt,
            role,
            _undims(gemm),
            _undims(rhs),
            kind == "cast",
            kind == "shadow-amax",
            scaling,
            rounding == "stochastic",
        )

    @property
    def flops(self) -> int:
        return 2 * math.prod(self.gemm) if self.gemm else 0


def conv_gemm(rhs_shape, out_shape, out_features: int) -> tuple[int, ...]:
    """`(1, M, N, K)` of a convolution: M output positions, N `out_features`
    channels, K the kernel's values per output channel."""
    n = max(int(out_features), 1)
    return (1, math.prod(out_shape) // n, n, math.prod(rhs_shape) // n)


def matmul_sites(
    lhs_shape, rhs_shape, gemm: tuple = (), applied: bool = True
) -> dict[str, Site]:
    """The three casts of one FP8 matmul: `lhs` and `rhs` to E4M3, `grad` (the
    output cotangent) to E5M2."""
    rhs = tuple(int(d) for d in rhs_shape)
    return {
        "lhs": Site(str(E4M3), "lhs", gemm, rhs, applied),
        "rhs": Site(str(E4M3), "rhs", gemm, rhs, applied),
        "grad": Site(str(E5M2), "grad", gemm, rhs, applied),
    }


def probed(x: Array, site: Site) -> Array:
    """`x` itself (`x * 1`, which XLA removes), named as the value a shadow cast
    `site` would round (the caller uses the result, so the name survives autodiff's
    dead-code elimination)."""
    with jax.named_scope(site.scope()):
        return x * 1.0
