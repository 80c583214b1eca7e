"""Unit-scaled functions, named as in `jax.nn` and `torch.nn.functional`: swap `F.`
or `jax.nn.` for `U.` (`import lowtrain.unit_scaling.functional as U`).

Each op multiplies its output and the gradients of its inputs by separate scales,
chosen so that unit-normal inputs and a unit-normal output cotangent give outputs
and gradients of unit RMS; its docstring gives the three scales (output, input
gradient, parameter gradient) and the assumption behind them. Ops whose output and
input-gradient scales must agree take a `constraint` from
`lowtrain.unit_scaling.constraints`. Ops with parameters take whole batches: their
parameter-gradient scales depend on the batch size (wrong under `jax.vmap`).

```python
import jax
import jax.numpy as jnp
import lowtrain.unit_scaling.functional as U

x = jax.random.normal(jax.random.key(0), (512, 256))
w = jax.random.normal(jax.random.key(1), (256, 256))
y, vjp = jax.vjp(lambda x, w: U.gelu(U.linear(x, w)), x, w)
gx, gw = vjp(jax.random.normal(jax.random.key(2), y.shape))
rms = lambda a: float(jnp.sqrt(jnp.mean(a**2)))
assert all(0.75 < rms(a) < 1.33 for a in (y, gx, gw))
```
"""

from ._activations import dropout as dropout
from ._activations import gelu as gelu
from ._activations import silu as silu
from ._activations import silu_glu as silu_glu
from ._activations import softmax as softmax
from ._attention import scaled_dot_product_attention as scaled_dot_product_attention
from ._losses import cross_entropy as cross_entropy
from ._losses import mse_loss as mse_loss
from ._matmuls import embedding as embedding
from ._matmuls import linear as linear
from ._matmuls import linear_readout as linear_readout
from ._matmuls import matmul as matmul
from ._norms import layer_norm as layer_norm
from ._norms import rms_norm as rms_norm
from ._residual import residual_add as residual_add
from ._residual import residual_apply as residual_apply
from ._residual import residual_split as residual_split
from ._scale import scale_bwd as scale_bwd
from ._scale import scale_fwd as scale_fwd
