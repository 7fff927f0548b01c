"""No function of the product is longer than 80 lines, counted from its `def` line to its last line.

Exempt are kernels and data tables. A kernel (a Triton `@triton.jit` function, the kernels' folder, the GPU
benchmarks that time them) is written as one long body on purpose: the compiler sees one function, and
splitting it costs launches or registers. A data table (a function that only returns one literal) is long
because the data is, not the logic.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("runtime", "operator", "gateway", "kvfleet", "contract", "e2e", "bench", "images")
KERNEL_FOLDERS = ("runtime/kernels/", "bench/gpu/")
KERNEL_DECORATORS = {"triton.jit", "triton.autotune", "triton.heuristics"}
MAX_LINES = 80


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _is_kernel(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(_dotted(decorator) in KERNEL_DECORATORS for decorator in function.decorator_list)


def _is_data_table(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    literals = (ast.Dict, ast.List, ast.Tuple, ast.Set)
    return len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, literals)


def _functions(
    tree: ast.AST, scope: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{scope}{node.name}", node
            yield from _functions(node, f"{scope}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{scope}{node.name}.")
        else:
            yield from _functions(node, scope)


def too_long(source: str, where: str) -> list[str]:
    """'where:line name (N lines)' for each function of source over MAX_LINES that is not exempt."""
    if where.startswith(KERNEL_FOLDERS):
        return []
    found = []
    for name, function in _functions(ast.parse(source, where)):
        assert function.end_lineno is not None
        lines = function.end_lineno - function.lineno + 1
        if lines > MAX_LINES and not _is_kernel(function) and not _is_data_table(function):
            found.append(f"{where}:{function.lineno} {name} ({lines} lines)")
    return found


@pytest.mark.parametrize("folder", [folder for folder in PRODUCT if (ROOT / folder).is_dir()])
def test_no_function_is_longer_than_80_lines(folder: str) -> None:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        found += too_long(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, f"functions over {MAX_LINES} lines:\n" + "\n".join(found)


def _function(name: str, body_lines: int, decorator: str = "") -> str:
    """A function of body_lines + 1 lines (its def line and body_lines statements), after its decorator."""
    lines = [decorator] if decorator else []
    lines += [f"def {name}():", *["    x = 1"] * body_lines]
    return "\n".join(lines) + "\n"


def test_the_count_runs_from_the_def_line_to_the_last_line() -> None:
    source = _function("fits", MAX_LINES - 1) + _function("over", MAX_LINES)
    found = too_long(source, "runtime/example.py")
    assert found == [f"runtime/example.py:{MAX_LINES + 1} over ({MAX_LINES + 1} lines)"]


def test_methods_and_nested_functions_are_named_by_their_scope() -> None:
    method = textwrap.indent(_function("step", MAX_LINES), "    ")
    inner = textwrap.indent(_function("inner", MAX_LINES), "    ")
    source = f"class Engine:\n{method}\ndef outer():\n{inner}"
    names = [entry.split(" ")[1] for entry in too_long(source, "runtime/example.py")]
    assert names == ["Engine.step", "outer", "outer.inner"]


def test_kernels_and_data_tables_are_exempt() -> None:
    long = _function("kernel", MAX_LINES)
    assert too_long(long, "runtime/kernels/example.py") == []
    assert too_long(long, "bench/gpu/example.py") == []
    assert too_long(_function("kernel", MAX_LINES, decorator="@triton.jit"), "runtime/attention/x.py") == []
    table = "def table():\n    return [\n" + "        1,\n" * MAX_LINES + "    ]\n"
    assert too_long(table, "operator/example.py") == []
    # The same length of logic ending in a return is not a table.
    logic = "def table():\n" + "    x = 1\n" * MAX_LINES + "    return [x]\n"
    assert len(too_long(logic, "operator/example.py")) == 1
