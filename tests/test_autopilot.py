"""The FP8 autopilot (`lowtrain.train.Autopilot`, the CLI's `precision.auto=true`):
plans from casts reports during training, re-planned as ranges drift, written to the
run directory and restored on resume; with the recipes' own FP8 precisions, on a
user's own Trainer, with early stopping."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_module

import lowtrain
import lowtrain.numerics as numerics
from lowtrain.recipes import _autopilot, _common, _config, _run, gpt

_config.register()


class Two(eqx.Module):
    """Two matmuls in named scopes: `a` (x @ wa) and `b` (x @ wb)."""

    wa: jax.Array
    wb: jax.Array

    def __call__(self, x):
        with jax.named_scope("a"):
            ya = x @ self.wa
        with jax.named_scope("b"):
            yb = x @ self.wb
        return ya, yb


class Fit(lowtrain.Trainer):
    # `b`'s output enters the loss scaled by 1e-9: its gradient is far below E5M2's
    # range, so plain (scale-1) FP8 flushes it; `a`'s is fine.
    def loss(self, model, batch, *, key):
        ya, yb = model(batch["x"])
        return jnp.mean((ya - batch["y"]) ** 2) + 1e-9 * jnp.sum(yb)


def _naive_config(**auto):
    fields = dict(name="fp8_naive", auto=True, auto_every=3, auto_batches=1) | auto
    return _config.NaiveFp8PrecisionConfig(**fields)


@dataclasses.dataclass
class _Config:
    precision: object


def _data(step):
    x = jax.random.normal(jax.random.key(step), (16, 8))
    return {"x": x, "y": x @ jnp.ones((8, 4))}


def _setup(config, trainer_class=Fit, model=None):
    model = model or Two(
        jax.random.normal(jax.random.key(1), (8, 4)),
        jax.random.normal(jax.random.key(2), (8, 4)),
    )
    p = config.precision
    trainer = trainer_class(
        model, optax.sgd(0.01), precision=_autopilot.build_precision(p, p.keep)
    )
    return trainer, trainer.init(key=jax.random.key(0))


def _fit(config, trainer, state, data, steps, out=None, **fit):
    pilot = _autopilot.autopilot(config.precision, out)
    fit.setdefault("progress", False)
    state = trainer.fit(state, data, steps=steps, callbacks=[pilot], **fit)
    return state, pilot.summary(steps)


def test_the_autopilot_keeps_the_matmul_whose_gradient_flushes(tmp_path):
    config = _Config(_naive_config())
    trainer, state = _setup(config)
    fit = dict(metrics_file=tmp_path / "metrics.jsonl", log_every=1)
    state, summary = _fit(config, trainer, state, _data, 7, tmp_path, **fit)
    assert int(state.step) == 7
    assert summary["keep"] == ["b"] and summary["plans"] == 3  # steps 1, 3, 6
    assert summary["fp8_share"] == 0.5
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["current"]["keep"] == ["b"]
    assert saved["current"]["override"] == 'precision.keep=["b"]'
    assert [h["step"] for h in saved["history"]] == [1, 3, 6]
    assert "b@8x4" in (tmp_path / "plan.txt").read_text()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    plans = [r for r in rows if r.get("event") == "plan"]
    assert [r["step"] for r in plans] == [1, 3, 6]
    assert plans[0]["kept"] == ["b@8x4"] and plans[0]["changes"]
    assert plans[1]["changes"] == []
    # One row per step, the plans' rows after their step's.
    assert [r["step"] for r in rows if "event" not in r] == list(range(1, 8))
    # The Trainer ends with the plan's precision: `b` as written, `a` in FP8.
    report = numerics.track(
        trainer.precision.wrap_step(lambda b, s: trainer.loss_and_grads(s, b)[0][1]),
        casts=True,
    )(_data(0), state)[1]
    applied = {r["name"]: r["site"]["applied"] for r in report.rows if r["site"]}
    assert applied == {"a": True, "b": False}


def test_the_autopilot_trains_as_fits_of_each_plan_would(tmp_path):
    # The plans switch the precision over the state in memory: the same weights
    # as training each segment with a Trainer built for its plan.
    config = _Config(_naive_config())
    trainer, state = _setup(config)
    switched, summary = _fit(config, trainer, state, _data, 7)
    p = config.precision
    segments = [(1, []), (3, ["b"]), (6, ["b"]), (7, ["b"])]  # (end, plan's keep)
    state = None
    for end, keep in segments:
        by_hand, fresh = _setup(_Config(dataclasses.replace(p, keep=keep)))
        state = by_hand.fit(state or fresh, _data, steps=end, progress=False)
    assert summary["keep"] == ["b"]
    np.testing.assert_array_equal(switched.model.wa, state.model.wa)
    np.testing.assert_array_equal(switched.model.wb, state.model.wb)


@pytest.mark.slow
def test_the_autopilot_resumes_with_the_plan_in_effect(tmp_path):
    config = _Config(_naive_config())

    def run(out, steps, resume):
        trainer, state = _setup(config)
        fit = dict(checkpoint_dir=out / "checkpoints", checkpoint_every=4)
        return _fit(config, trainer, state, _data, steps, out, resume=resume, **fit)

    whole, _ = run(tmp_path / "whole", 7, False)
    run(tmp_path / "cut", 4, False)
    resumed, summary = run(tmp_path / "cut", 7, True)
    assert summary["keep"] == ["b"]
    np.testing.assert_array_equal(resumed.model.wa, whole.model.wa)
    np.testing.assert_array_equal(resumed.model.wb, whole.model.wb)


def test_early_stopping_stops_a_run_under_the_autopilot(tmp_path):
    # One fit: a stop inside a planning interval ends the run, and the patience
    # counts across plans (evaluations at every step; the loss never improves by
    # 1e9, so the second evaluation without improvement stops it).
    config = _Config(_naive_config())
    trainer, state = _setup(config)
    stop = lowtrain.train.EarlyStopping("eval_loss", "min", patience=2, min_delta=1e9)
    pilot = _autopilot.autopilot(config.precision, tmp_path)
    state = trainer.fit(
        state,
        _data,
        steps=50,
        eval_data=[_data(100)],
        eval_every=1,
        callbacks=[pilot, stop],
        progress=False,
    )
    assert int(state.step) == 3  # the first eval sets the best; two without gain
    assert [s for s, _ in pilot.plans] == [1]  # none at the step the run ends


class Own(lowtrain.Trainer):
    """A user's Trainer: its own loss and evaluation, its own hook."""

    def loss(self, model, batch, *, key):
        ya, yb = model(batch["x"])
        return jnp.mean((ya - batch["y"]) ** 2) + 1e-9 * jnp.sum(yb), {"n": 1.0}

    def evaluate(self, model, batch):
        ya, _ = model(batch["x"])
        return {"mae": jnp.mean(jnp.abs(ya - batch["y"]))}


