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
