"""The package's structure holds: no module-level import cycle, kernels never import the engine, no source
file over 400 lines, and every exit code and error class defined in exactly one place."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("engine", "kernels", "pipeline", "schemas")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["deepinfer", *parts])


def _source_files() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in (REPO / root).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, module_level_only: bool) -> set[str]:
    """Absolute names of the deepinfer modules `module` imports (resolving relative imports)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                continue  # typing-only imports never run
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            elif not module_level_only:
                visit([n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))])
    visit(tree.body)
    return {name for name in found if name.startswith("deepinfer.")}


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    files = _source_files()
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target in _imports(tree, name, path.name == "__init__.py", module_level_only):
            # `from pkg import name` names either a module or an attribute: keep what is a module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    result.append(sorted(comp))
    return result


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle():
    assert _cycles(_graph(module_level_only=True)) == []


def test_kernels_import_nothing_from_the_engine():
    graph = _graph(module_level_only=False)
    edges = [(m, t) for m, targets in graph.items() if m.startswith("deepinfer.kernels")
             for t in targets if t.startswith("deepinfer.engine")]
    assert edges == []


@pytest.mark.parametrize("root", [*SOURCE_ROOTS, "tests", "benchmarks"])
def test_no_source_file_over_400_lines(root):
    long = {str(p.relative_to(REPO)): n for p in (REPO / root).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def _definitions() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    classes: dict[str, list[str]] = defaultdict(list)
    exit_codes: dict[str, list[str]] = defaultdict(list)
    for path in _source_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = str(path.relative_to(REPO))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if node.name.endswith(("Error", "Exceeded", "Mismatch", "Exception")) or bases & {
                        "Exception", "ValueError", "RuntimeError", "JobError"}:
                    classes[node.name].append(where)
                if node.name == "ExitCode":
                    exit_codes["ExitCode"].append(where)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id.startswith("EXIT_"):
                            exit_codes[name.id].append(where)
    return classes, exit_codes


def test_every_error_class_is_defined_once():
    classes, _ = _definitions()
    assert {name: places for name, places in classes.items() if len(places) > 1} == {}


def test_exit_codes_are_defined_only_in_pipeline_errors():
    _, exit_codes = _definitions()
    assert exit_codes == {"ExitCode": ["pipeline/errors.py"]}
