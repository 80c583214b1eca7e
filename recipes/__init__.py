"""The tasks of `python -m lowtrain`: MNIST and a char-level GPT, every precision,
and `Task`, the base of a user's own (`task=my_pkg.tasks.MyTask`).

`lowtrain.recipes.mnist` and `lowtrain.recipes.gpt` are worked examples of subclassing
`lowtrain.Trainer` and `Task`; `load_mnist` and `load_text` give their data to a
Python user's own loop; `internal.run(cfg, output_dir)` trains the task a Hydra
config names.
"""

from ._mnist_data import load_mnist as load_mnist
from ._task import Task as Task
from ._task import TaskData as TaskData
from ._task import load_task as load_task
from ._text_data import load_text as load_text