@pytest.mark.slow  # the `Autopilot` docstring's example runs a user's Trainer too
def test_the_autopilot_on_a_users_trainer_with_loggers_and_best_checkpoints(tmp_path):
    from lowtrain.train import naive_fp8

    model = Two(jnp.ones((8, 4)), jnp.ones((8, 4)) / 8)
    trainer = Own(model, optax.sgd(0.01), precision=naive_fp8())
    seen = []
    trainer.add_hook(lambda info: seen.append(info.step), every=2)
    pilot = lowtrain.train.Autopilot(
        lambda keep: naive_fp8(keep=keep), every=2, batches=1
    )
    best = lowtrain.train.BestCheckpoint("eval_mae", "min", keep_checkpoints=1)
    csv = lowtrain.train.CSVLogger(tmp_path / "metrics.csv")
    state = trainer.fit(
        trainer.init(key=jax.random.key(0)),
        _data,
        steps=5,
        eval_data=[_data(100)],
        eval_every=2,
        checkpoint_dir=tmp_path / "checkpoints",
        callbacks=[pilot, best],
        loggers=[csv],
        log_every=1,
        progress=False,
    )
    csv.close()
    assert int(state.step) == 5 and seen == [2, 4]
    assert pilot.summary(5)["keep"] == ["b"]
    assert [s for s, _ in pilot.plans] == [1, 2, 4]
    assert (tmp_path / "checkpoints" / "plan.json").exists()  # its default folder
    assert lowtrain.train.best_checkpoint(tmp_path / "checkpoints" / "best")
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 1 + 5


def test_use_precision_refuses_a_precision_that_stores_the_state_otherwise():
    config = _Config(_naive_config())
    trainer, state = _setup(config)
    with pytest.raises(ValueError, match="stores it otherwise.*float16"):
        trainer.use_precision(lowtrain.train.Amp("p=f16,c=f16,o=f32"), state)
    trainer.use_precision("bf16", state)  # the same storage: fine
    assert trainer.precision.parts[0].policy.compute_dtype == jnp.bfloat16


