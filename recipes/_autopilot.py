"""`precision.auto=true`: the numerics report decides which matmuls run in FP8.

`fit_auto` trains as `Trainer.fit` does, in segments. At step 1 (after one step in
the configured precision, so that delayed scaling has a history) and every
`precision.auto_every` steps after, it tracks the step's casts on
`precision.auto_batches` batches (`lowtrain.numerics.track(..., casts=True)`: each
FP8 cast after its scale, and the shadows of the matmuls kept wide), makes a
`lowtrain.numerics.Plan` from them, and trains the next segment with a Trainer built
for that plan (`precision.keep` = the configured entries and the plan's). A plan
that keeps a matmul wide changes what the other casts see (a gradient no longer
flushed upstream), so each planning round tracks again with the new plan, up to
`ROUNDS` times, until the plan holds. A matmul moves back into FP8 only when its
casts lose less than half the thresholds (hysteresis: no flapping at a threshold).

What it leaves in the run directory: `plan.json` (the current plan, the keep
override that reproduces it, and the history of plans by step), `plan.txt` (the
current plan's table), one `metrics.jsonl` row per plan (`"event": "plan"`, the step,
`fp8_share`, the kept matmuls) and a log line per change. A resumed run restores the
plan that was in effect at its checkpoint's step.

The model's structure does not depend on the plan (the recipes' precisions keep a
matmul wide at call time), so the state carries over from one plan to the next as it
is.

    python -m lowtrain recipe=gpt precision=fp8_naive precision.auto=true
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import hydra.utils
import jax

import lowtrain
import lowtrain.numerics
from lowtrain.numerics import Plan

from ._config import AUTO_FIELDS

log = logging.getLogger("lowtrain")

ROUNDS = 3  # planning rounds at one step (tracked again while the plan changes)
HYSTERESIS = 0.5  # a wide matmul moves in below this fraction of the thresholds


def build_precision(precision_config, keep: Sequence[str]):
    """The `lowtrain.train.Precision` that `precision_config` (an FP8 precision's
    config dataclass) builds with `keep` as its `precision.keep`."""
    fields = dataclasses.asdict(precision_config)
    fields.pop("name")
    fields["keep"] = list(keep)
    return hydra.utils.instantiate(fields)


def _thresholds(config) -> dict[str, float]:
    return {
        "max_flush_fwd": config.auto_max_flush_fwd,
        "max_flush_bwd": config.auto_max_flush_bwd,
        "max_saturate": config.auto_max_saturate,
    }


def make_plan(reports, config, previous: Plan | None) -> Plan:
    """`lowtrain.numerics.plan` of `reports` with `config`'s thresholds and
    `min_dim`, moving a matmul `previous` kept wide back into FP8 only under
    `HYSTERESIS` times the thresholds."""
    return lowtrain.numerics.plan(
        reports,
        **_thresholds(config),
        min_dim=getattr(config, "min_dim", 0),
        previous=previous,
        hysteresis=HYSTERESIS,
    )


def tracked_reports(trainer, state, data, step: int, n: int) -> list:
    """Casts reports of `trainer`'s loss and gradients on the batches of steps
    `step .. step + n - 1` at `state` (nothing is trained)."""

    def loss_and_grads(batch, s):
        ((loss, _), grads, _), _, _ = trainer.loss_and_grads(s, batch)
        return grads, {"loss": loss}

    tracked = getattr(trainer, "_autopilot_tracked", None)
    if tracked is None:  # one tracked program per Trainer (per plan), compiled once
        step_fn = trainer.precision.wrap_step(loss_and_grads)
        tracked = lowtrain.numerics.track(step_fn, casts=True)
        trainer._autopilot_tracked = tracked
    return [tracked(trainer.shard_batch(data(step + i)), state)[1] for i in range(n)]


def _boundaries(start: int, steps: int, every: int) -> list[int]:
    # The steps at which a plan is made: 1, then every `every`, before `steps`.
    points = sorted({1, *range(every, steps, every)})
    return [b for b in points if start <= b < steps]


class _History:
    """`plan.json`: the plans by step; the one in effect at any step."""

    def __init__(self, out: pathlib.Path | None):
        self.out = out
        self.plans: list[tuple[int, Plan]] = []
        path = None if out is None else out / "plan.json"
        if path is not None and path.exists():
            data = json.loads(path.read_text())
            self.plans = [
                (h["step"], Plan.from_json(h["plan"])) for h in data["history"]
            ]

    def at(self, step: int) -> Plan | None:
        found = [p for s, p in self.plans if s <= step]
        return found[-1] if found else None

    def add(self, step: int, plan: Plan, keep: Sequence[str]) -> None:
        self.plans = [(s, p) for s, p in self.plans if s < step] + [(step, plan)]
        if self.out is None or jax.process_index() != 0:
            return
        current = {
            "step": step,
            "keep": list(keep),
            "override": "precision.keep=["
            + ",".join(json.dumps(k) for k in keep)
            + "]",
            "fp8_share": plan.fp8_share,
        }
        data = {
            "current": current,
            "plan": plan.to_json(),
            "history": [{"step": s, "plan": p.to_json()} for s, p in self.plans],
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "plan.json").write_text(json.dumps(data, indent=1))
        (self.out / "plan.txt").write_text(f"step {step}\n{plan.table()}\n")

    def shares(self, steps: int) -> float:
        """The step-weighted FP8 share of the run up to `steps` (the configured
        precision's own share before the first plan is not counted)."""
        if not self.plans:
            return 0.0
        total = 0.0
        for i, (s, p) in enumerate(self.plans):
            end = self.plans[i + 1][0] if i + 1 < len(self.plans) else steps
            total += p.fp8_share * max(0, min(end, steps) - s)
        span = steps - self.plans[0][0]
        return total / span if span > 0 else self.plans[-1][1].fp8_share


def _latest_step(checkpoint_dir) -> int | None:
    if checkpoint_dir is None:
        return None
    path = lowtrain.latest_checkpoint(checkpoint_dir)
    return None if path is None else int(path.name.rsplit("_", 1)[1])


def fit_auto(
    make_trainer: Callable[[Any], lowtrain.Trainer],
    state: lowtrain.TrainState,
    data: Callable[[int], Any],
    *,
    steps: int,
    config,
    out: pathlib.Path | None = None,
    fit_kwargs: dict | None = None,
) -> tuple[lowtrain.TrainState, lowtrain.Trainer, dict]:
    """Train `state` to `steps` as `make_trainer(precision).fit(state, data, steps=...,
    **fit_kwargs)` would, with the FP8 matmuls decided by the numerics report (see
    the module docstring). `config` is the run's `Config` (its `precision`: an FP8
    precision's config with `auto`); `make_trainer` builds the recipe's Trainer
    (hooks included) for a `lowtrain.train.Precision`; `out` is the run directory
    (`plan.json`, `plan.txt`); `fit_kwargs` are `Trainer.fit`'s other arguments
    (`resume` is honoured for the first segment: later ones go on from the
    checkpoint the one before wrote, so `checkpoint_dir` is expected with
    `resume`).

    Returns the final state, the Trainer of the last plan (evaluate and export with
    it: its precision is the one trained last) and a summary: `fp8_share` (the
    final plan's share of matmul FLOPs in FP8), `fp8_share_run` (step-weighted over
    the run), `keep` (the final entries) and `plans` (how many were made).
    """
    p = config.precision
    missing = [f for f in AUTO_FIELDS if not hasattr(p, f)]
    if missing or not getattr(p, "auto", False):
        raise ValueError(
            "Expected an FP8 precision config with `auto=true` for `fit_auto`, got "
            f"{type(p).__name__} with auto={getattr(p, 'auto', None)!r} instead."
        )
    fit_kwargs = dict(fit_kwargs or {})
    user_keep = list(getattr(p, "keep", []))
    history = _History(out)
    resume = fit_kwargs.get("resume", False)
    ckpt_dir = fit_kwargs.get("checkpoint_dir")
    start = int(state.step)
    if resume:
        found = _latest_step(ckpt_dir)
        start = found if found is not None else start
    if not resume:  # a new run: a plan.json from another run is not ours
        history.plans = []
    current = history.at(start)

    def keep_of(plan: Plan | None) -> list[str]:
        return sorted({*user_keep, *(plan.keep if plan else ())})

    def trainer_for(plan: Plan | None) -> lowtrain.Trainer:
        return make_trainer(build_precision(p, keep_of(plan)))

    trainer = trainer_for(current)
    if current is not None:
        log.info("autopilot: resuming with the plan of step %d", history.plans[-1][0])
    points = _boundaries(start, steps, p.auto_every)
    segments = [*points, steps]
    first = True
    for end in segments:
        if int(state.step) < end or first:
            kwargs = dict(fit_kwargs)
            if not first and ckpt_dir is not None:
                kwargs["resume"] = True  # the checkpoint the last segment ended with
            state = trainer.fit(state, data, steps=end, **kwargs)
            first = False
        if end >= steps:
            break
        plan, built = current, current  # `built`: the plan `trainer` runs
        for _ in range(ROUNDS):
            reports = tracked_reports(trainer, state, data, end, p.auto_batches)
            plan = make_plan(reports, p, plan)
            if keep_of(plan) == keep_of(built):
                break
            trainer, built = trainer_for(plan), plan
        changes = plan.changes(current)
        history.add(end, plan, keep_of(plan))
        for line in changes:
            log.info("autopilot step %d: %s", end, line)
        log.info(
            "autopilot step %d: FP8 on %.1f%% of matmul FLOPs; %s",
            end,
            100 * plan.fp8_share,
            "precision.keep=[" + ",".join(json.dumps(k) for k in keep_of(plan)) + "]",
        )
        _metrics_row(fit_kwargs.get("metrics_file"), end, plan, changes)
        if keep_of(plan) != keep_of(built):
            trainer = trainer_for(plan)
        current = plan
    final = history.at(steps)
    summary = {
        "fp8_share": final.fp8_share if final else None,
        "fp8_share_run": history.shares(steps),
        "keep": keep_of(final),
        "plans": len(history.plans),
    }
    return state, trainer, summary


def _metrics_row(path, step: int, plan: Plan, changes: list[str]) -> None:
    if path is None or jax.process_index() != 0:
        return
    row = {
        "step": step,
        "event": "plan",
        "fp8_share": plan.fp8_share,
        "kept": [m.key for m in plan.wide],
        "changes": changes,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
