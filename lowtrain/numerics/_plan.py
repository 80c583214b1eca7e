"""`plan`: which matmuls run in FP8, decided from a casts report.

A casts report (`track(fn, casts=True)`) holds, for every FP8 matmul of the program
(and every matmul kept wide by `keep_op`, as shadows), the fractions of its three
casts' values that round to zero (flush) or past the format's largest value
(saturate), after the cast's scale. `plan` keeps a matmul wide when one of its casts
loses more than a threshold, or when its GEMM is too small for FP8 to pay, and
names what it keeps as `precision.keep` entries (`jax.named_scope` names, with `@`
and the right operand's shape where several matmuls share a scope).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

from ._report import Report

# Defaults of `plan`'s thresholds, and why (docs/numerics.md has the data):
# - a forward (E4M3) cast may flush a quarter of its nonzero values: the standard
#   GPT's 0.007-std weights lose 11% in E4M3's subnormals, u-μP's attention
#   probabilities up to a third, and neither costs measurable loss; the values lost
#   are the smallest ones;
MAX_FLUSH_FWD = 0.25
# - a backward (E5M2) cast may flush 0.5%: the gradient is the training signal. The
#   naive-FP8 GPT's logits gradient (90% flushed) and attention-score gradient
#   (100%) stop it learning; u-μP's readout gradient flushes 0.6% at step 500 of
#   the char-GPT, 4% at 750, 9% at 1000, and the readout costs it 0.05 nats/char
#   kept in FP8 (docs/numerics.md);
MAX_FLUSH_BWD = 0.005
# - any cast may saturate 0.1% of its values: a saturated value is wrong by up to
#   its own size (u-μP's growing readout weight, clipped at 448, costs 0.05-0.13
#   nats/char on the char-GPT).
MAX_SATURATE = 0.001

ROLES = ("lhs", "rhs", "grad")
FP8, WIDE = "fp8", "wide"


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul of a plan: `name` (the `jax.named_scope` path around it, "/"
    joined), `rhs` (its right operand's shape), `gemm` (`(batch, M, N, K)` of one
    call), `calls` (how many times the program runs it: the layers of a scanned
    stack), `flops` (of all its forward calls: `2 * batch * M * N * K * calls`),
    `losses` (per cast role `lhs`, `rhs`, `grad`: `(format, flush, saturate)`, the
    worst over the calls), `applied` (whether the report saw it in FP8 rather than
    kept wide), `decision` (`"fp8"` or `"wide"`), `reason` and `selector` (the
    `precision.keep` entry that keeps it, or "" if it runs in FP8).

    ```python
    from lowtrain.numerics import Matmul

    m = Matmul("mlp", (128, 512), (1, 2048, 512, 128), 4, 4 * 2 * 2048 * 512 * 128,
               {"grad": ("float8_e5m2", 0.6, 0.0)}, True, "wide", "flushes")
    assert m.key == "mlp@128x512"
    ```
    """

    name: str
    rhs: tuple[int, ...]
    gemm: tuple[int, ...]
    calls: int
    flops: int
    losses: dict[str, tuple[str, float, float]]
    applied: bool
    decision: str = FP8
    reason: str = ""
    selector: str = ""

    @property
    def key(self) -> str:
        """The matmul's name and shape: `name@rhs`."""
        return f"{self.name}@{'x'.join(map(str, self.rhs))}"


