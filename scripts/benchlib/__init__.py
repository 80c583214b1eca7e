"""The pieces of the benchmark scripts (`scripts/bench_*.py`).

- `models`: the benchmark models, which are the recipes' own
  (`lowtrain.recipes.mnist.MLP` and `lowtrain.recipes.gpt.GPT`), their loss and
  batches, and the same loss with mixed precision written by hand (jmp style);
- `timing`: train steps, interleaved step timing and cold trace/compile timing;
- `residuals`: the residuals reverse-mode AD saves, traced to what produces them;
- `report`: the machine line and the markdown tables.

The scripts run as `python scripts/bench_amp.py` from the repository root, which puts
`scripts/` on `sys.path`: they import these as `from benchlib import models`.
"""
