"""`Task`: what `python -m lowtrain` trains, the model, its loss and its data; the
built-in MNIST and GPT recipes are two. `task=` names one: `mnist`, `gpt`, or the
dotted path of a user's `Task` subclass (`task=my_pkg.tasks.Cifar`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray, PyTree

import lowtrain

BUILTIN = {
    "mnist": "lowtrain.recipes.mnist.MnistTask",
    "gpt": "lowtrain.recipes.gpt.GptTask",
}


class TaskData(NamedTuple):
    """What `Task.data` returns.

    - `train`: `data(step) -> batch` for `Trainer.fit` (`lowtrain.ArrayBatches`,
      `lowtrain.train.from_iterable`, `from_grain`), with `steps_per_epoch` if
      `trainer.epochs` is to work. Each process gives its own share of each global
      batch (`jax.process_index()`, `jax.process_count()`).
    - `eval`: an iterable of eval batches, iterated once per evaluation.
    - `fingerprint`: JSON data that identifies the data (a digest, a vocabulary):
      saved with each checkpoint, a resume with other data is refused.

    ```python
    import numpy as np
    import lowtrain
    from lowtrain.recipes import TaskData

    arrays = {"x": np.zeros((10, 3), np.float32), "y": np.zeros(10, np.int32)}
    data = TaskData(lowtrain.ArrayBatches(arrays, 4), lowtrain.ArrayBatches(arrays, 5))
    assert data.train(0)["x"].shape == (4, 3) and data.fingerprint == {}
    ```
    """

    train: Callable[[int], PyTree]
    eval: Iterable[PyTree]
    fingerprint: dict = {}


class Task:
    """A training task for `python -m lowtrain task=<dotted path>`: subclass it.

    Set `trainer` to your `lowtrain.Trainer` subclass (its `loss` and `evaluate`),
    and define `data(config)` and `model(config, *, key)`. Everything else comes
    from the config, as for the built-in recipes (`lowtrain.recipes.mnist.MnistTask`
    and `lowtrain.recipes.gpt.GptTask` are two tasks): the precision (`precision=`),
    optimizer, trainer options, distributed run, loggers, early stopping, best
    checkpoint, resume. `config` is the run's typed config (`Config`): its `model`
    and `data` are the schema dataclasses of the built-in groups, or a plain dict
    for a group of your own (`--config-dir my_conf` with `my_conf/model/x.yaml`).

    - `model(config, *, key)`: the model, or `(model, state)` for a stateful one
      (`eqx.nn.make_with_state`: an `eqx.nn.State` becomes the Trainer's
      `model_state`).
    - `data(config) -> TaskData`: train and eval data, and the data's fingerprint.
    - `trainer_class(config, model)`: the Trainer class (default `self.trainer`).
    - `decay_mask(params)`: what weight decay applies to (default: float arrays
      of two or more dimensions: matrices, convolution kernels, embeddings; not
      biases and norms' scales).
    - `callbacks(config)`: extra `lowtrain.train.Callback`s (default none).
    - `results(trainer, state, data, config, out)`: the run's final metrics,
      `{"final": {name: value, ...}, ...}`; the first of `final` is the headline
      the CLI prints and a sweep optimises (default: the eval metrics, `eval_`
      prefixed).
    - `sample(trainer, model, config, out) -> str`: what `mode=sample` prints
      (default: the task cannot sample).

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import lowtrain
    from lowtrain.recipes import Task, TaskData

    class Mse(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    class Line(Task):
        trainer = Mse

        def model(self, config, *, key):
            return eqx.nn.Linear(1, 1, key=key)

        def data(self, config):
            x = np.linspace(-1, 1, 64, dtype=np.float32)[:, None]
            arrays = {"x": x, "y": 2 * x}
            return TaskData(lowtrain.ArrayBatches(arrays, 16), [arrays])

    task = lowtrain.recipes.load_task("mnist")  # or a dotted path to `Line`
    assert type(task).__name__ == "MnistTask" and Line().trainer is Mse
    ```
    """

    trainer: type[lowtrain.Trainer] | None = None

    def model(self, config: Any, *, key: PRNGKeyArray) -> Any:
        """The model, or `(model, state)` for a stateful one, built as `config` (the
        run's `Config`) says, its random initialisation drawn from `key` (a PRNG
        key). Required."""
        raise NotImplementedError(
            f"Expected {type(self).__name__} to define `model(self, config, *, key)`."
        )

    def data(self, config: Any) -> TaskData:
        """The `TaskData` (train and eval data, fingerprint) for `config`, the run's
        `Config`. Required."""
        raise NotImplementedError(
            f"Expected {type(self).__name__} to define `data(self, config)`."
        )

    def trainer_class(self, config: Any, model: Any) -> type[lowtrain.Trainer]:
        """The `lowtrain.Trainer` subclass to train `model` (what `model(...)` built,
        without its state) under `config`, the run's `Config`; default
        `self.trainer`."""
        if self.trainer is None:
            raise TypeError(
                f"Expected {type(self).__name__}.trainer to be a `lowtrain.Trainer` "
                "subclass that defines `loss`, got None. Set `trainer = MyTrainer`."
            )
        return self.trainer

    def decay_mask(self, params: PyTree) -> PyTree:
        """A pytree of bools of the structure of `params` (the model's parameters):
        True where weight decay applies; default float arrays of two or more
        dimensions."""
        return jax.tree.map(lambda x: eqx.is_inexact_array(x) and x.ndim >= 2, params)

    def axis_names(self, config: Any, model: Any) -> dict | None:
        """The logical axis names of `model`'s arrays under `config` (the
        Trainer's `axis_names`: a regular expression on an array's path -> the
        names of its last dimensions), which a mesh axis "tensor" needs; default
        None (the arrays split by shape alone)."""
        return None

    def callbacks(self, config: Any) -> list:
        """Extra `lowtrain.train.Callback`s for the fit under `config`, the run's
        `Config`; default none."""
        return []

    def results(
        self, trainer: lowtrain.Trainer, state, data: TaskData, config: Any, out
    ) -> dict:
        """The run's final metrics, `{"final": {name: value, ...}, ...}`, after
        training; default the eval metrics of `state` on `data.eval`, `eval_`
        prefixed.

        **Arguments:**

        - `trainer`: the `lowtrain.Trainer` that trained.
        - `state`: the final `lowtrain.TrainState`.
        - `data`: the `TaskData` that `data(config)` returned.
        - `config`: the run's `Config`.
        - `out`: the run's output directory (a `pathlib.Path`), for files to write.
        """
        metrics = trainer.run_evaluation(state, data.eval)
        return {"final": {f"eval_{k}": v for k, v in metrics.items()}}

    def sample(self, trainer: lowtrain.Trainer, model: Any, config: Any, out) -> str:
        """What `mode=sample` prints; default: the task cannot sample (a
        `ValueError`).

        **Arguments:**

        - `trainer`: the task's `lowtrain.Trainer`, built as `config` says.
        - `model`: the model with the checkpoint's arrays.
        - `config`: the run's `Config`.
        - `out`: the path of the checkpoint the model was read from (a
          `pathlib.Path`).
        """
        raise ValueError(
            f"Expected a task that can sample for `mode=sample`, got "
            f"{type(self).__name__}, which defines no `sample`. Use mode=train or "
            "mode=evaluate."
        )


def load_task(name: str) -> Task:
    """The task `name` (the value of `task=`) names: `mnist`, `gpt`, or the dotted
    path of a `Task` subclass importable from here (`my_pkg.tasks.Cifar`),
    instantiated; a `ValueError` saying what is wrong otherwise.

    ```python
    import lowtrain

    assert type(lowtrain.recipes.load_task("gpt")).__name__ == "GptTask"
    try:
        lowtrain.recipes.load_task("my_pkg.tasks.Missing")
    except ValueError as e:
        assert "importable module" in str(e)
    ```
    """
    path = BUILTIN.get(name, name)
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"Expected `task` to be {' or '.join(BUILTIN)} or the dotted path of a "
            f"`lowtrain.recipes.Task` subclass (my_pkg.tasks.MyTask), got {name!r} "
            "instead."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"Expected `task={name}` to name an importable module, got "
            f"{type(e).__name__}: {e}. Run from the folder that holds the package, "
            "or add it to PYTHONPATH."
        ) from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        got = "nothing" if cls is None else type(cls).__name__
        raise ValueError(
            f"Expected `task={name}` to name a `lowtrain.recipes.Task` subclass, got "
            f"{got} at {attr!r} in {module_name} instead."
        )
    return cls()


def split_model(built: Any) -> tuple[Any, Any]:
    """`(model, model_state)` of what `Task.model` returned: `(model, state)` with
    an `eqx.nn.State`, else the model and None."""
    if (
        isinstance(built, tuple)
        and len(built) == 2
        and isinstance(built[1], eqx.nn.State)
    ):
        return built
    return built, None
