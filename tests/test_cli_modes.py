"""The CLI around a trained run: loggers from `trainer.loggers`, the best checkpoint
with `trainer.keep_best`, and `mode=sample` / `mode=evaluate` of a checkpoint."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from lowtrain.recipes import _run

from .test_recipes import TINY_GPT, make_config


def _text(tmp_path):
    text = tmp_path / "tiny.txt"
    rng = np.random.default_rng(0)
    words = np.array(["to", "be", "or", "not", "that", "is", "the", "question"])
    text.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(200)))
    return text


def test_loggers_best_checkpoint_sample_and_evaluate(tmp_path, capsys):
    text = _text(tmp_path)
    run = tmp_path / "run"
    common = ["recipe=gpt_bf16", f"data.path={text}", *TINY_GPT]
    summary = _run.run(
        make_config(*common, "trainer.loggers=[jsonl,csv]", "trainer.keep_best=1"),
        run,
    )
    # The CSV logger's file holds the same rows as metrics.jsonl.
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    jsonl = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    assert [int(r["step"]) for r in rows] == [r["step"] for r in jsonl] == [3, 6, 9, 12]
    assert float(rows[-1]["loss"]) == pytest.approx(jsonl[-1]["loss"])
    best = sorted((run / "checkpoints" / "best").iterdir())
    evals = {r["step"]: r["eval_loss"] for r in jsonl if "eval_loss" in r}
    assert [p.name for p in best] == [f"ckpt_{min(evals, key=evals.get):08d}"]
    capsys.readouterr()

    # Sampling: the prompt, then `sample.length` characters of the text's alphabet.
    _run.run(
        make_config(
            *common, "mode=sample", f"checkpoint={run}", "sample.prompt=to be",
            "sample.length=40",
        ),
        tmp_path / "unused",
    )  # fmt: skip
    out = capsys.readouterr().out.rstrip("\n")
    assert out.startswith("to be") and len(out) == len("to be") + 40
    assert set(out) <= set(text.read_text())
    with pytest.raises(ValueError, match="never saw"):
        _run.run(
            make_config(*common, "mode=sample", f"checkpoint={run}", "sample.prompt=Z"),
            tmp_path / "unused",
        )

    # Evaluating: the best checkpoint's eval loss, as the run measured it then.
    result = _run.run(
        make_config(*common, "mode=evaluate", f"checkpoint={run}"), tmp_path / "unused"
    )
    assert result["final"]["eval_loss"] == pytest.approx(min(evals.values()), rel=1e-6)
    assert summary["final"]["val_loss"] == pytest.approx(jsonl[-1]["eval_loss"])


def test_mode_needs_a_checkpoint_that_exists(tmp_path):
    with pytest.raises(ValueError, match="checkpoint="):
        _run.check(make_config("recipe=gpt", "mode=sample"))
    with pytest.raises(ValueError, match="no checkpoint in it|nothing there"):
        _run.run(
            make_config("recipe=mnist", "mode=evaluate", f"checkpoint={tmp_path}"),
            tmp_path / "unused",
        )


@pytest.mark.slow  # a GPT trained, then three uses of its checkpoint
def test_sample_and_evaluate_rebuild_the_model_from_the_checkpoint(tmp_path, capsys):
    # The checkpoint holds the run's resolved config: `mode=sample|evaluate` with
    # only `checkpoint=` rebuild its model, data and precision from it (the
    # composed default would be MNIST's MLP); a key given on the command line wins.
    text = _text(tmp_path)
    run = tmp_path / "run"
    summary = _run.run(
        make_config("recipe=gpt_bf16", f"data.path={text}", *TINY_GPT), run
    )
    capsys.readouterr()
    given = ["mode=evaluate", f"checkpoint={run}"]
    evaluated = _run.run(make_config(*given), tmp_path / "unused", overrides=given)
    assert evaluated["final"]["eval_loss"] == pytest.approx(
        summary["final"]["val_loss"], rel=1e-6
    )
    capsys.readouterr()
    given = ["mode=sample", f"checkpoint={run}", "sample.prompt=to be"]
    given += ["sample.length=20"]
    _run.run(make_config(*given), tmp_path / "unused", overrides=given)
    out = capsys.readouterr().out.rstrip("\n")
    assert out.startswith("to be") and len(out) == len("to be") + 20
    # A model option given that the checkpoint does not hold: refused, named.
    given = ["mode=evaluate", f"checkpoint={run}", "recipe=gpt", "model.n_embd=32"]
    with pytest.raises(ValueError, match="n_embd|shape|expected"):
        _run.run(make_config(*given), tmp_path / "unused", overrides=given)


@pytest.mark.slow  # two launches; the in-process test above is in the default suite
def test_the_cli_evaluates_a_run_from_its_checkpoint_alone(tmp_path):
    # `python -m lowtrain mode=evaluate checkpoint=<run>`: no recipe, no model
    # options; a model key of the run's model (not the default's) may be given.
    import subprocess
    import sys

    text = _text(tmp_path)
    args = ["recipe=gpt_bf16", f"data.path={text}", *TINY_GPT, "hydra.run.dir=run"]
    cli = lambda *a: subprocess.run(
        [sys.executable, "-m", "lowtrain", *a], cwd=tmp_path, capture_output=True,
        text=True,
    )  # fmt: skip
    trained = cli(*args)
    assert trained.returncode == 0, trained.stderr[-2000:]
    done = cli("mode=evaluate", "checkpoint=run", "trainer.eval_batch_size=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval loss:" in done.stdout
