"""The architecture as written down matches the code.

The README lists exactly the operations a server registers and names every module of the
package in its file map; ARCHITECTURE.md gives the layers the build enforces (the import-linter
contract in pyproject.toml, run by ``make lint``) and names only files, classes and functions
that exist. So renaming a module, a function or an operation without the documents fails here.
No module of the package imports itself through others, not even for type checking only: the
layers say which package may import which, this says the same of modules within one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import grimp
import pytest

from paramserver.transport.operations import OPERATIONS
from tests.procs import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE = REPO / "paramserver"
README = (REPO / "README.md").read_text()
ARCHITECTURE = (REPO / "ARCHITECTURE.md").read_text()


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def first_code_block(text: str) -> str:
    start = text.index("```\n") + len("```\n")
    return text[start : text.index("```", start)]


def modules_in_file_map(block: str) -> set[str]:
    """The module paths a file map names. A line indented by two spaces starts an entry: a
    folder (``server/``) whose modules follow, on it and on the lines indented further, or
    top-level modules (``protocol.py``)."""
    folder = ""
    named = set()
    for line in block.splitlines()[1:]:  # the first is the package itself
        if len(line) - len(line.lstrip(" ")) <= 2:
            first = line.split()[0]
            folder = first if first.endswith("/") else ""
        named.update(folder + name for name in re.findall(r"\b\w+\.py\b", line))
    return named


def test_readme_lists_exactly_the_operations_a_server_registers() -> None:
    trust = section(README, "Trust model")
    listing = trust[trust.index("registered operations") : trust.index("anything else is refused")]
    listed = [name for name in re.findall(r"`(\w+)`", listing) if name != "OPERATIONS"]
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    assert set(listed) == set(OPERATIONS), (
        f"missing from the README: {sorted(set(OPERATIONS) - set(listed))}; "
        f"not registered: {sorted(set(listed) - set(OPERATIONS))}"
    )


def test_readme_file_map_names_every_module_of_the_package() -> None:
    mapped = modules_in_file_map(first_code_block(section(README, "How it works")))
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert mapped == modules, (
        f"missing from the file map: {sorted(modules - mapped)}; "
        f"no such module: {sorted(mapped - modules)}"
    )


def test_the_file_map_parser_reads_folders_and_top_level_modules() -> None:
    block = (
        "paramserver/\n"
        "  server/      shard.py (values), tables.py,\n"
        "               optim.py (update rules)\n"
        "  protocol.py  messages    compression.py  codecs\n"
        "  trainer/     loop.py (the step)\n"
    )
    assert modules_in_file_map(block) == {
        "server/shard.py",
        "server/tables.py",
        "server/optim.py",
        "protocol.py",
        "compression.py",
        "trainer/loop.py",
    }


def test_architecture_gives_the_layers_the_build_enforces() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    enforced = next(c for c in contracts["contracts"] if c["type"] == "layers")["layers"]
    block = first_code_block(section(ARCHITECTURE, "Layers"))
    written = [re.split(r"\s{2,}", line)[0] for line in block.splitlines() if line[:1] != " "]
    assert written == enforced


@cache
def defined_names() -> tuple[set[str], dict[str, set[str]]]:
    """Top-level names of every module of the package, and each class's members."""
    top: set[str] = set()
    classes: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                top.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                top.update(t.id for t in targets if isinstance(t, ast.Name))
    return top, classes


CALL = re.compile(r"(\w+)(?:\.(\w+))?\(\)")  # `function()`, `method()`, `Class.method()`
NAME = re.compile(r"([A-Z][a-z0-9]\w*|[A-Z][A-Z0-9_]+)(?:\.(\w+))?")  # `Class`, `CONSTANT`


def unknown_references(text: str) -> list[str]:
    """The code names in backticks and the ``.py`` paths of ``text`` that name nothing."""
    top, classes = defined_names()
    methods = set().union(*classes.values())
    unknown = []
    for token in re.findall(r"`([^`\n]+)`", text):
        if call := CALL.fullmatch(token):
            owner, member = call.groups()
            if member is not None:
                exists = member in classes.get(owner, ())
            else:
                exists = owner in top or owner in methods
        elif name := NAME.fullmatch(token):
            owner, member = name.groups()
            if member is not None:
                exists = member in classes.get(owner, ())
            else:
                exists = owner in classes or owner in top
        else:
            continue  # a flag, a mode, an expression: not a reference
        if not exists:
            unknown.append(token)
    for path in re.findall(r"(?<![\w/.])(?:\w+/)*\w+\.py\b", text):
        if not (PACKAGE / path).is_file() and not (REPO / path).is_file():
            unknown.append(path)
    return unknown


def test_architecture_names_only_modules_classes_and_functions_that_exist() -> None:
    assert unknown_references(ARCHITECTURE) == []


@pytest.mark.parametrize(
    "stale",
    [
        "`Coordinator.no_such_step()`",
        "`no_such_function()`",
        "`NoSuchClass`",
        "`ServerShard.no_such_member`",
        "server/no_such_module.py",
    ],
)
def test_a_stale_reference_is_caught(stale: str) -> None:
    assert unknown_references(f"See {stale} and `Coordinator.push_pull()`.") == [stale.strip("`")]


def import_circles(graph: grimp.ImportGraph) -> set[frozenset[str]]:
    """The circles among ``graph``'s modules: each set of modules that reach one another by
    imports. Every import counts, those under ``TYPE_CHECKING`` and inside functions too."""
    circles = set()
    for module in graph.modules:
        around = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if around:
            circles.add(frozenset({module, *around}))
    return circles


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    graph = grimp.build_graph("paramserver", cache_dir=None)
    assert len(graph.modules) > 100
    assert sorted(sorted(circle) for circle in import_circles(graph)) == []


def test_the_circle_check_sees_imports_for_type_checking_and_inside_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "circled"
    package.mkdir()
    modules = {
        "__init__": "",
        "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circled.b import B\n",
        "b": "def f():\n    from circled import c\n",
        "c": "import circled.a\n",
        "d": "import circled.a\n",  # imports from a circle without being in it
    }
    for name, source in modules.items():
        (package / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("circled", cache_dir=None)
    assert import_circles(graph) == {frozenset({"circled.a", "circled.b", "circled.c"})}


@pytest.mark.system
def test_importing_the_package_loads_no_role_transport_or_launcher() -> None:
    script = "import sys, paramserver; print(*(m for m in sys.modules if 'paramserver' in m))"
    loaded = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=REPO,
    ).stdout.split()
    assert "paramserver.api" in loaded
    roles = {"paramserver.server", "paramserver.trainer", "paramserver.transport"}
    roles.add("paramserver.launch")
    assert [m for m in loaded if ".".join(m.split(".")[:2]) in roles] == []
