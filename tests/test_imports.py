"""Import hygiene: the pure-Python layers load without torch, no module of pagoda takes part in an
import circle, and the engine's packages import each other in one direction only.

The circle rule (``module_graph``): a module imports another when it names it in an ``import``
or ``from ... import`` statement anywhere in the file, at module level **or inside a function**;
an import put in a function to dodge a circle only postpones it until the call, so it counts.
Imports under ``if TYPE_CHECKING:`` are annotations, never executed, and do not count.
``from package import name`` is an import of the submodule ``package.name`` when there is one,
else of the package. Importing ``package.sub`` is not counted as importing ``package`` as well:
a package file importing its own submodules is the ordinary way to build a package. Imports by
name at run time (``importlib.import_module("...")``, the CLI's bench table) are not seen.
``ALLOWED_CIRCLES`` lists the circles being closed elsewhere; an entry that is no longer a circle
fails the test as well, so the list cannot go stale.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pagoda

PACKAGE_ROOT = Path(pagoda.__file__).parent
# The packages that must form a DAG (data flows down, results flow back up through contracts).
PACKAGES = ("engine", "executor", "spec_decode", "scheduler", "kvcache", "structured_output")
# Circles known and being closed elsewhere, each with where it goes away; anything else fails.
ALLOWED_CIRCLES: dict[frozenset[str], str] = {}


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_scheduler_and_kvcache_import_without_torch():
    _run("import pagoda.kvcache, pagoda.scheduler; import sys; assert 'torch' not in sys.modules")


def test_light_modules_load_no_torch_engine_extensions_or_tqdm():
    _run("""
import os, sys
before = dict(os.environ)
import pagoda, pagoda.config, pagoda.request, pagoda.omp
import pagoda.kvcache.manager, pagoda.scheduler.scheduler, pagoda.step, pagoda.scheduler.output, pagoda.executor.output
heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'pagoda.engine', 'pagoda.layers',
         'pagoda.models', 'pagoda.entrypoints', 'triton', 'tqdm', 'transformers'))]
