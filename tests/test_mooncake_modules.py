"""The Mooncake backend's modules depend on each other one way (issue 15, item 7).

Read from the source with ``ast``, without importing Mooncake, so this runs on any
machine. An import under ``if TYPE_CHECKING:`` counts like any other: a type-only import
of its caller is how a module comes to call back into it.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

PACKAGE = "kvconn_mooncake"
SOURCE = Path(__file__).resolve().parents[1] / "backends" / PACKAGE

#: The backend's modules, top first: each may import only modules listed after it, so
#: data flows down and no module calls back into one that imports it.
LAYERS = (
    "__init__",
    "_transfer",  # plans and runs batches; carries out the policy's answers
    "_session",  # owns the client and its life
    "_failover",  # the policy: decisions about keys that failed, as data
    "_memory",  # registered memory, scratch areas, rounds
    "_replicas",  # where copies lie; reading a chosen copy; endpoints that failed
    "_config",
    "_flight",  # slices of calls that move bytes, within the transport's queue
    "_library",
    "_counters",
    "_codes",
)

#: Names of the layers that use the fail-over policy and the replica reader: neither may
#: import them, nor hold or annotate one of their objects, nor name them in a string.
CALLERS = frozenset({"_transfer", "Transfers", "Pending", "_session", "Session"})


def _modules() -> set[str]:
    return {path.stem for path in SOURCE.glob("*.py")}


def _sibling(name: str, modules: set[str]) -> str:
    """The module an imported name of the package lives in (a class: ``__init__``)."""
    return name if name in modules else "__init__"


def _imports(module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((SOURCE / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                package, _, rest = alias.name.partition(".")
                if package == PACKAGE:
                    found.add(rest.split(".")[0] or "__init__")
        elif isinstance(node, ast.ImportFrom):
            path = (node.module or "").split(".")
            if node.level == 0 and path[0] != PACKAGE:
                continue
            inner = path[1:] if node.level == 0 else [p for p in path if p]
            if inner:  # from kvconn_mooncake._x import y / from ._x import y
                found.add(inner[0])
            else:  # from kvconn_mooncake import _x, Name / from . import _x
                found.update(_sibling(alias.name, modules) for alias in node.names)
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, modules) for module in sorted(modules)}


def _names(module: str) -> set[str]:
    """Every name ``module`` uses: imported, read, written, as an attribute, or inside a
    string other than a docstring (``cast("Pending", x)``, a string annotation)."""
    tree = ast.parse((SOURCE / f"{module}.py").read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            names.update(re.findall(r"\w+", node.value))
    return names


def test_the_mooncake_modules_import_each_other_without_a_cycle() -> None:
    graph = _graph()
    assert {"_session", "_failover"} <= graph["_transfer"]  # the parse sees imports
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:  # args[1]: the cycle, each importing the one before
        cycle = " imports ".join(reversed(exc.args[1]))
        raise AssertionError(f"import cycle: {cycle}") from None


def test_each_mooncake_module_imports_only_modules_of_the_layers_below_it() -> None:
    graph = _graph()
    assert set(graph) == set(LAYERS), "a module was added or removed: place it in LAYERS"
    upward = {
        f"{module} imports {other}"
        for module, imported in graph.items()
        for other in imported
        if LAYERS.index(other) <= LAYERS.index(module)
    }
    assert not upward


def test_the_failover_policy_and_the_replica_reader_never_name_the_layers_that_use_them() -> None:
    assert "ReadStatus" in _names("_failover")  # the scan sees names
    for module in ("_failover", "_replicas"):
        assert not _names(module) & CALLERS, module
    assert not _names("_replicas") & {"_failover", "Reroute", "Verdict"}
