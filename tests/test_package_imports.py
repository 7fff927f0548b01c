"""The packages' import graph: no cycle between packages, and the contract depends on none of them.

Read from the sources with `ast`, so every import counts wherever it is written (module level, inside a
function, under a `try:`): a function-level import still ties the two packages together, only later.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> the folder it is installed from
FOLDERS = {
    name: ROOT / folder
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}
# The runtime is several packages in one folder: each subpackage or top-level module of it is one node.
SPLIT = {"kvfleet.runtime"}
CONTRACT = "kvfleet.contract"


def _modules() -> dict[str, Path]:
    """Every module's dotted name -> its source file."""
    modules: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def package_of(module: str) -> str | None:
    """The node of the package graph a module belongs to; None outside the project."""
    for package in sorted(FOLDERS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            if package in SPLIT and module != package:
                return ".".join(module.split(".")[: package.count(".") + 2])
            return package
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """The modules a source imports, with the line of each import.

    Imports under `if TYPE_CHECKING:` are left out: they are never executed, exist only for annotations
    (which `from __future__ import annotations` keeps as strings), and so bind no package to another at
    run time; counting them would forbid a layer from naming in a hint the type a higher layer passes in.
    """
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                # `from package import module` imports the submodule.
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in MODULES else source), node.lineno
        stack.extend(ast.iter_child_nodes(node))


def package_graph() -> dict[str, dict[str, list[str]]]:
    """Package -> the packages it imports -> where (`path:line`)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in sorted(MODULES.items()):
        source_package = package_of(module)
        assert source_package is not None
        graph.setdefault(source_package, {})
        tree = ast.parse(path.read_text(), str(path))
        for imported, line in _imports(tree, module, path.name == "__init__.py"):
            target = package_of(imported)
            if target is not None and target != source_package:
                where = f"{path.relative_to(ROOT)}:{line}"
                graph[source_package].setdefault(target, []).append(where)
    return graph


def find_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def _describe(component: list[str], graph: dict[str, dict[str, list[str]]]) -> str:
    members = set(component)
    edges = [
        f"  {source} -> {target} ({', '.join(graph[source][target][:3])})"
        for source in component
        for target in sorted(graph[source])
        if target in members
    ]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph = package_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between packages:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_the_contract_imports_no_other_package_of_the_project() -> None:
    imported = package_graph()[CONTRACT]
    assert not imported, f"{CONTRACT} imports {imported}"


def test_the_contract_needs_only_the_standard_library() -> None:
    third_party = set()
    for module, path in MODULES.items():
        if package_of(module) == CONTRACT:
            tree = ast.parse(path.read_text(), str(path))
            for imported, line in _imports(tree, module, path.name == "__init__.py"):
                top = imported.split(".")[0]
                if top not in sys.stdlib_module_names and top != "kvfleet":
                    third_party.add(f"{imported} ({path.relative_to(ROOT)}:{line})")
    assert not third_party, f"{CONTRACT} imports beyond the standard library: {sorted(third_party)}"


def test_the_cycle_finder_finds_a_cycle_and_names_its_members() -> None:
    graph = {"a": {"b": ["x:1"]}, "b": {"c": ["x:2"]}, "c": {"a": ["x:3"]}, "d": {"a": ["x:4"]}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b": []}, "b": {}}) == []


def test_every_module_maps_to_a_package_node() -> None:
    assert package_of("kvfleet.runtime.core.scheduler") == "kvfleet.runtime.core"
    assert package_of("kvfleet.runtime.metrics") == "kvfleet.runtime.metrics"
    assert package_of("kvfleet.gateway.flow") == "kvfleet.gateway"
    assert package_of("torch.nn") is None
    assert "kvfleet.runtime.core.scheduler" in MODULES and "kvfleet.cli" in MODULES
