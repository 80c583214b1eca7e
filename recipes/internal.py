"""What the app (`python -m lowtrain`) and `scripts/` use of the recipes' private
modules, named in one place (as `lowtrain.fp8.internal` names fp8's for its
siblings), so that nothing outside the recipes reaches into a private module of
theirs. Not public API: it changes with the recipes."""

from ._common import optimizer as optimizer
from ._common import trainer_options as trainer_options
from ._config import CrossEntropy as CrossEntropy
from ._config import GPTConfig as GPTConfig
from ._config import NaiveFp8PrecisionConfig as NaiveFp8PrecisionConfig
from ._config import register as register
from ._layers import Linear as Linear
from ._layers import decay_mask as decay_mask
from ._overrides import check_overrides as check_overrides
from ._overrides import with_recipe_of_checkpoint as with_recipe_of_checkpoint
from ._run import check as check
from ._run import run as run
from ._run import to_config as to_config
from ._text_data import shakespeare as shakespeare
