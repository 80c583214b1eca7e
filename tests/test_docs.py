"""The documentation is checked like code: every public name has a docstring with a
runnable example, and the examples run; every ```python block of the README and of
each page of the docs site runs; the API reference names every public name; the
README stays a front page; the pages say what is true now (no commit hashes, dates
or issue numbers: history goes to CHANGELOG.md); the site's nav lists every page."""

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import jax
import pytest
import yaml

import lowtrain
import lowtrain.fp8
import lowtrain.numerics
import lowtrain.recipes
import lowtrain.scalify
import lowtrain.train
import lowtrain.unit_scaling
import lowtrain.unit_scaling.constraints
import lowtrain.unit_scaling.functional
import lowtrain.unit_scaling.optim

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MKDOCS = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

MODULES = (
    lowtrain,
    lowtrain.fp8,
    lowtrain.numerics,
    lowtrain.recipes,
    lowtrain.scalify,
    lowtrain.train,
    lowtrain.unit_scaling,
    lowtrain.unit_scaling.constraints,
    lowtrain.unit_scaling.functional,
    lowtrain.unit_scaling.optim,
)


def _is_lowtrains(obj) -> bool:
    # lowtrain's own (not `Callable` or a type alias a module imports or defines).
    return str(getattr(obj, "__module__", "")).startswith("lowtrain")


PUBLIC = [
    f"{module.__name__}.{name}"
    for module in MODULES
    for name in dir(module)
    if not name.startswith("_")
    and callable(getattr(module, name))
    and not isinstance(getattr(module, name), types.ModuleType)
    and not name.isupper()  # dtype constants such as E4M3
    and _is_lowtrains(getattr(module, name))
]
# Every name the API reference documents: the public callables and the constants
# (`lowtrain.fp8.E4M3`, `lowtrain.DEFAULT_RULES`, ...).
DOCUMENTED = PUBLIC + [
    f"{module.__name__}.{name}"
    for module in MODULES
    for name in dir(module)
    if name.isupper() and not name.startswith("_")
]

# The pages of the site: docs/**/*.md but the folders mkdocs.yml's `exclude_docs`
# leaves out (the site's hook).
_EXCLUDED = [e.strip("/") for e in MKDOCS.get("exclude_docs", "").split()]
PAGES = sorted(
    p
    for p in DOCS.rglob("*.md")
    if not any(p.relative_to(DOCS).as_posix().startswith(e + "/") for e in _EXCLUDED)
)
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(text):
    return [textwrap.dedent(b) for b in _BLOCK.findall(text or "")]


def _name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


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


def _parameters(fn) -> list[str]:
    # The named parameters a caller passes (not self/cls, *args, **kwargs or a
    # private `_name`).
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in signature.parameters.values()
        if p.name not in ("self", "cls")
        and p.kind not in variadic
        and not p.name.startswith("_")
    ]


def _undocumented(params, *docs) -> list[str]:
    text = "\n".join(d or "" for d in docs)
    return [p for p in params if not re.search(rf"`{re.escape(p)}\b", text)]


def _method_docs(cls, name) -> list[str]:
    # A method's docstring, and those of the methods it overrides (it inherits
    # their description of the arguments).
    return [vars(c)[name].__doc__ for c in cls.__mro__ if name in vars(c)]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_arguments_documented(name):
    """Each argument of a public function, class or public method is described in
    its docstring (a `` `name` `` mention; the `**Arguments:**` list where there
    are several), or, for a method, in the docstring of the method it overrides."""
    module, _, attr = name.rpartition(".")
    obj = getattr({m.__name__: m for m in MODULES}[module], attr)
    missing = {}
    if inspect.isclass(obj):
        init = vars(obj).get("__init__")
        init_doc = getattr(init, "__doc__", "")
        gaps = _undocumented(_parameters(obj), obj.__doc__, init_doc)
        if gaps:
            missing[name] = gaps
        for method, fn in vars(obj).items():
            if method.startswith("_") or not inspect.isfunction(fn):
                continue
            gaps = _undocumented(_parameters(fn), *_method_docs(obj, method))
            if gaps:
                missing[f"{name}.{method}"] = gaps
    else:
        gaps = _undocumented(_parameters(obj), obj.__doc__)
        if gaps:
            missing[name] = gaps
    assert not missing, (
        f"Expected each argument described in the docstring (`name`: what it is), "
        f"got none for {missing}."
    )


