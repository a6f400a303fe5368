"""No import circles inside cpcompile (issue 51).

The import graph of every module in `cpcompile/` is read with `ast` (nothing is imported): imports
inside functions count, `if TYPE_CHECKING:` blocks do not; relative imports are resolved; and
`from pkg import name` imports the submodule `pkg.name` when there is one, else `pkg` itself.
A parent package is not an edge of its submodules (importing `a.b` runs `a/__init__.py`, but
every module would then reach the package's front door, and no circle would say anything).
Any strongly connected component of more than one module is a circle, and the test names it.

Run as a script, it prints the number of such components:
    python tests/test_no_import_circles.py
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "cpcompile"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its `__init__.py`)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Import statements anywhere in the tree, except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that `module` imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
            continue
        target = _resolve_from(module, is_package, node)
        for alias in node.names:
            submodule = f"{target}.{alias.name}"
            if submodule in modules:
                found.add(submodule)
            elif target in modules:
                found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, to name in the failure."""
    members, start = set(component), component[0]
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for succ in sorted(graph[path[-1]] & members):
            if succ == start:
                return path + [start]
            if succ not in seen:
                seen.add(succ)
                paths.append(path + [succ])
    return component


def test_graph_sees_the_package():
    graph = import_graph()
    assert "cpcompile.pipeline" in graph["cpcompile"]
    assert "cpcompile.methods.registry" in graph["cpcompile.methods"]


def test_no_import_circles():
    graph = import_graph()
    found = circles(graph)
    described = [f"{len(c)} modules, e.g. " + " -> ".join(_one_cycle(graph, c)) for c in found]
    assert not found, "import circles in cpcompile:\n" + "\n".join(described)


if __name__ == "__main__":
    graph = import_graph()
    found = circles(graph)
    print(f"{len(graph)} modules, {len(found)} circles (strongly connected components of more than one module)")
    for component in found:
        print(f"  {len(component)}: " + " -> ".join(_one_cycle(graph, component)))
