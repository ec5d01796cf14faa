"""Docstrings are reference and speak of the code, not of a machine: read from the package's source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dynamix"
MODULE_LINES = 25  # a module says what it is for; the rest is docs/internals.md's
PROSE_LINES = 20  # a class's or function's text before its Args, Returns, Raises...
SECTION = re.compile(r"^\s*(Args|Arguments|Attributes|Returns|Yields|Raises|Examples?):\s*$")
MACHINE = re.compile(r"\b\d+-core\b|\bVM\b|\bH100\b|\bH200\b|\bXeon\b|this project's machines?")


def _docstrings(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))]
    return [(n, doc) for n in nodes if (doc := ast.get_docstring(n, clean=True))]  # type: ignore[arg-type]


def too_long(source: str) -> list[str]:
    """The docstrings of ``source`` over the house's lengths, as ``name: lines``."""
    found = []
    for node, doc in _docstrings(ast.parse(source)):
        lines = doc.splitlines()
        if isinstance(node, ast.Module):
            if len(lines) > MODULE_LINES:
                found.append(f"module docstring: {len(lines)} lines")
            continue
        prose = next((i for i, line in enumerate(lines) if SECTION.match(line)), len(lines))
        if prose > PROSE_LINES:
            found.append(f"{node.name}: {prose} lines before its arguments")  # type: ignore[attr-defined]
    return found


def test_docstrings_are_a_summary_arguments_and_what_they_raise():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        offenders += [f"{path.relative_to(PACKAGE.parent)}: {row}" for row in too_long(path.read_text())]
    assert not offenders, "move the explanation to docs/internals.md:\n" + "\n".join(offenders)


def test_the_code_names_no_machine_it_was_measured_on():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if MACHINE.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "a machine's facts belong in docs (docs/internals.md, docs/benchmarks/):\n" + "\n".join(
        offenders
    )


def test_the_checks_see_a_long_docstring_and_a_machine():
    long_module = '"""' + "line\n" * (MODULE_LINES + 1) + '"""\n'
    assert too_long(long_module) == [f"module docstring: {MODULE_LINES + 1} lines"]
    function = 'def f():\n    """' + "why\n    " * (PROSE_LINES + 1) + 'Args:\n        x: y\n    """\n'
    assert too_long(function) == [f"f: {PROSE_LINES + 1} lines before its arguments"]
    assert too_long('def f():\n    """Short.\n\n    Args:\n        x: ' + "y\n        " * 40 + '"""\n') == []
    assert MACHINE.search("measured on the 2-core VM")
    assert not MACHINE.search("a machine with few cores")
