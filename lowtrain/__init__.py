"""lowtrain: FP16 and FP8 training in JAX, as easy as FP32."""

from . import _compat

_compat.check_version()

from . import _checkout  # noqa: E402

_checkout.install()  # `lowtrain.recipes` and `lowtrain.conf` from a checkout too

from . import fp8 as fp8  # noqa: E402
from . import scalify as scalify  # noqa: E402
from . import train as train  # noqa: E402
from . import unit_scaling as unit_scaling  # noqa: E402
from ._amp import DEFAULT_RULES as DEFAULT_RULES  # noqa: E402
from ._amp import Policy as Policy  # noqa: E402
from ._amp import amp as amp  # noqa: E402
from ._amp import amp_stop as amp_stop  # noqa: E402
from ._amp import get_policy as get_policy  # noqa: E402
from ._attention import dot_product_attention as dot_product_attention  # noqa: E402
from ._loss_scale import AbstractLossScale as AbstractLossScale  # noqa: E402
from ._loss_scale import DynamicLossScale as DynamicLossScale  # noqa: E402
from ._loss_scale import NoOpLossScale as NoOpLossScale  # noqa: E402
from ._loss_scale import StaticLossScale as StaticLossScale  # noqa: E402
from ._loss_scale import all_finite as all_finite  # noqa: E402
from ._loss_scale import scaled_value_and_grad as scaled_value_and_grad  # noqa: E402
from ._rewrite import rewrite as rewrite  # noqa: E402
from .train import ArrayBatches as ArrayBatches  # noqa: E402
from .train import CheckpointCorruptError as CheckpointCorruptError  # noqa: E402
from .train import StepInfo as StepInfo  # noqa: E402
from .train import Trainer as Trainer  # noqa: E402
from .train import TrainState as TrainState  # noqa: E402
from .train import checkpoint_extra as checkpoint_extra  # noqa: E402
from .train import latest_checkpoint as latest_checkpoint  # noqa: E402
from .train import load_checkpoint as load_checkpoint  # noqa: E402
from .train import load_model as load_model  # noqa: E402
from .train import load_safetensors as load_safetensors  # noqa: E402
from .train import save_checkpoint as save_checkpoint  # noqa: E402
from .train import save_safetensors as save_safetensors  # noqa: E402

__version__ = "0.1.0"
