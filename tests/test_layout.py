"""The layout shows the architecture: imports flow dags → tasks → data_prep with no cycle (function-level imports
included), no module imports from a floor above its own (FLOORS: shared layers < domain packages < the stage runner
< launch < stages < entry points < DAGs), and docs/ARCHITECTURE.md's map names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = ("dags", "tasks", "data_prep", "plugins")


def _stage_modules() -> list[str]:
    from tasks.stages import OWN_SCHEDULE, STAGES

    return sorted({*STAGES.values(), *OWN_SCHEDULE.values()})


# The floors, lowest first: (name, units, open). A module imports from its own unit (a module, or a package and
# everything in it), from a lower floor, or, on an open floor, from the units beside it; never from a floor above.
# The domain packages are closed floors of their own: the planner is arithmetic over shapes and layouts, the model
# stands on it, the lm-eval harness (the model as an lm-eval LM) on the model, the parallelisms, the profiler and
# quantization (whose gate runs the harness) on those, the trainer and the environment checks (which read
# quantization's version pins) on those. A module in no unit fails test_every_module_has_a_floor.
FLOORS = [
    ("data_prep", ["data_prep"], True),
    (
        "shared layers",
        [
            "tasks",
            "tasks.errors",
            "tasks.units",
            "tasks.fsutil",
            "tasks.config",
            "tasks.layout",
            "tasks.shape",
            "tasks.collectives",
            "tasks.device",
            "tasks.npu_smi",
            "tasks.nvidia_smi",
            "tasks.procs",
            "tasks.bounds",
            "tasks.tracking",
            "tasks.sysmetrics",
            "tasks.logs",
        ],
        True,
    ),
    ("domain: planner", ["tasks.planner"], False),
    ("domain: model", ["tasks.model"], False),
    ("domain: evaluation harness", ["tasks.harness"], False),
    ("domain: parallel, profiling, quant", ["tasks.parallel", "tasks.profiling", "tasks.quant"], False),
    ("domain: envcheck, train", ["tasks.envcheck", "tasks.train"], False),
    ("stage runner", ["tasks.runner", "tasks.stages"], True),
    ("launch", ["tasks.launch"], True),
    ("stages", _stage_modules(), True),
    (
        "entry points",
        ["tasks.__main__", "tasks.cli", "tasks.pipeline", "tasks.shard_fanout", "tasks.summary", "tasks.notify"],
        True,
    ),
    ("DAGs and plugins", ["dags", "plugins"], True),
]
EXACT = {"tasks", "tasks.stages"}  # package roots whose modules live on other floors: the unit is the root alone


def _unit(module: str, floors=FLOORS) -> tuple[int, str] | None:
    """(floor index, unit) of a module: the most specific unit that holds it; None when no unit does."""
    found = [
        (len(u), i, u)
        for i, (_, units, _) in enumerate(floors)
        for u in units
        if module == u or (u not in EXACT and module.startswith(u + "."))
    ]
    return max(found)[1:] if found else None


def _upward(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import that reaches above its floor, or sideways across a closed floor, in words."""
    bad = []
    for m, edges in sorted(graph.items()):
        for e in sorted(edges):
            (fm, um), (fe, ue) = _unit(m, floors), _unit(e, floors)
            if ue != um and (fe > fm or (fe == fm and not floors[fm][2])):
                bad.append(f"{m} ({floors[fm][0]}) imports {e} ({floors[fe][0]})")
    return bad


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


def test_upward_finder_finds_an_upward_and_a_sideways_import():
    floors = [("low", ["a"], True), ("mid", ["b", "c"], False), ("top", ["d"], True)]
    graph = {"a.x": {"a.y", "b.z"}, "a.y": set(), "b.z": {"a.x", "c"}, "c": set(), "d": {"a.x", "b.z", "c"}}
    assert _upward(graph, floors) == ["a.x (low) imports b.z (mid)", "b.z (mid) imports c (mid)"]


def test_every_module_has_a_floor():
    assert [m for m in sorted(_modules()) if _unit(m) is None] == []


def test_no_module_imports_from_a_floor_above_its_own():
    assert _upward(_graph()) == []


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
