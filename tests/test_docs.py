"""The documentation: a short README, generated docs that match their sources, links that resolve, and no file that
cites a path outside the repository or an issue number."""

from __future__ import annotations

import argparse
import json
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


README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "simulations" / "results"


def _merging(group: str, method: str, key: str = "merged_accuracy") -> float:
    """A merging-bench figure in %: ``key`` of the row of ``group`` and ``method``."""
    rows = json.loads((RESULTS / "merging" / "results.json").read_text())["rows"]
    return 100 * next(r[key] for r in rows if (r["group"], r["method"]) == (group, method))


def _family(model: str, method: str) -> float:
    """A families-bench figure: the vanilla barrier, or a method's barrier in % of it."""
    summary = json.loads((RESULTS / "families" / "results.json").read_text())["summary"]
    row = next(r for r in summary if (r["model"], r["method"]) == (model, method))
    return row["barrier"] if method == "none" else 100 * row["ratio"]


def _grid(name: str, split: str | None, last: int, agg: str) -> float:
    """A width grid's figure in %: the full tier's accuracy of ``agg`` (on ``split``, where the grid has several)
    averaged over its last ``last`` rounds, mean over its finished seeds."""
    rows = json.loads((RESULTS / name / "results.json").read_text())["rows"]
    finals = [sum(x["central_accuracy"] for x in r["records"][-last:]) / last for r in rows
              if r["aggregation"] == agg and r["status"] == "finished:completed" and split in (None, r["split"])]
    return 100 * sum(finals) / len(finals)


WHOLE_GROUP = "vit-bench, same width, the whole group (2026-12-06 seeds)"  # today's defaults on retrained seeds
# (the README results row's first words, the words before a figure in it, the figure simulations/results/ holds)
HEADLINES = [
    ("merging 5 vit-bench", "mean input", lambda: _merging(WHOLE_GROUP, "none", "mean_input_accuracy")),
    ("merging 5 vit-bench", "averaging", lambda: _merging(WHOLE_GROUP, "none")),
    ("merging 5 vit-bench", "weight", lambda: _merging(WHOLE_GROUP, "weight")),
    ("merging 5 vit-bench", "learned", lambda: _merging(WHOLE_GROUP, "learned")),
    ("merging 5 vit-bench", "`--refit 512`", lambda: _merging("vit-bench, same width, refit", "weight")),
    ("merging 5 llama-tiny", "inputs", lambda: _merging("llama-tiny, same width", "none", "mean_input_accuracy")),
    ("merging 5 llama-tiny", "ensemble", lambda: _merging("llama-tiny, same width", "none", "ensemble_accuracy")),
    ("merging 5 llama-tiny", "averaging", lambda: _merging("llama-tiny, same width", "none")),
    ("merging 5 llama-tiny", "weight", lambda: _merging("llama-tiny, same width, the whole group", "weight")),
    ("merging 5 llama-tiny", "learned", lambda: _merging("llama-tiny, same width, the whole group", "learned")),
    ("merging 5 llama-tiny", "`--refit 512`", lambda: _merging("llama-tiny, same width, refit", "weight")),
    *[(f"{model}, 3 pairs", label, lambda model=model, method=method: _family(model, method))
      for model in ("llama-tiny", "neox-tiny")
      for label, method in (("vanilla", "none"), ("weight", "weight"), ("learned", "learned"), ("dual", "dual"),
                            ("permutations only", "weight-perm-stream"))],
    ("bert-tiny (masked LM)", "vanilla", lambda: _family("bert-tiny", "none")),
    ("bert-tiny (masked LM)", "weight", lambda: _family("bert-tiny", "weight")),
    ("bert-tiny (masked LM)", "stay at", lambda: _family("bert-tiny", "learned")),
    *[(row, label, lambda grid=grid, agg=agg: _grid(*grid, agg=agg))
      for row, grid in (("mixed widths FL, 100 clients", ("width-plateau-multistep", "dirichlet0.3", 28)),
                        ("mixed widths FL on text", ("width-text-seeded", None, 12)))
      for label, agg in (("HeteroFL", "fedavg"), ("FedRolex", "fedrolex"), ("smallest", "smallest-width"),
                         ("full-only", "full-width-only"), ("weight", "weight"))],
]


@pytest.mark.parametrize(("row", "label", "measured"), HEADLINES, ids=lambda x: x if isinstance(x, str) else "")
def test_the_readmes_headline_figures_are_those_simulations_results_holds(row, label, measured):
    """A README figure is the committed result rounded to the digits it shows: a re-measured result, or a figure
    edited by hand, that disagrees fails here."""
    (line,) = [line for line in README.splitlines() if line.startswith(f"| {row}")]
    found = re.search(rf"{re.escape(label)} ([0-9]+(?:\.([0-9]+))?)", line.rsplit(" | ", 1)[0])  # not the link
    assert found, f"no figure after {label!r} in {line}"
    shown, digits = float(found[1]), len(found[2] or "")
    assert abs(shown - measured()) <= 0.5 * 10 ** -digits + 1e-9, (line, label, measured())
