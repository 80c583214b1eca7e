"""Training: `TrainState`, `Trainer` and its loop, the `Precision` protocol and its
implementations, checkpoints, batches."""

from ._checkpoint import CheckpointCorruptError as CheckpointCorruptError
from ._checkpoint import checkpoint_extra as checkpoint_extra
from ._checkpoint import latest_checkpoint as latest_checkpoint
from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import save_checkpoint as save_checkpoint
from ._data import ArrayBatches as ArrayBatches
from ._finite import apply_if_finite as apply_if_finite
from ._hooks import StepInfo as StepInfo
from ._jit import async_filter_jit as async_filter_jit
from ._numerics import NumericsRecorder as NumericsRecorder
from ._placement import array_spec as array_spec
from ._precisions import Amp as Amp
from ._precisions import DelayedFp8 as DelayedFp8
from ._precisions import Rewrite as Rewrite
from ._precisions import Scalify as Scalify
from ._precisions import UnitScale as UnitScale
from ._protocol import Chain as Chain
from ._protocol import Precision as Precision
from ._state import TrainState as TrainState
from ._trainer import Trainer as Trainer
