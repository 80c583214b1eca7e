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
from collections.abc import Iterable, Mapping, Sequence
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
    kept wide), `decision` (`"fp8"` or `"wide"`; with several formats, the one
    chosen), `reason` and `selector` (the `precision.keep` entry that keeps it, or
    the entry that routes it to its format; "" if it runs in the plan's first
    format), and `candidates` (with several formats: per format, per role,
    `(format, flush, saturate, error, stochastic, block-scaled)` as measured in
    it).

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
    candidates: dict[str, dict[str, tuple]] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        """The matmul's name and shape: `name@rhs`."""
        return f"{self.name}@{'x'.join(map(str, self.rhs))}"


def _label(m: Matmul, total: int) -> str:
    # A table row's first columns: name@rhs, the GEMM (and calls), FLOP share.
    name = m.name if len(m.name) <= 24 else "..." + m.name[-21:]
    name = f"{name}@{'x'.join(map(str, m.rhs))}"
    shape = "x".join(map(str, m.gemm)) + (f" x{m.calls}" if m.calls > 1 else "")
    return f"{name:32} {shape:>22} {100 * m.flops / total:5.1f}%"


def _decided(m: Matmul) -> str:
    return m.decision + (f" ({m.reason})" if m.reason else "")


def _short(fmt: str) -> str:
    names = {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2", "float4_e2m1fn": "E2M1"}
    return names.get(fmt, fmt)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decision of `plan`: which matmuls run in FP8 and which stay wide.

    - `matmuls`: every FP8-capable matmul the report saw (`Matmul`), in program
      order;
    - `keep`: the `precision.keep` entries (`lowtrain.unit_scaling.keep_scopes`)
      that keep exactly the wide ones wide;
    - `fp8_share`: the fraction of the matmuls' FLOPs that run in FP8;
    - `thresholds`: what it was decided with;
    - `formats`: with several formats (`plan(formats=...)`), the candidates, most
      aggressive first (`base`, the first, is that of every matmul no route names);
      empty for a plan of FP8 or wide;
    - `routes`: `(entry, format)` pairs routing the matmuls in a format other than
      `base` and wide (`route_list()` gives them as `precision.routes` entries,
      `shares()` each decision's share of the FLOPs).

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
    formats: tuple[str, ...] = ()
    routes: tuple[tuple[str, str], ...] = ()

    @property
    def base(self) -> str:
        """The format of the matmuls no entry routes: the first of `formats`, or
        "fp8"."""
        return self.formats[0] if self.formats else FP8

    @property
    def fp8_share(self) -> float:
        """The fraction of the matmuls' FLOPs not kept wide (in FP8, or in any of
        `formats`)."""
        return 1.0 - self.shares().get(WIDE, 0.0) if self.matmuls else 0.0

    def shares(self) -> dict[str, float]:
        """Each decision's fraction of the matmuls' FLOPs: `{"nvfp4": 0.9, ...}`."""
        total = sum(m.flops for m in self.matmuls)
        out: dict[str, float] = {}
        for m in self.matmuls:
            out[m.decision] = out.get(m.decision, 0.0) + (
                m.flops / total if total else 0
            )
        return out

    def route_list(self) -> list[str]:
        """`routes` as `precision.routes` entries: `"<entry>=<format>"`."""
        return [f"{entry}={fmt}" for entry, fmt in self.routes]

    @property
    def wide(self) -> tuple[Matmul, ...]:
        return tuple(m for m in self.matmuls if m.decision == WIDE)

    def override(self) -> str:
        """`precision.keep=[...]`: the command-line override that keeps what this
        plan keeps (each entry quoted: scopes such as `btc,vc->btv` hold commas)."""
        keep = "precision.keep=[" + ",".join(json.dumps(k) for k in self.keep) + "]"
        if not self.formats:
            return keep
        routes = ",".join(json.dumps(r) for r in self.route_list())
        return f"precision.base={self.base} {keep} precision.routes=[{routes}]"

    def table(self) -> str:
        """The plan as a plain-text table (see the class docstring)."""
        if self.formats:
            return self._format_table()
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
            lines.append(
                f"{_label(m, total)}  {cells[0]:>11} {cells[1]:>11} {cells[2]:>11}  "
                f"{_decided(m)}"
            )
        lines.append(f"override: '{self.override()}'")
        return "\n".join(lines)

    __str__ = table

    def _format_table(self) -> str:
        # With several formats: each candidate's worst cast (error, flush,
        # saturation, in %) and the decision.
        total = sum(m.flops for m in self.matmuls) or 1
        shares = ", ".join(f"{k} {v:.1%}" for k, v in self.shares().items())
        head = f"{'matmul':32} {'shape (B,M,N,K)':>22} {'FLOPs':>6}  " + " ".join(
            f"{f + ' err/fl/sat':>20}" for f in self.formats
        )
        lines = [f"matmul FLOPs: {shares} (worst cast of each format, %)", head]
        for m in self.matmuls:
            cells = []
            for f in self.formats:
                casts = m.candidates.get(f, {})
                if not casts:
                    cells.append(f"{'-':>20}")
                    continue
                err = max(c[3] for c in casts.values())
                # A stochastically rounded cast's flush is no loss (`_judge`).
                flush = max((c[1] for c in casts.values() if not c[4]), default=0.0)
                sat = max(c[2] for c in casts.values())
                cells.append(f"{100 * err:6.1f}/{100 * flush:5.1f}/{100 * sat:<6.2f}")
            cells = " ".join(f"{c:>20}" for c in cells)
            lines.append(f"{_label(m, total)}  {cells}  {_decided(m)}")
        lines.append(f"override: '{self.override()}'")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data (`from_json` reads it back)."""
        return {
            "keep": list(self.keep),
            "fp8_share": self.fp8_share,
            "shares": self.shares(),
            "thresholds": dict(self.thresholds),
            "formats": list(self.formats),
            "routes": [list(r) for r in self.routes],
            "matmuls": [
                dataclasses.asdict(m)
                | {"losses": {k: list(v) for k, v in m.losses.items()}}
                | {
                    "candidates": {
                        f: {r: list(c) for r, c in casts.items()}
                        for f, casts in m.candidates.items()
                    }
                }
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
                    "candidates": {
                        f: {r: tuple(c) for r, c in casts.items()}
                        for f, casts in m.get("candidates", {}).items()
                    },
                }
            )
            for m in data["matmuls"]
        )
        return cls(
            matmuls,
            tuple(data["keep"]),
            dict(data["thresholds"]),
            tuple(data.get("formats", ())),
            tuple(tuple(r) for r in data.get("routes", ())),
        )

    def changes(self, before: Plan | None) -> list[str]:
        """What moved between `before` and this plan, one line a matmul: "name:
        fp8 -> wide (reason)"; every one not in the plan's first format (`base`)
        when `before` is None."""
        old = {} if before is None else {m.key: m.decision for m in before.matmuls}
        lines = []
        for m in self.matmuls:
            was = old.get(m.key, self.base)
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
    # One `Matmul` per (name, rhs, gemm) of the report's FP8 casts, program order;
    # its `candidates[""]`: per role `(format, flush, saturate, error, stochastic,
    # block)` (`block`: block-scaled).
    found: dict[tuple, dict] = {}
    for row in report.rows:
        site = row.get("site")
        if not site or site["role"] not in ROLES:
            continue
        key = (row["name"], tuple(site["rhs"]), tuple(site["gemm"]))
        entry = found.setdefault(key, {"casts": {}, "calls": {}, "applied": False})
        fmt, role = site["format"], site["role"]
        flush, sat = row["underflow"][fmt], row["overflow"][fmt]
        error, stochastic = row.get("error", 0.0), bool(site.get("stochastic"))
        block = bool(site.get("scaling"))
        old = entry["casts"].get(role, (fmt, 0.0, 0.0, 0.0, False, False))
        entry["casts"][role] = (
            fmt,
            max(old[1], flush),
            max(old[2], sat),
            max(old[3], error),
            old[4] or stochastic,
            old[5] or block,
        )
        # A call is one layer's cast in its own pass (a remat's recomputed forward
        # casts, in the backward pass, are the same calls again).
        if (row["pass"] == "bwd") == (role == "grad"):
            entry["calls"].setdefault(role, set()).add(row.get("layer"))
        entry["applied"] |= bool(site["applied"])
    out = []
    for (name, rhs, gemm), e in found.items():
        # The forward casts count the calls (a block-scaled GEMM casts its
        # gradient twice a call, once for each backward GEMM).
        counted = [len(e["calls"][r]) for r in ("lhs", "rhs") if r in e["calls"]]
        counted = counted or [len(layers) for layers in e["calls"].values()]
        calls = max(counted or [1])
        flops = 2 * math.prod(gemm) * calls if gemm else 0
        losses = {role: c[:3] for role, c in e["casts"].items()}
        out.append(
            Matmul(
                name,
                rhs,
                gemm,
                calls,
                flops,
                losses,
                e["applied"],
                candidates={"": e["casts"]},
            )
        )
    return out


def _merged(reports: list[Report]) -> dict[str, Matmul]:
    # The matmuls of several reports by key, each cast's worst over them.
    merged: dict[str, Matmul] = {}
    for r in reports:
        for m in _gather(r):
            old = merged.get(m.key)
            if old is not None:
                casts = dict(old.candidates[""])
                for role, (fmt, flush, sat, err, sto, blk) in m.candidates[""].items():
                    none = (fmt, 0.0, 0.0, 0.0, False, False)
                    _, f0, s0, e0, st0, b0 = casts.get(role, none)
                    casts[role] = (
                        fmt,
                        max(f0, flush),
                        max(s0, sat),
                        max(e0, err),
                        st0 or sto,
                        b0 or blk,
                    )
                m = dataclasses.replace(
                    old,
                    losses={role: c[:3] for role, c in casts.items()},
                    candidates={"": casts},
                )
            merged[m.key] = m
    return merged


def _judge(
    m: Matmul, limits: dict[str, float], min_dim: int, casts=None
) -> tuple[str, str]:
    # FP8 or WIDE for the casts `casts` (default the matmul's own, as measured),
    # each `(format, flush, saturate, error, stochastic, block)`: a stochastically
    # rounded cast's flush is no loss (its mean is kept), its error is; a
    # block-scaled cast's saturation is bounded by its block's scale rule (MX's
    # power-of-two scale clips a block's largest values by at most an eighth, by
    # the OCP spec) and counted in its error.
    if min_dim and m.gemm and min(m.gemm[1:]) < min_dim:
        dims = "x".join(map(str, m.gemm[1:]))
        return WIDE, f"GEMM {dims} below min_dim {min_dim}"
    casts = m.candidates.get("", {}) if casts is None else casts
    reasons = []
    for role in ROLES:
        if role not in casts:
            continue
        fmt, flush, sat, error, stochastic, block = casts[role]
        back = role == "grad"
        most = limits["max_flush_bwd" if back else "max_flush_fwd"]
        if flush > most and not stochastic:
            reasons.append(f"{role} {_short(fmt)} flushes {flush:.1%} > {most:.1%}")
        most = limits["max_saturate"]
        if sat > most and not block:
            reasons.append(f"{role} {_short(fmt)} saturates {sat:.2%} > {most:.1%}")
        most = limits.get("max_error_bwd" if back else "max_error_fwd")
        if most is not None and error > most:
            reasons.append(f"{role} {_short(fmt)} error {error:.1%} > {most:.1%}")
    return (WIDE, "; ".join(reasons)) if reasons else (FP8, "")


def _selects(selector: tuple[str, tuple | None], m: Matmul) -> bool:
    scope, shape = selector
    return scope in m.name.split("/") and (shape is None or shape == m.rhs)


def _text(selector: tuple[str, tuple | None]) -> str:
    scope, shape = selector
    return scope if shape is None else f"{scope}@{'x'.join(map(str, shape))}"


def _selectors(
    matmuls: list[Matmul], base: str = FP8, rank: dict[str, int] | None = None
) -> tuple[list[Matmul], list[tuple[str, str]]]:
    """The entries that route each matmul not in `base` to its decision: for each,
    the innermost scope that selects only matmuls of that decision, else a scope
    and its right operand's shape; matmuls that no entry separates all take the
    most conservative of their decisions (`rank`: higher is more conservative;
    default FP8 then WIDE), repeated until every one has an entry. Returns the
    matmuls with their `selector` and the `(entry, decision)` pairs."""
    rank = rank or {FP8: 0, WIDE: 1}
    matmuls = list(matmuls)
    while True:
        chosen: dict[str, str] = {}
        pulled = None
        for m in matmuls:
            if m.decision == base:
                continue
            scopes = [s for s in reversed(m.name.split("/")) if s != "(top)"]
            options = [(s, None) for s in scopes] + [(s, m.rhs) for s in scopes]
            for option in options:
                selected = [o for o in matmuls if _selects(option, o)]
                if all(o.decision == m.decision for o in selected):
                    chosen[m.key] = _text(option)
                    break
            else:
                if not scopes:  # no named scope: it cannot be routed by name
                    chosen[m.key] = ""
                    continue
                pulled = [o for o in matmuls if _selects((scopes[0], m.rhs), o)]
                break
        if pulled is None:
            break
        worst = max((o.decision for o in pulled), key=rank.__getitem__)
        why = f"shares `{_text((pulled[0].name.split('/')[-1], pulled[0].rhs))}`"
        matmuls = [
            dataclasses.replace(o, decision=worst, reason=why)
            if o in pulled and o.decision != worst
            else o
            for o in matmuls
        ]
    out = []
    for m in matmuls:
        if m.decision != base and not chosen.get(m.key):
            m = dataclasses.replace(
                m, decision=base, reason="no named scope to route it by: " + m.reason
            )
        out.append(dataclasses.replace(m, selector=chosen.get(m.key, "")))
    routes = sorted({(m.selector, m.decision) for m in out if m.selector})
    return out, routes


def plan(
    report: Report | Iterable[Report] | Mapping[str, Report | Iterable[Report]],
    *,
    formats: Sequence[str] | None = None,
    max_flush_fwd: float = MAX_FLUSH_FWD,
    max_flush_bwd: float = MAX_FLUSH_BWD,
    max_saturate: float = MAX_SATURATE,
    max_error_fwd: float | None = None,
    max_error_bwd: float | None = None,
    min_share: float = 0.0,
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
      `scripts/bench.py gemm`: `break_even`);
    - `max_error_fwd`, `max_error_bwd` (default None: not judged): the largest
      relative RMS rounding error (a row's `error`) of a forward and a backward
      cast.

    With `formats` (format names, most aggressive first, e.g. `["nvfp4", "mxfp8",
    "fp8"]`), the scaling is the decision: `report` is a dict from each format to
    its report(s), measured with every matmul in that format, and each matmul
    takes the first format whose casts are all within the limits, else stays wide.
    There a stochastically rounded cast's flush is not judged (its values survive
    on average; its error is), nor a block-scaled cast's saturation (its block's
    scale bounds it; its error counts it); `min_share` (default 0) is the smallest
    share of the FLOPs a matmul needs for a 4-bit format ("nvfp4", "mxfp4"). The
    plan's `routes` and `keep` name the matmuls not in the first format.

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
    limits = {
        "max_flush_fwd": _check_fraction(max_flush_fwd, "max_flush_fwd"),
        "max_flush_bwd": _check_fraction(max_flush_bwd, "max_flush_bwd"),
        "max_saturate": _check_fraction(max_saturate, "max_saturate"),
    }
    for name, value in (
        ("max_error_fwd", max_error_fwd),
        ("max_error_bwd", max_error_bwd),
    ):
        if value is not None:
            limits[name] = _check_fraction(value, name)
    if isinstance(min_dim, bool) or not isinstance(min_dim, int) or min_dim < 0:
        raise ValueError(f"Expected `min_dim` as an int >= 0, got {min_dim!r} instead.")
    hysteresis = _check_fraction(hysteresis, "hysteresis")
    min_share = _check_fraction(min_share, "min_share")
    strict = {k: v * hysteresis for k, v in limits.items()}
    if formats is not None:
        return _plan_formats(
            report, formats, limits, strict, min_share, min_dim, previous
        )
    merged = _merged(_reports(report))
    was_wide = set() if previous is None else {m.key for m in previous.wide}
    judged = []
    for m in merged.values():
        decision, reason = _judge(m, limits, min_dim)
        if decision == FP8 and m.key in was_wide:
            decision, reason = _judge(m, strict, min_dim)
            if decision == WIDE:
                reason = f"stays wide until under {hysteresis:g}x the limits: {reason}"
        judged.append(dataclasses.replace(m, decision=decision, reason=reason))
    matmuls, routes = _selectors(judged)
    matmuls = [dataclasses.replace(m, candidates={}) for m in matmuls]
    keep = tuple(entry for entry, _ in routes)
    return Plan(tuple(matmuls), keep, limits | {"min_dim": min_dim})


def _reports(report, what: str = "`report`") -> list[Report]:
    reports = [report] if isinstance(report, Report) else list(report)
    if not reports or not all(isinstance(r, Report) for r in reports):
        raise TypeError(
            f"Expected {what} as a `lowtrain.numerics.Report` (or several), from "
            f"`track(fn, casts=True)`, got {report!r} instead."
        )
    for r in reports:
        if r.kind != "casts":
            raise ValueError(
                "Expected a casts report, which judges each FP8 cast after its scale, "
                "got a report of every tensor (kind 'all') instead. Track with "
                "`lowtrain.numerics.track(fn, casts=True)`."
            )
    return reports


# Element widths of the formats a plan may choose: a format narrower than 8 bits
# runs only matmuls that carry `min_share` of the FLOPs.
_NARROW = {"nvfp4": 4, "mxfp4": 4}


def _plan_formats(report, formats, limits, strict, min_share, min_dim, previous):
    # Each matmul in the first of `formats` whose casts (in that format's reports)
    # are all within `limits`, else wide.
    formats = tuple(formats)
    if not formats or not all(isinstance(f, str) and f for f in formats):
        raise TypeError(
            "Expected `formats` as format names, most aggressive first, e.g. "
            f"['nvfp4', 'mxfp8', 'fp8'], got {formats!r} instead."
        )
    if WIDE in formats or len(set(formats)) != len(formats):
        raise ValueError(
            f"Expected distinct formats other than {WIDE!r} (the fallback of every "
            f"plan), got {list(formats)} instead."
        )
    if not isinstance(report, Mapping) or set(report) != set(formats):
        given = sorted(report) if isinstance(report, Mapping) else type(report).__name__
        raise ValueError(
            "Expected one casts report (or several) per format, measured with every "
            f"matmul in that format: a dict with keys {list(formats)}, got {given} "
            "instead."
        )
    measured = {f: _merged(_reports(report[f], f"report[{f!r}]")) for f in formats}
    rank = {f: i for i, f in enumerate(formats)} | {WIDE: len(formats)}
    before = {} if previous is None else {m.key: m.decision for m in previous.matmuls}
    total = sum(m.flops for m in measured[formats[0]].values()) or 1
    judged = []
    for key, first in measured[formats[0]].items():
        candidates = {
            f: measured[f][key].candidates[""] for f in formats if key in measured[f]
        }
        decision, reasons = WIDE, []
        for f in formats:
            if f not in candidates:
                reasons.append(f"{f}: not measured")
                continue
            if f in _NARROW and first.flops / total < min_share:
                reasons.append(
                    f"{f}: {first.flops / total:.1%} of the FLOPs < min_share "
                    f"{min_share:.1%}"
                )
                continue
            # A matmul moves to a more aggressive format than its last one only
            # well within the limits (no flapping at a threshold).
            moving = key in before and rank.get(before[key], 0) > rank[f]
            verdict, why = _judge(
                first, strict if moving else limits, min_dim, candidates[f]
            )
            if verdict == FP8:
                decision = f
                break
            reasons.append(f"{f}: {why}" + (" (moving in: stricter)" if moving else ""))
        losses = {
            r: c[:3]
            for r, c in candidates.get(decision, candidates[formats[0]]).items()
        }
        judged.append(
            dataclasses.replace(
                first,
                decision=decision,
                reason="; ".join(reasons),
                losses=losses,
                candidates=candidates,
            )
        )
    matmuls, routes = _selectors(judged, formats[0], rank)
    keep = tuple(e for e, d in routes if d == WIDE)
    routed = tuple((e, d) for e, d in routes if d != WIDE)
    thresholds = limits | {"min_dim": min_dim, "min_share": min_share}
    return Plan(tuple(matmuls), keep, thresholds, formats, routed)


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
