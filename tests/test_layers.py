"""The package's floors: each module imports only modules on its own floor or below, the three
components (dispatcher, worker, client) never import each other, and no import cycle exists.

An AST walk (every import, including those inside functions) instead of import-linter: a few
lines, no extra dependency, and the failure message names the file, line and rule. Imports under
`if TYPE_CHECKING:` are left out: they never run, so they cannot form a cycle at import time.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torch_dataservice"

# Floor of each top-level piece (a module or a sub-package); higher floors may import lower ones.
FLOORS = {
    "errors": 0, "config": 0, "auth": 0, "rpc": 0, "serving": 0, "proto": 0, "version": 0,
    "fork_gate": 0, "peers": 0,
    "policies": 1, "wire": 1, "pipeline": 1, "observability": 1,
    "dispatcher": 2, "worker": 2, "client": 2,
    "torch": 3,
    "__init__": 4, "cli": 4, "__main__": 4,
}
COMPONENTS = {"dispatcher", "worker", "client"}
# The only place below the face that may start servers: the embedded service of tds.DataLoader.
EXCEPTIONS = {("torch.embedded", "dispatcher"), ("torch.embedded", "worker")}
# Cycles still to break (each entry is an import edge to ignore); the list only shrinks.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _runtime_nodes(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n[len("torch_dataservice."):]) for n in names
                  if n.startswith("torch_dataservice.")]
    return found


def _graph() -> dict[str, list[tuple[int, str]]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "proto" not in p.parts}
    graph = {}
    for name, path in modules.items():
        targets = [(line, t) for line, t in _imports(path) if t in modules]
        graph[name] = targets
    return graph


def _top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.timeout(30)
def test_every_top_level_piece_has_a_floor() -> None:
    tops = {_top(m) for m in _graph()} | {_top(_module_name(p)) for p in PACKAGE.glob("*.py")}
    assert not tops - set(FLOORS), f"give these a floor in FLOORS: {sorted(tops - set(FLOORS))}"


@pytest.mark.timeout(30)
def test_no_import_points_up_a_floor_or_across_components() -> None:
    wrong = []
    for module, targets in _graph().items():
        src = _top(module)
        for line, target in targets:
            dst = _top(target)
            if src == dst or (module, dst) in EXCEPTIONS:
                continue
            if FLOORS[dst] > FLOORS[src]:
                wrong.append(f"{module}:{line} imports {target} (floor {FLOORS[dst]} above "
                             f"{FLOORS[src]})")
            elif src in COMPONENTS and dst in COMPONENTS:
                wrong.append(f"{module}:{line} imports {target} (components are peers)")
            elif src == "torch" and dst in COMPONENTS - {"client"}:
                wrong.append(f"{module}:{line} imports {target} (torch/ reads through client/)")
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(30)
def test_no_import_cycle() -> None:
    graph = {m: {t for _, t in targets if (m, t) not in KNOWN_CYCLE_EDGES}
             for m, targets in _graph().items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
