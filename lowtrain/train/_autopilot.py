"""`Autopilot`: the numerics report decides, during training, which matmuls run in FP8.

A callback of `Trainer.fit`. At step 1 (after one step in the Trainer's own
precision, so that delayed scaling has a history) and every `every` steps after, it
tracks the step's casts on `batches` batches (`lowtrain.numerics.track(...,
casts=True)`: each FP8 cast after its scale, and the shadows of the matmuls kept
wide), makes a `lowtrain.numerics.Plan` from them, and switches the Trainer to the
precision that runs it (`Trainer.use_precision`: the state stays in memory, the
step is compiled again). A plan that keeps a matmul wide changes what the other
casts see (a gradient no longer flushed upstream), so each planning round tracks
again with the new plan, up to `ROUNDS` times, until the plan holds. A matmul moves
back into FP8 only when its casts lose less than `HYSTERESIS` times the thresholds
(no flapping at a threshold).

With `formats` (e.g. `["nvfp4", "mxfp8", "fp8"]`), the scaling is the decision: each
planning round tracks the step once per format with every matmul in it, and each
matmul takes the first format whose casts (flush, saturation and rounding error)
are within the thresholds, else stays wide (`lowtrain.numerics.plan(formats=...)`).
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import numerics
from ..numerics import Plan
from ._callbacks import Callback
from ._hooks import positive_int
from ._protocol import Precision

log = logging.getLogger("lowtrain")

ROUNDS = 3  # planning rounds at one step (tracked again while the plan changes)
HYSTERESIS = 0.5  # a wide matmul moves in below this fraction of the thresholds
# The defaults with `formats`, and why (docs/numerics.md has the data): a cast may
# lose a relative RMS error of 0.15 forward and 0.3 backward. On the char-GPT every
# NVFP4 cast loses 0.10-0.13 (E2M1 has one mantissa bit; Gaussian values lose
# 0.11), MXFP8's 0.027 and per-tensor FP8's 0.05: over 0.15 is a cast whose blocks
# hold outliers that flush their neighbours. Flush separates the matmuls there.
MAX_ERROR_FWD = 0.15
MAX_ERROR_BWD = 0.3
MIN_SHARE = 0.02  # a 4-bit format only for a matmul with 2% of the FLOPs


class Autopilot(Callback):
    """Chooses, while `fit` trains, which matmuls run in FP8 from what their casts
    lose (a callback: `trainer.fit(..., callbacks=[Autopilot(...)])`).

    **Arguments:**

    - `precision`: `precision(keep) -> Precision`, the run's precision with the
      matmuls `keep` names kept wide (scope names, or a scope, `@` and the right
      operand's shape: `lowtrain.unit_scaling.keep_scopes`; the recipes' FP8
      precisions, such as `lowtrain.recipes.precisions.amp`, take `keep`). It
      must store the state as the Trainer's precision does. With `formats`:
      `precision(keep, routes, base) -> Precision`, the matmuls `routes` names
      (`"<entry>=<format>"`) in their formats and the others in `base`, as
      `lowtrain.train.block_scaled(keep=, routes=, base=)` takes them.
    - `formats`: None (the default: each matmul in FP8 or wide), or the formats a
      matmul may take, most aggressive first (`lowtrain.train.block_scaled`'s
      `FORMATS`: "nvfp4", "mxfp8", "fp8_block", "fp8"); wide is the fallback.
    - `max_error_fwd`, `max_error_bwd`: with `formats`, the largest relative RMS
      rounding error of a forward and a backward cast (`plan`'s); `min_share`:
      the smallest share of the matmul FLOPs a 4-bit format runs.
    - `every`: steps between plans (the first is made after step 1).
    - `batches`: batches tracked for each plan (those of the steps that follow:
      the worst of each cast counts).
    - `max_flush_fwd`, `max_flush_bwd`, `max_saturate`, `min_dim`: the thresholds
      of `lowtrain.numerics.plan` (what a forward E4M3 cast may flush to zero, a
      backward E5M2 one, any cast clip; matmuls smaller than `min_dim` stay wide).
    - `keep`: matmuls kept wide whatever the plans say.
    - `directory`: where `plan.json` (the current plan, the `keep` that
      reproduces it, the plans by step) and `plan.txt` (its table) are written,
      and read back on resume; default the fit's `checkpoint_dir`, else nowhere.

    Each plan also goes to the fit's metrics file as a row `{"event": "plan",
    "step", "fp8_share", "kept", "changes"}` and to the `lowtrain` logger. A
    resumed fit (`resume=True`) goes on with the plan in effect at its
    checkpoint's step. `summary(steps)` sums the run up.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import lowtrain
    from lowtrain.train import naive_fp8

    class Two(eqx.Module):
        a: jax.Array
        b: jax.Array

        def __call__(self, x):
            with jax.named_scope("a"):
                ya = x @ self.a
            with jax.named_scope("b"):
                yb = x @ self.b
            return ya, yb

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):  # b's gradient: far below E5M2's
            ya, yb = model(batch)
            return jnp.mean((ya - 1.0) ** 2) + 1e-9 * jnp.sum(yb)

    model = Two(jnp.ones((8, 4)), jnp.ones((8, 4)))
    trainer = Fit(model, optax.sgd(0.01), precision=naive_fp8())
    pilot = lowtrain.train.Autopilot(lambda keep: naive_fp8(keep=keep), every=3,
                                     batches=1)
    data = lambda step: jax.random.normal(jax.random.key(step), (16, 8))
    trainer.fit(trainer.init(key=jax.random.key(0)), data, steps=5,
                callbacks=[pilot], progress=False)
    assert pilot.summary(5)["keep"] == ["b"]  # a runs in FP8, b stays wide
    ```
    """

    def __init__(
        self,
        precision: Callable[[list[str]], Precision],
        *,
        every: int = 250,
        batches: int = 2,
        max_flush_fwd: float = 0.25,
        max_flush_bwd: float = 0.005,
        max_saturate: float = 0.001,
        min_dim: int = 0,
        keep: Sequence[str] = (),
        directory: str | pathlib.Path | None = None,
        formats: Sequence[str] | None = None,
        max_error_fwd: float | None = MAX_ERROR_FWD,
        max_error_bwd: float | None = MAX_ERROR_BWD,
        min_share: float = MIN_SHARE,
    ):
        if not callable(precision):
            raise TypeError(
                "Expected `precision` to be a function `keep -> Precision` (e.g. "
                "`lambda keep: naive_fp8(keep=keep)`), got "
                f"{type(precision).__name__} instead."
            )
        self.precision = precision
        self.every = positive_int(every, "every", optional=False)
        self.batches = positive_int(batches, "batches", optional=False)
        self.thresholds = {}
        for name, value in (
            ("max_flush_fwd", max_flush_fwd),
            ("max_flush_bwd", max_flush_bwd),
            ("max_saturate", max_saturate),
        ):
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and 0 <= value <= 1):
                raise ValueError(
                    f"Expected `{name}` a fraction in [0, 1], got {value!r} instead."
                )
            self.thresholds[name] = float(value)
        self.formats = None if formats is None else tuple(str(f) for f in formats)
        if self.formats is not None:
            if not self.formats:
                raise ValueError(
                    "Expected `formats` to name at least one format, e.g. "
                    "['nvfp4', 'mxfp8', 'fp8'], got none."
                )
            for name, value in (
                ("max_error_fwd", max_error_fwd),
                ("max_error_bwd", max_error_bwd),
                ("min_share", min_share),
            ):
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if value is not None and not (number and 0 <= value <= 1):
                    raise ValueError(
                        f"Expected `{name}` a fraction in [0, 1], got {value!r} "
                        "instead."
                    )
            self.thresholds |= {
                "max_error_fwd": max_error_fwd,
                "max_error_bwd": max_error_bwd,
                "min_share": float(min_share),
            }
        self.min_dim = int(min_dim)
        self.keep = sorted(str(k) for k in keep)
        self.directory = None if directory is None else pathlib.Path(directory)
        self.plans: list[tuple[int, Plan]] = []  # (step, plan) in effect from step
        self._tracked: tuple[Callable, Callable] | None = None  # (step fn, tracked)
        self._out: pathlib.Path | None = None
        self._total = 0  # the fit's last step

    def due(self, step: int) -> bool:
        total = self._total
        return (step == 1 or step % self.every == 0) and step < total

    def keep_of(self, plan: Plan | None) -> list[str]:
        """The matmuls kept wide under `plan`: its own and `keep`."""
        return sorted({*self.keep, *(plan.keep if plan else ())})

    def at(self, step: int) -> Plan | None:
        """The plan in effect at `step` (None before the first)."""
        found = [p for s, p in self.plans if s <= step]
        return found[-1] if found else None

    # -- the callback ------------------------------------------------------------

    def on_fit_start(self, trainer, state) -> None:
        run = trainer.fit_run
        self._total = run.schedule.total
        self._out = self.directory or run.schedule.checkpoint_dir
        self._tracked = None
        self.plans = self._read() if run.resumed is not None else []
        start = int(state.step)
        current = self.at(start)
        if current is not None:
            log.info("autopilot: resuming with the plan of step %d", self.plans[-1][0])
            trainer.use_precision(self._built(current), state)
        if start and self.due(start) and not any(s == start for s, _ in self.plans):
            # Stopped after the checkpoint of a planning step, before its plan.
            self._plan(trainer, start, state)

    def on_step_end(self, trainer, info) -> None:
        if not info.stopping:  # a run that ends here trains no further
            self._plan(trainer, info.step, info.state)

    def _plan(self, trainer, step: int, state) -> None:
        current = self.at(step)
        if self.formats is not None:
            plan = self._choose_formats(trainer, step, state, current)
        else:
            plan = self._choose_fp8(trainer, step, state, current)
        changes = plan.changes(current)
        self.plans = [(s, p) for s, p in self.plans if s < step] + [(step, plan)]
        shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in plan.shares().items())
        self._write(step, plan)
        for line in changes:
            log.info("autopilot step %d: %s", step, line)
        keep = self.keep_of(plan)
        log.info(
            "autopilot step %d: matmul FLOPs %s; %s",
            step,
            shares,
            "precision.keep=["
            + ",".join(json.dumps(k) for k in keep)
            + "]"
            + (f" routes {plan.route_list()}" if plan.formats else ""),
        )
        row = {
            "event": "plan",
            "fp8_share": plan.fp8_share,
            "shares": plan.shares(),
            "kept": [m.key for m in plan.wide],
            "changes": changes,
        }
        trainer.fit_run.log_event(row, step)

    def _choose_fp8(self, trainer, step: int, state, current: Plan | None) -> Plan:
        # FP8 or wide, tracked again (up to ROUNDS) while keeping one wide changes
        # what the other casts see; the trainer left on the plan's precision.
        plan, built = current, current  # `built`: the plan the trainer runs
        for _ in range(ROUNDS):
            plan = numerics.plan(
                self._reports(trainer, state, step),
                **self.thresholds,
                min_dim=self.min_dim,
                previous=plan,
                hysteresis=HYSTERESIS,
            )
            if self.keep_of(plan) == self.keep_of(built):
                break
            trainer.use_precision(self.precision(self.keep_of(plan)), state)
            built = plan
        if self.keep_of(plan) != self.keep_of(built):
            trainer.use_precision(self.precision(self.keep_of(plan)), state)
        return plan

    def _choose_formats(self, trainer, step: int, state, current: Plan | None) -> Plan:
        # Each format measured with every matmul in it (the user's `keep` wide),
        # then the plan's precision built.
        reports = {}
        for f in self.formats:
            trainer.use_precision(self.precision(self.keep, [], f), state)
            reports[f] = self._reports(trainer, state, step)
        plan = numerics.plan(
            reports,
            formats=self.formats,
            **self.thresholds,
            min_dim=self.min_dim,
            previous=current,
            hysteresis=HYSTERESIS,
        )
        trainer.use_precision(self._built(plan), state)
        return plan

    def _built(self, plan: Plan) -> Precision:
        # The precision that runs `plan` (and the user's `keep`).
        if plan.formats:
            routes = [
                r for r in plan.route_list() if r.rpartition("=")[0] not in self.keep
            ]
            return self.precision(self.keep_of(plan), routes, plan.base)
        return self.precision(self.keep_of(plan))

    # -- what it leaves ----------------------------------------------------------

    def summary(self, steps: int) -> dict[str, Any]:
        """`fp8_share` (the plan in effect at `steps`: its share of matmul FLOPs
        not kept wide), `fp8_share_run` (weighted by the steps each plan ran, up to
        `steps`), `shares` (the final plan's share of each decision), `keep` and
        `routes` (the final entries) and `plans` (how many were made)."""
        final = self.at(steps)
        return {
            "fp8_share": final.fp8_share if final else None,
            "fp8_share_run": self._share_of_run(steps),
            "shares": final.shares() if final else {},
            "keep": self.keep_of(final),
            "routes": final.route_list() if final else [],
            "plans": len(self.plans),
        }

    def _share_of_run(self, steps: int) -> float:
        # The Trainer's own precision, before the first plan, is not counted.
        if not self.plans:
            return 0.0
        total = 0.0
        for i, (s, p) in enumerate(self.plans):
            end = self.plans[i + 1][0] if i + 1 < len(self.plans) else steps
            total += p.fp8_share * max(0, min(end, steps) - s)
        span = steps - self.plans[0][0]
        return total / span if span > 0 else self.plans[-1][1].fp8_share

    def _reports(self, trainer, state, step: int) -> list:
        # Casts reports of the step's loss and gradients (the program the Trainer's
        # numerics reports track) on the batches of the next `batches` steps, at
        # `state` (nothing is trained); tracked once per precision.
        fn = trainer._numerics_step  # made again by `use_precision`
        if self._tracked is None or self._tracked[0] is not fn:
            self._tracked = (fn, numerics.track(fn, casts=True))
        tracked = self._tracked[1]
        data = trainer.fit_run.data
        return [
            tracked(trainer.shard_batch(data(step + i)), state)[1]
            for i in range(self.batches)
        ]

    def _read(self) -> list[tuple[int, Plan]]:
        path = None if self._out is None else self._out / "plan.json"
        if path is None or not path.exists():
            return []
        history = json.loads(path.read_text())["history"]
        return [(h["step"], Plan.from_json(h["plan"])) for h in history]

    def _write(self, step: int, plan: Plan) -> None:
        if self._out is None or jax.process_index() != 0:
            return
        keep = self.keep_of(plan)
        current = {
            "step": step,
            "keep": keep,
            "override": "precision.keep=[" + ",".join(map(json.dumps, keep)) + "]",
            "fp8_share": plan.fp8_share,
            "shares": plan.shares(),
            "routes": plan.route_list(),
            "base": plan.base,
        }
        data = {
            "current": current,
            "plan": plan.to_json(),
            "history": [{"step": s, "plan": p.to_json()} for s, p in self.plans],
        }
        self._out.mkdir(parents=True, exist_ok=True)
        (self._out / "plan.json").write_text(json.dumps(data, indent=1))
        (self._out / "plan.txt").write_text(f"step {step}\n{plan.table()}\n")
