"""The package map of docs/architecture.md, enforced: imports point one way only
(``cli`` → ``node`` / ``controller`` → ``ops`` → ``core``), and no two modules import each
other at import time.

Every ``import`` in the source counts — inside functions and ``TYPE_CHECKING`` blocks too — for
the direction rules: a lazy import is still a dependency. Only module-level imports outside
``TYPE_CHECKING`` count for cycles, since only those run when a module is first imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import REPO

# package prefix -> the prefixes it may import (besides itself and the standard library)
ALLOWED: dict[str, tuple[str, ...]] = {
    "agent.core.aio": (),
    "agent.core.telemetry": (),
    # bounded YAML loading and brief values, shared with the discovery handlers
    "agent.core.bounded_yaml": (),
    "agent.core.model": ("agent.core.bounded_yaml",),
    "agent.core.kube": ("agent.core.telemetry", "agent.core.bounded_yaml"),
    "agent.core": ("agent.core", "agent.protos"),
    "agent.ops": ("agent.core",),
    "agent.node": ("agent.core", "agent.ops", "agent.protos", "agent.node", "discovery_handlers"),
    # the controller asks the embedded handlers which Configurations any agent can run, as
    # the agents do, to decide who holds a name (agent/core/name_claims.py) like them
    "agent.controller": ("agent.core", "agent.ops", "agent.controller", "discovery_handlers"),
    "agent.protos": ("agent.protos",),
    # agent/__init__.py and the ``akri`` command (agent/cli.py) wire everything together
    "agent": ("agent", "discovery_handlers"),
    # the debugEcho handler borrows the agent's inotify kit when it runs inside the agent;
    # every handler loads discoveryDetails with the core's bounded YAML loading
    "discovery_handlers": ("discovery_handlers", "agent.core.aio", "agent.core.bounded_yaml"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> Iterator[tuple[str, Path]]:
    for top in ("agent", "discovery_handlers"):
        for path in sorted((REPO / top).rglob("*.py")):
            if "_pb2" not in path.name:
                yield module_name(path), path


def rule_for(module: str) -> tuple[str, tuple[str, ...]]:
    """The most specific ALLOWED entry for ``module``."""
    matches = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no package of the map (tests/core/test_layout.py)")
    prefix = max(matches, key=len)
    return prefix, ALLOWED[prefix]


def imports_of(module: str, path: Path) -> Iterator[tuple[str, bool]]:
    """(imported module, at import time) for every import of ours in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checking.update(id(child) for child in ast.walk(node))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # "from agent.core import telemetry" imports agent.core.telemetry
            names = [f"{base}.{alias.name}" for alias in node.names]
        eager = id(node) in top_level and id(node) not in type_checking
        for name in names:
            if name.split(".")[0] in ("agent", "discovery_handlers"):
                yield name, eager


def resolve(name: str, known: set[str]) -> str | None:
    """The module of ours that ``name`` names (``pkg.attr`` → ``pkg``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def violations(modules: dict[str, Path]) -> list[str]:
    """Every import of ``modules`` against the map, as readable lines."""
    known = set(modules)
    wrong: list[str] = []
    for module, path in modules.items():
        own, allowed = rule_for(module)
        for name, _ in imports_of(module, path):
            target = resolve(name, known)
            if target is None or target == "agent":
                continue
            if target == own or target.startswith(own + "."):
                continue
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} imports {target} ({own} may import {allowed or 'none'})")
    return sorted(set(wrong))


def test_imports_follow_the_package_map() -> None:
    wrong = violations(dict(source_modules()))
    assert not wrong, "\n".join(wrong)


def import_graph(*, lazy: bool) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (at import time only unless ``lazy``)."""
    modules = dict(source_modules())
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, eager in imports_of(module, path):
            target = resolve(name, known)
            # a package's own __init__ importing its children is not a cycle worth naming
            inside = target is not None and (target == module or module.startswith(target + "."))
            if (eager or lazy) and target and not inside:
                graph[module].add(target)
    return graph


