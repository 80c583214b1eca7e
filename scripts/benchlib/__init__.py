"""The pieces of the benchmark scripts (`scripts/bench_*.py`).

- `models`: the benchmark models, which are the recipes' own
  (`lowtrain.recipes.mnist.MLP` and `lowtrain.recipes.gpt.GPT`), their loss and
  batches, and the same loss with mixed precision written by hand (jmp style);
- `unit_twin`: the unit-scaled GPT (`model=gpt_unit`) with its mixed precision and
  FP8 casts written by hand, the twin of the unit_bf16, unit_fp16 and unit_fp8 rows;
- `throughput`, `benchtable`, `overhead`: `scripts/bench.py`'s cases (the recipes'
  Trainers), its tables and targets, `Trainer.fit` against a plain loop;
- `waiting`: the Trainer's step compiled as it was up to git 8cf1783;
- `timing`: train steps, interleaved step timing and cold trace/compile timing;
- `residuals`: the residuals reverse-mode AD saves, traced to what produces them;
- `report`: the machine line and the markdown tables.

The scripts run as `python scripts/bench_amp.py` from the repository root, which puts
`scripts/` on `sys.path`: they import these as `from benchlib import models`.
"""
