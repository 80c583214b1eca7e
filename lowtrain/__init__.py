"""lowtrain: FP16 and FP8 training in JAX, as easy as FP32."""

from . import _compat

_compat.check_version()

from .amp import DEFAULT_RULES as DEFAULT_RULES  # noqa: E402
from .amp import Policy as Policy  # noqa: E402
from .amp import amp as amp  # noqa: E402
from .amp import amp_stop as amp_stop  # noqa: E402
from .amp import get_policy as get_policy  # noqa: E402

__version__ = "0.1.0"
