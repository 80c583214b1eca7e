"""The unit-scaling internals `scripts/` measures against (the scale rules its
hand-written twins of the recipes' models use), named in one place. Not public API."""

from ._activations import glu_scale as glu_scale
from ._attention import attention_scale as attention_scale
from ._core import leading_size as leading_size
from ._residual import next_stream_scale as next_stream_scale
from ._swiglu import folds as folds
