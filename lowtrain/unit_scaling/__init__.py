"""Unit scaling and u-μP (Blake et al. 2023, 2024) for JAX and Equinox.

`functional` holds the unit-scaled ops, this package their Equinox modules, `optim`
the u-μP optimizers and `constraints` the ways to tie an op's forward and backward
scales. Modules take whole batches `(..., features)`, not single examples.

```python
import jax
import jax.numpy as jnp
import lowtrain.unit_scaling as uu

model = uu.TransformerDecoder(32, 16, layers=2, heads=2, key=jax.random.key(0))
tokens = jnp.zeros((4, 8), jnp.int32)
assert model(tokens).shape == (4, 8, 16)
opt = uu.optim.adamw(1e-2, model=model)
```
"""

from . import constraints as constraints
from . import functional as functional
from . import optim as optim
from ._modules import Embedding as Embedding
from ._modules import LayerNorm as LayerNorm
from ._modules import Linear as Linear
from ._modules import LinearReadout as LinearReadout
from ._modules import RMSNorm as RMSNorm
from ._residual import (
    transformer_residual_scaling_rule as transformer_residual_scaling_rule,
)
from ._simulate import MATMULS as MATMULS
from ._simulate import format_scope as format_scope
from ._simulate import fp8_cast_op as fp8_cast_op
from ._simulate import fp8_cast_rules as fp8_cast_rules
from ._simulate import fp8_weight_cast_op as fp8_weight_cast_op
from ._simulate import keep_scopes as keep_scopes
from ._simulate import parse_keep as parse_keep
from ._simulate import route_scopes as route_scopes
from ._simulate import simulate_fp8 as simulate_fp8
from ._transform import unit_scale as unit_scale
from ._transformer import MHSA as MHSA
from ._transformer import MLP as MLP
from ._transformer import DepthSequential as DepthSequential
from ._transformer import TransformerDecoder as TransformerDecoder
from ._transformer import TransformerLayer as TransformerLayer
