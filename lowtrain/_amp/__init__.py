"""Automatic mixed precision as a jaxpr transform."""

from ._policy import Policy as Policy
from ._policy import get_policy as get_policy
from ._rules import AMP_STOP_SCOPE as AMP_STOP_SCOPE
from ._rules import DEFAULT_RULES as DEFAULT_RULES
from ._transform import amp as amp
from ._transform import amp_stop as amp_stop