class Growing(lowtrain.Trainer):
    # With unit inputs, SGD at lr 7 adds 7 * 16 = 112 to each of `a`'s weights a
    # step: from 100, past E4M3's 448 (saturating) after four steps.
    def loss(self, model, batch, *, key):
        ya, yb = model(batch["x"])
        return -jnp.sum(ya) + 1e-2 * jnp.sum(yb)  # `b`'s weights move by 1.1 a step


def _plans(out):
    history = json.loads((out / "plan.json").read_text())["history"]
    return {h["step"]: tuple(h["plan"]["keep"]) for h in history}


def test_a_matmul_whose_range_drifts_moves_out(tmp_path):
    config = _Config(_naive_config(auto_every=2))
    model = Two(jnp.full((8, 4), 100.0), jnp.ones((8, 4)))

    trainer, state = _setup(config, Growing, model)
    trainer = Growing(model, optax.sgd(7.0), precision=trainer.precision)
    state = trainer.init(key=jax.random.key(0))
    data = lambda step: {"x": jnp.ones((16, 8))}  # noqa: E731
    _fit(config, trainer, state, data, 7, tmp_path)
    keeps = _plans(tmp_path)
    assert keeps == {1: (), 2: (), 4: ("a",), 6: ("a",)}
    reason = json.loads((tmp_path / "plan.json").read_text())["plan"]["matmuls"][0]
    assert "rhs E4M3 saturates 100.00%" in reason["reason"]


def test_a_matmul_that_settles_moves_back_in(tmp_path):
    config = _Config(_naive_config(auto_every=2))

    def data(step):  # tiny inputs until step 4 (E4M3 flushes them), then unit ones
        x = (1e-6 if step < 4 else 1.0) * jnp.ones((16, 8))
        return {"x": x, "y": jnp.zeros((16, 4))}

    trainer, state = _setup(config)
    _fit(config, trainer, state, data, 7, tmp_path)
    keeps = _plans(tmp_path)
    assert keeps[1] == ("a", "b") and keeps[2] == ("a", "b")
    assert keeps[4] == ("b",)  # `a` moves in; `b`'s gradient still flushes


# -- the recipes' precisions ---------------------------------------------------------


def _tiny_gpt(recipe, *extra):
    with initialize_config_module("lowtrain.conf", version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"recipe={recipe}",
                "model.n_layer=2",
                "model.n_embd=32",
                "model.n_head=2",
                "model.block_size=8",
                "trainer.batch_size=4",
                "precision.auto=true",
                "precision.auto_every=2",
                "precision.auto_batches=1",
                *extra,
            ],
        )
    return cfg, _run.to_config(cfg)


@pytest.mark.parametrize(
    "recipe, extra",
    [
        pytest.param("gpt_fp8", (), marks=pytest.mark.slow),
        pytest.param("gpt_fp8_delayed", (), marks=pytest.mark.slow),
        pytest.param("gpt", ("precision=fp8_naive",), marks=pytest.mark.slow),
        ("gpt_unit_fp8", ("precision.keep=[]",)),
    ],
)
def test_every_fp8_recipe_precision_runs_its_plan(tmp_path, recipe, extra):
    cfg, config = _tiny_gpt(recipe, *extra)
    model, trainer_class = gpt.build_model(config.model, 11, key=jax.random.key(0))
    opt = _common.optimizer(cfg, 4, gpt.decay_mask, model)
    options = _common.trainer_options(config)

    def make(precision):
        return trainer_class(model, opt, **(options | {"precision": precision}))

    def data(step):
        tokens = jax.random.randint(jax.random.key(step), (4, 9), 0, 11)
        return {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    trainer = make(options["precision"])
    state, summary = _fit(
        config, trainer, trainer.init(key=jax.random.key(1)), data, 4, tmp_path
    )
    assert int(state.step) == 4 and 0 <= summary["fp8_share"] <= 1
    # Whatever the plan, keeping a matmul makes its casts shadows: check it with the
    # head (its scope names it in every model), kept on purpose.
    head = "projection" if recipe.startswith("gpt_unit") else "btc,vc->btv"
    kept = make(_autopilot.build_precision(config.precision, [head]))
    report = numerics.track(
        kept.precision.wrap_step(lambda b, s: kept.loss_and_grads(s, b)[0][1]),
        casts=True,
    )(kept.shard_batch(data(0)), state)[1]
    fp8_rows = [r for r in report.rows if r["site"]]
    assert fp8_rows
    for r in fp8_rows:
        assert r["site"]["applied"] == (r["name"].split("/")[-1] != head), r["name"]
    plan = numerics.plan(report)
    assert {m.name.split("/")[-1] for m in plan.matmuls} >= {head}


def test_the_autopilot_refuses_a_precision_without_auto_and_bad_arguments():
    with pytest.raises(ValueError, match="auto=true"):
        _autopilot.autopilot(_naive_config(auto=False), None)
    with pytest.raises(TypeError, match="keep -> Precision"):
        lowtrain.train.Autopilot("fp8")
    with pytest.raises(ValueError, match=r"max_saturate.*\[0, 1\]"):
        lowtrain.train.Autopilot(lambda keep: None, max_saturate=2.0)
    with pytest.raises(ValueError, match="every"):
        lowtrain.train.Autopilot(lambda keep: None, every=0)


def _cli_config(tmp_path, steps, *extra):
    text = tmp_path / "tiny.txt"
    if not text.exists():
        rng = np.random.default_rng(0)
        words = np.array(["to", "be", "or", "not", "that", "is", "the", "question"])
        text.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(200)))
    with initialize_config_module("lowtrain.conf", version_base="1.3"):
        return compose(
            "config",
            overrides=[
                "recipe=gpt",
                "precision=fp8_naive",
                "precision.auto=true",
                "precision.auto_every=3",
                "precision.auto_batches=1",
                f"data.path={text}",
                "model.n_layer=1",
                "model.n_embd=16",
                "model.n_head=2",
                "model.block_size=8",
                f"trainer.steps={steps}",
                "trainer.batch_size=8",
                "trainer.eval_batch_size=8",
                "data.eval_batches=1",
                "trainer.eval_every=3",
                "trainer.checkpoint_every=3",
                "trainer.progress=false",
                *extra,
            ],
        )


