import os

import jax
import pytest

# The CLI turns JAX's persistent compilation cache on by default; the suite's launches
# (its processes and their children) leave the user's cache alone.
# tests/test_compilation.py turns it on where it is the subject.
os.environ.setdefault("LOWTRAIN_COMPILE_CACHE", "off")

# As in Equinox's own test suite: any silent promotion or broadcasting is a bug.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test twice: the function as it is, and under `eqx.filter_jit`."""
    import equinox as eqx

    return eqx.filter_jit if request.param else (lambda f: f)
