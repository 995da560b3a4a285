"""The house rules that import-linter's contracts (``lint-imports`` in CI) do not state on their own."""

from __future__ import annotations

import ast

import grimp
import networkx as nx

from tests.conftest import ROOT

PACKAGES = ("planner", "cost_models", "executors", "calibration")


def test_no_import_cycles_between_modules_even_inside_functions() -> None:
    graph = grimp.build_graph(*PACKAGES)  # imports inside functions and under TYPE_CHECKING included
    imports = nx.DiGraph(
        (module, imported) for module in graph.modules for imported in graph.find_modules_directly_imported_by(module)
    )
    cycles = [sorted(component) for component in nx.strongly_connected_components(imports) if len(component) > 1]
    assert not cycles, cycles


def test_the_planner_never_imports_torch_distributed() -> None:
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("torch.distributed")]
    assert not found, found


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    for package in PACKAGES:
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            assert len(modules) <= 15, f"{folder.relative_to(ROOT)} holds {len(modules)} modules"