def _check_cli_run(out, summary, steps):
    auto = summary["auto"]
    assert auto["plans"] == len(steps) and 0 <= auto["fp8_share"] <= 1
    saved = json.loads((out / "plan.json").read_text())
    assert [h["step"] for h in saved["history"]] == steps
    assert saved["current"]["keep"] == auto["keep"]
    assert saved["current"]["override"].startswith("precision.keep=[")
    assert (out / "plan.txt").read_text().startswith(f"step {steps[-1]}\n")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    plans = [r for r in map(json.loads, lines) if r.get("event") == "plan"]
    assert [r["step"] for r in plans] == steps


def test_the_cli_runs_the_autopilot(tmp_path):
    # `python -m lowtrain recipe=gpt precision=fp8_naive precision.auto=true`: the
    # plan (one, at step 1: naive FP8 keeps matmuls wide) in the run directory, the
    # metrics and the summary.
    out = tmp_path / "run"
    summary = _run.run(_cli_config(tmp_path, 2, "precision.auto_every=10"), out)
    _check_cli_run(out, summary, [1])
    assert summary["auto"]["fp8_share"] < 1 and summary["auto"]["keep"]


@pytest.mark.slow
def test_the_cli_resumes_with_the_plan_in_effect(tmp_path, caplog):
    out = tmp_path / "run"
    _check_cli_run(out, _run.run(_cli_config(tmp_path, 4), out), [1, 3])
    # Resumed to 7 steps: from step 4 with step 3's plan, one more plan at step 6.
    caplog.set_level("INFO", logger="lowtrain")
    longer = ("trainer.resume=true", "trainer.resume_allow=[trainer.steps]")
    summary = _run.run(_cli_config(tmp_path, 7, *longer), out)
    assert "autopilot: resuming with the plan of step 3" in caplog.text
    assert summary["steps"] == 7 and summary["auto"]["plans"] == 3
    saved = json.loads((out / "plan.json").read_text())
    assert [h["step"] for h in saved["history"]] == [1, 3, 6]


@pytest.mark.slow
def test_the_cli_stops_early_under_the_autopilot(tmp_path):
    # `precision.auto=true trainer.early_stopping=1`: one fit, so the patience
    # counts across plans and the stop ends the run (evaluations every 3 steps; no
    # evaluation improves on the first by 1e9).
    out = tmp_path / "run"
    extra = ("trainer.early_stopping=1", "trainer.min_delta=1e9")
    summary = _run.run(_cli_config(tmp_path, 20, *extra), out)
    assert summary["steps"] == summary["stopped_early_at"] == 6
    assert summary["auto"]["plans"] == 2  # steps 1 and 3; the run ended at 6
