"""The pieces of `scripts/bench.py` (and of `profile_step.py`, `gpu_session.py`).

- `throughput`, `benchtable`, `overhead`: the step benchmark's cases (the recipes'
  Trainers at each model size), its tables and targets, `Trainer.fit` against a
  plain loop;
- `models`: the recipes' MLP and GPT, their loss and batches, and the same loss with
  mixed precision written by hand (casts at the matmuls);
- `unit_twin`: the unit-scaled GPT (`model=gpt_unit`) with its mixed precision and
  FP8 matmuls written by hand, the twin of the unit_bf16, unit_fp16, unit_fp8 rows;
- the commands of `bench.py COMMAND`: `gemm`, `launch`, `vmap_cost`, `amp_hand`,
  `scalify_step`, `unit_step`, `numerics_step`, `twin_hlo`, `saved_bytes`, `zoo`;
- `zoo_models`: the model zoo, small models written the way their users write them
  (needs diffrax, Flax and einops, the `test` extra), for `zoo` and
  tests/test_zoo.py;
- `timing`: train steps, interleaved step timing and cold trace/compile timing;
- `residuals`: the residuals reverse-mode AD saves, traced to what produces them;
- `report`: the machine line and the markdown tables.

The scripts run as `python scripts/bench.py` from the repository root, which puts
`scripts/` on `sys.path`: they import these as `from benchlib import models`.
"""