def test_no_import_cycles_at_import_time() -> None:
    cycles = strongly_connected(import_graph(lazy=False))
    assert not cycles, "\n".join(" -> ".join(sorted(c)) for c in cycles)


def test_no_import_cycles_even_lazily() -> None:
    """A lazy import still ties two modules together: neither can be read, tested or moved
    without the other (issue 39.6: ``cli`` and ``launch`` imported each other)."""
    cycles = strongly_connected(import_graph(lazy=True))
    assert not cycles, "\n".join(" -> ".join(sorted(c)) for c in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm; the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_layout_check_catches_a_wrong_import(tmp_path: Path) -> None:
    """The checker itself: a core module importing the node agent (even lazily) and ops
    importing the controller are reported; core importing core is not."""
    files = {
        "agent.core.store.bad": "def f():\n    from agent.node.app import Agent\n",
        "agent.ops.worse": "import agent.controller.leader\n",
        "agent.core.store.good": "from agent.core.model import naming\n",
        "agent.node.app": "",
        "agent.controller.leader": "",
        "agent.core.model.naming": "",
    }
    modules = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        modules[name] = path
    found = violations(modules)
    assert [line.split(" (")[0] for line in found] == [
        "agent.core.store.bad imports agent.node.app",
        "agent.ops.worse imports agent.controller.leader",
    ]
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


@pytest.mark.parametrize("package", ["agent/core", "agent/node", "agent/ops", "agent/controller"])
def test_every_package_says_its_job(package: str) -> None:
    init = REPO / package / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def architecture_rows() -> list[str]:
    """The first cell of each row of docs/architecture.md's package table, in order."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("## Where things are", 1)[1].split("\n\n| package |", 1)[1]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def row_paths(cell: str) -> list[str]:
    """``agent/node/app.py``, ``settings.py`` -> both paths, the second in the first's folder."""
    names = [name.strip().strip("`") for name in cell.split(",")]
    folder = names[0].rpartition("/")[0]
    return [names[0], *(n if "/" in n else f"{folder}/{n}" for n in names[1:])]


def parent_row(index: int, rows: list[list[str]]) -> int | None:
    """The row of the nearest package folder that holds row ``index``'s first path."""
    path = rows[index][0]
    best: tuple[int, int] | None = None
    for other, paths in enumerate(rows):
        for candidate in paths:
            holds = other != index and candidate.endswith("/") and path.startswith(candidate)
            if holds and (best is None or len(candidate) > best[0]):
                best = (len(candidate), other)
    return None if best is None else best[1]


def misplaced_rows(cells: list[str]) -> list[str]:
    """Rows that do not follow their package's row (directly, or after its other rows)."""
    rows = [row_paths(cell) for cell in cells]
    wrong = []
    for index, paths in enumerate(rows):
        parent = parent_row(index, rows)
        if parent is None:
            continue
        between = range(parent + 1, index)
        inside = all(
            rows[i][0].startswith(rows[parent][0]) or parent_row(i, rows) == parent for i in between
        )
        if parent > index or not inside:
            wrong.append(f"{paths[0]} is not beside {rows[parent][0]}")
    return wrong


def test_the_architecture_table_puts_every_file_beside_its_package() -> None:
    """Issue 34.17: rows added for split-out files sat after ``deploy/``."""
    assert misplaced_rows(architecture_rows()) == []


def test_the_row_placement_check_can_fail() -> None:
    cells = ["`agent/core/`", "`agent/core/store/`", "`deploy/`", "`agent/core/store/x.py`"]
    assert misplaced_rows(cells) == ["agent/core/store/x.py is not beside agent/core/store/"]
    assert misplaced_rows(cells[:2] + cells[3:] + cells[2:3]) == []


def test_every_package_of_the_map_is_in_the_architecture_table() -> None:
    """Each entry of ALLOWED has a row (the map is documented where people read it)."""
    documented = {
        path.removesuffix("/").removesuffix(".py").replace("/", ".")
        for cell in architecture_rows()
        for path in row_paths(cell)
    }
    missing = [prefix for prefix in ALLOWED if prefix not in documented and prefix != "agent"]
    assert missing == []
