"""The package's imports go one way: the planner imports no strategy, and no subpackage imports itself back.

Read from the source (every ``import`` statement of every module, those inside functions too), so an import
made late, to dodge a cycle at import time, counts as what it is: a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "lightning_dynamix"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# Edges between subpackages allowed although they close a cycle, each with the reason. Remove one as soon as
# it is gone (the test below fails while a listed edge no longer exists).
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        yield _module_name(path), path


def _imports(name: str, path: Path) -> set[str]:
    """The modules (or names in modules) module ``name``, at ``path``, imports, wherever the statement is."""
    return _imports_in(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def _imports_in(source: str, package: str) -> set[str]:
    """The modules (or names in modules) ``source``, a module of ``package``, imports, wherever the statement is."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)  # a name may be a submodule
    return found


def _root_exports() -> dict[str, str]:
    """The names ``lightning_dynamix/__init__.py`` imports from its subpackages, and from which module."""
    exports = {}
    for node in ast.walk(ast.parse((ROOT / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{PACKAGE}."):
            exports.update({alias.asname or alias.name: node.module for alias in node.names})
    return exports


def _unit(module: str, exports: dict[str, str]) -> str | None:
    """``lightning_dynamix.<subpackage or top-level module>`` that ``module`` belongs to; None outside the
    package, and for the package's own ``__init__`` (the facade that re-exports the rest)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) == 1:
        return None
    if len(parts) == 2 and parts[1] in exports:  # `from lightning_dynamix import Name`: where Name comes from
        return _unit(exports[parts[1]], exports)
    if not ((ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file()):
        return None  # a name defined by the package's __init__ itself (__version__)
    return f"{PACKAGE}.{parts[1]}"


def _subpackage_graph() -> dict[str, set[str]]:
    exports = _root_exports()
    graph: dict[str, set[str]] = {}
    for name, path in _modules():
        source = _unit(name, exports)
        if source is None:
            continue
        targets = {_unit(imported, exports) for imported in _imports(name, path)}
        graph.setdefault(source, set()).update(t for t in targets if t is not None and t != source)
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, as the path around it; None where it has none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_planner_imports_no_strategy_nor_lightning():
    # the plan file (PlacementPlan) and the profiles are the contract: the planner knows no strategy or Trainer
    offenders = []
    for name, path in _modules():
        if name == f"{PACKAGE}.placement" or name.startswith(f"{PACKAGE}.placement."):
            for imported in sorted(_imports(name, path)):
                top = imported.split(".")[0]
                if imported.startswith(f"{PACKAGE}.strategies") or top in ("lightning", "pytorch_lightning"):
                    offenders.append(f"{path.relative_to(ROOT.parent)} imports {imported}")
    assert not offenders, "\n".join(offenders)
    # nor through another subpackage
    reached = _reachable(_subpackage_graph(), f"{PACKAGE}.placement")
    assert f"{PACKAGE}.strategies" not in reached, sorted(reached)


def test_the_subpackages_import_each_other_without_a_cycle():
    graph = _subpackage_graph()
    for (source, target), reason in ALLOWED_CYCLE_EDGES.items():
        assert target in graph.get(source, set()), f"{source} -> {target} is gone: take it off the list ({reason})"
        graph[source].discard(target)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_import_reader_sees_late_and_relative_imports():
    # the checks above are only as good as their reader: an import inside a function is an import all the same
    source = "def late():\n    from ..strategies import LayerOffloadStrategy\n    import lightning.pytorch\n"
    found = _imports_in(source, f"{PACKAGE}.placement")
    assert {f"{PACKAGE}.strategies", f"{PACKAGE}.strategies.LayerOffloadStrategy", "lightning.pytorch"} <= found
    assert _unit(f"{PACKAGE}.strategies.LayerOffloadStrategy", _root_exports()) == f"{PACKAGE}.strategies"
    assert _unit(f"{PACKAGE}.DynamixCallback", _root_exports()) == f"{PACKAGE}.callbacks"


def test_the_module_renamed_to_decisions_still_imports_under_its_old_name_with_a_warning():
    import pytest

    from lightning_dynamix import decisions

    with pytest.warns(DeprecationWarning, match=r"lightning_dynamix\.loop is now lightning_dynamix\.decisions"):
        from lightning_dynamix.loop import DecisionMaker
    assert DecisionMaker is decisions.DecisionMaker
