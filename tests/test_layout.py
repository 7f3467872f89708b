"""The layout the architecture page describes: packages named for their concern, imports that only go down, no
import cycle, the map in docs/architecture.md true to the tree, and the method registry the single source of names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from glmc.match.registry import MERGE_METHODS, METHODS, get_method

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("glmc", "federation", "server", "client", "harness", "simulations", "deploy")
# What each package may import of the others: the library at the bottom, then what both apps share, then the apps;
# the harness (the engine that runs the apps through flwr, the docs generator), which imports neither app; then the
# experiments and the deployment, which drive flwr through the harness's engine and never import each other.
ALLOWED = {
    "glmc": set(),
    "federation": {"glmc"},
    "client": {"glmc", "federation"},
    "server": {"glmc", "federation"},
    "harness": {"glmc", "federation"},
    "simulations": {"glmc", "federation", "server", "client", "harness"},
    "deploy": {"glmc", "federation", "server", "client", "harness"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imported(path: Path, top_level_only: bool) -> set[str]:
    """Every module name ``path`` imports (``from X import Y``: X.Y)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return names


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The project modules ``path`` imports: ``from X import Y`` counts as X.Y where that is a module. With
    ``top_level_only``, the imports that run when the module is imported (none inside a function, or only for type
    checking)."""
    return {n for n in _imported(path, top_level_only) if n.split(".")[0] in PACKAGES and n != module}


def test_the_library_top_level_holds_at_most_ten_modules():
    top = sorted(p.name for p in (ROOT / "glmc").glob("*.py"))
    assert len(top) <= 10, top


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module: str):
    """glmc imports no other package of the project (and never flwr); client and server never import each other."""
    package = module.split(".")[0]
    path = MODULES[module]
    upward = sorted(n for n in _imports(path, module, False) if n.split(".")[0] not in ALLOWED[package] | {package})
    assert not upward, f"{module} imports {upward}"
    if package == "glmc":
        assert not {n for n in _imported(path, False) if n.split(".")[0] == "flwr"}, f"{module} imports flwr"


def test_no_bench_imports_an_analysis():
    """The product benchmarks stand alone: a one-off analysis may use a bench's helpers, never the other way, so an
    analysis the docs no longer cite can be removed without touching a bench."""
    found = {m: sorted(n for n in _imports(MODULES[m], m, False) if n.startswith("simulations.analyses"))
             for m in MODULES if m.startswith("simulations.bench")}
    assert len(found) > 5 and not any(found.values()), {m: names for m, names in found.items() if names}


def test_no_import_cycle():
    """The imports that run at import time form no cycle (a function's own import is a lazy load, not a cycle)."""
    graph = {m: _imports(p, m, True) & MODULES.keys() for m, p in MODULES.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1 and not cycle:
                cycle.extend([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycle, " → ".join(cycle)


# glmc's subpackages and top-level modules, lowest first. Each imports only the ones before it, lazy imports and
# type-checking ones included: the vocabulary (core) at the bottom, the families, what acts on their symmetries,
# data and training, checkpoints, pairwise matching, merging N models, training on their width slices (FjORD), then
# the front-ends.
GLMC_ORDER = ("errors", "device", "core", "archs", "symmetry", "data", "train", "io", "match", "merging",
              "ordered_dropout", "plots", "api", "cli")


def _unit(module: str) -> str | None:
    """The part of glmc a module belongs to: its subpackage or its top-level module (None: glmc itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "glmc" and len(parts) > 1 else None


def upward_imports(module: str, source: str) -> list[str]:
    """The glmc modules ``source`` (the text of ``module``) imports from a part at or above its own in GLMC_ORDER,
    other than its own part."""
    own = _unit(module)
    if own is None:
        return []
    tree = ast.parse(source)
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    return sorted(n for n in names if (unit := _unit(n)) is not None and unit != own
                  and GLMC_ORDER.index(unit) > GLMC_ORDER.index(own))


def test_every_part_of_glmc_has_its_place_in_the_order():
    parts = {_unit(m) for m in MODULES if m.startswith("glmc.")} - {None, "__main__"}
    assert parts == set(GLMC_ORDER), parts ^ set(GLMC_ORDER)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("glmc.")))
def test_glmc_imports_only_the_parts_below_its_own(module: str):
    assert not upward_imports(module, MODULES[module].read_text()), upward_imports(module, MODULES[module].read_text())


def test_a_planted_upward_import_is_found():
    """The check above can fail: archs importing matching, lazily or for type checking, is caught."""
    planted = "def f():\n    from glmc.match.weight import weight_match\n"
    assert upward_imports("glmc.archs.base", planted) == ["glmc.match.weight"]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import glmc.merging.merge\n"
    assert upward_imports("glmc.core.state", typed) == ["glmc.merging.merge"]
    assert upward_imports("glmc.merging.merge", "from glmc.match.align import align_pair\n") == []


ARCHITECTURE = (ROOT / "docs/architecture.md").read_text()


def test_every_path_and_name_the_architecture_page_names_exists():
    """`path` and `path: name` (a function, class or method defined in that file)."""
    named = re.findall(r"`((?:glmc|federation|server|client|harness|simulations|deploy|tests)/[\w/.]*)(?:: (\w+))?`",
                       ARCHITECTURE)
    assert len(named) > 20, "the page names few files"
    missing = sorted(path for path, _ in named if not (ROOT / path).exists())
    assert not missing, missing
    undefined = sorted(f"{path}: {name}" for path, name in named
                       if name and not re.search(rf"^\s*(def|class) {name}\b", (ROOT / path).read_text(), re.M))
    assert not undefined, undefined


def test_the_architecture_page_maps_every_package_and_module():
    """A new module (or package) of the library or the apps must find its place on the map."""
    for module, path in MODULES.items():
        if module.split(".")[0] in ("simulations", "deploy") or path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        assert f"`{rel}`" in ARCHITECTURE or (f"`{path.name}`" in ARCHITECTURE and f"`{folder}`" in ARCHITECTURE), \
            f"docs/architecture.md does not place {rel}"


def test_the_api_names_stay_the_api_functions_whatever_is_imported():
    import glmc
    import glmc.api
    import glmc.cli.align
    import glmc.cli.merge

    assert all(getattr(glmc, name) is getattr(glmc.api, name) for name in glmc.API)


def test_every_registered_method_resolves_to_its_function():
    for method in METHODS.values():
        if method.function is None:
            continue
        assert callable(method.match()), method.name
    assert set(MERGE_METHODS) <= set(METHODS)
    assert all(METHODS[m].merge_pairwise in METHODS for m in MERGE_METHODS)
    with pytest.raises(Exception, match="unknown merge method 'soft'; known: none, weight"):
        get_method("soft", merging=True)


def test_the_names_the_cli_lists_without_torch_match_their_sources():
    """Choice lists the command line writes out so that `glmc --help` loads no torch, each against its source."""
    from glmc.cli.export import DTYPE_NAMES, FORMAT_NAMES
    from glmc.cli.merge import FILL_NAMES
    from glmc.cli.pair import FORM_NAMES, METHOD_NAMES
    from glmc.cli.train import PRECISIONS
    from glmc.device import PRECISIONS as DEVICE_PRECISIONS
    from glmc.io.formats import DTYPES, FORMATS
    from glmc.merging.widths import FILLS
    from glmc.symmetry.canonical import FORMS

    assert (list(FORMATS), list(DTYPES), list(FILLS)) == (FORMAT_NAMES, DTYPE_NAMES, FILL_NAMES)
    assert list(FORMS) == FORM_NAMES
    assert list(DEVICE_PRECISIONS) == PRECISIONS
    assert ", ".join(METHODS) == METHOD_NAMES


# Method names that name nothing else; "none" is also a word of other settings, so it counts only where the other side
# of the comparison reads a method.
METHOD_WORDS = set(METHODS) - {"none"}
PRODUCT = ("glmc", "server", "client", "federation", "deploy")


def method_comparisons(source: str) -> list[str]:
    """Comparisons in ``source`` against a registered method's name (a decision the registry's properties make)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        words = {e.value for s in sides for e in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))
                 if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        reads_method = any("method" in ast.unparse(s) for s in sides if not isinstance(s, ast.Constant))
        if words & METHOD_WORDS or ("none" in words and reads_method):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_the_registry_names_a_method_in_a_comparison():
    paths = sorted(p for part in PRODUCT for p in (ROOT / part).rglob("*.py") if p != ROOT / "glmc/match/registry.py")
    found = {p.relative_to(ROOT).as_posix(): hits for p in paths if (hits := method_comparisons(p.read_text()))}
    assert len(paths) > 100 and not found, found


def test_a_planted_method_comparison_is_found():
    assert method_comparisons('if method == "learned":\n    pass\n') == ["line 1: method == 'learned'"]
    assert method_comparisons('x = options.method != "none"\n')
    assert not method_comparisons('x = settings.attack != "none"\n')


# The algorithm packages read the families' declarations only: no family is named in their code, and no canonical
# module of one (docstrings and comments may name them as examples).
ALGORITHMS = ("glmc/match", "glmc/merging", "glmc/symmetry", "glmc/core/state.py", "glmc/core/spec.py")
FAMILY_WORDS = re.compile(r"\b(vit|gpt2|gpt-2|llama|mistral|qwen2|neox|bert)\b|\b(attn|mlp)\.[a-z]|\bln[12]\b",
                          re.IGNORECASE)


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module that is not a docstring, with its line."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_algorithm_names_a_family_or_its_modules() -> None:
    paths = [p for root in ALGORITHMS for p in ((ROOT / root).rglob("*.py") if (ROOT / root).is_dir()
                                               else [ROOT / root])]
    assert len(paths) > 20
    named = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in paths for line, text in _code_strings(p)
             if FAMILY_WORDS.search(text)]
    assert not named, "\n".join(named)


def test_the_flower_app_bundle_holds_the_packages_code_and_stays_far_under_flowers_limit() -> None:
    """`flwr run .` packs the app bundle (FAB) from the tree: every package's modules go in, and the published
    results, docs and fixtures stay out, so no amount of results can push it past the 10 MB Flower refuses."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.constant import FAB_MAX_SIZE

    fab = build_fab_from_disk(ROOT)
    names = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    assert {"server/app.py", "client/app.py", "federation/settings.py", "glmc/__init__.py"} <= names
    assert not any(name.startswith(("simulations/results/", "docs/", "tests/")) for name in names)
    assert len(fab) < FAB_MAX_SIZE / 4, len(fab)
