"""`Trainer(numerics_every=N)`: a `lowtrain.numerics` report of the train step every N
steps, written next to the metrics file (`numerics.jsonl`, `numerics.png`)."""

from __future__ import annotations

import json
import pathlib

import jax

from .. import numerics


class NumericsRecorder:
    """Records a `lowtrain.numerics.Report` of the loss and gradients of the batch
    about to be trained on, when `state.step % every == 0` (so at the first step of a
    run too), before the update; `every=None` never does. What is tracked is the
    function `maybe_record` is handed: in `Trainer.fit`, the step's own loss and
    gradients (`Trainer.loss_and_grads` under the precision's `wrap_step`: gradient
    accumulation, FSDP's gather, loss scaling and redo as configured), run a second
    time on the same state and batch; its result is dropped.

    The report judges what the precision does (`track(fn, casts=True)`): every
    tensor the step casts to a narrower format, each in its format, an FP8 cast
    after its scale. A step that casts nothing (float32) gets a report of every
    tensor instead (`casts=False` always does).

    Each report is kept as `last` (with its step as `last_step`) and, when
    `Trainer.fit` has a `metrics_file`, appended to `numerics.jsonl` in its folder
    (one line `{"step": s, "kind": "casts" or "all", "rows": [...]}`) with the
    latest scale plot as `numerics.png` there (a report of every tensor judged
    against `fmt`). Tracking is a second compiled program (compiled at the first
    report); the train step itself is unchanged.

    ```python
    import equinox as eqx
    import jax
    import optax
    import lowtrain

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean()

    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    trainer = Fit(model, optax.sgd(0.1), numerics_every=2)
    data = {"x": jax.numpy.ones((4, 2)), "y": jax.numpy.zeros((4, 1))}
    state = trainer.init(key=jax.random.key(1))
    trainer.fit(state, lambda step: data, steps=3, progress=False)
    assert trainer.numerics.last_step == 2
    assert trainer.numerics.last.kind == "all"  # float32: nothing is cast
    assert {r["pass"] for r in trainer.numerics.last.rows} == {"fwd", "bwd"}
    ```
    """

    def __init__(
        self, every: int | None, fmt: str = "float8_e4m3fn", casts: bool = True
    ):
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ValueError(
                f"Expected `numerics_every` as an int >= 1 or None, got {every!r} "
                "instead."
            )
        if fmt not in numerics.FORMATS:
            raise ValueError(
                f"Expected a format among {', '.join(numerics.FORMATS)}, got {fmt!r} "
                "instead."
            )
        self.every, self.fmt, self.casts = every, fmt, bool(casts)
        self.last: numerics.Report | None = None
        self.last_step: int | None = None
        self._tracked = None
        self._fn = None

    def maybe_record(
        self, loss_and_grads, state, batch, step: int, metrics_file
    ) -> None:
        """Record a report of `loss_and_grads(batch, state) -> (grads, metrics)` on
        `batch` from `state` if `step % every == 0` (see the class docstring),
        written as a row of `metrics_file` (a path, or None for none); it is
        tracked once (compiled at the first report) and the same function is
        expected after."""
        if self.every is None or step % self.every:
            return
        if self._tracked is None or self._fn is not loss_and_grads:
            self._tracked = numerics.track(loss_and_grads, casts=self.casts)
            self._fn = loss_and_grads
        _, report = self._tracked(batch, state)
        if report.kind == "casts" and not report.rows:  # nothing cast: every tensor
            self._tracked = numerics.track(loss_and_grads)
            _, report = self._tracked(batch, state)
        self.last, self.last_step = report, step
        if metrics_file is None or jax.process_index() != 0:
            return
        folder = pathlib.Path(metrics_file).parent
        line = {"step": step, "kind": report.kind, "rows": report.to_json()}
        with open(folder / "numerics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        report.plot(folder / "numerics.png", self.fmt)
