"""The rehearsal's judgement (tasks/planner/rehearsal.py) on a real plan: Qwen2-7B on one 910B node, as planned by
tasks.planner.search. The trainer (issue 24, wave 2) measures; this decides, in one line with the next feasible plan."""

from __future__ import annotations

import pytest

from tasks.model.config import get_preset
from tasks.planner import rehearsal
from tasks.planner.cluster import get_cluster
from tasks.planner.memory import shape_of
from tasks.planner.search import Problem, search
from tasks.units import GB


@pytest.fixture(scope="module")
def spec():
    cluster = get_cluster("910b")
    result = search(Problem(cluster, shape_of(get_preset("qwen2-7b")), seq_len=4096, global_batch=256))
    doc = {"chosen": result["plans"][0], "plans": result["plans"]}
    capacity = (cluster.memory_gb - cluster.reserve_gb) * GB
    return rehearsal.spec(doc, result["plans"][0]["total_bytes"] - cluster.reserve_gb * GB, capacity, 3, 0.05)


def test_within_tolerance_passes_and_logs_the_figures(spec):
    est, est_s = spec["estimate_bytes"], spec["estimate_step_s"]
    v = rehearsal.verdict(spec, [0.9 * est, 1.04 * est, est], 1.04 * est_s)
    assert v["ok"] and v["cause"] is None and v["peak_rank"] == 1
    assert v["estimate_over_measured"] == pytest.approx(1 / 1.04)
    figs = rehearsal.figures(v)
    assert figs["rehearsal.ok"] == 1.0 and figs["rehearsal.peak_gb"] == pytest.approx(1.04 * est / GB)


def test_memory_beyond_the_estimate_names_measured_estimated_and_the_next_feasible_plan(spec):
    est = spec["estimate_bytes"]
    v = rehearsal.verdict(spec, [est, 1.1 * est], spec["estimate_step_s"])
    assert not v["ok"] and "\n" not in v["cause"]
    chosen = rehearsal.layout_name(spec["chosen"])
    assert v["cause"].startswith(f"rehearsal at {chosen}: rank 1 peaked at {1.1 * est / GB:.2f} GB against the ")
    assert f"plan's {est / GB:.2f} GB estimate (+10%, beyond plan.tolerance 5%)" in v["cause"]
    alt = rehearsal.next_plan(spec, 1.1)
    assert alt is not None and alt["total_bytes"] * 1.1 <= spec["capacity_bytes"]
    assert rehearsal.layout_name(alt) != chosen and f"next feasible plan {rehearsal.layout_name(alt)}" in v["cause"]
    assert "--set parallel.dp=" in v["cause"]
    # Every better-ranked alternative would not fit at the measured ratio (or is the layout that ran).
    for p in spec["alternatives"][: spec["alternatives"].index(alt)]:
        assert p["total_bytes"] * 1.1 > spec["capacity_bytes"] or rehearsal.layout_name(p) == chosen


def test_over_the_device_slow_steps_and_nothing_left(spec):
    cap = spec["capacity_bytes"]
    over = rehearsal.verdict(spec, [1.01 * cap], spec["estimate_step_s"])
    assert not over["ok"] and f"over the {cap / GB:.2f} GB a device holds" in over["cause"]
    slow = rehearsal.verdict(spec, [spec["estimate_bytes"]], 2 * spec["estimate_step_s"])
    assert not slow["ok"] and "(+100%, beyond plan.tolerance 5%; the step-time model is off" in slow["cause"]
    huge = rehearsal.verdict(spec, [10 * spec["estimate_bytes"]], spec["estimate_step_s"])
    assert huge["cause"].endswith(
        "no other planned layout fits at the measured ratio: lower train.micro_batch or add devices"
    )
