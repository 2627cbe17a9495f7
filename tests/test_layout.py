"""The layout shows the architecture: imports flow dags → tasks → data_prep with no cycle (function-level imports
included), domain packages never reach into a stage module, and docs/ARCHITECTURE.md's map names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = ("dags", "tasks", "data_prep", "plugins")
DOMAIN = (
    "tasks.envcheck",
    "tasks.harness",
    "tasks.model",
    "tasks.parallel",
    "tasks.planner",
    "tasks.profiling",
    "tasks.quant",
)


def _modules() -> dict[str, Path]:
    mods = {}
    for top in TOPS:
        for p in (REPO / top).rglob("*.py"):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def _graph() -> dict[str, set[str]]:
    """Module → project modules it imports, anywhere in its body (lazy imports are edges too)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                edges |= {
                    resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base) for a in node.names
                }
        graph[m] = {e for e in edges if e and e != m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_even_through_function_level_imports():
    assert _cycles(_graph()) == []


def test_imports_flow_dags_to_tasks_to_data_prep_never_back():
    graph = _graph()
    back = [
        (m, e)
        for m, edges in graph.items()
        for e in edges
        if (m.startswith("data_prep") and e.split(".")[0] in ("tasks", "dags"))
        or (m.startswith("tasks") and e.split(".")[0] == "dags")
    ]
    assert back == []


def test_domain_packages_never_import_a_stage_module():
    graph = _graph()
    bad = [
        (m, e)
        for m, edges in graph.items()
        if m.startswith(DOMAIN)
        for e in edges
        if e == "tasks.stages" or e.startswith("tasks.stages.")
    ]
    assert bad == []


def test_architecture_map_names_every_tasks_module_and_package():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    tree = re.search(r"```\n(dags/.*?)```", text, re.S).group(1)
    names = {
        p.name
        for p in (REPO / "tasks").iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())
    }
    missing = sorted(n for n in names if not re.search(rf"(?<![\w.]){re.escape(n.removesuffix('.py'))}(\.py|/)", tree))
    assert missing == []
