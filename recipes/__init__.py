"""The tasks of `python -m lowtrain`: MNIST and a char-level GPT, every precision,
and `Task`, the base of a user's own (`task=my_pkg.tasks.MyTask`).

`lowtrain.recipes.mnist` and `lowtrain.recipes.gpt` are worked examples of subclassing
`lowtrain.Trainer` and `Task`; `_run.run(cfg, output_dir)` trains the task a Hydra
config names.
"""

from ._task import Task as Task
from ._task import TaskData as TaskData
from ._task import load_task as load_task
