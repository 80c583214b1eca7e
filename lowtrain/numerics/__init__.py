"""See where precision is lost: `track` a function to get the statistics of every
float tensor it makes (forward and backward), as a `Report`."""

from ._report import Report as Report
from ._stats import FORMATS as FORMATS
from ._track import track as track
