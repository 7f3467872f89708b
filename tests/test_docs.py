"""The documentation: a short README, generated docs that match their sources, links that resolve, and no file that
cites a path outside the repository or an issue number."""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from harness import docs

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 10_240  # bytes
# A path outside the repository (the design notes it was built from) or an issue number: meaningless to a reader.
OUTSIDE = re.compile(r"\.\./shared|shared/design|(?<!docs/)\b(?:symmetry|architecture|flower|style|data)\.md\b|"
                     r"\bissues? #?\d", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def _repo_files() -> list[Path]:
    """Every file git tracks or would track (untracked but not ignored), text or not."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_at_most_10_kib():
    assert (ROOT / "README.md").stat().st_size <= README_LIMIT


def _in_docs(path: Path, name: str) -> bool:
    """A page of docs/ naming a sibling page that this repository has (docs/architecture.md is its own)."""
    return path.parent == ROOT / "docs" and (ROOT / "docs" / name).is_file()


def test_no_file_cites_a_path_outside_the_repository_or_an_issue_number():
    offenders = []
    for path in _repo_files():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # plots and other binaries
        offenders += [f"{path.relative_to(ROOT)}:{n}: {m[0]}" for n, line in enumerate(text.splitlines(), 1)
                      if (m := OUTSIDE.search(line)) and not _in_docs(path, m[0])]
    assert not offenders, "\n".join(offenders)


def test_the_generated_docs_are_fresh():
    """docs/cli.md, run-config.md and results.md equal what their sources give now (`python -m harness.docs`)."""
    assert docs.stale() == []


def test_every_run_config_key_is_documented_with_a_meaning():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([a-z-]+)` \|.*\| ([^|]*) \|$", docs.run_config_markdown(), re.M)}
    assert set(rows) == set(config)
    assert all(meaning.strip() for meaning in rows.values()), [k for k, v in rows.items() if not v.strip()]


def test_every_subcommand_and_option_is_in_the_cli_page():
    from glmc.cli.main import COMMANDS, build_parser

    page = docs.cli_markdown()
    assert all(f"## `glmc {name}`" in page for name in COMMANDS)
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {flag for action in sub.choices["merge"]._actions for flag in action.option_strings
             if flag not in ("-h", "--help")}
    assert flags and all(f"`{flag}" in page for flag in flags)


def test_every_results_folder_has_a_section():
    page = docs.results_markdown()
    for folder in (ROOT / "simulations" / "results").glob("*/results.json"):
        assert f"## {folder.parent.name}\n" in page


def test_every_module_the_results_page_loads_by_name_exists():
    """harness.results_doc names the module that renders each results folder and loads it by name (the harness imports
    no experiment): every name is a module here and every folder exists, so a bench or an analysis moved or removed
    cannot leave its line behind."""
    from harness.results_doc import COMPARE, PUBLISHERS, RESULTS

    missing = [module for module in (COMPARE, *(m for m, _ in PUBLISHERS.values()))
               if not (ROOT / f"{module.replace('.', '/')}.py").is_file()]
    assert not missing, missing
    assert not [folder for folder in PUBLISHERS if not (RESULTS / folder / "results.json").is_file()]


def test_readme_results_cells_are_short():
    """One row per experiment, no cell over 120 characters: the details live in docs/."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| ")]
    long = [cell for row in rows for cell in row.strip().strip("|").split(" | ") if len(cell.strip()) > 120]
    assert len(rows) >= 5 and not long, long


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a markdown page's headings (lower case, punctuation dropped, spaces as hyphens)."""
    fence, found = False, set()
    for line in page.read_text().splitlines():
        fence ^= line.startswith("```")
        if not fence and line.startswith("#"):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", _markdown(), ids=lambda p: p.name)
def test_relative_links_and_their_anchors_resolve(page):
    broken = []
    for target, anchor in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path = (page.parent / target) if target else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(f"{target}#{anchor}" if anchor else target)
    assert not broken, broken
