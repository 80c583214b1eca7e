"""Training: `TrainState`, `Trainer` and its loop, checkpoints, batches."""

from ._checkpoint import latest_checkpoint as latest_checkpoint
from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import save_checkpoint as save_checkpoint
from ._data import ArrayBatches as ArrayBatches
from ._hooks import StepInfo as StepInfo
from ._state import TrainState as TrainState
from ._trainer import Trainer as Trainer
