"""FP8 like the hardware does it: E4M3 forward, E5M2 backward, scaled, saturating."""

from ._dot import fp8_conv_general_dilated as fp8_conv_general_dilated
from ._dot import fp8_dot_general as fp8_dot_general
from ._dot import fp8_dot_general_delayed as fp8_dot_general_delayed
from ._dot import gemm_dims as gemm_dims
from ._dot import keep_op as keep_op
from ._formats import E4M3 as E4M3
from ._formats import E4M3_MAX as E4M3_MAX
from ._formats import E5M2 as E5M2
from ._formats import E5M2_MAX as E5M2_MAX
from ._formats import fp8_max as fp8_max
from ._linear import Fp8Linear as Fp8Linear
from ._linear import pop_scales as pop_scales
from ._linear import put_scales as put_scales
from ._quantize import DelayedScale as DelayedScale
from ._quantize import amax as amax
from ._quantize import compute_scale as compute_scale
from ._quantize import current_scale as current_scale
from ._quantize import dequantize as dequantize
from ._quantize import quantize as quantize
from ._sites import KEEP_SCOPE as KEEP_SCOPE
