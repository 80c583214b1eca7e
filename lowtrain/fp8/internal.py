"""The FP8 internals other lowtrain subpackages lean on (`_amp`, `numerics`, `train`,
`unit_scaling`), named here so that none of them reaches into a private module of
`fp8` (as `equinox.internal` does for Equinox's siblings). Not public API."""

from ._dot import delayed_dot_config as delayed_dot_config
from ._dot import keep_op as keep_op
from ._dot import static_dot_config as static_dot_config
from ._linear import advanced_scales as advanced_scales
from ._linear import split_records as split_records
from ._linear import zero_scales as zero_scales
from ._quantize import ROUNDINGS as ROUNDINGS
from ._quantize import current_scale as current_scale
from ._quantize import from_bits as from_bits
from ._quantize import quantize_at as quantize_at
from ._quantize import to_bits as to_bits
from ._sites import FORMAT_SCOPE as FORMAT_SCOPE
from ._sites import KEEP_SCOPE as KEEP_SCOPE
from ._sites import Site as Site
from ._sites import matmul_sites as matmul_sites