def _short(fmt: str) -> str:
    return {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}.get(fmt, fmt)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decision of `plan`: which matmuls run in FP8 and which stay wide.

    - `matmuls`: every FP8-capable matmul the report saw (`Matmul`), in program
      order;
    - `keep`: the `precision.keep` entries (`lowtrain.unit_scaling.keep_scopes`)
      that keep exactly the wide ones wide;
    - `fp8_share`: the fraction of the matmuls' FLOPs that run in FP8;
    - `thresholds`: what it was decided with.

    `str(plan)` (or `plan.table()`) is a table: matmul, shape, FLOP share, the
    losses of each cast, decision and reason. `plan.override()` is the command-line
    override that reproduces it; `to_json`/`from_json` round-trip it (the
    autopilot's `plan.json`). Apply it to a model with
    `lowtrain.unit_scaling.simulate_fp8(model, keep=plan.keep)`, or to a recipe
    precision with `precision.keep`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.numerics
    import lowtrain.unit_scaling as uu

    def loss(w, x):
        with jax.named_scope("head"):
            return jnp.sum(x @ w) * 1e-9

    grad = jax.grad(uu.simulate_fp8(loss))
    tracked = lowtrain.numerics.track(grad, casts=True)
    _, report = tracked(jnp.ones((4, 2)), jnp.ones((8, 4)))
    plan = lowtrain.numerics.plan(report)
    assert plan.keep == ("head",) and plan.fp8_share == 0.0
    assert plan.override() == 'precision.keep=["head"]'
    assert lowtrain.numerics.Plan.from_json(plan.to_json()) == plan
    ```
    """

    matmuls: tuple[Matmul, ...]
    keep: tuple[str, ...]
    thresholds: dict[str, float]

    @property
    def fp8_share(self) -> float:
        total = sum(m.flops for m in self.matmuls)
        fp8 = sum(m.flops for m in self.matmuls if m.decision == FP8)
        return fp8 / total if total else 0.0

    @property
    def wide(self) -> tuple[Matmul, ...]:
        return tuple(m for m in self.matmuls if m.decision == WIDE)

    def override(self) -> str:
        """`precision.keep=[...]`: the command-line override that keeps what this
        plan keeps (each entry quoted: scopes such as `btc,vc->btv` hold commas)."""
        return "precision.keep=[" + ",".join(json.dumps(k) for k in self.keep) + "]"

    def table(self) -> str:
        """The plan as a plain-text table (see the class docstring)."""
        total = sum(m.flops for m in self.matmuls) or 1
        head = (
            f"{'matmul':32} {'shape (B,M,N,K)':>22} {'FLOPs':>6}  "
            f"{'lhs E4M3':>11} {'rhs E4M3':>11} {'grad E5M2':>11}  decision"
        )
        lines = [
            f"FP8 on {self.fp8_share:.1%} of matmul FLOPs; {len(self.wide)} of "
            f"{len(self.matmuls)} matmuls kept wide (flush/saturate %, worst call)",
            head,
        ]
        for m in self.matmuls:
            cells = []
            for role in ROLES:
                fmt, flush, sat = m.losses.get(role, ("", 0.0, 0.0))
                cells.append(f"{100 * flush:5.1f}/{100 * sat:<5.2f}" if fmt else "-")
            name = m.name if len(m.name) <= 24 else "..." + m.name[-21:]
            name = f"{name}@{'x'.join(map(str, m.rhs))}"
            shape = "x".join(map(str, m.gemm)) + (f" x{m.calls}" if m.calls > 1 else "")
            what = m.decision + (f" ({m.reason})" if m.reason else "")
            lines.append(
                f"{name:32} {shape:>22} {100 * m.flops / total:5.1f}%  "
                f"{cells[0]:>11} {cells[1]:>11} {cells[2]:>11}  {what}"
            )
        lines.append(f"override: '{self.override()}'")
        return "\n".join(lines)

    __str__ = table

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data (`from_json` reads it back)."""
        return {
            "keep": list(self.keep),
            "fp8_share": self.fp8_share,
            "thresholds": dict(self.thresholds),
            "matmuls": [
                dataclasses.asdict(m)
                | {"losses": {k: list(v) for k, v in m.losses.items()}}
                for m in self.matmuls
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The plan `to_json` gave."""
        matmuls = tuple(
            Matmul(
                **{
                    **m,
                    "rhs": tuple(m["rhs"]),
                    "gemm": tuple(m["gemm"]),
                    "losses": {k: tuple(v) for k, v in m["losses"].items()},
                }
            )
            for m in data["matmuls"]
        )
        return cls(matmuls, tuple(data["keep"]), dict(data["thresholds"]))

    def changes(self, before: Plan | None) -> list[str]:
        """What moved between `before` and this plan, one line a matmul: "name:
        fp8 -> wide (reason)"; every wide one when `before` is None."""
        old = {} if before is None else {m.key: m.decision for m in before.matmuls}
        lines = []
        for m in self.matmuls:
            was = old.get(m.key, FP8)
            if was != m.decision:
                lines.append(f"{m.key}: {was} -> {m.decision} ({m.reason or 'fits'})")
        return lines


def _check_fraction(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"Expected `{what}` as a number, got {value!r} instead.")
    if not 0 <= value <= 1:
        raise ValueError(
            f"Expected `{what}` as a fraction in [0, 1], got {value} instead (e.g. "
            "0.05 for 5%)."
        )
    return float(value)


def _gather(report: Report) -> list[Matmul]:
    # One `Matmul` per (name, rhs, gemm) of the report's FP8 casts, program order.
    found: dict[tuple, dict] = {}
    for row in report.rows:
        site = row.get("site")
        if not site or site["role"] not in ROLES:
            continue
        key = (row["name"], tuple(site["rhs"]), tuple(site["gemm"]))
        entry = found.setdefault(key, {"losses": {}, "calls": {}, "applied": False})
        fmt = site["format"]
        flush, sat = row["underflow"][fmt], row["overflow"][fmt]
        old = entry["losses"].get(site["role"], (fmt, 0.0, 0.0))
        entry["losses"][site["role"]] = (fmt, max(old[1], flush), max(old[2], sat))
        # A call is one layer's cast in its own pass (a remat's recomputed forward
        # casts, in the backward pass, are the same calls again).
        if (row["pass"] == "bwd") == (site["role"] == "grad"):
            entry["calls"].setdefault(site["role"], set()).add(row.get("layer"))
        entry["applied"] |= bool(site["applied"])
    out = []
    for (name, rhs, gemm), e in found.items():
        calls = max([len(layers) for layers in e["calls"].values()] or [1])
        flops = 2 * math.prod(gemm) * calls if gemm else 0
        out.append(Matmul(name, rhs, gemm, calls, flops, e["losses"], e["applied"]))
    return out


def _judge(m: Matmul, limits: dict[str, float], min_dim: int) -> tuple[str, str]:
    if min_dim and m.gemm and min(m.gemm[1:]) < min_dim:
        dims = "x".join(map(str, m.gemm[1:]))
        return WIDE, f"GEMM {dims} below min_dim {min_dim}"
    reasons = []
    for role in ROLES:
        if role not in m.losses:
            continue
        fmt, flush, sat = m.losses[role]
        most = limits["max_flush_bwd" if role == "grad" else "max_flush_fwd"]
        if flush > most:
            reasons.append(f"{role} {_short(fmt)} flushes {flush:.1%} > {most:.1%}")
        most = limits["max_saturate"]
        if sat > most:
            reasons.append(f"{role} {_short(fmt)} saturates {sat:.2%} > {most:.1%}")
    return (WIDE, "; ".join(reasons)) if reasons else (FP8, "")


def _selects(selector: tuple[str, tuple | None], m: Matmul) -> bool:
    scope, shape = selector
    return scope in m.name.split("/") and (shape is None or shape == m.rhs)


def _text(selector: tuple[str, tuple | None]) -> str:
    scope, shape = selector
    return scope if shape is None else f"{scope}@{'x'.join(map(str, shape))}"


def _selectors(matmuls: list[Matmul]) -> tuple[list[Matmul], list[str]]:
    """The `keep` entries for the wide matmuls: for each, the innermost scope that
    selects only wide ones, else a scope and its right operand's shape; a matmul
    that no entry separates from an FP8 one makes that one wide too (repeated
    until every wide one has an entry)."""
    matmuls = list(matmuls)
    while True:
        wide = [m for m in matmuls if m.decision == WIDE]
        chosen: dict[str, str] = {}
        pulled = None
        for m in wide:
            scopes = [s for s in reversed(m.name.split("/")) if s != "(top)"]
            options = [(s, None) for s in scopes] + [(s, m.rhs) for s in scopes]
            for option in options:
                if all(o.decision == WIDE for o in matmuls if _selects(option, o)):
                    chosen[m.key] = _text(option)
                    break
            else:
                if not scopes:  # no named scope: it cannot be kept by name
                    chosen[m.key] = ""
                    continue
                option = (scopes[0], m.rhs)
                pulled = [o for o in matmuls if _selects(option, o)]
                break
        if pulled is None:
            break
        why = f"shares `{_text((pulled[0].name.split('/')[-1], pulled[0].rhs))}`"
        matmuls = [
            dataclasses.replace(o, decision=WIDE, reason=why)
            if o in pulled and o.decision == FP8
            else o
            for o in matmuls
        ]
    out = []
    for m in matmuls:
        if m.decision == WIDE and not chosen.get(m.key):
            m = dataclasses.replace(
                m, decision=FP8, reason="no named scope to keep it by: " + m.reason
            )
        out.append(dataclasses.replace(m, selector=chosen.get(m.key, "")))
    keep = sorted({m.selector for m in out if m.selector})
    return out, keep


def plan(
    report: Report | Iterable[Report],
    *,
    max_flush_fwd: float = MAX_FLUSH_FWD,
    max_flush_bwd: float = MAX_FLUSH_BWD,
    max_saturate: float = MAX_SATURATE,
    min_dim: int = 0,
    previous: Plan | None = None,
    hysteresis: float = 0.5,
) -> Plan:
    """Which matmuls run in FP8, from `report`: a casts report
    (`track(fn, casts=True)`), or several (the worst of each cast over them:
    calibration batches).

    Each matmul's three casts (operands `lhs`, `rhs` to E4M3 forward, output
    cotangent `grad` to E5M2 backward), judged as the precision performs them
    (after its scale; for a matmul kept wide, its shadow casts), against:

    - `max_flush_fwd` (default 0.25): the largest fraction of a forward cast's
      nonzero values that may round to zero;
    - `max_flush_bwd` (default 0.005): the same for the backward cast, the
      gradient;
    - `max_saturate` (default 0.001): the largest fraction that may saturate
      (clip at the format's largest value), forward or backward;
    - `min_dim` (default 0: none): a GEMM with an M, N or K below it stays wide,
      too small for an FP8 GEMM to pay for its casts (a device's break-even,
      `scripts/bench.py gemm`: `break_even`).

    A matmul over a limit stays wide; the rest run in FP8. With `previous` (the
    plan in effect), a matmul it kept wide moves back into FP8 only when its casts
    lose less than `hysteresis` times the limits (default half), so that a cast
    near a limit does not move in and out at every plan. Matmuls are named by
    their `jax.named_scope` path and right operand's shape; a scanned stack of
    layers is one matmul (a scope applies to every layer), judged by its worst
    layer. The defaults' reasons are in `lowtrain/numerics/_plan.py`.

    ```python
    import jax
    import jax.numpy as jnp
    import lowtrain.numerics
    import lowtrain.unit_scaling as uu

    def loss(w1, w2, x):
        with jax.named_scope("up"):
            h = x @ w1
        with jax.named_scope("down"):
            y = h @ w2
        return jnp.sum(y) * 1e-9  # a gradient far below E5M2's range

    w1, w2, x = jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((32, 8))
    fp8 = uu.simulate_fp8(loss)
    grads = lowtrain.numerics.track(jax.grad(fp8, argnums=(0, 1)), casts=True)
    _, report = grads(w1, w2, x)
    plan = lowtrain.numerics.plan(report)
    assert plan.keep == ("down",)  # its output gradient flushes in E5M2
    assert "down" in str(plan) and abs(plan.fp8_share - 2 / 3) < 1e-9  # FLOPs
    kept = uu.simulate_fp8(loss, keep=plan.keep)  # the plan applied
    tracked = lowtrain.numerics.track(jax.grad(kept, argnums=(0, 1)), casts=True)
    _, again = tracked(w1, w2, x)
    # Kept wide, `down` passes its gradient on: `up`'s now flushes in turn.
    assert lowtrain.numerics.plan(again).keep == ("down", "up")
    ```
    """
    reports = [report] if isinstance(report, Report) else list(report)
    if not reports or not all(isinstance(r, Report) for r in reports):
        raise TypeError(
            "Expected a `lowtrain.numerics.Report` (or several), from "
            f"`track(fn, casts=True)`, got {report!r} instead."
        )
    for r in reports:
        if r.kind != "casts":
            raise ValueError(
                "Expected a casts report, which judges each FP8 cast after its scale, "
                "got a report of every tensor (kind 'all') instead. Track with "
                "`lowtrain.numerics.track(fn, casts=True)`."
            )
    limits = {
        "max_flush_fwd": _check_fraction(max_flush_fwd, "max_flush_fwd"),
        "max_flush_bwd": _check_fraction(max_flush_bwd, "max_flush_bwd"),
        "max_saturate": _check_fraction(max_saturate, "max_saturate"),
    }
    if isinstance(min_dim, bool) or not isinstance(min_dim, int) or min_dim < 0:
        raise ValueError(f"Expected `min_dim` as an int >= 0, got {min_dim!r} instead.")
    merged: dict[str, Matmul] = {}
    for r in reports:
        for m in _gather(r):
            old = merged.get(m.key)
            if old is not None:
                losses = dict(old.losses)
                for role, (fmt, flush, sat) in m.losses.items():
                    _, f0, s0 = losses.get(role, (fmt, 0.0, 0.0))
                    losses[role] = (fmt, max(f0, flush), max(s0, sat))
                m = dataclasses.replace(old, losses=losses)
            merged[m.key] = m
    hysteresis = _check_fraction(hysteresis, "hysteresis")
    was_wide = set() if previous is None else {m.key for m in previous.wide}
    strict = {k: v * hysteresis for k, v in limits.items()}
    judged = []
    for m in merged.values():
        decision, reason = _judge(m, limits, min_dim)
        if decision == FP8 and m.key in was_wide:
            decision, reason = _judge(m, strict, min_dim)
            if decision == WIDE:
                reason = f"stays wide until under {hysteresis:g}x the limits: {reason}"
        judged.append(dataclasses.replace(m, decision=decision, reason=reason))
    matmuls, keep = _selectors(judged)
    thresholds = limits | {"min_dim": min_dim}
    return Plan(tuple(matmuls), tuple(keep), thresholds)


def break_even(gemm_json: str | pathlib.Path | dict, kind: str = "fp8 static") -> int:
    """The smallest width from which `kind`'s FP8 GEMM is faster than bf16 at every
    larger width: `plan(min_dim=...)` for that device; 0 if FP8 never pays there
    (then nothing is kept wide for its size: no speed to gain, nothing to lose
    either).

    **Arguments:**

    - `gemm_json`: `scripts/bench.py gemm`'s `gemm.json`, as a path or its loaded
      data (a dict whose `"rows"` hold a `"width"`, `"bf16_s"` and `"<kind>_s"`).
    - `kind`: the FP8 timing compared with bf16's, "fp8 static" (the default) or
      "fp8 current".

    ```python
    import lowtrain.numerics

    rows = [
        {"width": 256, "bf16_s": 1.0, "fp8 static_s": 1.2},
        {"width": 1024, "bf16_s": 2.0, "fp8 static_s": 1.5},
    ]
    assert lowtrain.numerics.break_even({"rows": rows}) == 1024
    ```
    """
    data = gemm_json
    if not isinstance(data, dict):
        data = json.loads(pathlib.Path(gemm_json).read_text())
    rows: Sequence[dict] = data.get("rows", [])
    if not rows or f"{kind}_s" not in rows[0]:
        raise ValueError(
            f"Expected `scripts/bench.py gemm`'s gemm.json with rows timing {kind!r}, "
            f"got {sorted(rows[0]) if rows else 'no rows'} instead."
        )
    found = 0
    for row in sorted(rows, key=lambda r: -r["width"]):
        if row[f"{kind}_s"] < row["bf16_s"]:
            found = row["width"]
        else:
            break
    return found
