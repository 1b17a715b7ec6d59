"""Import hygiene: the pure-Python layers load without torch, and the engine's packages import
each other in one direction only."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pagoda

PACKAGE_ROOT = Path(pagoda.__file__).parent
# The packages that must form a DAG (data flows down, results flow back up through contracts).
PACKAGES = ("executor", "spec_decode", "scheduler", "kvcache")


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
import pagoda.kvcache.manager, pagoda.scheduler.scheduler, pagoda.scheduler.output, pagoda.executor.output
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


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module imported at run time (module level or inside functions); imports under
    ``if TYPE_CHECKING:`` are annotations only and are skipped."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
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
            for module in _imported_modules(ast.parse(path.read_text(), str(path))):
                target = _package_of(module)
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


def test_no_import_cycle_between_engine_packages():
    graph = package_graph()
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph) or [])}"
    # The arrows the layering forbids outright.
    assert "scheduler" not in graph["spec_decode"], "proposers return drafts; they do not reach the scheduler"
    assert "spec_decode" not in graph["executor"], "the executor verifies drafts without the proposers"
    assert graph["kvcache"] <= set(), "the KV-cache manager depends on none of the others"


def test_cycle_finder_sees_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pagoda.scheduler.output\n"
                     "def f():\n    from pagoda.executor import rejection\n")
    assert _imported_modules(tree) == ["typing", "typing.TYPE_CHECKING", "pagoda.executor",
                                       "pagoda.executor.rejection"]


def test_graphs_and_memory_profile_do_not_import_the_runner():
    """``cuda_graphs`` and ``gpu_profile`` work on the ``ModelHost`` protocol and the input
    builder; the runner imports them, never the other way (not even for annotations)."""
    for name in ("cuda_graphs", "gpu_profile", "input", "interface"):
        path = PACKAGE_ROOT / "executor" / f"{name}.py"
        tree = ast.parse(path.read_text(), str(path))
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not any(m.startswith("pagoda.executor.model_runner") for m in imported), name
