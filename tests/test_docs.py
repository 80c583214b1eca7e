"""Every public name has a docstring with a runnable example, and the examples run."""

import pathlib
import re
import textwrap

import jax
import pytest

import lowtrain
import lowtrain.fp8
import lowtrain.numerics
import lowtrain.scalify
import lowtrain.train
import lowtrain.unit_scaling
import lowtrain.unit_scaling.constraints
import lowtrain.unit_scaling.functional
import lowtrain.unit_scaling.optim

MODULES = (
    lowtrain,
    lowtrain.fp8,
    lowtrain.numerics,
    lowtrain.scalify,
    lowtrain.train,
    lowtrain.unit_scaling,
    lowtrain.unit_scaling.constraints,
    lowtrain.unit_scaling.functional,
    lowtrain.unit_scaling.optim,
)

PUBLIC = [
    f"{module.__name__}.{name}"
    for module in MODULES
    for name in dir(module)
    if not name.startswith("_")
    and callable(getattr(module, name))
    and not isinstance(getattr(module, name), type(lowtrain))
    and not name.isupper()  # dtype constants such as E4M3
    # lowtrain's own (not `Callable` or a type alias a module imports or defines)
    and str(getattr(getattr(module, name), "__module__", "")).startswith("lowtrain")
]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(text):
    return [textwrap.dedent(b) for b in _BLOCK.findall(text or "")]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_docstring_example_runs(name):
    module, _, attr = name.rpartition(".")
    modules = {m.__name__: m for m in MODULES}
    obj = getattr(modules[module], attr)
    blocks = _blocks(obj.__doc__)
    assert blocks, f"`{name}` has no ```python example in its docstring."
    for block in blocks:
        with jax.numpy_dtype_promotion("standard"):
            exec(compile(block, f"<{name} docstring>", "exec"), {})


def test_readme_examples_run():
    readme = pathlib.Path(__file__).parent.parent / "README.md"
    blocks = _blocks(readme.read_text())
    assert len(blocks) >= 3
    namespace = {}
    for block in blocks:  # the README's blocks build on each other
        with jax.numpy_dtype_promotion("standard"):
            exec(compile(block, "<README.md>", "exec"), namespace)
