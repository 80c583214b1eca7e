"""u-μP optimizers for unit-scaled Equinox models: `adamw` and `sgd` are optax
transformations whose learning rate is multiplied, per parameter, by u-μP's rule for
its kind, fan-in and depth, so that one base learning rate transfers across widths
and depths (Blake et al. 2024, "u-μP"; the rules of the `unit-scaling` library).
`param_info` and `lr_multipliers` show what they read from the model and apply.

Learning-rate multipliers (`fan_in` as in `ParamInfo`; `d = depth ** -0.5`, where
`depth` is the length of the enclosing `DepthSequential`, 1 outside one):

| kind | Adam(W) | SGD, readout None | SGD, readout `to_output_scale` |
|---|---|---|---|
| weight, embedding | `d * fan_in ** -0.5` | as Adam | `d * fan_in ** 0.5` |
| bias, norm | `d` | as Adam | `d * shape[0]` |
| output (readout) | `d` | as Adam | `d` |

Unit-scaled ops give every parameter a unit-scaled gradient, and Adam's update is
unit-scaled whatever the gradient: either way a unit-initialized weight of fan-in `n`
moves its outputs `sqrt(n)` times more per step than a bias does, hence
`fan_in ** -0.5`. With a `to_output_scale` readout, the gradients SGD sees are no
longer unit, and its rules compensate.

```python
import equinox as eqx
import jax
import lowtrain.unit_scaling as uu

model = uu.TransformerDecoder(64, 32, layers=4, heads=4, key=jax.random.key(0))
opt = uu.optim.adamw(0.5, model=model)  # one base LR for any width and depth
state = opt.init(eqx.filter(model, eqx.is_inexact_array))
mults = uu.optim.lr_multipliers(model)
assert mults.layers.layers[0].mlp.linear_1.weight == 64**-0.5 * 4**-0.5
```
"""

from ._optim import adamw as adamw
from ._optim import lr_multipliers as lr_multipliers
from ._optim import lr_scale_adam as lr_scale_adam
from ._optim import lr_scale_sgd as lr_scale_sgd
from ._optim import sgd as sgd
from ._params import KINDS as KINDS
from ._params import ParamInfo as ParamInfo
from ._params import param_info as param_info