def _exec_page(path: pathlib.Path):
    # The blocks of one page build on each other, in order, in one namespace, under
    # JAX's default promotion rules, as a reader runs them (conftest.py sets strict
    # dtype promotion and raises on rank promotion).
    namespace = {"__name__": "__docs__"}
    for i, block in enumerate(_blocks(path.read_text())):
        where = f"<{_name(path)} block {i + 1}>"
        with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
            exec(compile(block, where, "exec"), namespace)


def test_readme_examples_run(tmp_path, monkeypatch):
    assert len(_blocks(README.read_text())) >= 2
    monkeypatch.chdir(tmp_path)  # anything an example writes lands here
    _exec_page(README)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if _blocks(p.read_text())], ids=_name
)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _exec_page(page)


def _api_stubs() -> set[str]:
    stubs = set()
    for page in (DOCS / "api").glob("*.md"):
        stubs |= set(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M))
    # The checkout's `recipes/` is installed as `lowtrain.recipes`; mkdocstrings
    # reads it by its folder's name.
    return {f"lowtrain.{s}" if s.startswith("recipes.") else s for s in stubs}


def test_api_reference_names_every_public_name():
    missing = sorted(set(DOCUMENTED) - _api_stubs())
    assert not missing, (
        f"Expected a `::: <name>` stub in a docs/api/*.md page for {missing}; add one "
        "to the page of its module."
    )


def test_api_reference_names_only_public_names():
    stale = []
    for stub in sorted(_api_stubs()):
        module, _, attr = stub.rpartition(".")
        try:
            found = hasattr(importlib.import_module(module), attr)
        except ImportError:
            found = False
        if not found:
            stale.append(stub)
    assert not stale, f"docs/api stubs name what does not exist: {stale}"


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, (
        f"Expected README.md within 200 lines, got {len(lines)} instead: move the "
        "detail to a guide in docs/guides/."
    )


# History belongs in CHANGELOG.md. A commit hash: 7 to 40 hex characters standing
# alone as a word, with at least one digit and one letter (so neither "1000000" nor
# "deadbee" in prose, nor `float8_e4m3fn`), or any such run after "git" or "commit"
# (an all-digit hash). An ISO date. "issue 13", "issues #283".
_HISTORY = {
    "commit hash": re.compile(
        r"(?<![\w./-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])"
    ),
    "commit": re.compile(r"\b(?:git|commits?)\s+[0-9a-f]{7,40}\b", re.I),
    "date": re.compile(r"(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)"),
    "issue number": re.compile(r"\bissues? #?\d+", re.I),
}


@pytest.mark.parametrize("page", [README, *PAGES], ids=_name)
def test_docs_say_what_is_true_now(page):
    found = [
        f"{_name(page)}:{number}: {kind} {match.group(0)!r}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for kind, pattern in _HISTORY.items()
        for match in pattern.finditer(line)
    ]
    assert not found, (
        "Expected no commit hash, date or issue number in the docs (history goes to "
        "CHANGELOG.md), got:\n" + "\n".join(found)
    )


_FENCE = re.compile(r"```.*?```", re.S)
_SOURCE = re.compile(
    r"(?<![\w/.])((?:lowtrain|recipes|conf|scripts|tests)/[\w/.-]*\.py)\b"
)


@pytest.mark.parametrize("page", [README, *PAGES], ids=_name)
def test_docs_name_files_that_exist(page):
    # Outside code blocks (which may show a file to create), a repository file the
    # prose names exists.
    text = _FENCE.sub("", page.read_text())
    missing = sorted({p for p in _SOURCE.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{_name(page)} names files that do not exist: {missing}"


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def test_nav_lists_every_page():
    nav = _nav_pages(MKDOCS["nav"])
    pages = [p.relative_to(DOCS).as_posix() for p in PAGES]
    assert sorted(set(nav)) == sorted(nav), f"A page is in the nav twice: {nav}"
    assert not set(nav) - set(pages), (
        f"nav names missing pages: {set(nav) - set(pages)}"
    )
    assert not set(pages) - set(nav), f"Pages not in the nav: {set(pages) - set(nav)}"


def test_site_builds_strict(tmp_path):
    # Offline and warning-free (broken links, unknown API names, missing includes).
    for package in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(package, reason="the `docs` extra is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
