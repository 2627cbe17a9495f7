"""Each fact is defined once: a second copy coming back (a class, a formula, a table, a setting) fails here."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE = [p for d in ("tasks", "data_prep", "bench", "dags", "plugins") for p in (REPO / d).rglob("*.py")]


def defined(pattern: str) -> list[str]:
    """Files (relative) whose text matches `pattern` (a definition, not a use)."""
    rx = re.compile(pattern, re.M)
    return sorted(str(p.relative_to(REPO)) for p in CODE if rx.search(p.read_text(encoding="utf-8")))


def test_one_parallel_layout_type_for_planner_and_trainer():
    assert defined(r"^class Layout\b") == ["tasks/parallel/layout.py"]
    from tasks.parallel import layout
    from tasks.planner import memory, search

    assert search.Layout is memory.Layout is layout.Layout
    # The planner's plan row is the Layout itself (plus its figures): the trainer reads it without renaming.
    row = search._row(layout.Layout(pp=2, pp_schedule="interleaved1f1b", virtual_stages=2))
    assert set(layout.Layout.__dataclass_fields__) <= set(row)
