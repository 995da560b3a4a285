"""The rules of ``benchmarks/`` and ``tests/`` that no linter states: every benchmark runs as
``python -m benchmarks.NAME`` from the repository root, nothing edits ``sys.path``, a test file imports its
shared helpers from ``tests/conftest.py`` and never from another test file, and every file the results index
links to is there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import ROOT

SOURCES = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").rglob("*.py")])


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_nothing_in_benchmarks_or_tests_edits_sys_path() -> None:
    edits = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append)", line)
    ]
    assert not edits, edits


def test_no_test_file_imports_another() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in SOURCES
        for name in _imports(path)
        if re.match(r"(tests\.)?test_\w+$", name)
    ]
    assert not found, found


def test_every_benchmark_script_names_itself_as_a_module() -> None:
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        module = f"benchmarks.{path.stem}"
        assert not re.search(r"python3? benchmarks/\w+\.py", text), f"{path.name}: say `python -m {module}`"
        if "argparse.ArgumentParser(" in text:
            assert f'prog="python -m {module}"' in text, f"{path.name}: its --help should say `python -m {module}`"


def test_the_results_index_lists_every_file_and_every_link_is_there() -> None:
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)/]+)\)", index))
    assert linked <= {path.name for path in results.iterdir()}, linked - {path.name for path in results.iterdir()}
    unlisted = {path.name for path in results.iterdir() if path.name != "README.md"} - linked
    assert not unlisted, f"benchmarks/results/README.md has no row for {sorted(unlisted)}"


def test_every_results_file_the_readme_and_docs_name_is_there() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (page.name, name) for page in pages for name in re.findall(r"benchmarks/results/([\w.-]+)", page.read_text())
    }
    missing = sorted((page, name) for page, name in named if not (ROOT / "benchmarks" / "results" / name).is_file())
    assert not missing, missing
