"""The package's functions stay short enough to read in one screen (issue 12), and the server's,
the store's and the trainer's classes small enough to hold one concern each.

A function of ``paramserver/`` longer than ``MAX_FUNCTION_LINES`` lines (its ``def`` line to its
last line, docstring included) fails unless a ``# Long: <reason>`` comment, on its ``def`` line
or in the comment block just above it (or above its decorators), says why: a reason is for code
that is genuinely one flat list (an argparse table, a summary's dict literal), not for a
function that does several things. Complexity is ruff's job (``C90`` in ``pyproject.toml``,
``max-complexity = 12``); a ``# noqa: C901`` there must give its reason too, after ``--``.

A class of ``paramserver/server/``, ``paramserver/store/`` or ``paramserver/trainer/`` longer
than ``MAX_CLASS_LINES`` (its ``class`` line to its last line) fails, without exception: a
longer one holds several concerns, each of which can be a class of its own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paramserver"
MAX_FUNCTION_LINES = 50
MAX_CLASS_LINES = 300
CLASS_LIMITED_FOLDERS = ("server", "store", "trainer")  # of paramserver/
_REASON = re.compile(r"#\s*Long:\s*\S.{9,}")  # a reason of ten characters or more
_NOQA_C901 = re.compile(r"#\s*noqa:[^#]*\bC901\b")
_NOQA_REASON = re.compile(r"#\s*noqa:[^#]*\bC901\b[^#]*?\s--\s*\S")


def long_functions(source: str, max_lines: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, line of ``def``, length in lines) of each function in ``source`` longer
    than ``max_lines`` that no ``# Long:`` comment explains."""
    lines = source.splitlines()
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > max_lines and not _has_reason(lines, child):
                    found.append((name, child.lineno, length))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def long_classes(source: str, max_lines: int = MAX_CLASS_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, line of ``class``, length in lines) of each class in ``source``
    longer than ``max_lines``, nested ones included."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > max_lines:
                    found.append((name, child.lineno, length))
                name += "."
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}."
            visit(child, name)

    visit(ast.parse(source), "")
    return found


def _has_reason(lines: list[str], function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the ``def`` line, or the comment block just above the function (and its
    decorators), holds a ``# Long:`` reason."""
    if _REASON.search(lines[function.lineno - 1]):
        return True
    first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
    above = first - 2  # 0-based index of the line above
    while above >= 0 and lines[above].lstrip().startswith("#"):
        if _REASON.search(lines[above]):
            return True
        above -= 1
    return False


def unexplained_noqa_c901(source: str) -> list[int]:
    """Lines of ``source`` that silence ruff's complexity check without a reason after ``--``."""
    return [
        number
        for number, line in enumerate(source.splitlines(), start=1)
        if _NOQA_C901.search(line) and not _NOQA_REASON.search(line)
    ]


def _package_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no Python files under {PACKAGE}"
    return files


def test_no_function_of_the_package_is_longer_than_the_limit_without_a_reason() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({length} lines)"
        for path in _package_files()
        for name, line, length in long_functions(path.read_text())
    ]
    assert not offenders, (
        f"{len(offenders)} function(s) longer than {MAX_FUNCTION_LINES} lines: split each into "
        "named steps, or say why it is one flat list in a '# Long: <reason>' comment above it:\n  "
        + "\n  ".join(offenders)
    )


def test_no_class_of_the_server_or_the_store_is_longer_than_the_limit() -> None:
    folders = {path: path.relative_to(PACKAGE).parts[0] for path in _package_files()}
    files = [path for path, folder in folders.items() if folder in CLASS_LIMITED_FOLDERS]
    assert {folders[path] for path in files} == set(CLASS_LIMITED_FOLDERS)
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({length} lines)"
        for path in files
        for name, line, length in long_classes(path.read_text())
    ]
    assert not offenders, (
        f"{len(offenders)} class(es) longer than {MAX_CLASS_LINES} lines: give each of its "
        "concerns a class of its own:\n  " + "\n  ".join(offenders)
    )


def test_every_silenced_complexity_check_gives_its_reason() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in _package_files()
        for line in unexplained_noqa_c901(path.read_text())
    ]
    assert not offenders, "'# noqa: C901' without '-- <reason>' at:\n  " + "\n  ".join(offenders)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}() -> None:\n{body}"


def test_the_length_check_flags_long_functions_and_methods_and_accepts_a_reason() -> None:
    short = _function("short", MAX_FUNCTION_LINES - 1)  # exactly the limit, def line included
    long = _function("long", MAX_FUNCTION_LINES)
    method = "class Box:\n    @staticmethod\n" + _function("method", 60, indent="    ")
    nested = "def outer() -> None:\n" + _function("inner", 55, indent="    ")
    found = long_functions("\n".join([short, long, method, nested]))
    assert [(name, length) for name, _, length in found] == [
        ("long", MAX_FUNCTION_LINES + 1),
        ("Box.method", 61),
        ("outer", 57),
        ("outer.inner", 56),
    ]

    explained = [
        "# Long: one add_argument per flag, a flat table\n" + long,
        "# Long: one add_argument per flag, a flat table\n# (more on it)\n" + long,
        long.replace("-> None:", "-> None:  # Long: a summary's dict literal, key by key", 1),
        "class Box:\n    # Long: a flat table of options, one per line\n    @staticmethod\n"
        + _function("method", 60, indent="    "),
    ]
    for source in explained:
        assert long_functions(source) == [], source
    unexplained = [
        "# Long:\n" + long,  # no reason given
        "# Long: a reason\n\n" + long,  # not just above it
        "x = 1  # Long: a reason for something else\n" + long,
    ]
    for source in unexplained:
        assert [name for name, _, _ in long_functions(source)] == ["long"], source


def test_the_class_check_measures_classes_and_nested_classes() -> None:
    def body(lines: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))

    short = "class Short:\n" + body(MAX_CLASS_LINES - 1, "    ")  # exactly the limit
    long = "class Long:\n" + body(MAX_CLASS_LINES, "    ")
    nested = "def make() -> None:\n    class Inner:\n" + body(MAX_CLASS_LINES + 4, "        ")
    found = long_classes("\n".join([short, long, nested]))
    assert [(name, length) for name, _, length in found] == [
        ("Long", MAX_CLASS_LINES + 1),
        ("make.Inner", MAX_CLASS_LINES + 5),
    ]


def test_the_noqa_check_wants_a_reason() -> None:
    source = (
        "def a():  # noqa: C901\n"
        "    pass\n"
        "def b():  # noqa: C901 -- one branch per message type, flat\n"
        "    pass\n"
        "def c():  # noqa: E501, C901\n"
        "    pass\n"
    )
    assert unexplained_noqa_c901(source) == [1, 5]