assert not heavy, heavy
assert dict(os.environ) == before, 'importing pagoda changed the environment'
assert pagoda.SamplingParams.__name__ == 'SamplingParams' and 'torch' not in sys.modules
""")


def test_pagoda_exports_resolve_lazily():
    _run("import pagoda; assert pagoda.LLM.__name__ == 'LLM' and 'LLM' in dir(pagoda)")


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


@dataclass(frozen=True)
class ImportStmt:
    """One name an import statement may load: ``candidates``, most specific first (for ``from m
    import x``: ``m.x``, which is a module if such a file exists, then ``m``)."""

    candidates: tuple[str, ...]
    line: int
    in_function: bool


def _imports(tree: ast.AST, package: str = "") -> list[ImportStmt]:
    """Every import executed at run time (module level or inside functions); imports under
    ``if TYPE_CHECKING:`` are annotations only and are skipped. Relative imports are resolved
    against ``package`` (the importing module's package)."""
    found: list[ImportStmt] = []

    def base_of(node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        parts = package.split(".") if package else []
        if node.level - 1 > len(parts):
            return None
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else [])) or None

    def visit(node: ast.AST, in_function: bool) -> None:
        if _type_checking_block(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child, in_function)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.Import):
            found.extend(ImportStmt((alias.name,), node.lineno, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = base_of(node)
            if base:
                found.extend(ImportStmt((f"{base}.{alias.name}", base), node.lineno, in_function)
                             for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree, False)
    return found


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "pagoda" and parts[1] in PACKAGES:
        return parts[1]
    return None


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path in (PACKAGE_ROOT / package).rglob("*.py"):
            for stmt in _imports(ast.parse(path.read_text(), str(path))):
                target = _package_of(stmt.candidates[0])
                if target is not None and target != package:
                    graph[package].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


# ---- circles between modules -------------------------------------------------------------------

def _module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the package directory ``root``."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def module_graph(root: Path = PACKAGE_ROOT) -> dict[str, dict[str, list[str]]]:
    """Module -> the modules of the same package it imports, each with where (``file:line``, and
    "in a function" for an import inside one); the rule is in this file's docstring."""
    modules = _module_names(root)
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for stmt in _imports(ast.parse(path.read_text(), str(path)), package):
            target = next((c for c in stmt.candidates if c in modules), None)
            if target is None:  # ``import pkg.mod.attr``-like names: their longest module prefix
                target = next((m for m in _prefixes(stmt.candidates[-1]) if m in modules), None)
            if target is not None and target != name:
                where = f"{path.relative_to(root.parent)}:{stmt.line}" + (" in a function" if stmt.in_function else "")
                if where not in edges.setdefault(target, []):  # one line per statement
                    edges[target].append(where)
    return graph


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def import_circles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(circles)


def describe_circle(graph: dict[str, dict[str, list[str]]], circle: list[str]) -> str:
    """The imports inside one circle, one per line, each with where it is."""
    members = set(circle)
    lines = [f"  {a} -> {b}  ({'; '.join(graph[a][b])})"
             for a in circle for b in sorted(graph[a]) if b in members]
    return "import circle between " + ", ".join(circle) + ":\n" + "\n".join(lines)


def test_no_import_circle_between_modules():
    graph = module_graph()
    circles = import_circles(graph)
    found = {frozenset(c) for c in circles}
    unexpected = [c for c in circles if frozenset(c) not in ALLOWED_CIRCLES]
    assert not unexpected, "\n\n".join(describe_circle(graph, c) for c in unexpected)
    gone = [sorted(c) for c in ALLOWED_CIRCLES if c not in found]
    assert not gone, f"allow-listed circles no longer exist, remove them from ALLOWED_CIRCLES: {gone}"


def test_circle_finder_counts_function_level_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")  # a package importing its module: no circle
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")  # dodged at import time, still a circle
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import d\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from .. import c\nfrom ..a import name\n")  # relative imports resolve
    graph = module_graph(pkg)
    assert graph["pkg.b"] == {"pkg.a": ["pkg/b.py:2 in a function"]}
    assert graph["pkg.c"] == {}
    assert set(graph["pkg.sub.d"]) == {"pkg.c", "pkg.a"}
    assert import_circles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg.b -> pkg.a  (pkg/b.py:2 in a function)" in describe_circle(graph, ["pkg.a", "pkg.b"])
    (pkg / "c.py").write_text("from pkg.sub import d\n")  # now at run time: c <-> d
    assert import_circles(module_graph(pkg)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]


def test_no_import_cycle_between_engine_packages():
    graph = package_graph()
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph) or [])}"
    # The arrows the layering forbids outright.
    assert "scheduler" not in graph["spec_decode"], "proposers return drafts; they do not reach the scheduler"
    assert "spec_decode" not in graph["executor"], "the executor verifies drafts without the proposers"
    assert "executor" not in graph["scheduler"], "the step contracts are in pagoda.step, not the executor"
    assert graph["structured_output"] <= set(), "grammars get their tokenizer handed down; no reaching up"
    assert graph["kvcache"] <= set(), "the KV-cache manager depends on none of the others"


def test_cycle_finder_sees_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pagoda.scheduler.output\n"
                     "def f():\n    from pagoda.executor import rejection\n")
    assert _imports(tree) == [ImportStmt(("typing.TYPE_CHECKING", "typing"), 1, False),
                              ImportStmt(("pagoda.executor.rejection", "pagoda.executor"), 5, True)]


def test_graphs_and_memory_profile_do_not_import_the_runner():
    """``cuda_graphs`` and ``gpu_profile`` work on the ``ModelHost`` protocol and the input
    builder; the runner imports them, never the other way (not even for annotations)."""
    for name in ("cuda_graphs", "gpu_profile", "input", "interface"):
        path = PACKAGE_ROOT / "executor" / f"{name}.py"
        tree = ast.parse(path.read_text(), str(path))
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not any(m.startswith("pagoda.executor.model_runner") for m in imported), name
