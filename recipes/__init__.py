"""The recipes of `python -m lowtrain`: MNIST and a char-level GPT, every precision.

`lowtrain.recipes.mnist` and `lowtrain.recipes.gpt` are worked examples of subclassing
`lowtrain.Trainer`; `run(cfg, output_dir)` trains the recipe a Hydra config names.
"""
