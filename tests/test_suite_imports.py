"""The suite's own layering: tests share helpers through tests/helpers.py, tests/procs.py,
tests/fakes.py and fixtures in tests/conftest.py, never by importing another test module; the
benchmarks import nothing from tests (their shared harnesses live in benchmarks/)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.procs import REPO


def imported_modules(source: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` statement of ``source`` names."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def wrong_imports(path: Path) -> list[str]:
    """The imports of ``path`` its place forbids."""
    modules = imported_modules(path.read_text())
    if path.parent.name == "benchmarks":
        return sorted(m for m in modules if m == "tests" or m.startswith("tests."))
    return sorted(m for m in modules if m.startswith("tests.test_"))


def test_no_module_imports_a_test_module_and_benchmarks_import_no_tests() -> None:
    paths = [*(REPO / "tests").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    assert len(paths) > 40
    wrong = {str(p.relative_to(REPO)): wrong_imports(p) for p in paths if wrong_imports(p)}
    assert wrong == {}


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    test = tmp_path / "tests" / "test_x.py"
    bench = tmp_path / "benchmarks" / "bench_x.py"
    for path in (test, bench):
        path.parent.mkdir()
        path.write_text(
            "import tests.test_a\nfrom tests.test_b import helper\nfrom tests import procs\n"
            "from tests.helpers import mse\nfrom . import sibling\n"
        )
    assert wrong_imports(test) == ["tests.test_a", "tests.test_b"]
    assert wrong_imports(bench) == ["tests", "tests.helpers", "tests.test_a", "tests.test_b"]
