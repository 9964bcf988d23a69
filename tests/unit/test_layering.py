"""The import structure: shared/ imports neither process's code, the runner and the supervisor
never import each other, no folder of supervisor/ imports a folder above it, and no modules
import each other in a circle (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Higher may import lower, never the reverse. The CLI and the benchmark are entry points.
SUPERVISOR_RANKS = {"cli": 8, "bench": 7, "app": 7, "server_files": 7, "dashboard": 6,
                    "api": 5, "inference": 4, "runners": 3, "store": 2, "metrics": 1,
                    "version": 1}


def module_name(path: Path) -> str:
    name = "mlxr." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for folder in ("shared", "runner", "supervisor"):
        for path in (ROOT / folder).rglob("*.py"):
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
            graph[module_name(path)] = found
    return {m: {i for i in found if i in graph} for m, found in graph.items()}


def test_shared_runner_and_supervisor_keep_to_their_side():
    for module, targets in imports().items():
        side = module.split(".")[1]
        for target in targets:
            other = target.split(".")[1]
            assert other == side or other == "shared", f"{module} imports {target}"


def test_no_supervisor_folder_imports_a_folder_above_it():
    for module, targets in imports().items():
        parts = module.split(".")
        if parts[1] != "supervisor" or len(parts) < 3:
            continue
        for target in targets:
            theirs = target.split(".")
            if theirs[1] != "supervisor" or len(theirs) < 3 or theirs[2] == parts[2]:
                continue
            assert SUPERVISOR_RANKS[parts[2]] > SUPERVISOR_RANKS[theirs[2]], \
                f"{module} imports {target}, a folder above it"


def test_no_import_cycles():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
