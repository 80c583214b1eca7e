"""Scalify: every tensor as `ScaledArray(data, scale)`, scales propagated end to end."""

from ._ops import cast_fp8 as cast_fp8
from ._ops import dynamic_rescale_l1 as dynamic_rescale_l1
from ._ops import dynamic_rescale_l1_grad as dynamic_rescale_l1_grad
from ._ops import dynamic_rescale_l2 as dynamic_rescale_l2
from ._ops import dynamic_rescale_l2_grad as dynamic_rescale_l2_grad
from ._ops import dynamic_rescale_max as dynamic_rescale_max
from ._ops import dynamic_rescale_max_grad as dynamic_rescale_max_grad
from ._ops import fp8_scaled_dot_general as fp8_scaled_dot_general
from ._ops import stop_scaling as stop_scaling
from ._scaled_array import ScaledArray as ScaledArray
from ._scaled_array import as_scaled_array as as_scaled_array
from ._scaled_array import asarray as asarray
from ._scaled_array import is_scaled as is_scaled
from ._scaled_array import pow2_round as pow2_round
from ._transform import register_rule as register_rule
from ._transform import registered_rules as registered_rules
from ._transform import scalify as scalify
from ._transform import unregister_rule as unregister_rule
