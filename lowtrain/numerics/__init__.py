"""See where precision is lost: `track` a function to get the statistics of every
float tensor it makes (forward and backward), or of every cast it performs, as a
`Report`; `plan` decides from a casts report which matmuls run in FP8."""

from ._advice import worst_casts as worst_casts
from ._plan import Matmul as Matmul
from ._plan import Plan as Plan
from ._plan import break_even as break_even
from ._plan import plan as plan
from ._report import Report as Report
from ._stats import FORMATS as FORMATS
from ._track import track as track
