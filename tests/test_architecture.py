"""The layering of docs/architecture.md, checked on the source (an AST walk).

core (`_compat`, `_eqn`, `_higher_order`, `_interpret`, `_pow2`, `_scopes`,
`_attention`, `_devices`) <-
transforms (`fp8`, `_amp`, `scalify`, `_loss_scale`, `_rewrite`, `unit_scaling`) <-
`train` <- the
`lowtrain` package's public surface <- recipes and configs <- the app <- scripts.
A module may import from its own layer or a lower one, never a higher one; no two
modules and no two units (subpackages) import each other, directly or through
others, and imports inside functions count.
"""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Top-level folders of the checkout and the module names they are installed under.
FOLDERS = {
    "lowtrain": "lowtrain",
    "recipes": "lowtrain.recipes",
    "conf": "lowtrain.conf",
}
FOLDERS_OUTSIDE = {"scripts": "scripts"}

# Unit (a module, or a subpackage with everything in it) -> layer; lower is deeper.
LAYERS = {
    "lowtrain._compat": 0,
    "lowtrain._eqn": 0,
    "lowtrain._higher_order": 0,
    "lowtrain._interpret": 0,
    "lowtrain._pow2": 0,
    "lowtrain._scopes": 0,
    "lowtrain._checkout": 0,
    "lowtrain._attention": 0,
    "lowtrain._devices": 0,
    "lowtrain._context": 0,
    "lowtrain.fp8": 1,
    "lowtrain._amp": 1,
    "lowtrain.scalify": 1,
    "lowtrain._loss_scale": 1,
    "lowtrain._rewrite": 1,
    "lowtrain.unit_scaling": 1,
    "lowtrain.numerics": 1,
    "lowtrain.train": 2,
    "lowtrain": 3,  # the package's __init__: the public surface
    "lowtrain.recipes": 4,
    "lowtrain.conf": 4,
    "lowtrain.__main__": 5,
    "scripts": 6,
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, name in {**FOLDERS, **FOLDERS_OUTSIDE}.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> set[str]:
    """The project modules `module` imports, anywhere in its file."""
    out = set()
    for name, _ in _imported(module, MODULES[module].read_text()):
        while name and name not in MODULES:  # `import a.b.c` of a module a.b
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def _imported(module: str, source: str):
    """`(target module, name or None)` for each import of `module` (`source`: its
    text; the name None where it imports a module): `from pkg import name` is the
    submodule `pkg.name` if there is one."""
    tree = ast.parse(source)
    package = _package(module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(filter(None, [*parent, base]))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full, None) if full in MODULES else (base, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


def _package(module: str) -> str:
    package = module in MODULES and _is_package(module)
    return module if package else module.rpartition(".")[0]


GRAPH = {m: _imports(m) for m in MODULES}


def _unit(module: str) -> str:
    best = max(
        (u for u in LAYERS if module == u or module.startswith(u + ".")), key=len
    )
    return best


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (a list of nodes, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    unplaced = [
        m for m in MODULES if not any(m == u or m.startswith(u + ".") for u in LAYERS)
    ]
    assert not unplaced, f"Give these modules a layer in LAYERS: {unplaced}"


def test_the_walk_sees_imports():
    # The checker itself: known edges are found, relative and inside functions too.
    assert "lowtrain._interpret" in GRAPH["lowtrain._amp._transform"]
    assert "lowtrain.fp8" in GRAPH["lowtrain.train._precisions"]
    assert "lowtrain.recipes._task" in GRAPH["lowtrain.recipes._run"]
    inside_a_function = GRAPH["lowtrain.unit_scaling._transform"]
    assert "lowtrain.unit_scaling.functional" in inside_a_function
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_import_cycle():
    cycle = _cycle(GRAPH)
    assert cycle is None, "Import cycle between modules: " + " -> ".join(cycle)


def test_no_unit_import_cycle():
    units: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        here = _unit(module)
        units.setdefault(here, set()).update(_unit(d) for d in deps if _unit(d) != here)
    cycle = _cycle(units)
    assert cycle is None, "Import cycle between subpackages: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    here = _unit(module)
    up = [d for d in GRAPH[module] if LAYERS[_unit(d)] > LAYERS[here]]
    assert not up, (
        f"{module} (layer {LAYERS[here]}) imports {up} from a higher layer. A lower "
        "layer that needs something from a higher one gets a parameter or a registry "
        "(docs/architecture.md)."
    )


def test_jax_internals_only_in_compat():
    offenders = []
    for module, path in MODULES.items():
        if module == "lowtrain._compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]
            if any(n.startswith(("jax._src", "jax.extend")) for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"JAX internals outside lowtrain/_compat.py: {offenders}"


def _is_str(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


# What a precision or transform is called, by a class, a policy or a format.
_TRANSFORM_NAMES = re.compile(
    r"amp|scalify|rewrite|delayed|unit|fp8|fp16|bf16|fp32|float|e4m3|e5m2|policy",
    re.I,
)


def _is_name(node) -> bool:
    return _is_str(node) and bool(_TRANSFORM_NAMES.search(node.value))


def _compares_to_a_name(node: ast.Compare) -> bool:
    """`x == "amp"`, `x != "scalify"`, `x in ("amp", "scalify")` and the like
    (`"key" in mapping` is a lookup, not a branch on a name; `mode == "min"` is
    not a transform's name)."""
    for op, right in zip(node.ops, node.comparators):
        if isinstance(op, ast.Eq | ast.NotEq | ast.Is | ast.IsNot):
            if _is_name(node.left) or _is_name(right):
                return True
        if isinstance(op, ast.In | ast.NotIn) and isinstance(
            right, ast.Tuple | ast.List | ast.Set
        ):
            if any(_is_name(e) for e in right.elts):
                return True
    return False


def test_the_name_check_sees_comparisons():
    parse = lambda src: ast.parse(src).body[0].value  # noqa: E731
    assert _compares_to_a_name(parse('t == "scalify"'))
    assert _compares_to_a_name(parse('t in ("amp", "scalify")'))
    assert _compares_to_a_name(parse('type(p).__name__ == "DelayedFp8"'))
    assert not _compares_to_a_name(parse('"lr" in hyperparams'))
    assert not _compares_to_a_name(parse('mode in ("min", "max")'))


def test_trainer_compares_no_transform_names():
    # The Trainer asks its `Precision`; it never branches on a transform's name.
    found = []
    for module, path in MODULES.items():
        if not module.startswith("lowtrain.train"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _compares_to_a_name(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"String comparisons in lowtrain/train: {found}"


def test_architecture_doc_example_runs():
    # docs/architecture.md's worked example: a precision written without touching
    # the Trainer.
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/architecture.md lost its worked example"
    namespace = {}
    for block in blocks:
        with jax.numpy_dtype_promotion("standard"):  # optax's adam: b1 ** count
            exec(
                compile(textwrap.dedent(block), "<architecture.md>", "exec"), namespace
            )


# -- private names stay in their package ---------------------------------------------


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# `lowtrain/_compat.py` holds every JAX internal lowtrain touches, and scripts/
# share it rather than reach into JAX themselves.
SHARED = {"lowtrain._compat"}


def _private_reaches(module: str, source: str | None = None) -> list[str]:
    """The private modules and names of other packages `module` imports (its file,
    or `source`): a module `a.b._c` belongs to package `a.b`, a name `_x` to its
    module's package; only modules inside that package may import them."""
    found = []
    source = MODULES[module].read_text() if source is None else source
    for target, name in _imported(module, source):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if not target or target == module or target in SHARED:
            continue
        parts = target.split(".")
        owners = [".".join(parts[:i]) for i, p in enumerate(parts) if _private(p)]
        if owners and not _inside(module, owners[0]):
            found.append(target)
        elif name and _private(name) and not _inside(module, _package(target)):
            found.append(f"{target}.{name}")
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_of_another_package(module):
    # As Equinox keeps its siblings to `equinox.internal`: a package's private
    # modules and names are its own; what others need is named in an `internal`
    # module (`lowtrain.fp8.internal`, `lowtrain.recipes.internal`, ...).
    assert _private_reaches(module) == [], (
        f"{module} imports private names of another package; import them from "
        "that package's public or `internal` module"
    )


def test_the_private_check_sees_reaches():
    source = textwrap.dedent(
        """
        from lowtrain.fp8._dot import keep_op
        from lowtrain.fp8.internal import keep_op as ok
        from lowtrain.numerics import _track
        from lowtrain.train._callbacks import _monitored
        from lowtrain.train import _trainer as t
        import lowtrain._compat
        """
    )
    assert _private_reaches("scripts.fake", source) == [
        "lowtrain.fp8._dot",
        "lowtrain.numerics._track",
        "lowtrain.train._callbacks",
        "lowtrain.train._trainer",
    ]
    # Inside the owning package: its own.
    assert _private_reaches("lowtrain.fp8.internal", source)[:1] == [
        "lowtrain.numerics._track"
    ]
